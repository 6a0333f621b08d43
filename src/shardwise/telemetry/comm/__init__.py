"""The comm tap: every collective and point-to-point call of a run, counted by op, mesh axis, bytes
and time.

One job per module:

- `tap`: `CommTap`, what happens to one call (checked, counted, timed, recorded) and the step's
  boundaries;
- `wrappers`: where the calls come from: the wrappers set on torch's collectives;
- `calls`: what a call moves (bytes, the tensor whose device it runs on), per op;
- `groups`: which group a call runs on, and the mesh axis that names it (`axes_of`);
- `backends`: the backend/device discipline (`BackendDeviceError`);
- `timing`: host or device time, the device clocks;
- `totals`: the per-step and per-run tallies (`StepComm`, `OpTotals`);
- `ddp_hook`: DDP's bucket all-reduce, issued where the tap sees it.

`BackendDeviceError`, which a user's collective on the wrong device raises (docs/telemetry.md),
is importable from here too.
"""

from shardwise.telemetry.comm.backends import BackendDeviceError

__all__ = ["BackendDeviceError"]
