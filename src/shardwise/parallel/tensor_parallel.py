"""Tensor parallel (Megatron column/row split) and sequence parallel: DTensor parameters,
plain-tensor compute.

The model's plan (`shardwise.models.plan`) declares which modules are column-, row-, vocabulary-
or sequence-parallel; this module shards their parameters as DTensors on the `tp` mesh axis and
makes each such module compute with its local shard:
- colwise (a Linear): weight split by output features; its input is the full activation;
- rowwise (a Linear): weight split by input features; its partial outputs are summed over tp;
  rowwise on an Embedding is the vocabulary-parallel lookup (rows split by token id; a
  `padding_idx` row keeps a zero gradient, on the rank that holds it);
- with sequence parallel, the activations between blocks (norms, residual adds) are split along
  the sequence (dim 1): a rowwise output is a reduce-scatter, a colwise input an all-gather, and
  the norm weights ("sequence" modules) are replicated DTensors whose gradients are partial sums;
  without it a rowwise output is an all-reduce and a colwise input is all-reduced in backward;
- with loss parallel the output projection returns its vocabulary-sharded logits as a DTensor
  (`Shard(-1)`); `vocab_parallel_loss_sum` computes the cross entropy on the shards (and torch's
  `loss_parallel` context stays valid for code that calls F.cross_entropy on them).

The collectives between modules (`TPRegion`) are in `tp_collectives.py`, the vocabulary-parallel
lookup and loss in `vocab_parallel.py`; this module applies the styles and computes with local
shards.

Why not DTensor's own styles for the compute: every op on a DTensor goes through DTensor's
dispatch (sharding propagation, redistribution, re-wrapping). At the bench_tp shape a step had
2,535 of them (1,628 without sequence parallel), ~130 ms of CPU per step on this machine, 1.2–1.6x
a plain-tensor Megatron loop (benchmarks/RESULTS.md, "bench_tp"). Here the only DTensor work is
at the boundary: each parallel module swaps its DTensor parameters for differentiable views of
their local shards for the duration of its forward (`_LocalShard`: gradients come back as
DTensors with the parameter's placements, or `Partial` for replicated parameters under sequence
parallel, accumulated on the local shard), and the collectives between modules are hand-written
autograd functions on plain tensors. The parameters themselves stay DTensors with the placements
DTensor's styles give them — so checkpoints reshard through DCP at any tp degree, FSDP2 composes
on top (2-D DTensors), and the grad norm and AdamW see DTensor gradients.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from shardwise.compat import DTensorSpec
from shardwise.models.plan import ModelPlan, PlanError, embedding_refusal
from shardwise.parallel.tp_collectives import TPRegion, Transform, _GatherWhole, _OwnPart

# loss_context and vocab_parallel_loss_sum stay importable from here, where callers imported them
# before they moved to vocab_parallel.py (new code imports them from there)
from shardwise.parallel.vocab_parallel import (  # noqa: F401
    VocabLookup,
    loss_context,
    vocab_parallel_loss_sum,
)


def apply_tensor_parallel(model: nn.Module, plan: ModelPlan, tp_mesh: DeviceMesh, *,
                          sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard `model` (a whole model or a pipeline stage of one) in place over `tp_mesh`, as the
    plan's tensor-parallel map says. Tied parameters stay one tensor: a tensor used by two
    modules is sharded once, and both must shard it the same way (an embedding and the output
    projection both split the vocabulary rows)."""
    region = TPRegion(tp_mesh, sequence_parallel)
    sharded: dict[int, tuple[nn.Parameter, Placement]] = {}  # original tensor -> its DTensor
    modules = tp_modules(model, plan)
    regions = [name for name, _ in modules if plan.tp_style(name) == "full_input"]
    for name, module in modules:
        inside = any(name.startswith(r + ".") for r in regions)
        style = plan.tp_style(name)
        assert style is not None  # tp_modules keeps only the modules the plan gives a style
        _parallelize(name, module, style, region, loss_parallel, sharded, inside)
    if sequence_parallel:  # models that count positions from their input's length (plan.py)
        for module in model.modules():
            if hasattr(module, "sequence_shards"):
                # (a plain int attribute: nn.Module's __setattr__ is typed for tensors and modules)
                module.sequence_shards = tp_mesh.size()  # type: ignore[assignment]


def tp_modules(model: nn.Module, plan: ModelPlan) -> list[tuple[str, nn.Module]]:
    """The modules the plan's tensor-parallel map names (first matching pattern wins)."""
    return [(name, module) for name, module in model.named_modules()
            if module is not None and plan.tp_style(name) is not None]


