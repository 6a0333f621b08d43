"""Mixture-of-experts support on every layout: the end-of-step update of routing state.

`end_step(pm, updated)` runs after each optimizer step on every rank. A module of the model with
a method `shardwise_end_step(sum_over_data, updated)` (the built-in MoE feed-forward) is given a
function that sums a tensor over the ranks that hold the same module with different data (the
data- and context-parallel group of this pipeline stage) — so a non-gradient update made from it, such as
DeepSeek-V3's selection bias, sees the step's global routing and is the same on every layout.
It returns its step figures (for telemetry), collected here by module name.

**Expert parallel** (`parallel.ep = N`, `apply_expert_parallel`): the modules the plan's
`experts` entry names (their contract: every parameter's dim 0 is the expert index, and
`forward(tokens, counts)` takes tokens sorted by expert, `counts[e]` for expert e) keep E/N
experts per rank. EP borrows its ranks from the data- and context-parallel ranks, which, in
order, form a (dp x cp/N, N) grid — axis `ep` (consecutive ranks: one EP group, which exchanges
tokens) and axis `edp` (the ranks holding the same experts, with different data). How the expert
weights sit on edp follows the data-parallel layout of the dense part:
- DDP (zero 0): each expert parameter is a DTensor [Replicate on edp, Shard(0) on ep], which DDP
  leaves alone; see Gradients below.
- ZeRO-2/3 with edp > 1: a DTensor [Shard(0)] on the ep axis alone, which `apply_fsdp` then
  shards (ZeRO) over edp with its own FSDP2 unit per expert module (`EDP_MESH` names that mesh on
  the module): at rest each rank holds E/(N * edp) experts' weights, gradients and AdamW state;
  the unit all-gathers its E/N experts over edp for forward and backward and reduce-scatters
  (sums) their gradients over exactly the edp ranks. Dense parameters are FSDP's as before.

Forward of a wrapped module: the per-expert counts are exchanged first (one all_to_all of E
int64), then tokens go to the ranks holding their experts (`all_to_all_single` with the uneven
split sizes just learnt), are regrouped from (source rank, expert) to (expert, source rank) order,
run through the local experts, regrouped back and returned by the reverse exchange; backward is
the same two exchanges, transposed (`_AllToAll`). A rank that receives no token still makes
every exchange (zero-length splits) and runs its experts on empty inputs, so nothing waits for it.

Gradients: an expert's local gradient sums the contributions of the tokens every rank of its EP
group sent it. Under DDP the weights' local views are taken with a Partial gradient on `edp`,
which the trainer reduces (sums) over exactly the edp ranks before the gradient norm
(`run.step._reduce_partial_grads`); under ZeRO-2/3 the expert unit's reduce-scatter does it.
With the loss already divided by the step's global target count, that sum is the
single-process gradient; no rescaling.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

from shardwise.compat import _reparametrize_module
from shardwise.models.plan import ModelPlan
from shardwise.parallel.data_parallel import EDP_MESH, unwrap
from shardwise.parallel.execution import ParallelModel

HOOK = "shardwise_end_step"
EP_AXES = ("edp", "ep")  # the expert mesh: ranks holding the same experts x one EP group


def build_expert_mesh(ranks: int, ep: int, device_type: str, pp: int = 1,
                      tp: int = 1) -> DeviceMesh:
    """The (ranks/ep, ep) grid of the data- and context-parallel ranks of this rank's pipeline
    stage and tensor-parallel coordinate (collective: every rank builds it). In the run's mesh
    (pp outermost, tp innermost) those ranks are `ranks` ones `tp` apart. Any grouping is
    correct: a token's expert output does not depend on which ranks exchange it, and gradients
    are summed over every rank that holds the same experts; the ranks of one stage run the same
    schedule, so their exchanges come in the same order.

    Under tensor parallel the expert modules run as `tokens` modules (tensor_parallel.py): every
    tp rank routes the same tokens (all-gathered along the sequence under sequence parallel), so
    each tp coordinate has an expert grid of its own that exchanges exactly the single-process
    tokens, and the experts' gradients are whole on every tp rank — summed over edp, never tp."""
    shape, names = (pp, ranks // ep, ep, tp), ("pp", *EP_AXES, "tp")
    kept = [(n, d) for n, d in zip(names, shape, strict=True) if n in EP_AXES or d > 1]
    mesh = init_device_mesh(device_type, tuple(d for _, d in kept),
                            mesh_dim_names=tuple(n for n, _ in kept))
    return mesh[EP_AXES]


def expert_modules(model: nn.Module, plan: ModelPlan) -> list[tuple[str, nn.Module]]:
    """The modules the plan's `experts` pattern names."""
    return [(name, m) for name, m in model.named_modules()
            if plan.experts and fnmatch.fnmatchcase(name, plan.experts)]


def apply_expert_parallel(model: nn.Module, plan: ModelPlan, mesh: DeviceMesh, *,
                          zero_over_edp: bool = False) -> list[str]:
    """Shard every expert module's parameters along dim 0 over `mesh["ep"]` and route its
    forward through the token exchange. Over `edp` they are replicated, or, with
    `zero_over_edp` (ZeRO-2/3 and edp > 1), left for `apply_fsdp` to shard (the module's
    `EDP_MESH`). Returns the names of the expert parameters (which DDP must ignore; FSDP is given
    the replicated ones as ignored_params)."""
    ep_mesh = mesh["ep"]
    zero_over_edp = zero_over_edp and mesh["edp"].size() > 1
    placed = ep_mesh if zero_over_edp else mesh
    names: list[str] = []
    for prefix, module in expert_modules(model, plan):
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(
                _shard_experts(param.detach(), placed, ep_mesh.get_local_rank(), ep_mesh.size()),
                requires_grad=param.requires_grad)
            # data_parallel.apply_fsdp gives it its own unit (an attribute Parameter does not declare)
            sharded._shardwise_expert = True  # type: ignore[attr-defined]
            module.register_parameter(pname, sharded)
            names.append(f"{prefix}.{pname}")
        if zero_over_edp:
            setattr(module, EDP_MESH, mesh["edp"])
        module.forward = _ExpertParallelForward(module, ep_mesh)
    # DDP's own switch (read when DDP wraps the model): no all-reduce over dp for these
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


def _shard_experts(full: torch.Tensor, mesh: DeviceMesh, rank: int, size: int) -> DTensor:
    per = full.shape[0] // size
    local = full[rank * per:(rank + 1) * per]
    local = local if local.is_meta else local.clone()
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=full.shape, stride=full.stride())


