"""The leakage audit's arithmetic on token arrays built here: a planted exact duplicate, a planted
passage copied at an offset (found by containment, with its exact share), the sampled first pass
agreeing with the full one, and samples that are not tokens (exact duplicates only)."""

from __future__ import annotations

import numpy as np
import pytest

import shardwise.compare.leakage as leakage
from shardwise.compare.leakage import audit_digests, audit_tokens, digest, shingles

T = 32  # tokens per sequence (+1 for the shifted target)


def windows(stream: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Packed sequences as the loader cuts them: sequence s is stream[s*T : s*T + T + 1]."""
    return stream[np.asarray(ids)[:, None] * T + np.arange(T + 1)]


@pytest.fixture(scope="module")
def planted():
    rng = np.random.default_rng(0)
    train = rng.integers(0, 2048, size=2000 * T + 1)
    val = rng.integers(0, 2048, size=100 * T + 1)
    val[3 * T:4 * T + 1] = train[1234 * T:1235 * T + 1]  # held-out 3 == trained 1234
    val[40 * T + 5:43 * T + 5] = train[100 * T + 11:103 * T + 11]  # a passage, shifted by 6
    return train, val


def test_planted_exact_and_shifted_copies_are_found(planted):
    train, val = planted
    held = windows(val, np.arange(100))
    report = audit_tokens(held, 10, np.arange(2000), lambda ids: windows(train, ids))
    assert [(m.held_out, m.trained, m.similarity) for m in report.exact] == [(3, 1234, 1.0)]
    assert report.in_evaluated(report.exact) == report.exact  # held-out 3 is evaluated (< 10)
    # held-out 41 lies wholly inside the copied passage: of its 26 shingles, the 20 that do not
    # cross a trained sequence's boundary occur in trained sequences (101 holds the most)
    found = {m.held_out: m for m in report.near}
    assert set(found) == {40, 41, 42} and not report.passed
    assert found[41].trained == 101 and found[41].similarity == pytest.approx(20 / 26, abs=1e-4)
    assert found[40].similarity == pytest.approx(15 / 26, abs=1e-4)  # 5 tokens before the copy


def test_nothing_planted_passes(planted):
    train, _ = planted
    val = np.random.default_rng(1).integers(0, 2048, size=100 * T + 1)
    report = audit_tokens(windows(val, np.arange(100)), 10, np.arange(2000),
                          lambda ids: windows(train, ids))
    assert report.passed and report.exact == [] and report.near == []


def test_only_trained_sequences_count(planted):
    train, val = planted
    held = windows(val, np.arange(100))
    untrained = np.setdiff1d(np.arange(2000), [1234, 100, 101, 102, 103])
    report = audit_tokens(held, 10, untrained, lambda ids: windows(train, ids))
    assert report.passed and report.trained == 1995


def test_the_sampled_first_pass_reports_the_same_exact_shares(planted, monkeypatch):
    train, val = planted
    held = windows(val, np.arange(100))
    full = audit_tokens(held, 10, np.arange(2000), lambda ids: windows(train, ids))
    monkeypatch.setattr(leakage, "SHINGLE_LIMIT", 4096)  # forces 1 in 13
    sampled = audit_tokens(held, 10, np.arange(2000), lambda ids: windows(train, ids), chunk=300)
    assert sampled.method["first_pass_sample"] == "1 in 13"
    assert sampled.exact == full.exact and sampled.near == full.near


def test_hashes_read_token_values_not_storage():
    a = np.array([1, 2, 3, 70000], dtype=np.int64)
    assert digest(a) == digest(a.astype(np.uint32)) != digest(a[::-1])
    rows = np.array([[1, 2, 3, 4, 5], [9, 1, 2, 3, 4]])
    sh = shingles(rows, 3)
    assert sh.shape == (2, 3) and sh[0, 0] == sh[1, 1]  # the same 3 tokens, the same hash
    with pytest.raises(ValueError, match="no 6-token shingle"):
        shingles(rows, 6)


def test_samples_are_checked_for_exact_duplicates_only():
    report = audit_digests([b"a", b"b", b"a"], 2, {b"b": 17, b"z": 3})
    assert [(m.held_out, m.trained) for m in report.exact] == [(1, 17)]
    assert report.held_out_repeats == 1 and not report.near_checked and not report.passed
