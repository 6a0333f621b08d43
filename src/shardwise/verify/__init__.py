"""Verification: layout parity runs, restart checks, ledger audits."""
