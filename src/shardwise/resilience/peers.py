"""A peer lost mid-collective, told apart from a bug.

When another worker or a whole node dies, every surviving rank fails in whatever collective it
was in, with the transport's own words (gloo: "Connection closed by peer", "Connection reset by
peer"; NCCL: "remote process exited"...). That is the elastic agent's business — it restarts
the workers from the newest checkpoint — not a defect of the survivor, so the worker says it in
one line instead of a traceback per rank that buries the real failure above it.
"""

from __future__ import annotations

#: what torch's transports say when the other end of a connection went away
PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "remote process exited",
)


def peer_lost(err: BaseException) -> str | None:
    """The transport's first line when `err` (or an exception it came from) is a lost peer,
    else None."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        text = str(current)
        # torch's collectives raise RuntimeError (DistBackendError is one); an OSError with
        # these words is a file system or an S3 endpoint, not a peer
        if isinstance(current, RuntimeError) and any(w in text.lower() for w in PEER_GONE):
            line = next((line.strip() for line in text.splitlines() if line.strip()), text)
            line = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
            return line.split(". ", 1)[0]  # gloo's advice after it names the rank's logs
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    return None