def _parallelize(name: str, module: nn.Module, kind: str, region: TPRegion, loss_par: bool,
                 sharded: dict[int, tuple[nn.Parameter, Placement]], inside: bool) -> None:
    """`inside`: the module sits in a `full_input` module, whose input is already gathered."""
    shard = functools.partial(_shard_params, module, region.mesh, name=name, sharded=sharded)
    if kind == "full_input":
        first = _first_input(module)
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: first(args, kwargs,
                                           lambda x: region.full_input(region.forget_input(x))),
            with_kwargs=True)
    elif kind == "sequence":
        if region.sequence_parallel:  # replicated weights, partial-sum gradients
            shard({"weight": Replicate(), "bias": Replicate()})
            _compute_locally(module, region, before=region.forget_input)
    elif kind == "tokens":  # computes on each token alone, whole and the same on every tp rank
        if region.sequence_parallel:
            _run_on_whole_sequence(module, region)
    elif kind == "replicated":  # whole weights acting on this rank's heads: partial gradients
        shard({"weight": Replicate(), "bias": Replicate()})
        _compute_locally(module, region, partial=True)
    elif kind in ("colwise", "output"):
        _expect(module, nn.Linear, name, kind)
        shard({"weight": Shard(0), "bias": Shard(0)})
        _compute_locally(module, region, before=None if inside else region.shared_full_input,
                         after=region.vocab_output(loss_par) if kind == "output" else None)
    elif kind == "embedding":
        _expect(module, nn.Embedding, name, kind)
        embedding = cast(nn.Embedding, module)
        if refusal := embedding_refusal(name, embedding):  # a plan's own check says it earlier
            raise PlanError(refusal)
        shard({"weight": Shard(0)})
        lookup = VocabLookup(region, rows=cast(DTensor, embedding.weight).to_local().shape[0],
                             padding_idx=embedding.padding_idx)
        _compute_locally(module, region, before=lookup.local_ids, after=lookup.combine)
        lookup.use_local_padding(embedding)
    else:  # rowwise
        _expect(module, nn.Linear, name, kind)
        shard({"weight": Shard(1), "bias": Replicate()})
        _compute_locally(module, region, before=region.forget_input, after=region.reduce_output,
                         late_bias=True)


def _run_on_whole_sequence(module: nn.Module, region: TPRegion) -> None:
    """A `tokens` module (an MoE feed-forward: routing, capacity and the balance loss look at
    every token of the micro-batch) under sequence parallel: its input is all-gathered along the
    sequence, every tp rank runs the same computation on all tokens with its plain, whole
    parameters, and keeps its own part of the output. Since every rank computes the same
    function, the gradients are whole on each (the input's is cut back to the rank's part, the
    output's gathered), and parameters and statistics need no reduction over tp — like the
    module without sequence parallel, at the cost of running it tp times."""
    first = _first_input(module)
    module.register_forward_pre_hook(
        lambda _m, args, kwargs: first(args, kwargs, lambda x: _GatherWhole.apply(
            region.forget_input(x), region.group, region.size, region.rank)),
        with_kwargs=True)
    module.register_forward_hook(
        lambda _m, _args, out: _OwnPart.apply(out, region.group, region.size, region.rank))


def _expect(module: nn.Module, cls: type, name: str, kind: str) -> None:
    if not isinstance(module, cls):
        raise PlanError(f"the model's tensor-parallel plan makes {name} {kind}, which is "
                        f"implemented for {cls.__name__}, not {type(module).__name__}. Change "
                        "the plan's pattern so it names only such modules.")


def _shard_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], *,
                  name: str, sharded: dict[int, tuple[nn.Parameter, Placement]]) -> None:
    """Replace the module's own parameters by DTensors (rank 0's values, as DTensor styles do);
    a tensor already sharded for another module (a tied weight) is reused, not copied."""
    for pname, param in list(module.named_parameters(recurse=False)):
        want = placements[pname]
        if id(param) in sharded:
            done, placement = sharded[id(param)]
            if placement != want:
                raise PlanError(
                    f"{name}.{pname} is tied to a parameter the tensor-parallel plan already "
                    f"split as {placement}, but its own style needs {want}. Tied modules must "
                    "split the tensor the same way (an `embedding` and an `output`, both by "
                    "vocabulary row), or untie them.")
            module.register_parameter(pname, done)
            continue
        dt = distribute_tensor(param.data, mesh, [want])
        new = nn.Parameter(dt, requires_grad=param.requires_grad)
        sharded[id(param)] = (new, want)
        module.register_parameter(pname, new)


