"""The planner against published runs: predict every row of the reference set at its own layout,
score the error in MFU points, fit the cost model's efficiencies, and score them on a source the
fit never saw (leave-one-source-out).

- **Prediction of a row**: every candidate layout the row stands for (`published.Reference`:
  one, or one per value of a field the source leaves unknown) is predicted with the row's
  framework mechanics; of those that fit in memory the fastest is the prediction (tuned
  benchmark runs: their unstated settings are taken to be the fastest), else the fastest.
  Memory does not depend on the fitted efficiencies, so which candidates fit is decided once.
- **Error**: predicted minus measured MFU, in points, both under shardwise's FLOP convention.
- **Fit** (`fit`): the `FITTED_FIELDS` of `CostParams` (GEMM and attention efficiency per
  hardware generation, the GEMM's fixed cost `gemm_k_half`, the overlap shares of background
  collectives and of FSDP's, the host's work per step), under a weak prior (`PRIOR_WEIGHT`), within
  physical bounds (`BOUNDS`), minimising the squared error with every source weighted equally
  (a source of 15 rows counts as much as one of 3). Cyclic coordinate search with a golden
  section per field: deterministic, no starting-point luck, no dependency.
- **Held out** (`leave_one_source_out`): each source predicted by a fit on the others. A
  generation only the held-out source has keeps its starting value there.
Imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from shardwise.planner.cost import (
    DEFAULT_PARAMS,
    FITTED_FIELDS,
    CostParams,
    Prediction,
    predict,
    predict_memory,
)
from shardwise.planner.dpcomm import fsdp_per_micro_batch
from shardwise.planner.published import Reference

#: physical bounds of each fitted field: GEMMs reach at most ~95 % of the dense peak; fused
#: attention 50-73 % of an A100's peak (FlashAttention-2) and 35-75 % of an H100's
#: (FlashAttention-2 to -3, cuDNN); a tile's fixed cost (filling its 4-5 stage software
#: pipeline of 64-wide k-steps, and the epilogue's store of the output tile) is at most ~8
#: k-steps of 64; the host's work per step at most a quarter of a second (a step of a tuned run
#: is 0.4 s and more: more would be a host-bound run, which a benchmark table does not print)
BOUNDS: dict[str, tuple[float, float]] = {
    "gemm_efficiency_ampere": (0.40, 0.95),
    "gemm_efficiency_hopper": (0.40, 0.95),
    "attention_efficiency_ampere": (0.50, 0.73),
    "attention_efficiency_hopper": (0.35, 0.75),
    "gemm_k_half_ampere": (0.0, 512.0),
    "gemm_k_half_hopper": (0.0, 512.0),
    "overlap": (0.0, 1.0),
    "fsdp_overlap": (0.0, 1.0),
    "step_host_s": (0.0, 0.25),
}
#: where every fit starts, whatever the defaults are (so a fit does not depend on the last one),
#: and the centre of the prior (`PRIOR_WEIGHT`): round figures inside the bounds
START: dict[str, float] = {
    "gemm_efficiency_ampere": 0.75, "gemm_efficiency_hopper": 0.65,
    "attention_efficiency_ampere": 0.60, "attention_efficiency_hopper": 0.55,
    "gemm_k_half_ampere": 128.0, "gemm_k_half_hopper": 128.0, "overlap": 0.8,
    "fsdp_overlap": 0.8, "step_host_s": 0.05,
}
#: A Gaussian prior on each fitted field, centred on START with a standard deviation of half its
#: bounds' span, makes the fit a maximum a posteriori estimate: minimise the sources' mean squared
#: error + PRIOR_WEIGHT x sum((x - start) / (span / 2))^2, where PRIOR_WEIGHT is the residual
#: variance (3.2 points^2, the in-sample source-mean squared error) over the sources the loss
#: averages (6): 0.53, taken as 0.5 (it was 2.3 / 5 = 0.47 before BLOOM's rows). Without it a field
#: that only one source identifies runs to a bound when that source is held out (FSDP's overlap
#: share without MosaicML; the Hopper attention efficiency, which only short-sequence rows
#: exercise since Llama 3's 128K row went to the probes), and the held-out source pays for it.
PRIOR_WEIGHT = 0.5
#: which fields a generation's rows identify (a field no training row exercises is not fitted)
GENERATION_FIELDS = {"ampere": ("gemm_efficiency_ampere", "attention_efficiency_ampere",
                                "gemm_k_half_ampere"),
                     "hopper": ("gemm_efficiency_hopper", "attention_efficiency_hopper",
                                "gemm_k_half_hopper")}
COORDINATE_SWEEPS = 2
GOLDEN_STEPS = 12
SIMPLEX_ITERATIONS = 300
SIMPLEX_STEP = 0.1


@dataclass(frozen=True)
class RowResult:
    """One row, predicted."""

    ref: Reference
    prediction: Prediction
    any_fits: bool

    @property
    def predicted_mfu(self) -> float:
        return self.prediction.mfu

    @property
    def measured_mfu(self) -> float:
        return self.ref.measured_mfu

    @property
    def error(self) -> float:
        """Predicted minus measured MFU, in points."""
        return 100.0 * (self.predicted_mfu - self.measured_mfu)

    @property
    def ratio(self) -> float:
        """Measured over predicted throughput."""
        return self.measured_mfu / self.predicted_mfu if self.predicted_mfu else math.nan

    def chosen(self) -> str:
        """The layout predicted, with the value chosen for each unknown field."""
        lo = self.prediction.layout
        picks = {"micro_batch": f"mb {lo.micro_batch}", "recompute": f"recompute {lo.recompute}",
                 "schedule": f"schedule {lo.schedule}", "v": f"v {lo.v}",
                 "sequence_parallel": f"sequence parallel {'on' if lo.sequence_parallel else 'off'}"}
        unknown = ", ".join(picks[k] for k in self.ref.unknown if k in picks)
        return lo.name() + (f" ({unknown})" if unknown else "")


@dataclass(frozen=True)
class Score:
    """Errors in MFU points over a set of rows."""

    mae: float
    max_abs: float
    n: int
    per_source: dict[str, tuple[float, float, float, int]]  # id -> (MAE, max, mean, rows)
    not_fitting: int

    @property
    def source_mae(self) -> float:
        """Mean of the per-source MAEs (every source weighted equally)."""
        return statistics.mean(v[0] for v in self.per_source.values())


def fitting_candidates(ref: Reference) -> tuple[tuple, bool]:
    """The candidates predicted to fit in memory (all of them when none does), and whether any
    does. Memory does not depend on the fitted efficiencies."""
    params = ref.params(CostParams())
    device = ref.cluster.cluster.device
    fit = tuple(lo for lo in ref.candidates
                if predict_memory(lo, ref.model, ref.batch, params, device)[0].total
                <= ref.cluster.memory_bytes)
    return (fit, True) if fit else (ref.candidates, False)


def predict_row(ref: Reference, base: CostParams,
                candidates: tuple[tuple, bool] | None = None) -> RowResult:
    layouts, fits = candidates or fitting_candidates(ref)
    params = ref.params(base)
    best = max((predict(lo, ref.model, ref.cluster, ref.batch, params) for lo in layouts),
               key=lambda p: p.tokens_per_s)
    return RowResult(ref, best, fits)


def predict_all(refs: Sequence[Reference], base: CostParams,
                candidates: Mapping[str, tuple[tuple, bool]] | None = None) -> list[RowResult]:
    cands = candidates or {r.id: fitting_candidates(r) for r in refs}
    return [predict_row(r, base, cands[r.id]) for r in refs]


def score(results: Iterable[RowResult]) -> Score:
    rows = list(results)
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r.ref.source.id, []).append(r.error)
    errs = [r.error for r in rows]
    per = {s: (statistics.mean(abs(e) for e in v), max(abs(e) for e in v), statistics.mean(v),
               len(v)) for s, v in by.items()}
    return Score(mae=statistics.mean(abs(e) for e in errs), max_abs=max(abs(e) for e in errs),
                 n=len(rows), per_source=per, not_fitting=sum(not r.any_fits for r in rows))


def loss(results: Sequence[RowResult]) -> float:
    """Squared error in points, every source weighted equally."""
    by: dict[str, list[float]] = {}
    for r in results:
        by.setdefault(r.ref.source.id, []).append(r.error ** 2)
    return sum(statistics.mean(v) for v in by.values()) / max(len(by), 1)


def prior_penalty(params: CostParams) -> float:
    """The prior's term of the objective (`PRIOR_WEIGHT`), in squared points."""
    return PRIOR_WEIGHT * sum(
        ((getattr(params, f) - START[f]) / ((BOUNDS[f][1] - BOUNDS[f][0]) / 2)) ** 2
        for f in FITTED_FIELDS)


