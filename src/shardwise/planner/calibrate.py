"""Calibration: the `CostParams` that fit the step times of runs that happened, and the error of
that fit. Imports no torch. The runs themselves, read back and predicted, are
`planner/measured.py`; the parameters' TOML file is `planner/params_file.py`.

Fitting (`fit`): `efficiency`, `overlap` and the framework-overhead coefficients
(`cost.OVERHEAD_FIELDS`: per FSDP unit, per FSDP gather, per TP linear, per ZeRO-1 tensor, per
ring-attention chunk) — the parameters step time depends on that no datasheet gives — by least
squares on log step time: every run weighs the same whatever its length, so a 20 ms layout
counts as much as a 2 s one, and a ratio error is symmetric. Efficiency and overlap are searched
on a grid (efficiency log-spaced over [0.005, 1], overlap over [0, 1]: coarse, then finer around
the best), deterministic, with no starting point. On a CPU step time is linear in the overhead
coefficients (counts x coefficient per micro-batch, `cost.overhead_counts`), so for each grid
cell they are solved exactly: bounded least squares (each in [0, OVERHEAD_MAX_S]) on the relative
error, refined by Gauss-Newton on the log error at the last stage. Only coefficients some run
exercises are fitted, and only as many as leave `SPARE_CONFIGS` configurations beyond the fitted
parameters (with three configurations: efficiency and overlap alone, as before); the rest keep
their values (the defaults are measured: `cost.CostParams`). Ties (overlap cannot be told apart
when no run has communication to hide) keep the value nearest the current one; with one
configuration only efficiency is fitted; a fit no better than the current parameters on log
loss returns them unchanged.

The error is reported twice (`shardwise plan --calibrate`): in-sample (the fit scored on the
runs it was fitted to, which flatters it: 5-7 parameters on ~10 configurations) and
leave-one-out (`leave_one_out`): each configuration — a layout with all its repeats, so that a
repeat's twin cannot stand in for it — predicted by a fit made on the others. A coefficient that
only the left-out configuration exercises (tp2 is the only TP layout of bench_plan) is not
identifiable without it and keeps its default there, which is what a new layout would get.
Spearman's rank correlation (`config_spearman`) is over configurations: per configuration the
median measured step time against its prediction.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.planner.cost import OVERHEAD_FIELDS, CostParams, predict
from shardwise.planner.measured import RunRecord, relative_error
from shardwise.planner.models import ModelDims
from shardwise.spec.cluster import ClusterSpec

EFFICIENCIES = tuple(0.005 * (1 / 0.005) ** (i / 63) for i in range(64))
OVERLAPS = tuple(i / 20 for i in range(21))
#: the bound on each framework-overhead coefficient a fit may reach (per op; the defaults are
#: 0.65-3.6 ms on a 2-core CPU)
OVERHEAD_MAX_S = 0.05
#: configurations a fit needs beyond its parameters before it fits an overhead coefficient
SPARE_CONFIGS = 2

Case = tuple[RunRecord, ModelDims, ClusterSpec]


def config_key(run: RunRecord) -> tuple:
    """What makes runs repeats of one configuration: layout, batch, world, model and device.
    Leave-one-out leaves a configuration out with all its repeats — leaving out one repeat while
    its twin stays in the fit would score the fit on a run it has all but seen."""
    return (run.layout, run.batch, run.world, run.device, repr(run.spec.model))


class PredictionCache:
    """`predict`'s step time and overhead counts per (case, efficiency, overlap), memoised: the
    grid cells are the same for every leave-one-out fit, so each is predicted once. On a CPU
    cluster step time is linear in the overhead coefficients (`cost.predict`: counts x
    coefficient added to each micro-batch), so cells are predicted with every coefficient at 0
    and the coefficients added back from the counts; on a GPU (where they are hidden behind the
    kernels up to a point: not linear) the cell keeps the coefficients that are not fitted."""

    def __init__(self, cases: Sequence[Case]) -> None:
        self.cases = list(cases)
        self.memo: dict[tuple[int, CostParams], tuple[float, dict[str, float]]] = {}
        # repeats of a configuration predict alike: one prediction per distinct input
        first: dict[tuple, int] = {}
        self.same = [first.setdefault((r.layout, r.batch, m, c), i)
                     for i, (r, m, c) in enumerate(self.cases)]
        self.cpu = [c.cluster.device == "cpu" for _, _, c in self.cases]
        self.zeroed: dict[CostParams, CostParams] = {}

    def raw(self, i: int, params: CostParams) -> tuple[float, dict[str, float]]:
        i = self.same[i]
        key = (i, params)
        if key not in self.memo:
            run, model, cluster = self.cases[i]
            pred = predict(run.layout, model, cluster, run.batch, params)
            self.memo[key] = (pred.step_time_s, pred.overhead_counts)
        return self.memo[key]

    def __call__(self, i: int, params: CostParams,
                 free: Sequence[str] = ()) -> tuple[float, dict[str, float]]:
        """(step time with the `free` coefficients at 0, the overhead counts)."""
        if not self.cpu[i]:
            zeros: dict[str, Any] = dict.fromkeys(free, 0.0)  # (float coefficients)
            return self.raw(i, dataclasses.replace(params, **zeros))
        zeroed = self.zeroed.get(params)
        if zeroed is None:
            no_overhead: dict[str, Any] = dict.fromkeys(OVERHEAD_FIELDS, 0.0)
            zeroed = self.zeroed[params] = dataclasses.replace(params, **no_overhead)
        t, counts = self.raw(i, zeroed)
        return t + sum(n * getattr(params, f) for f, n in counts.items()
                       if n and f not in free), counts


def _bounded_lsq(rows: Sequence[Sequence[float]], rhs: Sequence[float],
                 upper: float) -> list[float]:
    """min |rows x - rhs|^2 over 0 <= x_k <= upper: projected coordinate descent on the normal
    equations (a handful of unknowns; exact per coordinate, converges on this convex box)."""
    k = len(rows[0]) if rows else 0
    h = [[sum(r[a] * r[b] for r in rows) for b in range(k)] for a in range(k)]
    g = [sum(r[a] * y for r, y in zip(rows, rhs, strict=True)) for a in range(k)]
    x = _solve(h, g)  # the unconstrained optimum: the answer when it lies in the box
    if x is not None and all(0.0 <= v <= upper for v in x):
        return x
    x = [min(max(v, 0.0), upper) for v in x] if x is not None else [0.0] * k
    for _ in range(100):
        moved = 0.0
        for a in range(k):
            if h[a][a] <= 0:
                continue
            rest = g[a] - sum(h[a][b] * x[b] for b in range(k) if b != a)
            new = min(max(rest / h[a][a], 0.0), upper)
            moved = max(moved, abs(new - x[a]))
            x[a] = new
        if moved < 1e-10:
            break
    return x


def _solve(h: list[list[float]], g: list[float]) -> list[float] | None:
    """h x = g by Gaussian elimination with partial pivoting; None when singular."""
    k = len(g)
    a = [[*row, g[i]] for i, row in enumerate(h)]
    scale = max((abs(v) for row in h for v in row), default=0.0)
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) <= 1e-12 * scale or scale == 0.0:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(c + 1, k):
            f = a[r][c] / a[c][c]
            if f:
                for j in range(c, k + 1):
                    a[r][j] -= f * a[c][j]
    x = [0.0] * k
    for c in range(k - 1, -1, -1):
        x[c] = (a[c][k] - sum(a[c][j] * x[j] for j in range(c + 1, k))) / a[c][c]
    return x


def _log_loss(base: Sequence[tuple[float, dict[str, float]]], measured: Sequence[float],
              free: Sequence[str], x: Sequence[float]) -> float:
    total = 0.0
    for (t, c), y in zip(base, measured, strict=True):
        p = t + sum(c.get(f, 0.0) * v for f, v in zip(free, x, strict=True))
        total += math.log(max(p, 1e-12) / y) ** 2
    return total


def _solve_overheads(base: Sequence[tuple[float, dict[str, float]]], measured: Sequence[float],
                     free: Sequence[str], refine: bool = True) -> tuple[list[float], float]:
    """The free overhead coefficients that best fit, given each run's step time without them and
    its counts (step time is linear in them on a CPU): bounded least squares on the relative
    error, then (`refine`) Gauss-Newton steps on log step time. Returns (coefficients, sum of
    squared log errors)."""
    if not free:
        return [], _log_loss(base, measured, free, [])
    rows = [[c.get(f, 0.0) / y for f in free] for (_, c), y in zip(base, measured, strict=True)]
    x = _bounded_lsq(rows, [1 - t / y for (t, _), y in zip(base, measured, strict=True)],
                     OVERHEAD_MAX_S)
    best = _log_loss(base, measured, free, x)
    for _ in range(3 if refine else 0):  # Gauss-Newton on log((t + c.x) / y)
        preds = [t + sum(c.get(f, 0.0) * v for f, v in zip(free, x, strict=True))
                 for t, c in base]
        jac = [[c.get(f, 0.0) / p for f in free] for (_, c), p in zip(base, preds, strict=True)]
        # the new x minimises |J x_new - (J x - r)|^2, r = log(p / y), within the bounds
        rhs = [-math.log(p / y) + sum(j * v for j, v in zip(row, x, strict=True))
               for row, p, y in zip(jac, preds, measured, strict=True)]
        cand = _bounded_lsq(jac, rhs, OVERHEAD_MAX_S)
        value = _log_loss(base, measured, free, cand)
        if value >= best * (1 - 1e-12):
            break
        x, best = cand, value
    return x, best


def free_overheads(cases: Sequence[Case], params: CostParams,
                   predictions: PredictionCache | None = None,
                   index: Sequence[int] | None = None) -> list[str]:
    """The overhead coefficients these runs can fit: those some run exercises, exercised by the
    most configurations first, as many as leave `SPARE_CONFIGS` configurations beyond the fitted
    parameters (efficiency, overlap and these). The rest keep their values."""
    predictions = predictions or PredictionCache(cases)
    index = list(range(len(cases))) if index is None else list(index)
    configs = len({config_key(predictions.cases[i][0]) for i in index})
    allowed = max(0, configs - 2 - SPARE_CONFIGS)
    used = {f: len({config_key(predictions.cases[i][0]) for i in index
                    if predictions(i, params)[1].get(f, 0.0) > 0})
            for f in OVERHEAD_FIELDS}
    ranked = sorted((f for f in OVERHEAD_FIELDS if used[f]), key=lambda f: -used[f])
    return ranked[:allowed]


def fit(cases: Sequence[Case], params: CostParams, predictions: PredictionCache | None = None,
        index: Sequence[int] | None = None) -> CostParams:
    """`params` with `efficiency`, `overlap` and the framework-overhead coefficients the runs
    exercise (`free_overheads`) fitted to the runs' step times — least squares on log step time,
    bounded (efficiency in [0.005, 1], overlap in [0, 1], each overhead in [0, OVERHEAD_MAX_S]);
    see the module docstring. `index`: fit on these cases only (leave-one-out). Never worse on
    these runs (log loss) than `params` itself."""
    predictions = predictions or PredictionCache(cases)
    index = list(range(len(cases))) if index is None else list(index)
    measured = [predictions.cases[i][0].step_time_s for i in index]
    free = free_overheads(cases, params, predictions, index)
    configs = len({config_key(predictions.cases[i][0]) for i in index})

    def score(e: float, o: float, refine: bool) -> tuple[float, list[float]]:
        cell = dataclasses.replace(params, efficiency=e, overlap=o)
        x, value = _solve_overheads([predictions(i, cell, free) for i in index], measured, free,
                                    refine)
        return value, x

    def best(effs: Sequence[float], olaps: Sequence[float],
             refine: bool = False) -> tuple[float, float, float, list[float]]:
        scored = []
        for e in effs:
            for o in olaps:
                value, x = score(e, o, refine)
                scored.append((value, abs(o - params.overlap), e, o, x))
        low = min(s[0] for s in scored)
        close = [s for s in scored if s[0] <= low * (1 + 1e-9) + 1e-12]
        value, _, e, o, x = min(close,
                                key=lambda s: (s[1], abs(math.log(s[2] / params.efficiency))))
        return value, e, o, x

    ratio = (1 / 0.005) ** (1 / 63)
    _, e, o, _ = best(EFFICIENCIES[::2], OVERLAPS[::2] if configs > 1 else (params.overlap,))
    near = tuple(e * ratio ** (i / 5) for i in range(-10, 11)
                 if EFFICIENCIES[0] <= e * ratio ** (i / 5) <= 1.0)
    _, e, o, _ = best(near, (o,))
    if configs > 1:
        _, e, o, _ = best((e,), tuple(x for x in OVERLAPS if abs(x - o) <= 0.1 + 1e-9))
    # last, efficiency off the grid: golden-section search on log efficiency within one coarse
    # step, per overlap, walking the overlap grid while a neighbour does better (the overheads
    # trade off against both; a grid efficiency's error would pull the overlap off)
    center = e

    def golden(olap: float) -> tuple[float, float, float, float, list[float]]:
        lo_e = max(math.log(center) - math.log(ratio), math.log(EFFICIENCIES[0]))
        hi_e = min(math.log(center) + math.log(ratio), 0.0)
        for _ in range(10):
            m1, m2 = hi_e - 0.618 * (hi_e - lo_e), lo_e + 0.618 * (hi_e - lo_e)
            if score(math.exp(m1), olap, True)[0] <= score(math.exp(m2), olap, True)[0]:
                hi_e = m2
            else:
                lo_e = m1
        ge = math.exp((lo_e + hi_e) / 2)
        gv, gx = score(ge, olap, True)
        return gv, abs(olap - params.overlap), ge, olap, gx

    step = OVERLAPS[1] - OVERLAPS[0]
    tried = {o: golden(o)}
    while configs > 1:
        here = min(tried.values(), key=lambda c: (c[0], c[1]))[3]
        fresh = [q for q in (round(here - step, 10), round(here + step, 10))
                 if 0.0 <= q <= 1.0 and q not in tried]
        if not fresh:
            break
        for q in fresh:
            tried[q] = golden(q)
        if min(tried.values(), key=lambda c: (c[0], c[1]))[3] == here:
            break
    value, _, e, o, x = min(tried.values(), key=lambda c: (c[0], c[1]))
    coefficients: dict[str, Any] = dict(zip(free, x, strict=True))
    fitted = dataclasses.replace(params, efficiency=e, overlap=o, **coefficients)
    current = _log_loss([predictions(i, params) for i in index], measured, (), ())
    return fitted if value <= current else params


@dataclass(frozen=True)
class LeaveOneOut:
    """Each run predicted by a fit made without its configuration (all its repeats)."""

    step_time_pred: tuple[float, ...]  # per case, in order
    params: tuple[CostParams, ...]  # the fit each case was predicted with

    def errors(self, cases: Sequence[Case]) -> list[float]:
        return [relative_error(p, c[0].step_time_s)
                for p, c in zip(self.step_time_pred, cases, strict=True)]


def leave_one_out(cases: Sequence[Case], params: CostParams,
                  predictions: PredictionCache | None = None) -> LeaveOneOut | None:
    """Leave-one-configuration-out predictions of step time (None with fewer than two
    configurations: nothing would be left to fit on)."""
    predictions = predictions or PredictionCache(cases)
    keys = [config_key(c[0]) for c in cases]
    if len(set(keys)) < 2:
        return None
    preds: list[float] = [0.0] * len(cases)
    fits: list[CostParams | None] = [None] * len(cases)
    for key in dict.fromkeys(keys):
        held = [i for i, k in enumerate(keys) if k == key]
        fitted = fit(cases, params, predictions, [i for i, k in enumerate(keys) if k != key])
        for i in held:
            run, model, cluster = cases[i]
            preds[i] = predict(run.layout, model, cluster, run.batch, fitted).step_time_s
            fits[i] = fitted
    return LeaveOneOut(tuple(preds), tuple(f for f in fits if f is not None))


def ranks(values: Sequence[float]) -> list[float]:
    """Average ranks (1-based), ties sharing the mean of their positions."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None when undefined."""
    if len(a) < 2:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else None


def config_spearman(cases: Sequence[Case], predicted: Sequence[float]) -> float | None:
    """Spearman of predicted against measured step time over configurations: each
    configuration's median measured step time against its (median) prediction, so that repeats
    do not count twice."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault(config_key(c[0]), []).append(i)
    meas = [statistics.median(cases[i][0].step_time_s for i in g) for g in groups.values()]
    pred = [statistics.median(predicted[i] for i in g) for g in groups.values()]
    return spearman(pred, meas)