# --- computing with local shards ----------------------------------------------------------------------
def _compute_locally(module: nn.Module, region: TPRegion, *, before: Transform | None = None,
                     after: Transform | None = None, late_bias: bool = False,
                     partial: bool = False) -> None:
    """Run `module`'s own forward on plain tensors: before it, the first input goes through
    `before` and each DTensor parameter is swapped for its differentiable local shard; after it,
    the parameters are put back (also when the forward raises) and the output goes through
    `after`. `late_bias`: the bias is left out of the forward and added after `after` (a
    row-parallel bias must be added once, to the reduced sum). `partial`: replicated
    parameters get partial-sum gradients even without sequence parallel."""
    partial_grads = partial or region.sequence_parallel
    saved: list[dict[str, nn.Parameter | None]] = []  # a stack: safe under re-entrant calls

    first = _first_input(module)

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        params = dict(mod._parameters)
        saved.append(params)
        for pname, p in params.items():
            if isinstance(p, DTensor):
                late = late_bias and pname == "bias"
                mod._parameters[pname] = None if late else _local(p, partial_grads)
        return first(args, kwargs, before) if before is not None else None

    def post(mod: nn.Module, _args: tuple, output: Any) -> Any:
        params = saved.pop()
        mod._parameters.update(params)
        if output is None:  # the forward raised: only the parameters are restored
            return None
        if after is not None:
            output = after(output)
        bias = params.get("bias")
        if late_bias and bias is not None:
            output = output + _local(cast(DTensor, bias), partial_grads)  # rowwise: a DTensor
        return output

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, always_call=True)


def _first_input(module: nn.Module) -> Callable[[tuple, dict, Transform], tuple | None]:
    """A pre-hook helper that maps a module's first input through a transform, whether the
    caller passed it by position or by name (transformers calls `self_attn(hidden_states=x)`)."""
    import inspect

    params = [p.name for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    name = params[0] if params else None

    def mapped(args: tuple, kwargs: dict, transform: Transform) -> tuple | None:
        if args:
            return (transform(args[0]), *args[1:]), kwargs
        if name is not None and name in kwargs:
            return args, {**kwargs, name: transform(kwargs[name])}
        return None

    return mapped


def _local(param: DTensor, partial: bool) -> torch.Tensor:
    """The local shard, differentiable. Under sequence parallel a replicated parameter (a norm
    weight, a row-parallel bias) acts on this rank's tokens only, so its gradient is a partial
    sum, which `run.step._reduce_partial_grads` (or FSDP2) sums once per step; without it every
    rank computes the same, whole gradient."""
    spec = param._spec
    if partial and any(pl.is_replicate() for pl in spec.placements):
        spec = _partial_grad_spec(spec, id(spec.mesh))
    return _LocalShard.apply(param, spec)


@functools.lru_cache(maxsize=256)
def _partial_grad_spec(spec: DTensorSpec, mesh_id: int) -> DTensorSpec:
    """`spec` with Replicate turned into Partial (sum): built once per parameter spec. Keyed on
    the mesh object too (`mesh_id`): specs compare meshes by value, so a later run in this
    process would otherwise get a spec on an earlier run's mesh, whose groups are gone."""
    return DTensorSpec(spec.mesh, tuple(Partial() if pl.is_replicate() else pl
                                        for pl in spec.placements),
                       tensor_meta=spec.tensor_meta)


class _LocalShard(torch.autograd.Function):
    """`DTensor.to_local()` with the gradient's spec fixed up front: forward, a view of the local
    shard; backward, the gradient wrapped as a DTensor of `grad_spec` (the parameter's global
    shape and stride, the gradient's placements). torch's `to_local` recomputes the global
    shape and stride and goes through `DTensor.from_local` on every backward (~20 ms per step
    of the bench_tp model at world 2, py-spy).

    The gradient is also accumulated here, on the local shard, and not returned to autograd:
    the first micro-batch's becomes `param.grad`, later ones are added to its local tensor in
    place. AccumulateGrad would instead run a DTensor `detach` / `add_` through DTensor's
    dispatch for every parameter and micro-batch (~40 µs each, ~5 ms per step here). FSDP2
    writes and accumulates its gradients the same way (`sharded_param.grad._local_tensor +=`);
    it reads the unsharded parameter's `.grad` after this node has run, as it would after
    AccumulateGrad. (Post-accumulate-grad hooks on these parameters therefore do not fire;
    nothing in shardwise registers one.)"""

    @staticmethod
    def forward(ctx, param: DTensor, grad_spec: DTensorSpec) -> torch.Tensor:
        ctx.param, ctx.grad_spec = param, grad_spec
        ctx.set_materialize_grads(False)
        local = param._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None
        param, held = ctx.param, ctx.param.grad
        if held is None:  # the first micro-batch: the gradient becomes the parameter's
            # the spec's stride is that of a contiguous parameter; a fresh copy per gradient, as
            # torch does, so that sharding propagation on one gradient never touches another's
            param.grad = DTensor(grad.contiguous(), copy.copy(ctx.grad_spec), requires_grad=False)
        elif (isinstance(held, DTensor) and held._spec.placements == ctx.grad_spec.placements
              and held._local_tensor.shape == grad.shape):
            held._local_tensor.add_(grad)
        else:  # a gradient of another layout (set by other code): autograd accumulates it
            return DTensor(grad.contiguous(), copy.copy(ctx.grad_spec), requires_grad=False), None
        return None, None
