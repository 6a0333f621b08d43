"""`shardwise audit RUN_DIR`: the held-out split against every sample the run's ledger recorded,
by content (`shardwise.compare.leakage`).

The run's own spec says what the data was; preparing it again checks its pinned content and
tokenizer hashes, so the audit reads exactly the tokens the run trained on (a changed corpus is a
UserError, not a silent audit of something else). Every global sample index in the ledger —
superseded steps of a crashed launch included: they were trained on — is mapped to its sequence
by the run's seed, as the loader did.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.compare.leakage import LeakageReport, audit_digests, audit_tokens
from shardwise.data import PreparedData, prepare_data
from shardwise.data.ledger import LAUNCHES, LEDGER_DIR
from shardwise.data.sampler import GlobalSampler, PackedSequences
from shardwise.data.samples import SampleData, fingerprint
from shardwise.errors import SpecError, UserError
from shardwise.spec import RunSpec, load_spec

AUDIT = "audit.json"


@dataclass
class Ledger:
    """What the ledger recorded: global sample indices (each once) over its steps and launches."""

    indices: np.ndarray
    records: int  # sample uses recorded (a re-run step counts again)
    steps: int
    launches: int


@dataclass
class Audit:
    run_dir: Path
    spec: RunSpec
    ledger: Ledger
    report: LeakageReport
    data: PreparedData
    seconds: float


def run_audit(run_dir: Path, threshold: float, shingle: int) -> Audit:
    t0 = time.perf_counter()
    spec = _run_spec(run_dir)
    ledger = read_ledger(run_dir)
    data = prepare_data(spec.data)  # checks the pinned hashes: the run's own tokens
    if data.samples is not None:
        report = _audit_samples(data.samples, ledger, spec)
    else:
        report = _audit_tokens(data, ledger, spec, threshold, shingle)
    return Audit(run_dir, spec, ledger, report, data, time.perf_counter() - t0)


def _run_spec(run_dir: Path) -> RunSpec:
    path = run_dir / "spec.toml"
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} does not exist. Pass a run directory made by `shardwise "
                        "train` (runs/NAME).")
    if not path.is_file():
        raise UserError(f"{run_dir} has no spec.toml, so its data is unknown: pass a run "
                        "directory made by `shardwise train`.")
    try:
        return load_spec(path)
    except SpecError as err:
        raise UserError(f"cannot read {path}: {err}") from None


def read_ledger(run_dir: Path) -> Ledger:
    ledger = run_dir / LEDGER_DIR
    if not (ledger / LAUNCHES).is_file():
        raise UserError(f"{run_dir} has no sample ledger ({LEDGER_DIR}/{LAUNCHES} is missing), "
                        "so what it trained on is unknown. Audit a run made by `shardwise "
                        "train`; the ledger is written from its first step.")
    parts: list[np.ndarray] = []
    steps: set[tuple[int, int]] = set()
    for path in sorted(ledger.glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by a crash: the step it began was not recorded
            steps.add((entry["launch"], entry["step"]))
            parts += [np.arange(a, b, dtype=np.int64) for a, b in entry["ranges"]]
    if not parts:
        raise UserError(f"the ledger of {run_dir} records no step: the run stopped before its "
                        "first step, so it trained on nothing to audit.")
    every = np.concatenate(parts)
    launches = len((ledger / LAUNCHES).read_text().splitlines())
    return Ledger(np.unique(every), len(every), len({s for _, s in steps}), launches)


def _audit_tokens(data: PreparedData, ledger: Ledger, spec: RunSpec, threshold: float,
                  shingle: int) -> LeakageReport:
    seq_len = spec.data.seq_len
    if not 1 <= shingle <= seq_len + 1:
        raise UserError(f"--shingle {shingle}: a shingle is a run of tokens inside one sequence "
                        f"of {seq_len + 1}; use 1 to {seq_len + 1} (8 is the default).")
    train = PackedSequences(data.train, seq_len)
    val = PackedSequences(data.val, seq_len)
    ids = np.unique(GlobalSampler(len(train), spec.run.seed).sequence_ids(ledger.indices))
    window = np.arange(seq_len + 1)

    def rows(split: PackedSequences, which: np.ndarray) -> np.ndarray:
        return np.asarray(split.tokens[which[:, None] * seq_len + window], dtype=np.int64)

    held_out = rows(val, np.arange(len(val)))
    evaluated = min(spec.eval.batches * spec.batch.global_batch, len(val))
    return audit_tokens(held_out, evaluated, ids, lambda which: rows(train, which),
                        threshold=threshold, shingle=shingle)


def _audit_samples(samples: SampleData, ledger: Ledger, spec: RunSpec) -> LeakageReport:
    ids = np.unique(GlobalSampler(len(samples.train), spec.run.seed)
                    .sequence_ids(ledger.indices)).tolist()
    trained: dict[bytes, int] = {}
    for i in ids:
        trained.setdefault(_sample_digest(samples.train[i]), i)
    held = [_sample_digest(samples.val[i]) for i in range(len(samples.val))]
    evaluated = min(spec.eval.batches * spec.batch.global_batch, len(held))
    return audit_digests(held, evaluated, trained)


def _sample_digest(sample: Any) -> bytes:
    """The content hash `data.samples.fingerprint` gives one sample (arrays, tensors, numbers,
    strings, and tuples, lists and dicts of them)."""
    return bytes.fromhex(fingerprint(SampleData(train=[sample], val=[])))


def write_result(audit: Audit) -> Path | None:
    """RUN_DIR/audit.json (what `shardwise report` shows); None when the directory is read-only."""
    path = audit.run_dir / AUDIT
    try:
        path.write_text(json.dumps(result_dict(audit), indent=2))
    except OSError:
        return None
    return path


def result_dict(audit: Audit) -> dict[str, Any]:
    r = audit.report
    return {
        "passed": r.passed, "time": round(time.time(), 3), "seconds": round(audit.seconds, 3),
        "data": {"source": audit.spec.data.source, "content_hash": audit.data.content_hash,
                 "tokenizer_hash": audit.data.tokenizer_hash or None,
                 "seq_len": audit.spec.data.seq_len},
        "trained": {"samples_recorded": audit.ledger.records, "distinct_samples":
                    int(audit.ledger.indices.size), "distinct_sequences": r.trained,
                    "steps": audit.ledger.steps, "launches": audit.ledger.launches},
        "held_out": {"sequences": r.held_out, "evaluated": r.evaluated,
                     "repeats_within": r.held_out_repeats},
        "exact": [asdict(m) for m in r.exact], "near": [asdict(m) for m in r.near],
        "near_checked": r.near_checked, "method": r.method,
    }


def render(audit: Audit, shown: int = 5) -> str:
    """What the terminal shows: the two sides of the check, what was found, and the verdict."""
    r, spec, ledger = audit.report, audit.spec, audit.ledger
    data = audit.data
    hashes = f"content {data.content_hash[:12]}…" + (
        f", tokenizer {data.tokenizer_hash[:12]}…" if data.tokenizer_hash else "")
    unit = "sequences" if r.near_checked else "samples"
    lines = [
        f"audit {audit.run_dir}: the held-out split against every sample the ledger recorded",
        f"  data      {spec.data.source} ({hashes})"
        + (f"; sequences of {spec.data.seq_len} + 1 tokens" if r.near_checked else ""),
        f"  trained   {ledger.records:,} sample uses over {ledger.steps:,} steps "
        f"({ledger.launches} launch{'es' if ledger.launches != 1 else ''}): {r.trained:,} "
        f"distinct {unit}",
        f"  held-out  {r.held_out:,} {unit} in the validation split; the first {r.evaluated:,} "
        f"are evaluated (eval.batches {spec.eval.batches} x global batch "
        f"{spec.batch.global_batch})",
        f"  exact duplicates across splits: {len(r.exact)}"
        + (f" ({len(r.in_evaluated(r.exact))} in the evaluated part)" if r.exact else ""),
    ]
    if r.near_checked:
        m = r.method
        lines.append(f"  near-duplicates (>= {m['threshold']:.0%} of a held-out sequence's "
                     f"{m['shingle']}-token shingles occur in trained sequences): {len(r.near)}"
                     + (f" ({len(r.in_evaluated(r.near))} in the evaluated part)" if r.near
                        else ""))
    else:
        lines.append("  near-duplicates: not checked (samples, not token sequences)")
    lines.append(f"  held-out {unit} that repeat another held-out one: {r.held_out_repeats}")
    tok = data.tokenizer() if r.near_checked else None
    for title, matches in (("exact duplicate", r.exact), ("near-duplicate", r.near)):
        for m in matches[:shown]:
            share = "identical" if title.startswith("exact") else \
                f"{m.similarity:.0%} of its shingles trained on, most from this one"
            lines.append(f"  {title}: held-out {unit[:-1]} {m.held_out} ~ trained {unit[:-1]} "
                         f"{m.trained} ({share})")
            if tok is not None:
                lines.append(f"    held-out: {_snippet(tok, data.val, m.held_out, spec)}")
                lines.append(f"    trained:  {_snippet(tok, data.train, m.trained, spec)}")
        if len(matches) > shown:
            lines.append(f"  ... {len(matches) - shown} more {title}s in {AUDIT}")
    lines.append("audit: PASS — no held-out sequence matches a trained one by content"
                 if r.passed else "audit: FAIL — held-out data the run also trained on (above)")
    return "\n".join(lines)


def _snippet(tok: Any, tokens: np.ndarray, sequence: int, spec: RunSpec, width: int = 90) -> str:
    t = spec.data.seq_len
    text = tok.decode([int(x) for x in tokens[sequence * t: sequence * t + t + 1]])
    text = " ".join(text.split())
    return repr(text if len(text) <= width else text[:width - 1] + "…")
