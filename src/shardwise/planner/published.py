"""The reference set of published training runs (`benchmarks/published_runs.toml`), read into
what the cost model predicts: per row the model, the batch, the cluster, the candidate layouts
(one, or several where the source leaves a field unknown), the framework's mechanics as
`CostParams` overrides, and the measured tokens/s.

Each row's measurement is turned into tokens/s with the FLOP formula its source used
(`MEASURED_KINDS`), so that measured and predicted MFU are both taken under shardwise's own FLOP
convention (`telemetry.flops`: 6N + causal-halved attention, no recompute). Imports no torch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError
from shardwise.planner.cost import FITTED_FIELDS, OVERHEAD_FIELDS, CostParams
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.models import ModelDims
from shardwise.planner.params_file import validate_params
from shardwise.spec.cluster import ClusterSpec, cluster_from_dict
from shardwise.spec.toml import build_table

UNKNOWN = "unknown"
LAYOUT_KEYS = ("tp", "pp", "cp", "dp", "zero", "schedule", "v", "micro_batch", "recompute",
               "sequence_parallel", "order")
MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "gated", "tied",
              "head_dim")
MAX_UNKNOWN_MICRO_BATCH = 8


@dataclass(frozen=True)
class Source:
    """One publication: where its rows come from and how its framework trains."""

    id: str
    title: str
    where: str
    url: str
    hardware: str
    notes: str
    cluster: Mapping[str, Any]
    stack: Mapping[str, Any]


@dataclass(frozen=True)
class Reference:
    """One published run, ready to predict."""

    id: str
    source: Source
    model: ModelDims
    batch: Batch
    cluster: ClusterSpec
    candidates: tuple[Layout, ...]  # one unless the source left a field unknown
    unknown: tuple[str, ...]  # the layout fields the source does not state
    stack: Mapping[str, Any]  # CostParams overrides: the framework's mechanics
    measured_tokens_per_s: float
    published_mfu: float | None
    measured_kind: str
    notes: str = ""
    order: str = "tp-cp-dp-pp"
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return self.cluster.world

    @property
    def flops_per_token(self) -> float:
        """shardwise's model FLOPs per token (the MFU numerator)."""
        return self.model.flop_counts(self.batch.seq_len).per_token()

    @property
    def measured_mfu(self) -> float:
        peak = self.cluster.peak_flops(self.batch.precision, self.batch.tf32)
        return self.flops_per_token * self.measured_tokens_per_s / (self.gpus * peak)

    def params(self, base: CostParams) -> CostParams:
        """`base` with this row's framework mechanics applied. The framework-overhead
        coefficients are shardwise's own (measured on its CPU runs: FSDP2's hooks, DTensor's
        dispatch), so another framework's rows are predicted without them."""
        values: dict[str, Any] = {k: 0.0 for k in OVERHEAD_FIELDS}
        values.update(self.stack)  # checked and typed when loaded (`_stack`)
        return dataclasses.replace(base, **values)


# --- what a source's throughput figure means ----------------------------------------------------

def megatron_sc21_flops_per_token(m: ModelDims, s: int) -> float:
    """Narayanan et al. (SC21) Eq. 3 per token: 96·l·h²·(1 + s/6h + V/16lh) (full recompute,
    full-square attention)."""
    h, layers, v = m.hidden, m.layers, m.vocab
    return 96.0 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def megatron_core_flops_per_token(m: ModelDims, s: int) -> float:
    """Megatron-Core's num_floating_point_operations (r0.8.0, megatron/training/training.py) per
    token: 12·l·h²·((1 + g/a + s/h)·(a·d/h) + (f/h)·(3/2 if SwiGLU) + V/2lh)."""
    h, layers = m.hidden, m.layers
    a, g, d = m.heads, m.kv, m.hd
    gate = 1.5 if m.gated else 1.0
    attn = (1 + g / a + s / h) * (a * d / h)
    return 12.0 * layers * h * h * (attn + (m.ffn / h) * gate + m.vocab / (2 * layers * h))


def palm_flops_per_token(m: ModelDims, s: int) -> float:
    """Chowdhery et al. (PaLM), appendix B: 6N + 12·L·H·Q·T (full-square attention)."""
    return m.flop_counts(s).per_token(causal_halved=False)


MEASURED_KINDS = {
    "tflops_megatron_sc21": megatron_sc21_flops_per_token,
    "tflops_megatron_core": megatron_core_flops_per_token,
    "tflops_palm": palm_flops_per_token,
    "tokens_per_s": None,
}


