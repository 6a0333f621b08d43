"""The validation against published runs, run and written down: the table `shardwise plan
--validate` prints, the dated section `python benchmarks/bench_plan.py --published` appends to
benchmarks/RESULTS.md, and the `planner/fitted.py` it regenerates (`--write-fit`)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardwise.planner import accuracy, validate
from shardwise.planner.cost import FITTED_FIELDS, CostParams, Prediction
from shardwise.planner.published import Reference, load
from shardwise.planner.validate import RowResult, Score, score


@dataclass(frozen=True)
class Validation:
    """Every row predicted three ways: with the parameters given, with a fit on all rows
    (in-sample), and with a fit that left the row's source out (held out)."""

    path: Path
    refs: list[Reference]
    given: list[RowResult]
    in_sample: list[RowResult]
    held_out: list[RowResult]
    fitted: CostParams
    folds: dict[str, CostParams]
    seconds: float


def out_of_sample(path: str | Path, params: CostParams) -> list[RowResult]:
    """Every row of a reference set no fit has seen (benchmarks/published_moe.toml), predicted
    with `params` (the fit on the reference set)."""
    return validate.predict_all(load(path), params)


def run(path: str | Path, base: CostParams,
        progress: Callable[[str], None] | None = None) -> Validation:
    """Load, predict with `base`, fit on all rows, and fit leaving each source out."""
    start = time.perf_counter()
    refs = load(path)
    cands = {r.id: validate.fitting_candidates(r) for r in refs}
    given = validate.predict_all(refs, base, cands)
    fitted = validate.fit(refs, base, cands, progress)
    in_sample = validate.predict_all(refs, fitted, cands)
    held, folds = validate.leave_one_source_out(refs, base, cands, progress)
    return Validation(Path(path), refs, given, in_sample, held, fitted, folds,
                      time.perf_counter() - start)


# --- what the CLI prints ----------------------------------------------------------------------

