"""Fault injection, for tests and drills: from `failure.faults` in the spec or $SHARDWISE_FAULTS.

A fault list is `;`-separated; each fault is `kind:key=value:key=value`, for example
    kill:rank=1:step=3:phase=backward      SIGKILL rank 1 as step 3 enters backward
    crash:rank=1:step=3                    SIGSEGV instead: a crash in native code (a launched
                                           worker prints every thread's Python stack first)
    raise:rank=0:step=2:phase=optimizer    raise an exception instead
    hang:rank=1:step=4:phase=forward       sleep until the collective timeout fires
    slow:rank=1:ms=200                     sleep 200 ms in every step (a straggler)
    nan:rank=0:step=5                      put a NaN into one gradient after backward
    mismatch:rank=1:step=3:phase=backward  issue one stray 1-element all-reduce on the data-parallel
                                           group: a collective mismatch, as a bug would cause
    corrupt:step=4                         flip a byte of a checkpoint file after it is committed
    signal:rank=1:step=3:sig=SIGUSR1       send this rank a signal (default SIGTERM) as step 3
                                           enters forward: a preemption that reaches one rank
    signal:phase=startup                   the same before the first step, while the worker
                                           starts (after it joined the group; step 0)
Phases: startup, data, forward, backward, optimizer, checkpoint-write. `rank` defaults to every rank,
`step` to every step. A fault fires in restart attempt 0 only (set `attempt=N` for another), so
that the restarted run can get past it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.spec.failure import KINDS, PHASES, Fault, parse_faults

if TYPE_CHECKING:  # the spec validates fault lists, and the spec layer imports no torch
    import torch

__all__ = ["KINDS", "PHASES", "Fault", "FaultInjector", "InjectedFault", "parse_faults"]


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault."""


@dataclass
class FaultInjector:
    faults: list[Fault]
    rank: int
    attempt: int
    fired: list[str] = field(default_factory=list)
    group: Any = None  # the process group a `mismatch` fault sends its stray collective on
    device: Any = "cpu"  # the run's device: where that collective's tensor lives

    @classmethod
    def from_spec(cls, spec_faults: str, rank: int) -> FaultInjector:
        text = ";".join(filter(None, [spec_faults, os.environ.get("SHARDWISE_FAULTS", "")]))
        from shardwise.resilience.attempt import launch_attempt

        attempt = launch_attempt()
        return cls(parse_faults(text), rank, attempt)

    def at(self, phase: str, step: int) -> None:
        """Called as `step` (1-based) enters `phase`."""
        for fault in self.faults:
            if fault.kind in ("kill", "crash", "raise", "hang", "mismatch", "signal") \
                    and fault.phase is None:
                fault = Fault(fault.kind, fault.rank, fault.step, "forward", fault.ms,
                              fault.attempt, fault.sig)
            if not fault.matches(self.rank, step, phase, self.attempt):
                continue
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            if fault.kind == "signal":
                os.kill(os.getpid(), signal.Signals[fault.sig])
            if fault.kind == "raise":
                raise InjectedFault(f"injected fault at step {step}, phase {phase}, rank "
                                    f"{self.rank}")
            if fault.kind == "hang":
                time.sleep(10**6)
            if fault.kind == "mismatch":
                import torch
                import torch.distributed as dist

                dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
            if fault.kind == "slow" and phase == "forward":
                time.sleep(fault.ms / 1000)

    def poisons_gradients(self, step: int) -> bool:
        """Whether `after_backward` plants a NaN on this rank at `step` (1-based)."""
        return any(f.kind == "nan" and f.matches(self.rank, step, None, self.attempt)
                   and f"nan@{step}" not in self.fired for f in self.faults)

    def after_backward(self, step: int, params: list[torch.nn.Parameter]) -> None:
        if self.poisons_gradients(step):  # once: a rollback replays the step
            grad = next(p.grad for p in params if p.grad is not None)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if local.numel():
                local.view(-1)[0] = float("nan")
            self.fired.append(f"nan@{step}")

    def after_checkpoint(self, step: int, path: Path) -> None:
        for fault in self.faults:
            if fault.kind == "corrupt" and fault.matches(self.rank, step, None, self.attempt) \
                    and self.rank == 0:
                target = sorted(path.glob("*.distcp"))[0]
                data = bytearray(target.read_bytes())
                data[len(data) // 2] ^= 0xFF
                target.write_bytes(bytes(data))
                self.fired.append(f"corrupt@{step}:{target.name}")
