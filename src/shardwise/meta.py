"""What this package is and when this process loaded it: a leaf every layer may import (the
package's `__init__` re-exports both; importing them from there would point upward, into the
facade that reaches `shardwise.api` and the runtime)."""

import time

__version__ = "0.1.0"

#: When this process first imported shardwise (before torch): the start of a worker, from which
#: the time to the first step after an elastic restart is measured.
STARTED_AT = time.time()
