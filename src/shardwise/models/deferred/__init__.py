"""Build a model on the meta device, then give each rank only the tensors it keeps, with the
values the eager CPU build gives, bit for bit.

One job per module:

- `recorder`: **record** the build on the meta device (`record_build`), or refuse it
  (`CannotDefer`) — the rules of what is recorded and what is refused are there;
- `replay`: **replay** any storage of the record on the CPU, at any version;
- `fill`: **materialise** the tensors a rank keeps (`materialize`), after the model is split and
  sharded: each filled with its share of the replayed value;
- `record`: the record itself (`InitRecord`, `Ref`, the calls and events), the vocabulary the
  recorder writes and the replayer reads;
- `buffers`: host memory for the tensors a record names (views, scratch, the one reused buffer).

The public names are importable from here.
"""

from shardwise.models.deferred.fill import materialize
from shardwise.models.deferred.record import CannotDefer, InitRecord, Ref
from shardwise.models.deferred.recorder import record_build

__all__ = ["CannotDefer", "InitRecord", "Ref", "materialize", "record_build"]
