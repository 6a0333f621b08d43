"""Write tests/assets/golden_default.json: the embedded default's loss curve at fixed settings.

The settings are the ones `tests/e2e/test_cli_e2e.py::test_embedded_default_trains_and_resumes`
runs (`shardwise train` with every default but `GOLDEN_SETS`: the default layout, zero3-2 on 2
workers). The tolerance is derived, not chosen: the same run at dp1 (one process, its own thread
count, another reduction order) is the largest legitimate change a machine or a refactor may make
to these numbers without changing what is computed; the test allows ten times the largest
relative difference seen between the two, per value, and never less than `FLOOR` (measured here:
6.8e-8 between the two, so the floor decides; it leaves room for CPUs with other vector units,
which reorder GEMM sums, while a behaviour change, one sample or one init draw, moves these losses
by 1e-3 or more).

    python tests/assets/make_golden.py     # from the repository root, after a deliberate change
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
#: the fixed settings: everything else is the default RunSpec
GOLDEN_SETS = ["run.steps=4", "log.every=1", "eval.every=2", "eval.batches=1", "sample.tokens=12"]
MARGIN = 10
FLOOR = 1e-5


def curve(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per-step training loss and held-out loss, from the run's metrics.jsonl."""
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"loss": {str(e["step"]): e["loss"] for e in events if e["kind"] == "step"},
            "val_loss": {str(e["step"]): e["val_loss"] for e in events if e["kind"] == "eval"}}


def train(run_dir: Path, *extra: str) -> dict[str, dict[str, float]]:
    sets = [a for s in [*GOLDEN_SETS, f"run.dir={run_dir}", *extra] for a in ("--set", s)]
    subprocess.run([sys.executable, "-m", "shardwise", "train", *sets], check=True,
                   capture_output=True, text=True)
    return curve(run_dir)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        golden = train(Path(tmp) / "default")
        dp1 = train(Path(tmp) / "dp1", "parallel.nproc=1")
    worst = max(abs(golden[k][s] - dp1[k][s]) / abs(golden[k][s]) for k in golden for s in golden[k])
    out = {"settings": GOLDEN_SETS, "layout": "the default (zero3-2 on 2 workers)",
           "torch": torch.__version__, **golden,
           "dp1_max_rel_diff": worst, "rel_tolerance": max(MARGIN * worst, FLOOR)}
    (HERE / "golden_default.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
