"""ParallelDims: the parallel degrees of a run and nothing else.

Degrees are validated against the world size with messages that name the numbers. The device mesh
is built from them with named axes in the Llama 3 order — pp outermost, then dp_replicate,
dp_shard, cp, and tp innermost (fastest links) — so that code asks for named views
(`mesh["tp"]`, the flattened data-parallel mesh) and never does rank arithmetic. This module
imports no torch.distributed, so the planner can use it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.errors import SpecError
from shardwise.spec.layout import ParallelSection

#: Degrees that exist in the spec but whose parallelism has not landed yet.
NOT_AVAILABLE_YET: dict[str, str] = {}

#: Mesh axis order, outermost first.
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    zero: int = 0  # resolved: 0 DDP, 1 optimizer state sharded, 2 + gradients, 3 + parameters

    @classmethod
    def from_spec(cls, section: ParallelSection, world_size: int) -> ParallelDims:
        """Resolve `dp_shard = -1` against the world size, then validate."""
        if world_size < 1:  # parallel.nproc = 0 must be resolved first (parallel.devices)
            raise ValueError(f"world size {world_size}: resolve parallel.nproc before the layout")
        others = section.dp_replicate * section.cp * section.tp * section.pp
        dp_shard = section.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise SpecError(
                    f"world size {world_size} is not divisible by dp_replicate({section.dp_replicate})"
                    f" * cp({section.cp}) * tp({section.tp}) * pp({section.pp}) = {others}, so "
                    "parallel.dp_shard = -1 cannot take the remaining ranks. Start a multiple of "
                    f"{others} workers (--nproc / parallel.nproc) or change the degrees."
                )
            dp_shard = world_size // others
        zero = section.zero if section.zero != -1 else (3 if dp_shard > 1 else 0)
        dims = cls(section.dp_replicate, dp_shard, section.cp, section.tp, section.pp, section.ep,
                   world_size, zero)
        dims.validate()
        return dims

    def validate(self) -> None:
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise SpecError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * "
                f"tp({self.tp}) * pp({self.pp}) = {product} != world size {self.world_size}. "
                f"Start {product} workers (--nproc {product} / parallel.nproc), or set "
                "parallel.dp_shard = -1 to let it take the ranks the other degrees leave."
            )
        for name, what in NOT_AVAILABLE_YET.items():
            degree = getattr(self, name)
            if degree != 1:
                raise SpecError(
                    f"parallel.{name} = {degree} asks for {what}, which is not available yet in "
                    f"this version of shardwise. Set parallel.{name} = 1; available now: DDP, "
                    "ZeRO-1/2/3, HSDP, tensor + sequence parallel, context parallel and "
                    "pipeline parallel."
                )
        if self.zero == 0 and self.dp_shard > 1:
            raise SpecError(
                f"parallel.zero = 0 (plain DDP) shards nothing, but dp_shard = {self.dp_shard}. "
                f"Replicate instead with dp_replicate = {self.dp_replicate * self.dp_shard} and "
                "dp_shard = 1, or pick zero = 1, 2 or 3 to shard across dp_shard."
            )
        fsdp_over_cp = self.zero >= 2 and self.cp > 1  # FSDP shards over dp_shard x cp
        if self.zero > 0 and self.dp_shard == 1 and not (self.world_size == 1 and self.zero >= 2) \
                and not fsdp_over_cp:
            # (FSDP on a single rank is allowed: it is how one GPU runs the FSDP code path.)
            raise SpecError(
                f"parallel.zero = {self.zero} shards state across dp_shard, but dp_shard = 1: "
                "there is nothing to shard across. Set parallel.dp_shard to the number of ranks "
                "to shard over (e.g. dp_shard = -1 for all data-parallel ranks), or zero = 0."
            )
        if self.zero in (0, 1) and self.dp * self.cp > 1 and (self.tp > 1 or self.pp > 1) \
                and self.ep > 1:
            raise SpecError(
                f"parallel.zero = {self.zero} with ep = {self.ep} under tp = {self.tp} / pp = "
                f"{self.pp} is not available yet: there the optimizers reduce the gradients "
                "(parallel/flat_dp.py), and expert weights reduce over their own ranks. Use "
                "zero = 2 or 3 with expert parallel.")
        if self.ep != 1:
            self._validate_expert()

    def _validate_expert(self) -> None:
        """Expert parallel borrows its ranks from the data-parallel and context-parallel ones
        (parallel/expert.py)."""
        ep, dp = self.ep, self.dp * self.cp
        if ep < 1 or dp % ep:
            raise SpecError(
                f"parallel.ep = {ep} must divide the ranks it borrows from, dp_replicate("
                f"{self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) = {dp}: "
                "expert parallel places the experts over the data- and context-parallel ranks. "
                f"Use ep among {[d for d in range(1, dp + 1) if dp % d == 0]}, or more "
                "data-parallel ranks.")


    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def describe(self) -> str:
        """A short name of the layout, for logs: `zero3-2`, `ddp2`, `hsdp2x2`, `tp2+pp2`, `single`."""
        if self.world_size == 1:
            return f"zero{self.zero}-1" if self.zero >= 2 else "single"
        parts = []
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts.append(f"hsdp{self.dp_replicate}x{self.dp_shard}")
        elif self.dp_shard > 1:
            parts.append(f"zero{self.zero}-{self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"ddp{self.dp_replicate}")
        elif self.zero >= 2 and self.cp > 1:  # FSDP over the cp ranks alone
            parts.append(f"zero{self.zero}-1")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return "+".join(parts)
