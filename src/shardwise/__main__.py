"""`python -m shardwise` is the same as the `shardwise` command."""

import os
import sys

if "LOCAL_RANK" in os.environ:  # a worker under torchrun: preemption handled from its first line
    from shardwise.resilience.preempt import catch_early

    catch_early()

from shardwise.cli.main import main  # (after the handlers: it imports torch)

if __name__ == "__main__":
    sys.exit(main())
