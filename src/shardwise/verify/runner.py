"""`shardwise verify`: run one job under several layouts (and a stop-and-resume), compare each with
the first layout, and say whether every difference is within the stated tolerance.

Each layout trains in its own run directory through the same launcher as `shardwise train`; the
comparison reads what the runs wrote: per-step losses from metrics.jsonl, the full final
parameters and optimizer state (saved by the workers with --dump-state), and the sample ledger.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.data import PreparedData, prepare_data
from shardwise.data.ledger import audit
from shardwise.errors import UserError
from shardwise.run import rundir
from shardwise.run.agent import check_preempted, launch_local
from shardwise.run.launch import run_local
from shardwise.run.preflight import preflight, with_model_tokenizer
from shardwise.run.worker import FINAL_STATE
from shardwise.spec import RunSpec, load_spec
from shardwise.verify.layouts import Layout


@dataclass
class RunOutcome:
    name: str
    run_dir: Path
    seconds: float
    losses: list[float]
    params: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor]
    ledger_exact: bool
    ledger_problems: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    name: str
    max_abs_dloss: float
    max_rel_dloss: float
    max_abs_dparam: float
    rel_dparam: float  # ||Δ|| / ||ref|| over all parameters together
    bitwise: bool
    seconds: float
    ledger_exact: bool
    passed: bool


def layout_spec(config: str | None, overrides: list[str], layout: Layout, run_dir: Path,
                steps: int, stop_at: int = 0) -> RunSpec:
    fixed = [f"run.steps={steps}", f"run.stop_at={stop_at}", f'run.dir="{run_dir}"',
             "log.every=1", "log.progress=false", "log.tensorboard=false", "sample.tokens=0",
             "eval.every=0", f"checkpoint.enabled={'true' if stop_at else 'false'}",
             "checkpoint.every=0"]
    return load_spec(config, [*overrides, *layout.overrides(), *fixed])


def preflight_all(specs: dict[str, RunSpec]) -> dict[str, RunSpec]:
    """`preflight` of every run, keyed by layout name, before any of them trains: a layout the
    batch or the model cannot take fails in seconds, not after the layouts before it have
    trained. The data is prepared once per distinct data section (in practice once)."""
    prepared: dict[str, PreparedData] = {}  # by repr: a section with tables is not hashable
    checked: dict[str, RunSpec] = {}
    for name, spec in specs.items():
        spec = with_model_tokenizer(spec)
        key = repr(spec.data)
        if key not in prepared:
            prepared[key] = prepare_data(spec.data)
        try:
            checked[name], _ = preflight(spec, prepared[key])
        except UserError as err:
            raise UserError(f"layout {name} cannot run this job: {err} Nothing was trained; fix "
                            "the spec or leave this layout out.") from None
    return checked


def run_layout(name: str, spec: RunSpec, run_dir: Path, resume: bool = False) -> RunOutcome:
    """Train `spec`, already through `preflight`, in `run_dir` and read back what it wrote."""
    if not resume:
        rundir.new_run_dir(spec)
    rundir.write_spec(run_dir, spec)
    t0 = time.perf_counter()
    run_local(spec, run_dir, resume, dump_state=True)
    seconds = time.perf_counter() - t0
    return read_outcome(name, run_dir, seconds)


def run_layouts(runs: list[tuple[str, RunSpec, Path]]) -> list[RunOutcome]:
    """Train fresh runs (each `(name, spec through preflight, run_dir)`) and read them back, in
    the order given. Multi-worker runs of one world size share one launch (the workers train
    them in turn), so start-up is paid once per world size, not once per layout; a run with a
    failure policy (restarts, planted faults) gets a launch of its own, since a restart would
    re-run the whole launch. A shared run's `seconds` is its own span in its events (first to
    last), without the shared start-up."""
    outcomes: dict[str, RunOutcome] = {}
    groups: dict[int, list[tuple[str, RunSpec, Path]]] = {}
    for name, spec, run_dir in runs:
        alone = spec.parallel.nproc == 1 or spec.failure.max_restarts > 0 or spec.failure.faults
        if alone:
            outcomes[name] = run_layout(name, spec, run_dir)
        else:
            groups.setdefault(spec.parallel.nproc, []).append((name, spec, run_dir))
    for nproc, group in groups.items():
        for _, spec, run_dir in group:
            rundir.new_run_dir(spec)
            rundir.write_spec(run_dir, spec)
        first = group[0][1].failure
        launch_local(group[0][2], nproc, False, worker_args=("--dump-state",),
                     preempt_signals=first.preempt_signals, grace_s=first.preempt_grace_s,
                     then=tuple(run_dir for _, _, run_dir in group[1:]))
        for name, _, run_dir in group:
            check_preempted(run_dir)
            outcomes[name] = read_outcome(name, run_dir, _span(run_dir))
    return [outcomes[name] for name, _, _ in runs]


def _span(run_dir: Path) -> float:
    times = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return max(times) - min(times) if times else 0.0


def read_outcome(name: str, run_dir: Path, seconds: float) -> RunOutcome:
    losses: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == "step":
            losses[event["step"]] = event["loss"]  # a resumed run re-logs nothing before it
    state = torch.load(run_dir / FINAL_STATE, weights_only=True)
    report = audit(run_dir)
    return RunOutcome(name, run_dir, seconds, [losses[s] for s in sorted(losses)],
                      state["params"], state["optim"], report.exact, report.problems)


def compare(ref: RunOutcome, run: RunOutcome, rtol: float, bitwise_required: bool) -> Comparison:
    if len(ref.losses) != len(run.losses) or ref.params.keys() != run.params.keys():
        return Comparison(run.name, float("inf"), float("inf"), float("inf"), float("inf"),
                          False, run.seconds, run.ledger_exact, False)
    dl = [abs(a - b) for a, b in zip(ref.losses, run.losses, strict=True)]
    rl = [d / abs(a) if a else d for d, a in zip(dl, ref.losses, strict=True)]
    diff_sq = sum(float((run.params[k].double() - ref.params[k].double()).pow(2).sum())
                  for k in ref.params)
    ref_sq = sum(float(ref.params[k].double().pow(2).sum()) for k in ref.params)
    max_abs = max(float((run.params[k] - ref.params[k]).abs().max()) for k in ref.params)
    bitwise = (ref.losses == run.losses
               and all(torch.equal(ref.params[k], run.params[k]) for k in ref.params)
               and ref.optim.keys() == run.optim.keys()
               and all(torch.equal(ref.optim[k], run.optim[k]) for k in ref.optim))
    rel_param = (diff_sq / ref_sq) ** 0.5 if ref_sq else diff_sq ** 0.5
    within = bitwise if bitwise_required else (max(rl) <= rtol and rel_param <= rtol)
    return Comparison(run.name, max(dl), max(rl), max_abs, rel_param, bitwise, run.seconds,
                      run.ledger_exact, within and run.ledger_exact)


def format_table(rows: list[Comparison], reference: str) -> str:
    header = (f"{'layout':<24} {'max|Δloss|':>11} {'max|Δparam|':>12} {'‖Δparam‖/‖p‖':>13} "
              f"{'bitwise':>8} {'ledger':>7} {'time s':>7}  result")
    lines = [f"reference: {reference}", header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.name:<24} {r.max_abs_dloss:>11.3e} {r.max_abs_dparam:>12.3e} "
                     f"{r.rel_dparam:>13.3e} {'yes' if r.bitwise else 'no':>8} "
                     f"{'exact' if r.ledger_exact else 'BAD':>7} {r.seconds:>7.1f}  "
                     f"{'ok' if r.passed else 'FAIL'}")
    return "\n".join(lines)
