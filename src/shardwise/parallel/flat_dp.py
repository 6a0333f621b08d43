"""Data parallel where DDP cannot wrap the model: tensor- and pipeline-parallel layouts with
`zero = 0` (DDP) or `zero = 1` (ZeRO-1), the layout Megatron-LM trains its largest models with
(TP within a node, PP across, DP with a distributed optimizer).

DDP reduces plain tensors during one backward; under tensor parallel the parameters are DTensors,
and a pipeline schedule runs many backwards per step (zero-bubble splits each in two). So these
layouts reduce once, after the step's last backward, on the local shards:

- `FlatAllReduce` (zero 0): every gradient's local values summed over the data-parallel ranks
  (and the context-parallel ones) in one flat buffer per dtype: one all-reduce per part.
- `DistributedOptimizer` (zero 1): each data-parallel rank owns a dim-0 slice of every
  parameter's local shard — the slice FSDP2 would give it, so its fp32 master weights and AdamW
  state checkpoint interchangeably with ZeRO-2/3 (and reshard through DCP at any layout). The
  gradients are packed rank-major into one flat buffer, reduce-scattered (each rank receives the
  sum of its slices: half an all-reduce's traffic), the owners update their slices, and the
  updated slices are all-gathered back into the parameters: the textbook ZeRO-1 volume, a
  reduce-scatter of the gradients plus an all-gather of the parameters. Ranks of `dp_replicate`
  and `cp`, which hold the same slices, sum theirs with an all-reduce of the slice only.

A tensor-parallel shard split along dim 0 whose rows the data-parallel ranks do not divide would
need an uneven strided shard; such a parameter keeps a whole master on every data-parallel rank
(replicated: its gradient is all-reduced) — correct, only not sharded.

Both reduce in buckets of `parallel.bucket_mb`, in the order backward produces the gradients, and
a bucket's collective can start during backward as soon as its last gradient of the step is ready
(`parallel.grad_buckets`, driven by `run.optim.Optimizers`): the reduction of the later layers
overlaps the backward of the earlier ones, under every pipeline schedule. `reduce` after
backward waits for them (and reduces a bucket again whose gradients changed after it started).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from shardwise.compat import _StridedShard
from shardwise.parallel.collectives import all_gather_flat, reduce_scatter_flat
from shardwise.parallel.grad_buckets import Bucket, cap_elements, plan_buckets

MakeOptimizer = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class FlatAllReduce:
    """zero 0: sum the local gradients of `params` over `group`, in flat buckets of one dtype
    (see the module docstring). `late`: ids of parameters whose gradients change after backward
    (tied copies): their buckets never start early."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup | None,
                 bucket_mb: float = 25.0, late: frozenset[int] = frozenset()) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.members: list[list[nn.Parameter]] = []
        backward = self.params[::-1]  # roughly the order backward produces them
        for dtype in dict.fromkeys(p.dtype for p in backward):
            same = [p for p in backward if p.dtype == dtype]
            plan = plan_buckets([p.numel() for p in same],
                                cap_elements(bucket_mb, same[0].element_size()))
            self.members += [[same[i] for i in b] for b in plan]
        self._work: list[Any] = [None] * len(self.members)
        self._flat: list[torch.Tensor | None] = [None] * len(self.members)
        self.buckets = [] if not self._reduces() else [
            Bucket([] if any(id(p) in late for p in ps) else list(ps),
                   functools.partial(self._launch, i, True))
            for i, ps in enumerate(self.members)]

    def _reduces(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    @torch.no_grad()
    def _launch(self, i: int, async_op: bool) -> None:
        grads = []
        for p in self.members[i]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._flat[i] = flat
        self._work[i] = dist.all_reduce(flat, group=self.group, async_op=async_op)

    @torch.no_grad()
    def reduce(self) -> None:
        for i, bucket in enumerate(self.buckets):
            bucket.settle(functools.partial(self._wait, i),
                          functools.partial(self._launch, i, False))
            offset = 0
            flat = cast(torch.Tensor, self._flat[i])
            for p in self.members[i]:
                g = _local(cast(torch.Tensor, p.grad))
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            self._flat[i] = None

    def _wait(self, i: int) -> None:
        if self._work[i] is not None:
            self._work[i].wait()
            self._work[i] = None


@dataclass
class _Slice:
    """How one parameter's local shard is cut over the shard group."""

    name: str
    param: nn.Parameter
    rows: int  # dim 0 of the local shard
    row_numel: int
    per_rank: int  # rows per rank (ceil); the last ranks may hold fewer, or none
    offset: int  # where its rows start in a rank's chunk of its bucket
    sharded: bool  # False: a whole master on every rank (see the module docstring)
    start: int = 0  # where its bucket's chunk starts in a rank's whole chunk

    @property
    def chunk_numel(self) -> int:
        return self.per_rank * self.row_numel if self.sharded else 0

    def my_rows(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.per_rank, self.rows)
        return start, min(start + self.per_rank, self.rows)


class DistributedOptimizer:
    """ZeRO-1 over the `shard` axis for a model part under tensor/pipeline parallel (see the
    module docstring). `replicas`: the group of ranks holding the same slices (dp_replicate x cp),
    None when there are none. Stepped by `Optimizers` like any optimizer, after `reduce`."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], root: DeviceMesh,
                 shard_axis: str, replicas: dist.ProcessGroup | None,
                 make_optimizer: MakeOptimizer, bucket_mb: float = 25.0,
                 late: frozenset[int] = frozenset()) -> None:
        """`late`: ids of parameters whose gradients change after backward (tied copies on
        several pipeline stages): their buckets are reduced after it."""
        self.root, self.shard_axis = root, shard_axis
        self.shard_mesh = root[shard_axis]
        self.group = self.shard_mesh.get_group()
        self.n, self.rank = self.shard_mesh.size(), self.shard_mesh.get_local_rank()
        self.replicas = replicas
        self.slices: list[_Slice] = []
        for name, p in named:
            if not p.requires_grad:
                continue
            local = _local(p.detach())
            rows = local.shape[0] if local.dim() else 1
            per = -(-rows // self.n)
            strided = isinstance(p, DTensor) and p.placements[0] == Shard(0)
            self.slices.append(_Slice(name, p, rows, local.numel() // max(rows, 1), per, 0,
                                      sharded=not (strided and rows % self.n)))
        # buckets of sharded slices in backward order; each a (n, chunk) rank-major region
        backward = [s for s in self.slices[::-1] if s.sharded]
        self.members = [[backward[i] for i in b] for b in plan_buckets(
            [s.chunk_numel * self.n for s in backward], cap_elements(bucket_mb))]
        start = 0
        for member in self.members:
            offset = 0
            for piece in member:
                piece.start, piece.offset = start, offset
                offset += piece.chunk_numel
            start += offset
        self.chunk = start
        self.masters = {s.name: nn.Parameter(self._master_of(s, _local(s.param.detach()), True))
                        for s in self.slices}
        self.optimizer = make_optimizer([(s.name, self.masters[s.name]) for s in self.slices])
        self.param_groups = self.optimizer.param_groups
        self._buffer: torch.Tensor | None = None
        self._mine: torch.Tensor | None = None
        self._work: list[Any] = [None] * len(self.members)
        self.buckets = [Bucket([] if any(id(s.param) in late for s in m) else [s.param for s in m],
                               functools.partial(self._launch, i, True))
                        for i, m in enumerate(self.members)]

    # --- layout -------------------------------------------------------------------------------
    def _placements(self, piece: _Slice) -> tuple[DeviceMesh, list[Placement]]:
        p = piece.param
        dp: Placement = Shard(0) if piece.sharded else Replicate()
        if not isinstance(p, DTensor):
            return self.shard_mesh, [dp]
        (tp,) = p.placements  # a tensor-parallel DTensor: one mesh axis
        if piece.sharded and tp == Shard(0):  # FSDP2's layout: dp slices each tp shard
            dp = _StridedShard(0, split_factor=p.device_mesh.size())
        tp_name = (p.device_mesh.mesh_dim_names or ("tp",))[0]
        return self.root[self.shard_axis, tp_name], [dp, tp]

    def _master_of(self, piece: _Slice, local: torch.Tensor, clone: bool = False,
                   sliced: bool = False) -> DTensor:
        """This rank's master of `piece` from the local shard `local` (or a gradient's); with
        `sliced`, `local` is already this rank's rows."""
        if piece.sharded and not sliced:
            start, end = piece.my_rows(self.rank)
            local = local[start:end]
        mesh, placements = self._placements(piece)
        return DTensor.from_local(local.detach().clone().float() if clone else local, mesh,
                                  placements, run_check=False, shape=piece.param.shape,
                                  stride=piece.param.stride())

    def _buffer_for(self, device: torch.device) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.zeros(self.n * self.chunk, dtype=torch.float32, device=device)
        return self._buffer

    def _mine_for(self, device: torch.device) -> torch.Tensor:
        """This rank's summed chunk of every bucket (the masters' gradients view it)."""
        if self._mine is None:
            self._mine = torch.zeros(self.chunk, dtype=torch.float32, device=device)
        return self._mine

    def _device(self) -> torch.device:
        return _local(self.slices[0].param).device if self.slices else torch.device("cpu")

    # --- a step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _launch(self, i: int, async_op: bool) -> None:
        """Reduce-scatter bucket i: its gradients packed rank-major, this rank's sum out."""
        member, device = self.members[i], self._device()
        start, numel = member[0].start, sum(s.chunk_numel for s in member)
        region = self._buffer_for(device)[self.n * start:self.n * (start + numel)]
        grid = region.view(self.n, numel)
        for s in member:
            grid[:, s.offset:s.offset + s.chunk_numel].copy_(self._padded_grad(s))
        mine = self._mine_for(device)[start:start + numel]
        self._work[i] = reduce_scatter_flat(mine, region, self.group, async_op=async_op)

    def _wait(self, i: int) -> None:
        if self._work[i] is not None:
            self._work[i].wait()
            self._work[i] = None

    @torch.no_grad()
    def reduce(self) -> None:
        """Sum the gradients over the data-parallel ranks into the masters' gradients."""
        device = self._device()
        for i, bucket in enumerate(self.buckets):
            bucket.settle(functools.partial(self._wait, i),
                          functools.partial(self._launch, i, False))
        if self.members:
            mine = self._mine_for(device)
            if self.replicas is not None:
                dist.all_reduce(mine, group=self.replicas)
            for s in (s for member in self.members for s in member):
                start, end = s.my_rows(self.rank)
                at = s.start + s.offset
                rows = mine[at:at + (end - start) * s.row_numel]
                shape = (end - start, *_local(s.param).shape[1:])
                self.masters[s.name].grad = self._master_of(
                    s, rows.view(shape) if rows.numel() else rows.new_zeros(shape), sliced=True)
        for s in (s for s in self.slices if not s.sharded):
            grad = _local(s.param.grad).float().clone() if s.param.grad is not None else \
                torch.zeros_like(_local(s.param.detach()), dtype=torch.float32)
            dist.all_reduce(grad, group=self.group)
            if self.replicas is not None:
                dist.all_reduce(grad, group=self.replicas)
            self.masters[s.name].grad = self._master_of(s, grad)
        for s in self.slices:
            s.param.grad = None  # the masters hold the step's gradients from here

    def _padded_grad(self, s: _Slice) -> torch.Tensor:
        """The local gradient as (n, per_rank x row_numel): rank r's rows in row r, zero-padded."""
        padded = torch.zeros(self.n * s.per_rank * s.row_numel, dtype=torch.float32,
                             device=_local(s.param).device)
        if s.param.grad is not None:
            flat = _local(s.param.grad).reshape(-1)
            padded[:flat.numel()].copy_(flat)
        return padded.view(self.n, s.chunk_numel)

    def grads(self, names: set[str] | None = None) -> list[torch.Tensor]:
        """The masters' gradients (DTensors sharded over the shard axis), for the norm."""
        return [cast(torch.Tensor, m.grad) for n, m in self.masters.items()
                if m.grad is not None and (names is None or n in names)]

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's slices, then all-gather them back into the parameters."""
        self.optimizer.step()
        sharded = [s for member in self.members for s in member]
        if sharded:
            device = self._device()
            mine = torch.zeros(self.chunk, dtype=torch.float32, device=device)
            for s in sharded:
                local = _local(cast(torch.Tensor, self.masters[s.name])).reshape(-1)
                at = s.start + s.offset
                mine[at:at + local.numel()].copy_(local)
            buffer = self._buffer_for(device)
            all_gather_flat(buffer, mine, self.group)
            grid = buffer.view(self.n, self.chunk)
            for s in sharded:
                target = _local(s.param.data)
                at = s.start + s.offset
                full = grid[:, at:at + s.chunk_numel].reshape(-1)
                target.copy_(full[:target.numel()].view_as(target))
        for s in self.slices:
            if not s.sharded:
                _local(s.param.data).copy_(_local(cast(torch.Tensor, self.masters[s.name])))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for s in self.slices:
            s.param.grad = None

    # --- checkpoints: flattened and FQN-keyed like torch's, as `Zero1Optimizer` ------------------
    def state_dict(self) -> dict[str, Any]:
        from shardwise.parallel.data_parallel import flat_state_dict

        return flat_state_dict(self.optimizer, self.masters)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from shardwise.parallel.data_parallel import load_flat_state_dict

        load_flat_state_dict(self.optimizer, self.masters, state)
        with torch.no_grad():  # the masters follow the (already loaded) model parameters
            for s in self.slices:
                master = cast(DTensor, self.masters[s.name])
                master.to_local().copy_(self._master_of(s, _local(s.param.detach())).to_local())