def objective(refs: Sequence[Reference], params: CostParams,
              cands: Mapping[str, tuple[tuple, bool]]) -> float:
    """What the fit minimises: `loss` of the rows predicted with `params`, plus the prior."""
    return loss(predict_all(refs, params, cands)) + prior_penalty(params)


def fitted_fields(refs: Sequence[Reference]) -> tuple[str, ...]:
    """The fields the rows identify: a generation's GEMM efficiency only if some row runs on
    it, its attention efficiency only if some such row uses fused attention, FSDP's overlap
    share only if some row's FSDP communicates on every micro-batch (`fsdp_per_micro_batch`)."""
    conditional = {f for fs in GENERATION_FIELDS.values() for f in fs} | {"fsdp_overlap"}
    keep: set[str] = set()
    for r in refs:
        gen = r.cluster.device.generation
        if gen in GENERATION_FIELDS:
            gemm, attention, k_half = GENERATION_FIELDS[gen]
            keep.update((gemm, k_half))
            if r.params(CostParams()).fused_attention:
                keep.add(attention)
    if any(fsdp_per_micro_batch(lo, lo.micro_batches(r.batch),
                                r.params(CostParams()).reduce_every_micro_batch)
           for r in refs for lo in r.candidates):
        keep.add("fsdp_overlap")
    return tuple(f for f in FITTED_FIELDS if f not in conditional or f in keep)


