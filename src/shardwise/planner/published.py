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
from shardwise.planner.comm import ORDERS
from shardwise.planner.cost import FITTED_FIELDS, OVERHEAD_FIELDS, CostParams
from shardwise.planner.figures import MEASURED_KINDS, MFU_FORMULAS, tokens_per_s
from shardwise.planner.layout import MODELLED_RECOMPUTE, SCHEDULES, Batch, Layout
from shardwise.planner.models import ModelDims
from shardwise.planner.op_checkpoint import UNSUPPORTED, supports_op_checkpoint
from shardwise.planner.params_file import refuse_renamed, validate_params
from shardwise.planner.published_models import model_dims, whole
from shardwise.spec.checks import choice
from shardwise.spec.cluster import ClusterSpec, cluster_from_dict
from shardwise.spec.toml import build_table
from shardwise.spec.training import PRECISIONS

UNKNOWN = "unknown"
LAYOUT_KEYS = ("tp", "pp", "cp", "dp", "ep", "zero", "schedule", "v", "micro_batch", "recompute",
               "sequence_parallel", "order")
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


# --- loading ---------------------------------------------------------------------------------------

def load(path: str | Path) -> list[Reference]:
    """Every row of a reference-set TOML file, checked."""
    from shardwise.spec.toml import read_toml

    path = Path(path)
    data = read_toml(path)
    origin = str(path)
    top = {"conventions": dict, "models": dict, "sources": list, "runs": list}
    for key, value in data.items():
        if key not in top:
            raise SpecError(f"{origin}: unknown table [{key}]; a reference set holds "
                            "[conventions] (text), [models.NAME] tables, [[sources]] and [[runs]].")
        if not isinstance(value, top[key]):
            shape = f"an array of tables, [[{key}]]" if top[key] is list else f"a table, [{key}]"
            raise SpecError(f"{origin}: {key} must be {shape}.")
    if not data.get("runs"):
        raise SpecError(f"{origin}: no [[runs]]; a reference set lists at least one published run.")
    models = {name: model_dims(name, table, origin) for name, table in data.get("models", {}).items()}
    listed = [_source(s, origin) for s in data.get("sources", [])]
    sources = {s.id: s for s in listed}
    if len(sources) < len(listed):
        raise SpecError(f"{origin}: two [[sources]] share an id; give each source its own.")
    rows = [_reference(row, models, sources, origin) for row in data.get("runs", [])]
    ids = [r.id for r in rows]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise SpecError(f"{origin}: run ids {dup} appear more than once; give each row its own id.")
    return rows


