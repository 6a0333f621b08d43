"""`shardwise plan --explain LAYOUT`: one layout's predicted step, term by term, with where each
term comes from, where each axis's groups run, and what bounds the step.

The terms are `Prediction.breakdown` (seconds per step on the critical pipeline rank; they sum to
the step time): compute by op class, recompute, the communication left exposed per axis (on its
link), the pipeline bubble, the gradient reduction, ZeRO-1's parameter gather, the optimizer
step and the framework overhead. Imports no torch.
"""

from __future__ import annotations

import re

from shardwise.planner.accuracy import Interval, describe
from shardwise.planner.cost import TERMS, Prediction
from shardwise.planner.layout import MODELLED_RECOMPUTE
from shardwise.spec.cluster import GIB, ClusterSpec

#: term -> (what it is, where its figure comes from); "{x}" is filled per layout
TERM_INFO: dict[str, tuple[str, str]] = {
    "gemm": ("compute: GEMMs (the blocks' projections)",
             "2mnk / (peak x e x k/(k+k0) x tile/wave use), each GEMM by shape {gemm}"),
    "attention": ("compute: attention core",
                  "{attention}"),
    "memory_bound": ("compute: memory-bound (norms, residuals, casts, rotary, dropout, "
                     "activation, MoE token permutation)",
                     "{memory_bound}"),
    "output_and_loss": ("compute: output layer, loss, embedding",
                        "the d x V/tp GEMM; the fp32 cross-entropy's passes over the "
                        "vocabulary / HBM"),
    "recompute": ("recompute (activation checkpointing)",
                  "the forward of the checkpointed blocks again"),
    "tp": ("exposed comm: tensor parallel", "{tp_how} per block; on {tp}"),
    "cp": ("exposed comm: context parallel", "K/V passed around the cp ring; on {cp}"),
    "ep": ("exposed comm: expert parallel", "dispatch + combine all-to-all per MoE block; on {ep}"),
    "pp": ("exposed comm: pipeline send/receive", "v activations and gradients per micro-batch; "
           "on {pp}"),
    "dp_fsdp": ("exposed comm: FSDP gathers", "all-gathers per unit (and reduce-scatters per "
                "micro-batch), prefetched under compute; on {dp_shard}"),
    "bubble": ("pipeline bubble", "{bubble}"),
    "dp_sync": ("exposed comm: gradient reduction", "after the last backward (of each call of "
                "the schedule), hidden behind it and the pipeline's drain; on {dp_shard}"),
    "param_gather": ("exposed comm: parameter gather per step", "ZeRO-1's updated shards "
                     "all-gathered after the step, or ZeRO-2's gather under pipeline parallel "
                     "(once a step, or a call of the schedule), with the first micro-batch's "
                     "forward; on {dp_shard}"),
    "optimizer": ("optimizer step", "AdamW's bytes over the rank's shard / HBM bandwidth"),
    "overhead": ("framework overhead", "host work not hidden behind the kernels "
                 "(planner/overhead.py; coefficients measured on shardwise's CPU runs) and, on "
                 "a GPU, the host's work per step (step_host_s, fitted on published runs)"),
}
COMM_TERMS = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp_fsdp": "dp_shard",
              "dp_sync": "dp_shard", "param_gather": "dp_shard"}


def find(preds: list[Prediction], wanted: str) -> Prediction | None:
    """`wanted`: a rank in the printed table ("1"), or a layout name as printed
    ("zero2-128+tp8sp+pp16-i4"), optionally with " mb2" and/or " full"; the fastest match."""
    text = wanted.strip()
    if text.isdigit():
        i = int(text) - 1
        return preds[i] if 0 <= i < len(preds) else None
    parts = text.split()
    name, extra = parts[0], parts[1:]
    mb = next((int(x[2:]) for x in extra if re.fullmatch(r"mb\d+", x)), None)
    rc = next((x for x in extra if x in MODELLED_RECOMPUTE), None)
    return next((p for p in preds if p.layout.name() == name
                 and (mb is None or p.layout.micro_batch == mb)
                 and (rc is None or p.layout.recompute == rc)), None)