def tokens_per_s(kind: str, value: float, model: ModelDims, seq_len: int, gpus: int) -> float:
    """The job's tokens/s that a source's throughput figure implies."""
    formula = MEASURED_KINDS[kind]
    if formula is None:
        return value
    return value * 1e12 * gpus / formula(model, seq_len)


# --- loading ---------------------------------------------------------------------------------------

def load(path: str | Path) -> list[Reference]:
    """Every row of a reference-set TOML file, checked."""
    from shardwise.spec.toml import read_toml

    path = Path(path)
    data = read_toml(path)
    origin = str(path)
    models = {name: _model(name, table, origin) for name, table in data.get("models", {}).items()}
    sources = {s["id"]: _source(s, origin) for s in data.get("sources", [])}
    rows = [_reference(row, models, sources, origin) for row in data.get("runs", [])]
    ids = [r.id for r in rows]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise SpecError(f"{origin}: run ids {dup} appear more than once; give each row its own id.")
    return rows


def _model(name: str, table: Mapping[str, Any], origin: str) -> ModelDims:
    unknown = [k for k in table if k not in MODEL_KEYS]
    if unknown:
        raise SpecError(f"{origin}: [models.{name}] has unknown keys {unknown}; valid keys: "
                        f"{', '.join(MODEL_KEYS)}.")
    try:
        return ModelDims(name=name, layers=int(table["layers"]), hidden=int(table["hidden"]),
                         heads=int(table["heads"]), kv_heads=int(table.get("kv_heads", 0)),
                         ffn=int(table["ffn"]), vocab=int(table["vocab"]),
                         gated=bool(table.get("gated", True)), tied=bool(table.get("tied", False)),
                         head_dim=int(table.get("head_dim", 0)), source=origin)
    except KeyError as err:
        raise SpecError(f"{origin}: [models.{name}] does not set {err.args[0]}; a model states "
                        "layers, hidden, heads, ffn and vocab.") from None


def _source(table: Mapping[str, Any], origin: str) -> Source:
    try:
        return Source(id=table["id"], title=table["title"], where=table["where"],
                      url=table["url"], hardware=table.get("hardware", ""),
                      notes=table.get("notes", ""), cluster=table["cluster"],
                      stack=table.get("stack", {}))
    except KeyError as err:
        raise SpecError(f"{origin}: a [[sources]] entry does not set {err.args[0]} (each source "
                        "states id, title, where, url and cluster).") from None


def _reference(row: Mapping[str, Any], models: Mapping[str, ModelDims],
               sources: Mapping[str, Source], origin: str) -> Reference:
    rid = row.get("id", "?")
    where = f"{origin}: run {rid!r}"
    try:
        source = sources[row["source"]]
        model = models[row["model"]]
    except KeyError as err:
        raise SpecError(f"{where} names {err.args[0]!r}, which no [[sources]] or [models] entry "
                        "defines.") from None
    gpus = int(row["gpus"])
    cluster = _cluster(source, gpus, where)
    batch = Batch(global_batch=int(row["global_batch"]), seq_len=int(row["seq_len"]),
                  precision=row.get("precision", "bf16"))
    spec = dict(row["layout"])
    bad = [k for k in spec if k not in LAYOUT_KEYS]
    if bad:
        raise SpecError(f"{where}: unknown layout keys {bad}; valid: {', '.join(LAYOUT_KEYS)}.")
    unknown = tuple(k for k, v in spec.items() if v == UNKNOWN)
    stack = _stack({**source.stack, **row.get("stack", {})}, where)
    ends = bool(stack.get("pp_ends_as_layers", False))
    units = model.layers + (2 if ends else 0)
    pp, v = int(spec.get("pp", 1)), spec.get("v", 1)
    if pp > 1 and v != UNKNOWN and pp * int(v) > units:
        what = f"{model.layers} blocks" + (" + the embedding and the head" if ends else "")
        raise SpecError(f"{where}: pp·v = {pp} x {v} = {pp * int(v)} pipeline stages for {what}: "
                        f"a stage needs at least one; state a v of at most {units // pp}, or "
                        "\"unknown\".")
    candidates = tuple(candidate_layouts(spec, model, batch, ends))
    if not candidates:
        raise SpecError(f"{where}: no layout matches its fields (check tp·pp·cp·dp = gpus and "
                        "the batch).")
    if spec["tp"] * spec["pp"] * spec["cp"] * spec["dp"] != gpus:
        raise SpecError(f"{where}: tp·pp·cp·dp = "
                        f"{spec['tp'] * spec['pp'] * spec['cp'] * spec['dp']} != gpus {gpus}.")
    measured = row["measured"]
    kind = measured["kind"]
    if kind not in MEASURED_KINDS:
        raise SpecError(f"{where}: measured.kind {kind!r} is not one of {', '.join(MEASURED_KINDS)}.")
    tps = tokens_per_s(kind, float(measured["value"]), model, batch.seq_len, gpus)
    return Reference(id=rid, source=source, model=model, batch=batch, cluster=cluster,
                     candidates=candidates, unknown=unknown, stack=stack,
                     measured_tokens_per_s=tps, published_mfu=row.get("published_mfu"),
                     measured_kind=kind, notes=row.get("notes", ""),
                     order=spec.get("order", "tp-cp-dp-pp"))


