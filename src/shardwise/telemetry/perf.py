"""FLOPs/MFU, memory and pipeline-bubble measurements of one training run, in one object the
trainer calls from three places: `manifest_fields` (manifest), `start_fields` (run_start event) and
`on_log` (step event fields; emits the one-off `memory` event).

Per-rank figures are gathered with the run's `gather` (one all-gather of a vector), so every
method that gathers is a collective: every rank calls it at the same point (the trainer's hooks run
on every rank). It is given the pieces it reads, not the trainer: telemetry sits below `run/`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from shardwise.spec.layout import MemorySection, ParallelSection
from shardwise.telemetry.bubble import StageClock, theoretical_bubble
from shardwise.telemetry.events import EventLog
from shardwise.telemetry.flops import FLOPS_FORMULA, FlopCounts, recomputed_blocks, utilization
from shardwise.telemetry.memory import ActivationSampler, device_memory
from shardwise.telemetry.peak import Peak, resolve_peak
from shardwise.utils.files import cache_root

Gather = Callable[[list[float]], list[list[float]]]  # every rank's vector, in rank order


def _agreed_peak(local: Peak, rows: list[list[float]]) -> Peak:
    """One peak for the run from every rank's (peak, probe). Each rank measured (or looked up) its
    own; the largest is the per-device figure, which can only lower MFU, never flatter it. A rank
    without one leaves the run without one."""
    peaks, probes = [row[0] for row in rows], [row[1] for row in rows]
    probe = max(probes) if min(probes) > 0 else None
    if min(peaks) > 0:
        return Peak(max(peaks), local.source, local.detail, probe, local.probe_detail)
    return Peak(None, local.source if local.flops is None else "unknown", local.detail, probe,
                local.probe_detail)


@dataclasses.dataclass(frozen=True)
class PerfInputs:
    """What the measurements read of the run's spec (its sections, not the whole spec)."""

    memory: MemorySection
    parallel: ParallelSection
    precision: str
    peak_flops: float
    cache_dir: str