def fit(refs: Sequence[Reference], base: CostParams = DEFAULT_PARAMS,
        candidates: Mapping[str, tuple[tuple, bool]] | None = None,
        progress: Callable[[str], None] | None = None) -> CostParams:
    """The fitted fields (`fitted_fields`) minimising `objective` over `refs`, within `BOUNDS`,
    from `START` (the fields the rows do not identify keep their `START` values): a golden
    section along each field in turn, then a Nelder-Mead simplex over all of them together (the
    efficiency and the fixed cost of one generation trade off against each other, which a
    search along one field at a time cannot follow). Deterministic."""
    cands = candidates or {r.id: fitting_candidates(r) for r in refs}
    fields = fitted_fields(refs)
    params = _with(base, START)
    current = objective(refs, params, cands)
    for _ in range(COORDINATE_SWEEPS):
        for name in fields:
            params, current = _golden(refs, params, name, cands, current)
    if progress:
        progress(f"coordinate search: loss {current:.3f}")
    params, current = _simplex(refs, params, fields, cands, current)
    if progress:
        progress(f"simplex: loss {current:.3f}")
    return params


def _with(params: CostParams, values: Mapping[str, float]) -> CostParams:
    """`params` with these fitted (float) fields replaced."""
    return dataclasses.replace(params, **values)  # type: ignore[arg-type]  # all float fields


def _golden(refs: Sequence[Reference], params: CostParams, name: str,
            cands: Mapping[str, tuple[tuple, bool]], current: float) -> tuple[CostParams, float]:
    """Golden-section search of one field within its bounds; keeps the current value unless a
    better one is found."""
    lo, hi = BOUNDS[name]

    def value_loss(x: float) -> float:
        return objective(refs, _with(params, {name: x}), cands)

    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = value_loss(c), value_loss(d)
    for _ in range(GOLDEN_STEPS):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = value_loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = value_loss(d)
    x, fx = (c, fc) if fc <= fd else (d, fd)
    if fx < current:
        return _with(params, {name: round(x, 4)}), fx
    return params, current


def _simplex(refs: Sequence[Reference], params: CostParams, fields: tuple[str, ...],
             cands: Mapping[str, tuple[tuple, bool]], current: float) -> tuple[CostParams, float]:
    """Nelder-Mead in coordinates scaled to each field's bounds (clipped to them)."""
    lo = [BOUNDS[f][0] for f in fields]
    span = [BOUNDS[f][1] - BOUNDS[f][0] for f in fields]

    def at(u: Sequence[float]) -> CostParams:
        return _with(params, {f: round(lo[i] + span[i] * min(max(u[i], 0.0), 1.0), 4)
                              for i, f in enumerate(fields)})

    def f(u: Sequence[float]) -> float:
        return objective(refs, at(u), cands)

    x0 = [(getattr(params, name) - lo[i]) / span[i] for i, name in enumerate(fields)]
    simplex = [x0] + [[x + (SIMPLEX_STEP if j == i else 0.0) for j, x in enumerate(x0)]
                      for i in range(len(fields))]
    values = [current] + [f(u) for u in simplex[1:]]
    for _ in range(SIMPLEX_ITERATIONS):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < 1e-4:
            break
        centre = [sum(col) / len(fields) for col in zip(*simplex[:-1], strict=True)]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centre, worst, strict=True)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centre, worst, strict=True)]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centre, worst, strict=True)]
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, u, strict=True)]
                                    for u in simplex[1:]]
                values = [values[0]] + [f(u) for u in simplex[1:]]
    i = min(range(len(values)), key=values.__getitem__)
    return (at(simplex[i]), values[i]) if values[i] < current else (params, current)


def leave_one_source_out(refs: Sequence[Reference], base: CostParams = DEFAULT_PARAMS,
                         candidates: Mapping[str, tuple[tuple, bool]] | None = None,
                         progress: Callable[[str], None] | None = None
                         ) -> tuple[list[RowResult], dict[str, CostParams]]:
    """Every row predicted by a fit made without its source; and each fold's parameters."""
    cands = candidates or {r.id: fitting_candidates(r) for r in refs}
    sources = list(dict.fromkeys(r.source.id for r in refs))
    held: dict[str, RowResult] = {}
    folds: dict[str, CostParams] = {}
    for source in sources:
        train = [r for r in refs if r.source.id != source]
        test = [r for r in refs if r.source.id == source]
        params = fit(train, base, cands)
        folds[source] = params
        if progress:
            progress(f"held out {source}: fitted on {len(train)} rows")
        for r in predict_all(test, params, cands):
            held[r.ref.id] = r
    return [held[r.id] for r in refs], folds
