"""`shardwise scale`: the same job at several world sizes, one after another, each through the
launcher `shardwise train` uses (`run.launch.start_run`: a fresh run directory, the spec written,
the workers started), then read back by `shardwise.compare.scaling`.

Strong scaling keeps the global batch (so the optimization and the token budget are the same at
every size, and the runs form a controlled comparison); weak scaling keeps the batch per rank: the
global batch grows with the world size, w / w0 times the config's at the smallest size w0.
Every size is checked (batch against the data-parallel degree, layout against the world) before
any trains, so a size the batch does not divide fails in seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import UserError
from shardwise.parallel.dims import ParallelDims
from shardwise.spec import RunSpec, load_spec

MAX_WORLD = 1024


@dataclass
class ScaleRun:
    world: int
    spec: RunSpec
    dims: ParallelDims | None = None
    run_dir: Path | None = None
    launch_s: float | None = None


def parse_worlds(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]: distinct positive sizes, in increasing order."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        worlds = [int(p) for p in parts]
    except ValueError:
        raise UserError(f"--world {text!r} is not a list of world sizes; write them as whole "
                        "numbers separated by commas, e.g. --world 1,2,4.") from None
    if len(worlds) < 2:
        raise UserError(f"--world {text!r} names {len(worlds)} size(s); a scaling study needs at "
                        "least two, e.g. --world 1,2,4.")
    bad = [w for w in worlds if not 1 <= w <= MAX_WORLD]
    if bad:
        raise UserError(f"--world {text!r}: {bad[0]} is not a world size; each must be between 1 "
                        f"and {MAX_WORLD}.")
    if len(set(worlds)) != len(worlds):
        raise UserError(f"--world {text!r} repeats a size; name each once.")
    return sorted(worlds)


def scale_specs(config: str | None, overrides: list[str], worlds: list[int], weak: bool,
                steps: int | None, out: Path) -> list[ScaleRun]:
    base = load_spec(config, overrides)
    runs = []
    for w in worlds:
        sets = [*overrides, f"parallel.nproc={w}", f'run.dir="{out / f"world-{w}"}"']
        if steps is not None:
            sets.append(f"run.steps={steps}")
        if weak:
            scaled, rest = divmod(base.batch.global_batch * w, worlds[0])
            if rest:
                raise UserError(
                    f"--weak keeps the batch per rank: world {w} would need a global batch of "
                    f"{base.batch.global_batch} x {w} / {worlds[0]}, not a whole number. Use "
                    f"world sizes that are multiples of the smallest ({worlds[0]}).")
            sets.append(f"batch.global_batch={scaled}")
        runs.append(ScaleRun(w, load_spec(config, sets)))
    return runs


def preflight_all(runs: list[ScaleRun], weak: bool) -> None:
    """`preflight` of every size before any trains (the data prepared once)."""
    from shardwise.data import prepare_data
    from shardwise.run.preflight import preflight, with_model_tokenizer

    data = prepare_data(with_model_tokenizer(runs[0].spec).data)
    for run in runs:
        try:
            run.spec, run.dims = preflight(run.spec, data)
        except UserError as err:
            how = ("the batch per rank is kept, so check batch.micro_batch against it" if weak
                   else f"strong scaling keeps batch.global_batch = {run.spec.batch.global_batch}"
                        ": choose --world sizes whose data-parallel degree divides it into "
                        "whole micro-batches, or pass --weak to keep the batch per rank instead")
            raise UserError(f"world size {run.world} cannot run this job: {err} Nothing was "
                            f"trained; {how}.") from None


def run_all(runs: list[ScaleRun]) -> None:
    """Train every size in turn, smallest first, timing each launch end to end."""
    from shardwise.run.launch import start_run

    for run in runs:
        assert run.dims is not None, "preflight_all first"
        t0 = time.perf_counter()
        run.run_dir = start_run(run.spec, run.dims, None)
        run.launch_s = time.perf_counter() - t0
