"""AdamW per model part, the learning-rate schedule, and clipping on the true global norm.

The schedule is a pure function of the step, so it has no state of its own to checkpoint: resuming
at step k gives lr(k) exactly. Optimizer state is saved flattened and keyed by parameter name
(torch's `flatten_optimizer_state_dict` format), so a checkpoint of any layout loads into any other.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from shardwise.compat import foreach_mul_, foreach_norm
from shardwise.parallel.collectives import gather_full
from shardwise.parallel.data_parallel import Zero1Optimizer
from shardwise.parallel.dims import MESH_AXES
from shardwise.parallel.distributed import DistContext
from shardwise.parallel.flat_dp import DistributedOptimizer, FlatAllReduce
from shardwise.parallel.grad_buckets import ReadyBuckets
from shardwise.parallel.parallelize import ParallelModel, unwrap
from shardwise.spec.runspec import OptimizerSection

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def build_adamw(named_params: Sequence[tuple[str, nn.Parameter]], opt: OptimizerSection,
                device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms, biases or other 1-D parameters).

    Parameters are grouped by decay and by where they live (plain tensors, or DTensors of one
    mesh): torch's foreach and fused kernels refuse to mix them in one call, and a model's
    biases and norms may be either (a row-parallel bias is a tp DTensor, a norm a plain tensor
    without sequence parallel)."""
    groups: dict[tuple[bool, int], list[nn.Parameter]] = {}
    for _, p in named_params:
        if p.requires_grad:
            mesh = id(p.device_mesh) if isinstance(p, DTensor) else 0
            groups.setdefault((p.ndim >= 2, mesh), []).append(p)
    impl = opt.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(
        [{"params": params, "weight_decay": opt.weight_decay if decay else 0.0}
         for (decay, _), params in sorted(groups.items(), key=lambda kv: not kv[0][0])],
        lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, **kwargs,
    )


