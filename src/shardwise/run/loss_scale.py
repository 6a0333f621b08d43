"""Dynamic loss scaling for fp16: scale the loss up so small gradients survive fp16, unscale before
clipping, skip the step and back off when any rank saw inf/NaN (the global gradient norm is then
not finite), grow after a run of good steps."""

from __future__ import annotations

from typing import Any

from shardwise.spec.runspec import LossScaleSection


class LossScaler:
    """Stateful: `{scale, good_steps, skipped_steps}` travel in checkpoints."""

    def __init__(self, cfg: LossScaleSection) -> None:
        self.cfg = cfg
        self.scale = cfg.init_scale
        self.good_steps = 0
        self.skipped_steps = 0

    @property
    def inverse(self) -> float:
        """What unscales the gradients (`run.optim.scale_grads`). Whether any rank's gradients
        overflowed is read from the global gradient norm (inf/NaN anywhere makes it non-finite),
        so unscaling needs neither a collective nor a host sync of its own."""
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> bool:
        """Adjust the scale after a step; returns True when the step must be skipped."""
        if found_inf:
            self.scale *= self.cfg.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return True
        self.good_steps += 1
        if self.good_steps >= self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self.good_steps = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
