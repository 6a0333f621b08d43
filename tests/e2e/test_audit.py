"""`shardwise audit` on real runs: a token corpus with a held-out sequence planted from the
training split (and a passage copied at an offset) is caught, named and failed; a clean run passes;
`shardwise report` shows the verdict; bad input is one paragraph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardwise.cli.main import main
from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.cli import assert_user_error
from tests.support.specs import tiny_spec_dict

T = 32  # data.seq_len of the tiny spec
TRAIN_BOTH = """
import sys, shardwise
for config in sys.argv[1:]:
    shardwise.train(config)
"""


def planted_tokens(path: Path) -> Path:
    """2,000 token ids: the last 100 (5 %) are held out. Held-out sequence 0 is training
    sequence 5, token for token; held-out sequence 2 is training sequence 20 shifted by 3."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 500, size=2000)
    train, val = tokens[:1900], tokens[1900:]
    val[0:T + 1] = train[5 * T:6 * T + 1]
    val[2 * T:3 * T + 1] = train[20 * T + 3:21 * T + 4]
    np.save(path, tokens)
    return path


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("audit")
    tokens = planted_tokens(root / "planted.npy")
    configs = {}
    for name, source, vocab in (("planted", tokens, 512), ("clean", small_corpus, 512)):
        # 8 steps of 8 sequences: every one of the planted corpus's 59 training sequences
        configs[name] = root / f"{name}.toml"
        configs[name].write_text(spec_to_toml(spec_from_dict(tiny_spec_dict(
            small_corpus, root / name, run={"steps": 8},
            data={"source": str(source), "vocab_size": vocab})).validate()))
    proc = subprocess.run([sys.executable, "-c", TRAIN_BOTH, *map(str, configs.values())],
                          cwd=root, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return {name: root / name for name in configs}


def audit(*args: str, capsys) -> tuple[int, str, str]:
    code = main(["audit", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_a_planted_duplicate_is_found(runs, capsys):
    code, out, _ = audit(str(runs["planted"]), capsys=capsys)
    assert code == 1 and "audit: FAIL" in out
    result = json.loads((runs["planted"] / "audit.json").read_text())
    assert result["passed"] is False
    assert result["trained"]["distinct_sequences"] == 59  # the whole training split
    assert result["held_out"] == {"sequences": 3, "evaluated": 3, "repeats_within": 0}
    assert [(m["held_out"], m["trained"]) for m in result["exact"]] == [(0, 5)]
    near = {m["held_out"]: m for m in result["near"]}
    assert set(near) == {2} and near[2]["trained"] == 20
    # 26 shingles of 8 tokens; the 23 that lie inside training sequence 20 were trained on (the
    # last 3 cross into sequence 21, which shares only its first token with 20)
    assert near[2]["similarity"] == pytest.approx(23 / 26, abs=1e-4)
    assert "exact duplicate: held-out sequence 0 ~ trained sequence 5 (identical)" in out


def test_a_clean_run_passes_and_the_report_shows_it(runs, capsys):
    code, out, _ = audit(str(runs["clean"]), "--json", capsys=capsys)
    result = json.loads(out)
    assert code == 0 and result["passed"] is True and result["exact"] == []
    assert result["trained"]["samples_recorded"] == 64 and result["trained"]["steps"] == 8
    assert audit(str(runs["planted"]), capsys=capsys)[0] == 1  # (whichever test ran first)
    assert main(["report", str(runs["clean"]), str(runs["planted"]), "--out",
                 str(runs["clean"].parent / "report")]) == 0
    capsys.readouterr()
    html = (runs["clean"].parent / "report" / "index.html").read_text()
    row = html.split("<th>leakage audit</th>")[1].split("</tr>")[0]
    assert "PASS" in row and "FAIL: 1 exact, 1 near-duplicate" in row


@pytest.mark.parametrize("case", ["missing", "no-ledger", "threshold"])
def test_bad_input_is_one_paragraph(runs, tmp_path, capsys, case):
    target, args = tmp_path / "nothing", []
    if case == "no-ledger":
        target.mkdir()
        (target / "spec.toml").write_text((runs["clean"] / "spec.toml").read_text())
    if case == "threshold":
        target, args = runs["clean"], ["--threshold", "0"]
    code, out, err = audit(str(target), *args, capsys=capsys)
    needle = {"missing": "does not exist", "no-ledger": "has no sample ledger",
              "threshold": "--threshold 0"}[case]
    assert_user_error((code, out, err), needle)
