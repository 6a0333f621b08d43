"""What `shardwise plan` prints and writes: the table, the JSON list, and a RunSpec of a layout."""

from __future__ import annotations

import json
from typing import Any

from shardwise.planner.accuracy import HIGH_Q, LOW_Q, Interval
from shardwise.planner.cost import Prediction
from shardwise.planner.costing import run_cost
from shardwise.planner.layout import not_run_today
from shardwise.planner.models import ModelDims
from shardwise.planner.search import PlanResult
from shardwise.spec.cluster import GIB, ClusterSpec
from shardwise.spec.load import spec_from_dict, spec_to_toml
from shardwise.spec.runspec import RunSpec
from shardwise.spec.toml import toml_value as _toml_value

JSON_KEYS = ("dp_replicate", "dp_shard", "zero", "tp", "pp", "schedule", "v", "cp", "ep",
             "micro_batch", "recompute", "mem_per_rank_bytes", "step_time_s", "tokens_per_s", "mfu")


def layouts_json(predictions: list[Prediction], band: Interval | None = None,
                 cluster: ClusterSpec | None = None, tokens: float | None = None,
                 model: ModelDims | None = None) -> str:
    """The predictions as a JSON list; with `tokens` (and the cluster) each carries its run's
    cost (`planner/costing.py`); with `model`, whether shardwise runs it (`available`,
    `not_run_today`) and how the model was read (a script can check which
    interpretation of a config was planned)."""
    out = []
    for p in predictions:
        row = p.as_dict()
        if model is not None:
            row["available"] = not not_run_today(p.layout, model)
            row["model"] = {"name": model.name, "params": model.params,
                            "active_params": model.active_params, "summary": model.describe(),
                            "note": model.note, "source": model.source}
        if tokens and cluster is not None:
            c = run_cost(p, cluster, tokens, band)
            row["run"] = {"tokens": tokens, "days": c.days, "device_hours": c.device_hours,
                          "energy_kwh": c.energy_kwh, "money": c.money, "busy": c.busy,
                          "scale_range": list(c.scale_range) if c.scale_range else None}
        if band is not None:
            row["mfu_interval"] = list(band.around(p.mfu))
            row["tokens_per_s_interval"] = list(band.around(p.tokens_per_s))
            row["interval_basis"] = {"runs": band.runs, "generation": band.basis,
                                     "quantiles": [LOW_Q, HIGH_Q],
                                     "none_of_generation": band.unseen or None}
        out.append(row)
    return json.dumps(out, indent=2)


def _row(rank: str, p: Prediction, band: Interval | None) -> list[str]:
    lo = p.layout
    pipe = "-" if lo.pp == 1 else f"{lo.pp} {lo.schedule}{f' v{lo.v}' if lo.v > 1 else ''}"
    row = [rank, lo.name(), str(lo.zero), str(lo.tp), str(lo.cp), pipe, str(lo.ep),
           str(lo.micro_batch), lo.recompute, f"{p.memory.total / GIB:.1f}",
           f"{p.step_time_s:.3g}", f"{p.tokens_per_s:,.0f}", f"{100 * p.mfu:.1f}"]
    if band is not None:
        low, high = band.around(p.mfu)
        row.append(f"{100 * low:.0f}-{100 * high:.0f}")
    return [*row, f"{100 * p.bubble:.0f}", f"{p.exposed_comm_s:.2g}"]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i not in (1, 5, 8) else c.ljust(w)
                      for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip() for r in rows]


HEADER = ["#", "layout", "zero", "tp", "cp", "pp", "ep", "mb", "recompute", "GiB/rank", "step s",
          "tokens/s", "MFU %", "bubble %", "exposed comm s"]


def human(result: PlanResult, top: int, band: Interval | None = None) -> str:
    c, b, m = result.cluster, result.batch, result.model
    lines = [f"model    {m.describe()}" + (f"  [{m.note}]" if m.note else ""),
             f"cluster  {c.name}: {c.nodes} node(s) x {c.devices_per_node} = {c.world:,} devices, "
             f"{c.memory_bytes / GIB:.1f} GiB each, {c.peak_flops(b.precision, b.tf32) / 1e12:,.4g} "
             f"TFLOP/s {b.precision}",
             f"batch    {b.global_batch:,} sequences x {b.seq_len:,} tokens = {b.tokens:,} tokens "
             f"per step; {b.precision}",
             f"searched {result.evaluated:,} layouts in {result.elapsed_s:.2f} s "
             f"({sum(result.pruned.values()):,} pruned); {len(result.feasible):,} fit", ""]
    if result.feasible:
        header = HEADER if band is None else [*HEADER[:13], "MFU band", *HEADER[13:]]
        rows = [header] + [_row(str(i + 1), p, band) for i, p in enumerate(result.top(top))]
        lines += _table(rows)
        best = result.feasible[0]
        if band is not None:
            side = ""
            if band.high < 1:
                side = "; the band lies wholly below the prediction: the planner was fast on such runs"
            elif band.low > 1:
                side = "; the band lies wholly above the prediction: the planner was slow on such runs"
            lines.append(f"MFU band: measured / predicted MFU of {band.drawn_from()}, "
                         f"{100 * LOW_Q:.0f}th-{100 * HIGH_Q:.0f}th percentile "
                         f"(benchmarks/RESULTS.md){side}; `--explain 1` breaks #1 down")
        if best.pod_bound:
            lines.append(f"placement: #1's {', '.join(best.pod_bound)} groups span pods, and the "
                         "oversubscribed uplinks between pods bound them")
        why = not_run_today(best.layout, m)
        if why:
            ready = next((p for p in result.feasible if not not_run_today(p.layout, m)), None)
            lines.append("")
            lines.append(f"note: #1 uses {why}, which shardwise does not run yet"
                         + (f"; the best it runs today: {ready.layout.name()} ({100 * ready.mfu:.1f} % MFU)"
                            if ready else "") + ".")
        if not m.opaque:
            lines.append(f"layer split of #1 (blocks per stage): {list(best.layer_split)}")
    if result.rejected:
        lines += ["", "best layouts that do not fit:"]
        for p in result.rejected:
            lines.append(f"  {p.layout.name()} mb{p.layout.micro_batch} {p.layout.recompute}: "
                         f"{p.tokens_per_s:,.0f} tokens/s ({100 * p.mfu:.1f} % MFU) but "
                         f"{p.reason}")
    elif result.closest:
        lines += ["", "closest degree choices (model state alone does not fit):"]
        for need, lo in result.closest:
            lines.append(f"  {lo.name()}: needs {need / GIB:.1f} GiB/rank before activations, "
                         f"device has {c.memory_bytes / GIB:.1f}")
    if result.pruned:
        lines += ["", "pruned: " + "; ".join(f"{why} ({n:,})" for why, n in result.pruned.most_common())]
    return "\n".join(lines)