class Optimizers:
    """One optimizer per model part (pipeline stages each own theirs), stepped together; under
    tensor or pipeline parallel with zero 0/1 they also own the data-parallel reduction
    (`parallel.flat_dp`: DDP cannot wrap those layouts)."""

    def __init__(self, pm: ParallelModel, opt: OptimizerSection, bucket_mb: float = 25.0) -> None:
        self.pm = pm
        dims = pm.ctx.dims
        self.zero1 = dims.zero == 1 and dims.dp > 1
        self.reducer: FlatAllReduce | None = None
        self.optimizers: list[Any] = []
        self.overlap: ReadyBuckets | None = None
        make = functools.partial(build_adamw, opt=opt, device=pm.ctx.device)
        late = frozenset(id(p) for g in (pm.tied.groups if pm.tied else []) for p in g.params)
        if pm.flat_dp and self.zero1:
            replicas = _replica_group(pm.ctx)
            self.optimizers = [DistributedOptimizer(list(part.named_parameters()),
                                                    pm.ctx.mesh, "dp_shard", replicas, make,
                                                    bucket_mb, late)
                               for part in pm.parts]
            # later stages' backwards end first: their buckets start first
            self.overlap = ReadyBuckets([b for o in self.optimizers[::-1] for b in o.buckets])
            return
        if pm.flat_dp:
            self.reducer = FlatAllReduce(pm.parameters(), pm.ctx.grad_group(), bucket_mb, late)
            self.overlap = ReadyBuckets(self.reducer.buckets)
        for part in pm.parts:
            if self.zero1:
                self.optimizers.append(Zero1Optimizer(unwrap(part), pm.ctx.mesh["dp_shard"], make))
            else:
                self.optimizers.append(make(list(part.named_parameters())))

    def arm(self, micro_batches: int) -> None:
        """Before the step's backwards (`micro_batches` of them per parameter): the reduction
        that DDP and FSDP do not do starts in buckets during backward (`parallel.grad_buckets`).
        Not called, it all happens in `reduce_grads`."""
        if self.overlap is not None:
            self.overlap.arm(micro_batches)

    def reduce_grads(self) -> None:
        """Sum the gradients over the data-parallel ranks where DDP or FSDP did not (started in
        backward where `arm` allowed it, finished here: `parallel.flat_dp`)."""
        if self.overlap is not None:
            self.overlap.flush()
        if self.reducer is not None:
            self.reducer.reduce()
        for o in self.optimizers:
            if isinstance(o, DistributedOptimizer):
                o.reduce()

    def norm_grads(self) -> list[torch.Tensor]:
        """The gradients the update reads, each counted once (tied copies' mirrors left out):
        the parameters', or the distributed optimizer's sharded ones."""
        counted = self.pm.counted_parameters()
        if not any(isinstance(o, DistributedOptimizer) for o in self.optimizers):
            return [p.grad for p in counted if p.grad is not None]
        ids = {id(p) for p in counted}
        out: list[torch.Tensor] = []
        for o in self.optimizers:
            names = {s.name for s in o.slices if id(s.param) in ids}
            out += o.grads(names)
        return out

    def scale_grads(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient the update reads by `factor` (unscaling, clipping)."""
        if any(isinstance(o, DistributedOptimizer) for o in self.optimizers):
            _scale([g for o in self.optimizers for g in o.grads()], factor)
        else:
            scale_grads(self.pm, factor)

    def set_lr(self, lr: float) -> None:
        for o in self.optimizers:
            for group in o.param_groups:
                group["lr"] = lr

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the optimizers hold (moments, steps, ZeRO-1 master shards)."""
        out: list[torch.Tensor] = []
        for o in self.optimizers:
            inner = o.optimizer if isinstance(o, Zero1Optimizer | DistributedOptimizer) else o
            for state in inner.state.values():
                out.extend(v for v in state.values() if torch.is_tensor(v))
            if isinstance(o, Zero1Optimizer):
                out.extend(o.shards.values())
            if isinstance(o, DistributedOptimizer):
                out.extend(o.masters.values())
        return out

    def _part_state(self, index: int) -> dict[str, Any]:
        """Part `index`'s flattened optimizer state, a tied tensor's copy named by its group's
        first name (as the single process names it), so checkpoints reshard across pp."""
        part, o = self.pm.parts[index], self.optimizers[index]
        sd = o.state_dict() if isinstance(o, Zero1Optimizer | DistributedOptimizer) else \
            get_optimizer_state_dict(part, o, options=_FLAT)
        return _renamed(sd, self._aliases(index))

    def _aliases(self, index: int) -> dict[str, str]:
        return self.pm.tied.aliases(index) if self.pm.tied is not None else {}

    def _tied_keys(self) -> set[str]:
        """Every name of a tied tensor this rank holds more than one copy of."""
        if self.pm.tied is None:
            return set()
        return {name for group in self.pm.tied.groups if len(group.held) > 1
                for name in group.names}

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for i in range(len(self.pm.parts)):
            merged.update(self._part_state(i))
        return merged

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every optimizer state tensor gathered to its full value on every rank, keyed
        `state.<param>.<name>` (collective; for tests and verification of small models)."""
        full: dict[str, torch.Tensor] = {}
        for i in range(len(self.pm.parts)):
            for key, value in self._part_state(i).items():
                if key.startswith("state.") and torch.is_tensor(value):
                    full[key] = gather_full(value).detach().cpu().clone()
        return full

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tied = self._tied_keys()
        for i, (part, o) in enumerate(zip(self.pm.parts, self.optimizers, strict=True)):
            back = {canonical: name for name, canonical in self._aliases(i).items()}
            part_state = {**state, **_renamed(state, back)} if back else dict(state)
            if i > 0 and tied:
                # Copies of one tied tensor held by two parts of this rank (the zero-bubble V
                # puts the first and last stages on one rank) read the same saved state: each
                # gets tensors of its own, or both optimizers would step one shared `step`,
                # `exp_avg`, `exp_avg_sq` — twice per step.
                part_state = {k: v.clone() if torch.is_tensor(v) and _names(k) & tied else v
                              for k, v in part_state.items()}
            if isinstance(o, Zero1Optimizer | DistributedOptimizer):
                o.load_state_dict(part_state)
            else:
                set_optimizer_state_dict(part, o, optim_state_dict=part_state, options=_FLAT)


def _names(key: str) -> set[str]:
    """The parameter a flattened optimizer-state key names, as a one-element set."""
    head, _, rest = key.partition(".")
    return {rest.rsplit(".", 1)[0]} if head in ("state", "param_groups") else set()


def _renamed(flat: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """Flattened optimizer-state keys (`state.<param>.<key>`, `param_groups.<param>.<key>`)
    with parameter names mapped by `names`."""
    if not names:
        return flat
    out: dict[str, Any] = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        for old, new in names.items():
            if rest.startswith(old + "."):
                key = f"{head}.{new}{rest[len(old):]}"
                break
        out[key] = value
    return out


def _replica_group(ctx: DistContext) -> dist.ProcessGroup | None:
    """The ranks holding the same ZeRO-1 slices as this one: dp_replicate x cp (collective:
    a flattened view is a new process group on every rank)."""
    assert ctx.mesh is not None
    axes = [a for a in ("dp_replicate", "cp") if ctx.mesh[a].size() > 1]
    if not axes:
        return None
    if len(axes) == 1:
        return ctx.mesh[axes[0]].get_group()
    return ctx.mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp").get_group()


def global_grad_norm(pm: ParallelModel, grads: list[torch.Tensor] | None = None) -> torch.Tensor:
    """L2 norm of every gradient of the whole model, across shards, TP ranks and stages, as a
    device scalar (no host sync), with one all-reduce over the world.

    Each rank adds the squares of the gradient values it holds *and counts*: a value replicated
    over some mesh axes is counted by the rank at coordinate 0 of those axes only, so the world
    sum counts every element once. Gradients sharded over an axis (FSDP, TP) are counted by every
    rank of it; pipeline stages hold disjoint parameters. This replaces a norm per mesh and axis
    (DTensor's `full_tensor`, one all-reduce per mesh dimension, and a warning for 2-D meshes)
    and works for any mix of meshes (FSDP + TP without sequence parallel has gradients on three).
    """
    if grads is None:
        grads = [p.grad for p in pm.counted_parameters() if p.grad is not None]
    device = pm.ctx.device
    counted = [_local(g).float() for g in grads if _counted_here(g, pm.ctx)]
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if counted:
        norms = foreach_norm(counted, 2)
        sq = torch.stack(norms).pow(2).sum()
    if pm.ctx.distributed and pm.ctx.world_size > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The values this rank holds (a DTensor's local shard)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _counted_here(grad: torch.Tensor, ctx: DistContext) -> bool:
    """Whether this rank's copy of `grad` is the one counted in the world sum: coordinate 0 on
    every mesh axis over which the values are replicated (pp excluded: stages are disjoint)."""
    if ctx.mesh is None:
        return True
    covered: set[str] = set()
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        names = mesh.mesh_dim_names or ()
        coordinate = mesh.get_coordinate() or []
        for name, index, placement in zip(names, coordinate, grad.placements, strict=True):
            axes = FLATTENED.get(name, (name,))
            if any(axis not in MESH_AXES for axis in axes):
                raise RuntimeError(f"gradient on a mesh axis {name!r} that the run's mesh "
                                   f"{MESH_AXES} does not have")
            if placement.is_partial():
                raise RuntimeError("a gradient is still a partial sum; reduce it before the norm")
            covered.update(axes)
            if placement.is_replicate() and index != 0:
                return False
    world = dict(zip(MESH_AXES, ctx.mesh.get_coordinate() or [], strict=True))
    return all(world[axis] == 0 for axis in MESH_AXES if axis not in covered and axis != "pp")


#: names of flattened mesh views and the axes they stand for
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp"),
             # the expert mesh (parallel/expert.py): two factors of the data- and
             # context-parallel ranks
             "edp": ("dp_replicate", "dp_shard", "cp"), "ep": ("dp_replicate", "dp_shard", "cp")}


def clip_grads(pm: ParallelModel, max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total), with the same global `total` on all
    ranks; on the device, without reading `total` on the host."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scale_grads(pm, coef)


def scale_grads(pm: ParallelModel, factor: torch.Tensor | float) -> None:
    """Multiply every gradient (each rank's local values) by `factor`, in one foreach per
    dtype (no host sync for a tensor factor)."""
    _scale([p.grad for p in pm.parameters() if p.grad is not None], factor)


def _scale(grads: list[torch.Tensor], factor: torch.Tensor | float) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        local = _local(g)
        by_dtype.setdefault(local.dtype, []).append(local)
    for dtype, tensors in by_dtype.items():
        f = factor.to(dtype) if isinstance(factor, torch.Tensor) else factor
        foreach_mul_(tensors, f)
