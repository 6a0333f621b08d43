"""The data-parallel family: DDP, ZeRO-1, ZeRO-2, ZeRO-3 (FSDP2) and HSDP.

| zero | parameters | gradients | optimizer state | how                                        |
|------|------------|-----------|-----------------|--------------------------------------------|
| 0    | replicated | replicated| replicated      | DDP: bucketed all-reduce during backward   |
| 1    | replicated | replicated| sharded         | DDP + `Zero1Optimizer` (shard update, all-gather) |
| 2    | sharded*   | sharded   | sharded         | FSDP2, parameters kept gathered fwd->bwd   |
| 3    | sharded    | sharded   | sharded         | FSDP2, resharded after forward             |
(*) gathered for the whole forward/backward; sharded at rest.
With dp_replicate > 1 and zero >= 2 the mesh is 2-D: HSDP (shard within, replicate across).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from shardwise.compat import _StridedShard
from shardwise.parallel.collectives import all_gather_flat
from shardwise.parallel.precision import compute_dtype
from shardwise.telemetry.comm.ddp_hook import ddp_comm_hook

# set by expert parallel (parallel/expert.py) on an expert module whose weights ZeRO shards over
# the expert data-parallel ranks: the DeviceMesh of those ranks
EDP_MESH = "_shardwise_edp_mesh"


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, zero: int, precision: str,
               blocks: list[nn.Module]) -> nn.Module:
    """FSDP2 per block, then the root.

    Gradients are summed, never averaged (the loss is already divided by the step's global token
    count), and reduced in fp32. Precision (see `shardwise.parallel.precision`): with bf16, the
    weights of matmul modules (`nn.Linear`) are gathered in the compute dtype — exactly the cast
    autocast would make, at half the all-gather bytes — while every other parameter (norms,
    embeddings, the root's head) is gathered in fp32, as the other layouts use it. Under bf16 a
    block is therefore two units: its matmul sub-modules (`matmul_modules`, one grouped unit in
    bf16) inside the block itself (fp32, the rest); `matmul_modules` says why that split and not
    norms apart.
    """
    matmul, exact = fsdp_policies(precision)
    # expert-parallel parameters are already distributed over ep (parallel/expert.py): those
    # ZeRO shards over the expert data-parallel ranks get a unit of their own on that mesh, the
    # rest (replicated over edp) are left alone
    ignored = {p for p in model.parameters() if getattr(p, "_shardwise_expert", False)}
    skip: dict[str, Any] = {"ignored_params": ignored} if ignored else {}
    for i, block in enumerate(blocks):
        # ZeRO-2 keeps every block gathered from forward to backward; ZeRO-3 reshards each block
        # after its forward, except the last, whose parameters backward needs at once.
        reshard = zero == 3 and i < len(blocks) - 1
        for m in block.modules():
            edp_mesh = getattr(m, EDP_MESH, None)
            if edp_mesh is not None:  # fp32 gathers: autocast casts for the experts' matmuls
                fully_shard(m, mesh=edp_mesh, reshard_after_forward=reshard, mp_policy=exact)
        if matmul is not exact:
            linears = matmul_modules(block)
            if linears:
                fully_shard(linears, mesh=mesh, reshard_after_forward=reshard, mp_policy=matmul,
                            **skip)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=exact, **skip)
    # The root (embedding, final norm, output) is needed first thing in backward: keep it
    # gathered after forward, as torch does by default; re-gathering it would cost one
    # all-gather of those weights per micro-batch for no memory gain at the peak.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=exact, **skip)
    sum_gradients(model)
    return model


def fsdp_policies(precision: str) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """(policy for units of matmul weights, policy for everything else); the same object twice
    when every parameter is gathered in fp32. Inputs are never cast by FSDP: the residual stream
    stays fp32 on every layout.

    Only bf16 gathers matmul weights in the compute dtype: measured on one micro-batch, the bf16
    gather gives the single process's gradients bit for bit (CPU, torch 2.13; FSDP keeps
    accumulating them in fp32, its `reduce_dtype`), while an fp16 gather changed the first
    block's weight gradients by 3e-5 relative — so fp16 runs gather fp32 weights and let
    autocast cast them, as every other layout does."""
    exact = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    dtype = compute_dtype(precision)
    if dtype is not torch.bfloat16:
        return exact, exact
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                cast_forward_inputs=False), exact


def matmul_modules(block: nn.Module) -> list[nn.Module]:
    """The largest sub-modules of `block` whose every parameter belongs to an `nn.Linear`
    (attention, MLP, a router), leaving out FSDP units already made (experts over edp).

    Why these and not the norms as a unit apart: FSDP registers its post-backward hook by passing
    the tensor inputs of a unit's first module through an identity autograd node. At a norm that
    input is the residual stream, which the block also adds back: the identity splits its three
    gradient terms (the residual, and the norm's two uses of x) into a + (b + c) where the single
    process sums (a + b) + c — an fp32 rounding that bf16 then amplifies (a one-ulp change flips
    some bf16 rounding of a later activation gradient): after one step ZeRO-3 moved 6e-4 of the
    first blocks' AdamW moments away from the single process, with bits-equal losses. The input
    of a pre-norm block's attention or MLP is a norm's output that only it reads, so the identity
    there (and at the block's own input) changes no sum: the gradients equal the single
    process's bit for bit."""
    linear = {id(p) for m in block.modules() if isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            params = list(child.parameters())
            if not params or isinstance(child, FSDPModule):
                continue
            if all(id(p) in linear for p in params):
                found.append(child)
            else:
                visit(child)

    visit(block)
    return found


def sum_gradients(model: nn.Module) -> None:
    """Every FSDP unit of `model` sums gradients over the data-parallel ranks (factor 1, and
    SUM as the collective's op: gloo has no PREMUL_SUM, and a sum needs no division)."""
    for sub in model.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)


def apply_ddp(model: nn.Module, group: torch.distributed.ProcessGroup | None,
              device: torch.device, bucket_mb: float = 25.0) -> nn.Module:
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, process_group=group, device_ids=device_ids, gradient_as_bucket_view=True,
              bucket_cap_mb=bucket_mb, **_no_buffer_sync())
    # A sum of the ranks' gradients (the loss is already divided by the global token count),
    # issued from Python so the communication tap can count it.
    ddp.register_comm_hook(None, ddp_comm_hook(group))
    return ddp


def _no_buffer_sync() -> dict[str, Any]:
    """Every rank builds the same parameters and buffers (rotary tables) from the seed, or loads
    them from one checkpoint: nothing to broadcast at start or before each forward. torch 2.13
    renamed the per-forward switch (and warns on the old name)."""
    params = inspect.signature(DDP.__init__).parameters
    off = {"init_sync": False} if "init_sync" in params else {}
    if "forward_sync_buffers" in params:
        return {**off, "forward_sync_buffers": False}
    return {**off, "broadcast_buffers": False}


def unwrap(part: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 keeps the module itself)."""
    return part.module if isinstance(part, DDP) else part


def _local_slice(full: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's dim-0 chunk of `full`, with DTensor's Shard(0) sizes (ceil, last may be short)."""
    n, size, rank = full.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = -(-n // size)
    start = min(rank * chunk, n)
    return full[start:min(start + chunk, n)]


class _ExpertRows:
    """ZeRO-1 for an expert-parallel parameter (a DTensor [Replicate on edp, Shard(0) on ep],
    `parallel/expert.py`): its E/ep local experts split again over the edp ranks that hold the
    same ones — FSDP2's layout for the same parameter ([_StridedShard(0), Shard(0)]), so its
    optimizer state checkpoints interchangeably with ZeRO-2/3 + ep. Local experts that edp does
    not divide keep whole (replicated) master rows, updated alike on every edp rank."""

    def __init__(self, p: DTensor) -> None:
        mesh = p.device_mesh
        self.mesh, self.edp = mesh, mesh["edp"]
        n, rows = self.edp.size(), p.to_local().shape[0]
        self.split = n > 1 and rows % n == 0
        self.per = rows // n if self.split else rows
        self.start = self.edp.get_local_rank() * self.per if self.split else 0
        self.placements = ([_StridedShard(0, split_factor=mesh["ep"].size()), Shard(0)]
                           if self.split else list(p.placements))
        self.shape, self.stride = p.shape, p.stride()

    def rows(self, local: torch.Tensor) -> torch.Tensor:
        return local[self.start:self.start + self.per]

    def dtensor(self, rows: torch.Tensor) -> DTensor:
        return DTensor.from_local(rows, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)

    def write_back(self, p: DTensor, master: DTensor) -> None:
        local = p.to_local()
        if self.split:
            all_gather_flat(local, master.to_local().contiguous(), self.edp.get_group())
        else:
            local.copy_(master.to_local())


class Zero1Optimizer:
    """ZeRO-1: each rank keeps fp32 master shards and optimizer state for its dim-0 slice of
    every parameter; after DDP's all-reduce it updates its slice and all-gathers the parameters.

    Shards are DTensors with Shard(0) on the dp_shard mesh — the same layout as FSDP2 — so the
    optimizer state in a checkpoint is interchangeable with ZeRO-2/3 and resharded by DCP.
    Expert-parallel parameters are sliced over their own edp ranks instead (`_ExpertRows`).
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh,
                 make_optimizer) -> None:
        self.mesh = mesh
        self.named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        # (found by their mesh: a materialised meta build keeps no attribute on a parameter)
        self.experts = {name: _ExpertRows(p) for name, p in self.named if isinstance(p, DTensor)
                        and "edp" in (p.device_mesh.mesh_dim_names or ())}
        self.shards: dict[str, nn.Parameter] = {}
        for name, p in self.named:
            self.shards[name] = nn.Parameter(self._master(name, p.detach(), clone=True))
        self.optimizer: torch.optim.Optimizer = make_optimizer(
            [(name, self.shards[name]) for name, _ in self.named])
        self.param_groups = self.optimizer.param_groups

    def _master(self, name: str, full: torch.Tensor, clone: bool = False) -> DTensor:
        """This rank's master slice of a parameter (or gradient) `full`, as a DTensor."""
        expert = self.experts.get(name)
        if expert is not None:
            rows = expert.rows(cast(DTensor, full).to_local())  # expert parameters are DTensors
            return expert.dtensor(rows.clone() if clone else rows)
        local = _local_slice(full, self.mesh)
        return DTensor.from_local(local.clone() if clone else local, self.mesh, [Shard(0)],
                                  run_check=False, shape=full.shape, stride=full.stride())

    def step(self) -> None:
        for name, p in self.named:
            if p.grad is not None:
                self.shards[name].grad = self._master(name, p.grad)
        self.optimizer.step()
        with torch.no_grad():
            for name, p in self.named:
                expert = self.experts.get(name)
                if expert is not None:
                    expert.write_back(cast(DTensor, p), cast(DTensor, self.shards[name]))
                else:
                    p.copy_(cast(DTensor, self.shards[name]).full_tensor())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for _, p in self.named:
            p.grad = None

    # Flattened, FQN-keyed state like torch's get_optimizer_state_dict(flatten=True), so that a
    # checkpoint of any zero stage loads into any other.
    def state_dict(self) -> dict:
        return flat_state_dict(self.optimizer, self.shards)

    def load_state_dict(self, state: dict) -> None:
        load_flat_state_dict(self.optimizer, self.shards, state)
        with torch.no_grad():  # the master shards follow the (already loaded) model parameters
            for name, p in self.named:
                master = cast(DTensor, self.shards[name])  # a Parameter around `_master`'s DTensor
                master.to_local().copy_(self._master(name, p.detach()).to_local())


def flat_state_dict(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]
                    ) -> dict[str, Any]:
    """`optimizer`'s state of `params` (name -> the tensor it steps) flattened and keyed by name
    like torch's get_optimizer_state_dict(flatten=True), so that a checkpoint of any zero stage
    (and of the distributed optimizer, `flat_dp`) loads into any other."""
    if not optimizer.state:
        _init_state(optimizer)
    out: dict[str, Any] = {}
    by_param = {id(p): name for name, p in params.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = by_param[id(p)]
            for key, value in optimizer.state[p].items():
                out[f"state.{name}.{key}"] = value
            for key, value in group.items():
                if key != "params":
                    out[f"param_groups.{name}.{key}"] = value
    return out


def load_flat_state_dict(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor],
                         state: Mapping[str, Any]) -> None:
    """The inverse of `flat_state_dict`, in place (the state exists: DCP loaded into it)."""
    by_param = {id(p): name for name, p in params.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = by_param[id(p)]
            for key in list(optimizer.state[p]):
                optimizer.state[p][key] = state[f"state.{name}.{key}"]


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create optimizer state (zero moments) so a checkpoint can be loaded into it in place."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    wd = [group["weight_decay"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0
    optimizer.step()
    for group, lr, decay in zip(optimizer.param_groups, saved, wd, strict=True):
        group["lr"], group["weight_decay"] = lr, decay
        for p in group["params"]:
            p.grad = None
            for value in optimizer.state[p].values():
                if torch.is_tensor(value):
                    value.zero_()