def explain(pred: Prediction, cluster: ClusterSpec, band: Interval | None,
            params_note: str, eager: bool = True) -> str:
    """The decomposition as text."""
    lo, step = pred.layout, pred.step_time_s
    fill = _fill(pred, params_note, eager)
    lines = [f"{lo.name()} (micro-batch {lo.micro_batch}, recompute {lo.recompute}, "
             f"{pred.micro_batches} micro-batch(es) per step): step {step:.3g} s, "
             f"{pred.tokens_per_s:,.0f} tokens/s, {describe(pred.mfu, band)}", ""]
    rows = [["term", "seconds", "%", "how it is counted"]]
    for term in TERMS:
        value = pred.breakdown.get(term, 0.0)
        if value <= 0:
            continue
        label, how = TERM_INFO[term]
        rows.append([label, f"{value:.3g}", f"{100 * value / step:.1f}", how.format(**fill)])
    rows.append(["step", f"{step:.3g}", "100.0", ""])
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines += ["  " + "  ".join([r[0].ljust(widths[0]), r[1].rjust(widths[1]),
                                r[2].rjust(widths[2]), r[3]]).rstrip() for r in rows]
    lines += ["", "placement (mesh order inside out: " + lo.order + "):"]
    lines += [f"  {axis}: {link}" for axis, link in pred.placement.items()] or ["  one device"]
    lines += ["", bound(pred)]
    lines += ["", f"memory: {pred.memory.total / GIB:.1f} GiB on pipeline rank "
                  f"{pred.memory_rank} (device {cluster.memory_bytes / GIB:.1f}): "
              + ", ".join(f"{k} {v / GIB:.1f}" for k, v in pred.memory.as_dict().items()
                          if k not in ("total", "grads_at_step") and v >= 0.05 * GIB)]
    return "\n".join(lines)


def bound(pred: Prediction) -> str:
    """What bounds the step: the largest term, and where placement does."""
    step = pred.step_time_s
    comm = {t: pred.breakdown.get(t, 0.0) for t in COMM_TERMS}
    worst = max(comm, key=comm.__getitem__)
    lines = []
    top = max(TERMS, key=lambda t: pred.breakdown.get(t, 0.0))
    lines.append(f"bound: {TERM_INFO[top][0]} is the largest term "
                 f"({100 * pred.breakdown.get(top, 0.0) / step:.0f} % of the step)")
    if comm[worst] > 0:
        axis = COMM_TERMS[worst]
        lines.append(f"  the most exposed communication is {TERM_INFO[worst][0].split(': ')[1]} "
                     f"({comm[worst]:.3g} s, {100 * comm[worst] / step:.1f} %), on "
                     f"{pred.placement.get(axis, 'its links')}")
    for axis in pred.pod_bound:
        lines.append(f"  placement binds {axis}: its groups span pods and the oversubscribed "
                     "uplinks between them, not the NICs, set its bandwidth (put it innermost "
                     "among the cross-node axes, or keep it inside a pod)")
    return "\n".join(lines)


def _fill(pred: Prediction, params_note: str, eager: bool) -> dict[str, str]:
    lo = pred.layout
    pl = pred.placement
    return {
        "gemm": params_note,
        "memory_bound": "bytes moved / HBM bandwidth, op by op: " + (
            "eager modules, one kernel an op (bytes counted on the built-in block, "
            "planner/elementwise.py)" if eager else "fused kernels, the least each op moves"),
        "attention": "fused kernels: the keys each query attends (the causal half of the "
                     "square; a sliding window's in a windowed block) / (peak x attention "
                     "efficiency, less for heads narrower than 128); unfused: batched GEMMs over "
                     "the full square + softmax bytes",
        "tp_how": "2 all-gathers + 2 reduce-scatters" if lo.sequence_parallel else
                  "2 all-reduces forward, 2 backward",
        "tp": pl.get("tp", "-"), "cp": pl.get("cp", "-"), "ep": pl.get("ep", "-"),
        "pp": pl.get("pp", "-"), "dp_shard": pl.get("dp_shard", pl.get("dp_replicate", "-")),
        "bubble": f"{lo.schedule}: " + ("(p-1)/v idle micro-batch slots (Narayanan et al. 2021)"
                                        if lo.schedule != "zero-bubble" else
                                        "ZBV's residue (Qi et al. 2024)"),
    }
