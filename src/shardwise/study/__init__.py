"""Studies over runs that need the training stack: `shardwise scale` (the same job at several world
sizes, through the launcher `shardwise train` uses) and `shardwise audit` (a run's trained samples
and held-out split, read back through its ledger and data). The arithmetic they report lives in
`shardwise.compare`, which imports no torch."""