def _source(table: Mapping[str, Any], origin: str) -> Source:
    if not isinstance(table, Mapping):
        raise SpecError(f"{origin}: each [[sources]] entry is a table (id, title, where, url, "
                        "cluster, stack).")
    for key in ("cluster", "stack"):
        _table(table, key, f"{origin}: source {table.get('id', '?')!r}")
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
    gpus, global_batch, seq_len = (whole(row.get(k), k, where)
                                   for k in ("gpus", "global_batch", "seq_len"))
    precision = row.get("precision", "bf16")
    choice(f"{where}: precision", precision, PRECISIONS)
    spec = _layout_spec(row.get("layout"), where)
    if spec["tp"] * spec["pp"] * spec["cp"] * spec["dp"] != gpus:
        raise SpecError(f"{where}: tp·pp·cp·dp = "
                        f"{spec['tp'] * spec['pp'] * spec['cp'] * spec['dp']} != gpus {gpus}.")
    _check_ep(spec, model, where)
    if spec.get("recompute") == "op" and not supports_op_checkpoint(model):
        raise SpecError(f"{where}: {UNSUPPORTED}. State the row's recompute as none, selective, "
                        "full or \"unknown\".")
    cluster = _cluster(source, gpus, where)
    batch = Batch(global_batch=global_batch, seq_len=seq_len, precision=precision)
    unknown = tuple(k for k, v in spec.items() if v == UNKNOWN)
    stack = _stack({**source.stack, **_table(row, "stack", where)}, where)
    ends = stack.get("pp_split") == "ends_as_layers"
    units = model.layers + (2 if ends else 0)
    pp, v = spec["pp"], spec.get("v", 1)
    if pp > 1 and v != UNKNOWN and pp * v > units:
        what = f"{model.layers} blocks" + (" + the embedding and the head" if ends else "")
        raise SpecError(f"{where}: pp·v = {pp} x {v} = {pp * v} pipeline stages for {what}: "
                        f"a stage needs at least one; state a v of at most {units // pp}, or "
                        "\"unknown\".")
    candidates = tuple(candidate_layouts(spec, model, batch, ends))
    if not candidates:
        raise SpecError(f"{where}: no layout matches its fields. Check that dp divides the global "
                        "batch and micro_batch each replica's share, that a pipeline gets at least "
                        "pp micro-batches (a multiple of pp when interleaved), and that schedule "
                        "and v agree (1f1b: v = 1; interleaved-1f1b: v >= 2).")
    measured = row.get("measured")
    if not isinstance(measured, Mapping):
        measured = {}
    kind = measured.get("kind")
    if kind not in MEASURED_KINDS:
        raise SpecError(f"{where}: measured.kind {kind!r} is not one of {', '.join(MEASURED_KINDS)} "
                        "(measured = { kind = ..., value = ... }).")
    value = measured.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise SpecError(f"{where}: measured.value = {value!r} must be a number above 0 (the "
                        f"figure the source prints, as {kind}).")
    if kind in MFU_FORMULAS and value > 1:
        raise SpecError(f"{where}: measured.value = {value!r} is not a utilisation: give {kind} "
                        f"as a fraction of the peak (0.41 for 41 %).")
    peak = cluster.peak_flops(batch.precision, batch.tf32)
    tps = tokens_per_s(kind, float(value), model, batch, gpus, peak)
    return Reference(id=rid, source=source, model=model, batch=batch, cluster=cluster,
                     candidates=candidates, unknown=unknown, stack=stack,
                     measured_tokens_per_s=tps, published_mfu=row.get("published_mfu"),
                     measured_kind=kind, notes=row.get("notes", ""),
                     order=spec.get("order", "tp-cp-dp-pp"))


#: what a table-valued field of a source or row looks like, for its error message
_TABLE_EXAMPLES = {"cluster": '{ cluster = { base = "dgx-h100" } }',
                   "stack": '{ residual_bytes = 2, overlapped = ["dp"] }'}


