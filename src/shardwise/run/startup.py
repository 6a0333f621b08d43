"""A worker's start-up, from its first line to its first step: preemption handled throughout, and
waits that never race a collective timeout.

Until the first step a worker does work that can take minutes and differs between ranks: one
rank per node tokenizes a cold corpus or hashes a large model directory while the others wait.
Waiting in a collective would bound that by `parallel.timeout_s`; so the ranks meet at
`Startup.arrive(phase)` in the launcher's key-value store instead: each rank writes what it saw —
the preemption signal it caught (the handlers are installed before anything else, see
`install_flag`), or the user error it hit — and waits, without a deadline that work could
reach, until every rank has written. Then every rank acts on the same facts: the first user
error is raised everywhere (one message, exit 2); a signal anywhere stops every rank with
`StoppedAtStartup`, which the worker turns into the preemption marker (exit 75 at the launcher,
nothing lost: the next launch continues from the newest checkpoint, or step 0).
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from shardwise.errors import UserError
from shardwise.resilience.attempt import launch_attempt
from shardwise.resilience.faults import FaultInjector
from shardwise.resilience.preempt import SignalFlag
from shardwise.spec.failure import parse_signals

#: how long a rank waits for the others at a start-up phase before it calls them lost: long
#: enough for any preparation (the elastic agent ends a job whose worker died long before)
WAIT_S = 6 * 3600.0
_POLL_S = 0.05


class StoppedAtStartup(Exception):
    """A preemption signal reached some rank before the first step."""

    def __init__(self, signal_name: str, phase: str) -> None:
        super().__init__(f"preempted by {signal_name} during start-up ({phase})")
        self.signal_name, self.phase = signal_name, phase


def install_flag(preempt_signals: str) -> SignalFlag:
    """Catch the preemption signals from now on (the worker's first act): a signal before the
    trainer exists is recorded, not fatal. The process's flag (`SignalFlag.for_process`), so
    what an entry point caught before the spec was read is kept."""
    return SignalFlag.for_process(parse_signals(preempt_signals))


@dataclass
class Startup:
    """The start-up phases of one worker. `store` is the launcher's store (None: one process)."""

    flag: SignalFlag
    rank: int
    world: int
    store: Any = None
    faults: FaultInjector | None = None
    phases: list[str] = field(default_factory=list)

    def arrive(self, phase: str, error: UserError | None = None) -> None:
        """Meet the other ranks after `phase` (see the module docstring); raises the first
        rank's UserError, or StoppedAtStartup when a signal reached any rank."""
        self.phases.append(phase)
        if self.faults is not None:  # drills: `signal:phase=startup` fires at the first phase
            self.faults.at("startup", 0)
        facts = [{"signal": self.flag.signum, "error": str(error) if error else None}]
        if self.store is not None and self.world > 1:
            facts = self._exchange(phase, facts[0])
        errors = [f["error"] for f in facts if f["error"]]
        if errors:
            raise UserError(errors[0])
        signals = [f["signal"] for f in facts if f["signal"]]
        if signals:
            raise StoppedAtStartup(signal.Signals(signals[0]).name, phase)

    def _exchange(self, phase: str, mine: dict[str, Any]) -> list[dict[str, Any]]:
        prefix = f"/shardwise/startup_{launch_attempt()}/{phase}"
        self.store.set(f"{prefix}/{self.rank}", json.dumps(mine))
        keys = [f"{prefix}/{r}" for r in range(self.world)]
        deadline = time.monotonic() + WAIT_S
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                raise UserError(f"the ranks did not all finish start-up phase {phase!r} within "
                                f"{WAIT_S / 3600:g} h; a worker may have died silently. Check the "
                                "workers' output and launch again.")
            time.sleep(_POLL_S)
        return [json.loads(self.store.get(k)) for k in keys]