def _stack(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A row's framework mechanics (its source's `stack`, then its own), checked as a
    `--params` file is: an unknown key or a value of the wrong type is named, not ignored."""
    if not isinstance(values, Mapping):
        raise SpecError(f"{where}: stack must be a table of CostParams fields, like "
                        "{ residual_bytes = 2, overlapped = [\"dp\"] }.")
    fitted = [k for k in values if k in FITTED_FIELDS or k == "efficiency"]
    if fitted:
        raise SpecError(f"{where}: stack.{fitted[0]} is an efficiency, which the cost model fits "
                        "on every source at once (`bench_plan.py --published`); a source's stack "
                        "states only how its framework trains (mechanics). Remove it.")
    try:
        built = build_table("stack", CostParams, values, where)
    except SpecError as err:  # a value's type error does not say where it is
        raise err if where in str(err) else SpecError(f"{where}: {err}") from None
    checked = validate_params(built, where, table="stack")
    return {k: getattr(checked, k) for k in values}


def _cluster(source: Source, gpus: int, where: str) -> ClusterSpec:
    from shardwise.planner.cluster import presets
    from shardwise.spec.cluster import _SECTIONS

    tables = {k: v for k, v in source.cluster.items() if k in _SECTIONS}
    spec = cluster_from_dict(tables, origin=where, presets=presets())
    if gpus % spec.devices_per_node:
        raise SpecError(f"{where}: {gpus} GPUs is not whole nodes of {spec.devices_per_node}.")
    return spec.with_nodes(gpus // spec.devices_per_node)


# --- the layouts a row stands for ------------------------------------------------------------------

def candidate_layouts(spec: Mapping[str, Any], model: ModelDims, batch: Batch,
                      ends: bool = False) -> Iterator[Layout]:
    """Every Layout the row's fields allow: one when all are stated; otherwise each unknown field
    over the values it can take (see the module docstring of benchmarks/published_runs.toml). An
    unknown v divides the blocks per rank (with `ends`, the stack's `pp_ends_as_layers`, the
    blocks and the embedding and head, as Megatron requires)."""
    dp, pp = int(spec["dp"]), int(spec["pp"])
    per_dp = batch.global_batch // dp
    choices: dict[str, Sequence[Any]] = {}
    for key in ("micro_batch", "recompute", "schedule", "v"):
        value = spec.get(key, UNKNOWN)
        if value != UNKNOWN:
            choices[key] = (value,)
        elif key == "micro_batch":
            choices[key] = [b for b in (1, 2, 4, 8) if b <= MAX_UNKNOWN_MICRO_BATCH
                            and per_dp % b == 0] or [1]
        elif key == "recompute":
            choices[key] = ("none", "selective", "full")
        elif key == "schedule":
            choices[key] = ("none",) if pp == 1 else ("1f1b", "interleaved-1f1b")
        else:
            per_rank = (model.layers + (2 if ends else 0)) // pp if pp > 1 else 1
            choices[key] = [v for v in range(1, per_rank + 1) if per_rank % v == 0]
    known = {f.name for f in dataclasses.fields(Layout)}
    zero = int(spec["zero"])
    for mb, rc, sched, v in itertools.product(*(choices[k] for k in
                                                ("micro_batch", "recompute", "schedule", "v"))):
        if pp > 1 and (sched == "1f1b") != (v == 1):
            continue
        if per_dp % mb:
            continue
        m = per_dp // mb
        if pp > 1 and (m < pp or (v > 1 and m % pp)):
            continue
        kwargs: dict[str, Any] = dict(
            dp_replicate=dp if zero == 0 else 1, dp_shard=1 if zero == 0 else dp, zero=zero,
            tp=int(spec["tp"]), pp=pp, cp=int(spec["cp"]), schedule=sched if pp > 1 else "none",
            v=int(v) if pp > 1 else 1, micro_batch=int(mb), recompute=rc,
            sequence_parallel=bool(spec.get("sequence_parallel", False)) and spec["tp"] > 1,
            order=spec.get("order", "tp-cp-dp-pp"))
        yield Layout(**{k: v for k, v in kwargs.items() if k in known})
