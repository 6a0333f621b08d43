"""Faults: injection for drills and tests (restart policy and guards build on it)."""