class RunPerf:
    def __init__(self, inputs: PerfInputs, ctx: Any, model: Any, optimizers: list[Any],
                 accumulation: int, gather: Gather, events: EventLog,
                 rss_before_model: int | None = None) -> None:
        """`ctx`: the rank's DistContext; `model`: the ParallelModel (its plan, pipeline and
        parts are read); `rss_before_model`: a CPU run's host memory before the model existed,
        the baseline of its peak."""
        self.gather, self.events, self.rss_before_model = gather, events, rss_before_model
        self.world_size = ctx.world_size
        self.counts: FlopCounts | None = model.plan.flop_counts
        self.recomputed = 0
        self.model_flops = self.hardware_flops = None
        if self.counts is not None:
            mem = inputs.memory
            self.recomputed = recomputed_blocks(mem.activation_checkpoint, mem.ac_every,
                                                self.counts.n_layers)
            self.model_flops = self.counts.per_token()
            self.hardware_flops = self.counts.hardware_per_token(self.recomputed)
        local = resolve_peak(ctx.device, inputs.precision, inputs.peak_flops,
                             cache_root(inputs.cache_dir), announce=ctx.is_main)
        self.peak = _agreed_peak(local, gather([local.flops or 0.0, local.probe or 0.0]))
        self.clock = StageClock(model.pipeline) if model.pipeline is not None else None
        self.bubble_theory = None
        if model.pipeline is not None:
            par = inputs.parallel
            self.bubble_theory = theoretical_bubble(par.pp_schedule, ctx.dims.pp, accumulation,
                                                    par.pp_virtual_stages)
        self.activations: ActivationSampler | None = None
        if not inputs.memory.compile:  # compiled blocks and saved-tensor hooks do not mix
            self.activations = ActivationSampler()
            self.activations.arm(model.parts, optimizers)
        self.device = ctx.device
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._memory_emitted = False

    # --- the three call sites --------------------------------------------------------------------
    def manifest_fields(self) -> dict[str, Any]:
        return {
            "flops_formula": FLOPS_FORMULA,
            "flop_counts": dataclasses.asdict(self.counts) if self.counts else None,
            "flops_per_token": self.model_flops,
            "hardware_flops_per_token": self.hardware_flops,
            "recomputed_blocks": self.recomputed,
            **self.peak.as_fields(),
        }

    def start_fields(self) -> dict[str, Any]:
        return {"flops_per_token": self.model_flops,
                "hardware_flops_per_token": self.hardware_flops,
                "peak_flops": self.peak.flops, "peak_flops_source": self.peak.source,
                "peak_flops_probe": self.peak.probe, "flops_formula": FLOPS_FORMULA}

    def on_log(self, step: int, tokens: int, step_time: float,
               model_state: dict[str, int] | None) -> dict[str, Any]:
        """Step-event fields for the window that just ended at `step` (`tokens` trained in its
        last step; collective: one all-gather, and one more the first time, for the `memory`
        event, once `model_state` — the model-state meter's report — exists)."""
        if not self._memory_emitted and model_state is not None:
            self._emit_memory(model_state, step)
        fields: dict[str, Any] = {}
        if self.model_flops is not None and self.peak.flops:
            tokens_per_s = tokens / step_time
            fields["mfu"] = utilization(self.model_flops, tokens_per_s, self.world_size,
                                        self.peak.flops)
            fields["hfu"] = utilization(self.hardware_flops or 0.0, tokens_per_s,
                                        self.world_size, self.peak.flops)
        memory = device_memory(self.device)
        busy, span, steps = self.clock.drain() if self.clock is not None else (0.0, 0.0, 0)
        local = [float(v) for v in memory.values()] + [busy / max(steps, 1), span / max(steps, 1)]
        cols = list(zip(*self.gather(local), strict=True))
        for key, col in zip(memory, cols, strict=False):
            fields[f"{key}_per_rank"] = [int(v) for v in col]
        fields["peak_mem_bytes"] = max(fields["peak_mem_bytes_per_rank"])
        if self.clock is not None:
            fields.update(self._bubble(cols[-2], cols[-1]))
        return fields

    # --- parts -----------------------------------------------------------------------------------
    def _bubble(self, busy: tuple[float, ...], span: tuple[float, ...]) -> dict[str, Any]:
        """Idle fraction of each pipeline rank's schedule steps in the window (see bubble.py)."""
        fractions = [1 - b / s if s > 0 else 0.0 for b, s in zip(busy, span, strict=True)]
        return {"bubble_fraction": sum(fractions) / len(fractions),
                "bubble_fraction_per_rank": fractions,
                "bubble_fraction_theory": self.bubble_theory,
                "stage_busy_s_per_rank": list(busy),
                "stage_idle_s_per_rank": [s - b for b, s in zip(busy, span, strict=True)]}

    def _emit_memory(self, model_state: dict[str, int], step: int) -> None:
        """The one `memory` event: model state from ModelStateMeter, activations from the
        sampled step, per rank (collective)."""
        self._memory_emitted = True
        state = dict(model_state)
        sampled = self.activations.peak_bytes if self.activations is not None else None
        if self.activations is not None:
            self.activations.disarm()
        baseline = self.rss_before_model
        local = [float(v) for v in state.values()] + [-1.0 if sampled is None else float(sampled),
                                                      -1.0 if baseline is None else float(baseline)]
        cols = list(zip(*self.gather(local), strict=True))
        fields = {f"{key}_per_rank": [int(v) for v in col]
                  for key, col in zip(state, cols, strict=False)}
        fields["activation_bytes_per_rank"] = [None if v < 0 else int(v) for v in cols[-2]]
        if baseline is not None:
            fields["rss_before_model_bytes_per_rank"] = [int(v) for v in cols[-1]]
        self.events.emit("memory", step, **fields)
