"""The test harness: spawned ranks, the functions they run, spec and CLI helpers."""