class _ExpertParallelForward:
    """The forward of an expert module under EP (set as the module's `forward`)."""

    def __init__(self, module: nn.Module, ep_mesh: DeviceMesh) -> None:
        self.module_ref = [module]  # a list: not registered as a sub-module
        self.original = type(module).forward
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        module = self.module_ref[0]
        n = self.size
        local_e = counts.numel() // n
        # 1. counts: recv[s, e] = tokens rank s sends to this rank's local expert e
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=self.group)
        send_splits = counts.view(n, local_e).sum(1).tolist()
        recv_matrix = recv.view(n, local_e)
        recv_splits = recv_matrix.sum(1).tolist()
        # 2. tokens to their experts' ranks, regrouped by local expert
        received = _AllToAll.apply(tokens, recv_splits, send_splits, self.group)
        by_expert = _source_to_expert_order(recv_matrix)
        local_counts = recv_matrix.sum(0)
        # replicated over edp (DDP): the gradient is a Partial sum over edp, reduced by the
        # trainer; gathered by the expert's FSDP unit (ZeRO-2/3): [Shard(0)] on ep alone
        params = {name: p.to_local(grad_placements=[Partial() if pl.is_replicate() else pl
                                                    for pl in p.placements])
                  if isinstance(p, DTensor) else p
                  for name, p in module.named_parameters(recurse=False)}
        # the class's own forward on the local weights (what torch.func.functional_call does;
        # calling the module would re-enter this forward)
        with _reparametrize_module(module, params):
            out = self.original(module, received[by_expert], local_counts)
        # 3. back to the order received, and to the ranks the tokens came from
        restored = torch.empty_like(out).index_copy(0, by_expert, out) if out.numel() else out
        return _AllToAll.apply(restored, send_splits, recv_splits, self.group)


def _source_to_expert_order(recv_matrix: torch.Tensor) -> torch.Tensor:
    """Indices that reorder tokens received as (source rank, local expert) blocks into
    (local expert, source rank) blocks."""
    n, local_e = recv_matrix.shape
    sizes = recv_matrix.reshape(-1).tolist()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = [torch.arange(starts[s * local_e + e], starts[s * local_e + e] + sizes[s * local_e + e],
                           device=recv_matrix.device)
              for e in range(local_e) for s in range(n)]
    return torch.cat(pieces)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def end_step(pm: ParallelModel, updated: bool) -> dict[str, dict[str, Any]]:
    """Call every module's `shardwise_end_step`; {module name: its step figures}. Collective
    over the data-parallel group when any module has the hook (every rank of a stage has the
    same modules, so all of them take part)."""
    dims = pm.ctx.dims
    # context-parallel ranks hold other tokens of the same sequences: their load counts too
    group = pm.ctx.grad_group() if pm.ctx.distributed and dims.dp * dims.cp > 1 else None

    def sum_over_data(t: torch.Tensor) -> torch.Tensor:
        if group is not None:
            dist.all_reduce(t, group=group)
        return t

    hooks = pm.__dict__.get("_end_step_hooks")
    if hooks is None:  # found once per model: the modules do not change during a run
        hooks = [(name, getattr(module, HOOK)) for part in pm.parts
                 for name, module in unwrap(part).named_modules()
                 if callable(getattr(module, HOOK, None))]
        pm.__dict__["_end_step_hooks"] = hooks
    return {name: hook(sum_over_data, updated) for name, hook in hooks}
