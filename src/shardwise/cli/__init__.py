"""Command-line interface: `shardwise train` (more commands arrive with their issues)."""
