"""Layout names used on the command line (`dp1`, `ddp2`, `zero3-4`, `hsdp-2x2`, `tp2`, `pp2-1f1b`, `ep2`,
`zero3-2+tp2`, `cp2`, `zero3-2+cp2`, `cp2-allgather`, …) and the parallel settings they stand for.
Imports no torch."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shardwise.errors import UserError

SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved-1f1b",
                  "interleaved-1f1b": "interleaved-1f1b", "zero-bubble": "zero-bubble",
                  "zb": "zero-bubble"}

_PARTS = [
    (re.compile(r"^(dp|single)1?$"), lambda m: {}),
    (re.compile(r"^ddp(\d+)$"), lambda m: {"dp_replicate": int(m[1]), "dp_shard": 1, "zero": 0}),
    (re.compile(r"^zero([0-3])-(\d+)$"), lambda m: {"dp_shard": int(m[2]), "zero": int(m[1])}),
    (re.compile(r"^hsdp-(\d+)x(\d+)$"),
     lambda m: {"dp_replicate": int(m[1]), "dp_shard": int(m[2]), "zero": 3}),
    (re.compile(r"^tp(\d+)(-nosp)?$"),
     lambda m: {"tp": int(m[1]), "sequence_parallel": m[2] is None}),
    (re.compile(r"^pp(\d+)(?:-([a-z0-9-]+))?$"), lambda m: _pipeline(int(m[1]), m[2])),
    (re.compile(r"^cp(\d+)(?:-(ring|allgather))?$"),
     lambda m: {"cp": int(m[1]), "cp_comm": m[2] or "ring"}),
    # expert parallel borrows data-parallel ranks: `ep2` alone is ep2 over ddp2
    (re.compile(r"^ep(\d+)$"), lambda m: {"ep": int(m[1])}),
]


def _pipeline(pp: int, schedule: str | None) -> dict[str, Any]:
    name = SCHEDULE_NAMES.get(schedule or "1f1b")
    if name is None:
        raise UserError(f"unknown pipeline schedule {schedule!r} in a layout name; use one of "
                        f"{', '.join(sorted(SCHEDULE_NAMES))}.")
    virtual = 2 if name in ("interleaved-1f1b", "zero-bubble") else 1
    return {"pp": pp, "pp_schedule": name, "pp_virtual_stages": virtual}


@dataclass(frozen=True)
class Layout:
    name: str
    world_size: int
    parallel: dict[str, Any]

    def overrides(self) -> list[str]:
        """`--set` items that put a spec on this layout."""
        values = {"nproc": self.world_size, **self.parallel}
        return [f"parallel.{k}={_toml(v)}" for k, v in values.items()]


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def parse_layout(name: str) -> Layout:
    """`zero3-2+tp2` -> world 4, {dp_shard: 2, zero: 3, tp: 2}. Unnamed degrees are 1."""
    parallel: dict[str, Any] = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1,
                                "ep": 1}
    for part in name.replace("×", "+").split("+"):
        part = part.strip().lower()
        for pattern, build in _PARTS:
            match = pattern.match(part)
            if match:
                parallel.update(build(match))
                break
        else:
            raise UserError(
                f"cannot read the layout {name!r} (at {part!r}). Layouts are dp1, ddpN, zeroZ-N "
                "(Z = 0..3), hsdp-RxS, tpN, ppN[-gpipe|-1f1b|-interleaved|-zero-bubble], "
                "cpN[-ring|-allgather], epN, joined with '+', e.g. zero3-2+tp2, zero3-2+cp2 or "
                "ep2+zero3-2."
            )
    if parallel["ep"] > 1 and parallel["dp_replicate"] * parallel["dp_shard"] == 1:
        parallel.update(dp_replicate=parallel["ep"], zero=0)  # ranks for ep to borrow: DDP
    world = (parallel["dp_replicate"] * parallel["dp_shard"] * parallel["cp"] * parallel["tp"]
             * parallel["pp"])
    # (with cp, FSDP may shard over the cp ranks alone: zero3-1+cp2)
    if parallel["dp_shard"] == 1 and parallel.get("zero", 0) != 0 \
            and (parallel["cp"] == 1 or parallel["zero"] < 2):
        parallel["zero"] = 0
    return Layout(name, world, parallel)