def spec_for(pred: Prediction, result: PlanResult, base: RunSpec | None) -> RunSpec:
    """A validated RunSpec running `pred`'s layout: `base` with its parallel, batch and memory
    sections (and precision and sequence length) replaced, or the defaults with those set."""
    lo, b, c = pred.layout, result.batch, result.cluster
    parallel: dict[str, Any] = {
        "dp_replicate": lo.dp_replicate, "dp_shard": lo.dp_shard, "tp": lo.tp, "pp": lo.pp,
        "cp": lo.cp, "ep": lo.ep, "zero": lo.zero, "sequence_parallel": lo.sequence_parallel,
        "pp_schedule": lo.schedule if lo.pp > 1 else "1f1b", "pp_virtual_stages": lo.v,
        # the split by predicted stage cost (the last stage also runs the output layer and loss)
        "pp_layer_split": list(pred.layer_split) if lo.pp > 1 else [],
    }
    if c.nodes == 1:
        parallel["nproc"] = lo.world
    if c.cluster.device == "cpu":
        parallel["device"] = "cpu"
    sections: dict[str, dict[str, Any]] = base.to_dict() if base is not None else {}
    sections.setdefault("parallel", {}).update(parallel)
    sections.setdefault("batch", {}).update(global_batch=b.global_batch, micro_batch=lo.micro_batch)
    sections.setdefault("memory", {}).update(activation_checkpoint=lo.recompute,
                                             ac_every=lo.ac_every)
    sections.setdefault("run", {}).update(precision=b.precision)
    data = sections.setdefault("data", {})
    if not str(data.get("source", "")).startswith("py:"):
        data["seq_len"] = b.seq_len
    return spec_from_dict(sections, origin="the planned spec").validate()


PARALLEL_KEYS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "zero", "sequence_parallel",
                 "pp_schedule", "pp_virtual_stages", "pp_layer_split")


def spec_text(pred: Prediction, result: PlanResult, base: RunSpec | None) -> str:
    """TOML of `spec_for`'s spec with a header saying what was planned. Without a base RunSpec
    only the sections and keys the plan decides are written (the model comes from elsewhere)."""
    spec = spec_for(pred, result, base)
    lo, m, c = pred.layout, result.model, result.cluster
    if base is not None:
        body = spec_to_toml(spec)
    else:
        d = spec.to_dict()
        parallel = [*PARALLEL_KEYS, *(["nproc"] if c.nodes == 1 else []),
                    *(["device"] if c.cluster.device == "cpu" else [])]
        chosen = {"run": ["precision"], "data": ["seq_len"],
                  "batch": ["global_batch", "micro_batch"], "parallel": parallel,
                  "memory": ["activation_checkpoint", "ac_every"]}
        body = "\n".join(f"[{sec}]\n" + "\n".join(f"{k} = {_toml_value(d[sec][k])}" for k in keys)
                         + "\n" for sec, keys in chosen.items())
    header = [
        f"# written by `shardwise plan`: {m.name} on {c.name} x {c.nodes} node(s) "
        f"({c.world:,} devices)",
        f"# layout {lo.name()}: predicted {pred.memory.total / GIB:.1f} GiB/rank, step "
        f"{pred.step_time_s:.3g} s, {pred.tokens_per_s:,.0f} tokens/s, {100 * pred.mfu:.1f} % MFU",
    ]
    if base is None:
        origin = f"the preset {m.name}" if m.source == "preset" else m.source
        header.append(f"# no [model] section: the model came from {origin}; add its [model] and "
                      "[data] sections to train it")
    if c.nodes > 1:
        header.append(f"# {c.nodes} nodes: start it under torchrun --nnodes {c.nodes} "
                      f"--nproc-per-node {c.devices_per_node} (the world is their product)")
    why = not_run_today(lo, m)
    if why:
        header.append(f"# {why}: this version of shardwise does not run it yet")
    return "\n".join(header) + "\n\n" + body
