"""`python -m shardwise` is the same as the `shardwise` command."""

import sys

from shardwise.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