def text(results: Sequence[RowResult], title: str) -> str:
    """Per-row predicted vs measured MFU and the scores, for `shardwise plan --validate`."""
    head = ["run", "source", "measured %", "predicted %", "error", "fits", "layout predicted"]
    rows = [head] + [[r.ref.id, r.ref.source.id, f"{100 * r.measured_mfu:.1f}",
                      f"{100 * r.predicted_mfu:.1f}", f"{r.error:+.1f}",
                      "yes" if r.any_fits else "NO", r.chosen()] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [title, ""]
    lines += ["  ".join(c.rjust(w) if 2 <= i <= 4 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
              for row in rows]
    lines += ["", summary(score(results))]
    for r in results:
        if not r.any_fits:
            cuda = r.ref.cluster.cluster.device == "cuda"
            lines.append(f"  {r.ref.id}: {headroom(r.prediction, r.ref.params(CostParams()), cuda)}")
    return "\n".join(lines)


def headroom(pred: Prediction, params: CostParams, cuda: bool = True) -> str:
    """How far a layout predicted not to fit is from fitting: what it allocates against the
    device, and on a GPU the caching allocator's waste (`CostParams.fragmentation`, a default
    no source states) under which it would fit."""
    mem, gib = pred.memory, 2**30
    allocated = mem.total - mem.fragmentation - mem.overhead
    room = pred.capacity_bytes - mem.overhead
    head = (f"{mem.total / gib:.1f} GiB a rank on pipeline rank {pred.memory_rank}, of "
            f"{pred.capacity_bytes / gib:.1f}: {allocated / gib:.1f} GiB allocated")
    if not cuda:
        return head
    if allocated >= room:
        return head + ", more than the device holds with no allocator waste at all"
    return (head + f"; it fits if the caching allocator wastes under "
            f"{100 * (room / allocated - 1):.1f} % of that (the planner allows "
            f"{100 * params.fragmentation:.0f} %)")


def summary(s: Score) -> str:
    per = "; ".join(f"{src} {mae:.1f} (max {mx:.1f}, mean {mean:+.1f}, {n} rows)"
                    for src, (mae, mx, mean, n) in s.per_source.items())
    tail = f"; {s.not_fitting} row(s) predicted not to fit in memory" if s.not_fitting else ""
    return (f"MFU error over {s.n} rows: mean absolute {s.mae:.2f} points, max {s.max_abs:.2f}; "
            f"by source: {per}{tail}")


# --- benchmarks/RESULTS.md -------------------------------------------------------------------

def markdown(v: Validation, command: str, stamp: str) -> str:
    """The dated RESULTS.md section."""
    given, ins, held = score(v.given), score(v.in_sample), score(v.held_out)
    sources = list(dict.fromkeys(r.source.id for r in v.refs))
    lines = [f"## shardwise plan against published runs {stamp}", "", f"`{command}`", "",
             f"- reference set: `{v.path.name}` ({len(v.refs)} rows from {len(sources)} sources: "
             + ", ".join(f"{s} {sum(r.source.id == s for r in v.refs)}" for s in sources)
             + f"); wall {v.seconds:.0f} s",
             "- MFU under shardwise's convention (6N + causal attention) for measurement and "
             "prediction alike; error = predicted − measured, in points", "",
             "| parameters | MAE | max | source-mean MAE | rows not fitting |",
             "|---|---|---|---|---|",
             _score_row("built-in CostParams (as shipped)", given),
             _score_row("fitted on all rows (in-sample)", ins),
             _score_row("fitted without the row's source (held out)", held), "",
             "| source | rows | in-sample MAE | max | mean | held-out MAE | max | mean |",
             "|---|---|---|---|---|---|---|---|"]
    for s in sources:
        x, y = ins.per_source[s], held.per_source[s]
        lines.append(f"| {s} | {x[3]} | {x[0]:.2f} | {x[1]:.2f} | {x[2]:+.2f} | {y[0]:.2f} | "
                     f"{y[1]:.2f} | {y[2]:+.2f} |")
    lines += ["", "| run | measured % | published % | in-sample % | err | held-out % | err | "
              "layout predicted (unknown fields chosen) | fits |",
              "|---|---|---|---|---|---|---|---|---|"]
    for a, b in zip(v.in_sample, v.held_out, strict=True):
        pub = f"{100 * a.ref.published_mfu:.1f}" if a.ref.published_mfu else "-"
        lines.append(f"| {a.ref.id} | {100 * a.measured_mfu:.1f} | {pub} | "
                     f"{100 * a.predicted_mfu:.1f} | {a.error:+.1f} | {100 * b.predicted_mfu:.1f} "
                     f"| {b.error:+.1f} | {a.chosen()} | {'yes' if a.any_fits else 'no'} |")
    lines += ["", "Fitted (all rows): " + _params(v.fitted) + "."]
    lines += [f"Fitted without {s}: " + _params(p) + "." for s, p in v.folds.items()]
    lines += ["", "Interval (10th-90th percentile of held-out measured / predicted): " + "; ".join(
        f"{gen} {lo:.2f}-{hi:.2f} ({len(rs)} rows)" for gen, (lo, hi), rs in _bands(v)) + "."]
    return "\n".join(lines) + "\n"


def _score_row(label: str, s: Score) -> str:
    return f"| {label} | {s.mae:.2f} | {s.max_abs:.2f} | {s.source_mae:.2f} | {s.not_fitting} |"


def _params(p: CostParams) -> str:
    return ", ".join(f"{f} {getattr(p, f):.4g}" for f in FITTED_FIELDS)


def _bands(v: Validation) -> list[tuple[str, tuple[float, float], tuple[float, ...]]]:
    out = []
    for gen, rs in sorted(held_out_ratios(v).items()):
        lo, hi = accuracy.quantiles(rs, (accuracy.LOW_Q, accuracy.HIGH_Q))
        out.append((gen, (lo, hi), rs))
    return out


def held_out_ratios(v: Validation) -> dict[str, tuple[float, ...]]:
    by: dict[str, list[float]] = {}
    for r in v.held_out:
        by.setdefault(r.ref.cluster.device.generation, []).append(round(r.ratio, 4))
    return {g: tuple(rs) for g, rs in by.items()}


# --- planner/fitted.py -----------------------------------------------------------------------

def fitted_module(v: Validation, stamp: str, moe: Sequence[RowResult] = (),
                  moe_path: Path | None = None) -> str:
    """The text of `planner/fitted.py` for this validation, with the ratios of the MoE rows
    (`moe`, from `moe_path`) predicted by its fit."""
    digest = hashlib.sha256(v.path.read_bytes()).hexdigest()[:16]
    moe_ratios = tuple(round(r.ratio, 4) for r in moe)
    moe_from = (f"{moe_path.name} (sha256 {hashlib.sha256(moe_path.read_bytes()).hexdigest()[:16]}"
                "...)" if moe_path else "no file")
    ins, held = score(v.in_sample), score(v.held_out)
    fitted = ",\n".join(f'    "{f}": {getattr(v.fitted, f)!r}' for f in FITTED_FIELDS)
    ratios = ",\n".join(f'    "{g}": (\n' + _wrapped(rs) + ")"
                        for g, rs in sorted(held_out_ratios(v).items()))
    scores = {"in_sample_mae": ins.mae, "in_sample_max": ins.max_abs, "held_out_mae": held.mae,
              "held_out_max": held.max_abs}
    score_text = ",\n".join(f'    "{k}": {round(x, 3)!r}' for k, x in scores.items())
    head = Path(__file__).with_name("fitted.py").read_text(encoding="utf-8").split('"""')[1]
    return (f'"""{head}"""\n\nGENERATED = "{stamp} from {v.path.name} (sha256 {digest}...)"\n\n'
            "#: CostParams fields fitted on all rows (their defaults in `planner/params.py`)\n"
            f"FITTED: dict[str, float] = {{\n{fitted},\n}}\n\n"
            "#: measured / predicted MFU of each row, predicted by a fit without its source, by "
            "generation\n"
            f"HELD_OUT_RATIOS: dict[str, tuple[float, ...]] = {{\n{ratios},\n}}\n\n"
            "#: measured / predicted MFU of each mixture-of-experts row, predicted by the fit "
            f"above (none of them in it):\n#: {moe_from}\n"
            f"MOE_RATIOS: tuple[float, ...] = (\n{_wrapped(moe_ratios, indent=4)})\n\n"
            "#: MFU error in points: in-sample and held out\n"
            f"SCORES: dict[str, float] = {{\n{score_text},\n}}\n")


def _wrapped(values: tuple[float, ...], per_line: int = 10, indent: int = 8) -> str:
    """`values` as lines of a tuple's body, the closing bracket's indent after them."""
    return "".join(" " * indent + ", ".join(repr(x) for x in values[i:i + per_line]) + ",\n"
                   for i in range(0, len(values), per_line)) + " " * (indent - 4)
