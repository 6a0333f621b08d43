"""The end of a CI log: every failing test id with the last lines of its failure, then totals.

Reads the JUnit XML files pytest wrote (`--junitxml`) and the exit codes of the lint and type
steps, so that a red run is legible from its last 40 lines.
Usage: python .ci/digest.py REPORT.xml [REPORT.xml ...] [RERUNS.txt] [NAME=CODE ...]
RERUNS.txt (tests/conftest.py writes it where SHARDWISE_RERUN_LOG says): the tests that ran a
second time after a crash in native code, each with its cause, listed above the totals.
"""

from __future__ import annotations

import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

TAIL = 4  # lines of each failure's traceback end
MESSAGE_LINES = 4  # lines of its exception message
WIDTH = 160


def main(argv: list[str]) -> int:
    reports = [a for a in argv if "=" not in a and not a.endswith(".txt")]
    reruns = [line for a in argv if a.endswith(".txt") and Path(a).exists()
              for line in Path(a).read_text().splitlines() if line.strip()]
    steps = [a.split("=", 1) for a in argv if "=" in a]
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    failures: list[tuple[str, list[str]]] = []
    cases: dict[str, ET.Element] = {}  # a rerun test appears twice: its last run counts
    for report in reports:
        path = Path(report)
        if not path.exists():
            failures.append((f"{report}: no report (pytest did not finish)", []))
            continue
        for case in ET.parse(path).iter("testcase"):
            cases[f"{report}::{case.get('classname')}::{case.get('name')}"] = case
    for case in cases.values():
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            totals["failed"] += 1
            text = (bad.text or "").rstrip().splitlines()
            # the exception's own message first (it names the cause), wrapped, not cut;
            # then where it was raised
            message = textwrap.wrap(" ".join((bad.get("message") or "").split()),
                                    WIDTH)[:MESSAGE_LINES]
            failures.append((test_id, message + text[-TAIL:]))
        elif case.find("skipped") is not None:
            totals["skipped"] += 1
        else:
            totals["passed"] += 1
    print("\n" + "=" * 30 + " CI digest " + "=" * 30)
    for name, code in steps:
        print(f"{name}: {'ok' if code == '0' else f'FAILED (exit {code})'}")
    for test_id, lines in failures:
        print(f"FAILED {test_id}")
        for line in lines:
            print(f"    {line[:WIDTH]}")
    for entry in reruns:
        print(f"RERUN after a crash in native code (passed the second time unless FAILED above): "
              f"{entry}"[:2 * WIDTH])
    print(f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