def _table(owner: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    """`owner[key]` (empty when absent), refused unless it is a table."""
    value = owner.get(key, {})
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: {key} must be a table, like {_TABLE_EXAMPLES[key]}.")
    return value


def _layout_spec(raw: Any, where: str) -> dict[str, Any]:
    """A row's layout table, each field checked: tp, pp, cp, dp and zero stated; v, micro_batch,
    schedule, recompute and sequence_parallel stated or "unknown"."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where}: layout must be a table like {{ tp = 8, pp = 1, cp = 1, dp = 4, "
                        "zero = 1 }.")
    bad = [k for k in raw if k not in LAYOUT_KEYS]
    if bad:
        raise SpecError(f"{where}: unknown layout keys {bad}; valid: {', '.join(LAYOUT_KEYS)}.")
    missing = [k for k in ("tp", "pp", "cp", "dp", "zero") if k not in raw]
    if missing:
        raise SpecError(f"{where}: layout does not state {', '.join(missing)} (a row states tp, "
                        "pp, cp, dp and zero; v, micro_batch, schedule, recompute and "
                        "sequence_parallel may be \"unknown\").")
    spec = dict(raw)
    for key in ("tp", "pp", "cp", "dp"):
        whole(spec[key], f"layout.{key}", where)
    whole(spec.setdefault("ep", 1), "layout.ep", where)
    if spec["zero"] not in (0, 1, 2, 3) or isinstance(spec["zero"], bool):
        raise SpecError(f"{where}: layout.zero = {spec['zero']!r} must be 0 (DDP), 1, 2 or 3.")
    for key in ("v", "micro_batch"):
        if spec.get(key, UNKNOWN) != UNKNOWN:
            whole(spec[key], f"layout.{key}", where)
    for key, choices in (("schedule", SCHEDULES), ("recompute", MODELLED_RECOMPUTE)):
        choice(f"{where}: layout.{key}", spec.get(key, UNKNOWN), (*choices, UNKNOWN))
    choice(f"{where}: layout.order", spec.get("order", "tp-cp-dp-pp"), tuple(ORDERS))
    if not isinstance(spec.get("sequence_parallel", False), bool) \
            and spec.get("sequence_parallel") != UNKNOWN:
        raise SpecError(f"{where}: layout.sequence_parallel must be true, false or \"unknown\".")
    return spec


def _check_ep(spec: Mapping[str, Any], model: ModelDims, where: str) -> None:
    """Expert parallel as the planner models it: the routed experts split over `ep` ranks carved
    out of the data-parallel (x context-parallel) ranks, under a sharded optimizer, each
    expert's own tensor parallel that of the dense blocks (Megatron's
    --expert-tensor-parallel-size equal to --tensor-model-parallel-size)."""
    ep = spec["ep"]
    if ep == 1:
        return
    if not model.moe:
        raise SpecError(f"{where}: layout.ep = {ep} for {model.name}, which has no experts; "
                        "state ep = 1 or the model's MoE fields (experts, top_k, expert_ffn).")
    if model.experts % ep:
        raise SpecError(f"{where}: layout.ep = {ep} does not divide the {model.experts} experts.")
    if (spec["dp"] * spec["cp"]) % ep:
        raise SpecError(f"{where}: layout.ep = {ep} does not divide dp·cp = "
                        f"{spec['dp'] * spec['cp']}: expert parallel takes its ranks from the "
                        "data-parallel ones (a row whose experts fold over tensor-parallel ranks, "
                        "expert tensor parallel != tp, is not expressible yet).")
    if spec["zero"] == 0:
        raise SpecError(f"{where}: layout.ep = {ep} with zero = 0: the planner models expert "
                        "parallel under a sharded optimizer (zero 1-3) only.")


def _stack(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A row's framework mechanics (its source's `stack`, then its own), checked as a
    `--params` file is: an unknown key or a value of the wrong type is named, not ignored."""
    fitted = [k for k in values if k in FITTED_FIELDS or k == "efficiency"]
    if fitted:
        raise SpecError(f"{where}: stack.{fitted[0]} is an efficiency, which the cost model fits "
                        "on every source at once (`bench_plan.py --published`); a source's stack "
                        "states only how its framework trains (mechanics). Remove it.")
    refuse_renamed(dict(values), f"{where}: stack")
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
    unknown v divides the blocks per rank (with `ends`, the stack's pp_split "ends_as_layers",
    the blocks and the embedding and head, as Megatron requires)."""
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
    sp_stated = spec.get("sequence_parallel", False)
    sps = (False, True) if sp_stated == UNKNOWN else (bool(sp_stated),)
    known = {f.name for f in dataclasses.fields(Layout)}
    zero = int(spec["zero"])
    for mb, rc, sched, v, sp in itertools.product(
            *(choices[k] for k in ("micro_batch", "recompute", "schedule", "v")), sps):
        if sp and int(spec["tp"]) == 1 and len(sps) > 1:
            continue  # sequence parallel needs tensor parallel: one candidate, not two
        if pp > 1 and (sched == "1f1b") != (v == 1):
            continue
        if per_dp % mb:
            continue
        m = per_dp // mb
        if pp > 1 and (m < pp or (v > 1 and m % pp)):
            continue
        kwargs: dict[str, Any] = dict(
            dp_replicate=dp if zero == 0 else 1, dp_shard=1 if zero == 0 else dp, zero=zero,
            tp=int(spec["tp"]), pp=pp, cp=int(spec["cp"]), ep=int(spec.get("ep", 1)),
            schedule=sched if pp > 1 else "none",
            v=int(v) if pp > 1 else 1, micro_batch=int(mb), recompute=rc,
            sequence_parallel=sp and spec["tp"] > 1,
            order=spec.get("order", "tp-cp-dp-pp"))
        yield Layout(**{k: v for k, v in kwargs.items() if k in known})
