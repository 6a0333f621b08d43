"""Corpus sources other than the embedded plays: a folder of .txt files and a .npy of token ids."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.data import prepare_data
from shardwise.errors import UserError
from shardwise.spec.training import DataSection


def test_folder_of_text_files(small_corpus, tmp_path):
    text = small_corpus.read_text()
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(text[: len(text) // 2])
    (folder / "sub" / "b.txt").write_text(text[len(text) // 2:])
    (folder / "ignored.md").write_text("not a .txt file")
    data = prepare_data(DataSection(source=str(folder), seq_len=32, vocab_size=300))
    assert data.vocab_size == 300
    total = len(data.train) + len(data.val)
    assert len(data.val) == int(total * 0.05)
    # the same folder hashes the same; an edit changes the hash
    assert prepare_data(DataSection(source=str(folder), seq_len=32,
                                    vocab_size=300)).content_hash == data.content_hash
    (folder / "a.txt").write_text(text[: len(text) // 2] + "x")
    assert prepare_data(DataSection(source=str(folder), seq_len=32,
                                    vocab_size=300)).content_hash != data.content_hash


def test_token_file(tmp_path):
    tokens = (np.arange(50_000) * 7919 % 1000).astype(np.int32)
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    data = prepare_data(DataSection(source=str(path), seq_len=64, vocab_size=1000))
    assert data.tokenizer_hash == "" and data.tokenizer() is None
    assert np.array_equal(np.concatenate([data.train, data.val]), tokens)
    # a uniform-ish stream: the unigram baseline is close to log(1000)
    assert abs(data.unigram_val_loss - np.log(1000)) < 0.05
    with pytest.raises(UserError, match=r"data\.vocab_size to at least 1000"):
        prepare_data(DataSection(source=str(path), seq_len=64, vocab_size=999))


def test_pinned_hash_mismatch_is_refused(small_corpus):
    with pytest.raises(UserError, match=r"data\.content_hash"):
        prepare_data(DataSection(source=str(small_corpus), seq_len=32, vocab_size=512,
                                 content_hash="0" * 64))


def _reference_hash(named: list[tuple[str, str]]) -> str:
    """The corpus hash as defined (names and texts, length-prefixed), computed independently."""
    import hashlib

    h = hashlib.sha256()
    for name, text in named:
        for part in (name, text):
            raw = part.encode()
            h.update(len(raw).to_bytes(8, "little"))
            h.update(raw)
    return h.hexdigest()


def test_a_corpus_of_files_is_read_one_file_at_a_time_and_hashed_once(tmp_path, monkeypatch):
    """#26 item 5: a corpus of files holds no text (every rank used to read the whole corpus into
    memory to hash it); its hash is the same as before, blank files skipped, and is remembered
    by the files' sizes and times, so a second rank or launch reads nothing."""
    from shardwise.data import corpus

    folder = tmp_path / "texts"
    folder.mkdir()
    texts = {"a.txt": "alpha beta\n", "b.txt": "   \n", "c/d.txt": "gamma delta epsilon\n"}
    for name, text in texts.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    cache = tmp_path / "hashes.json"
    source = corpus.load_text_corpus(str(folder), cache)
    assert all(isinstance(d, corpus.FileDocument) for d in source.documents)
    want = _reference_hash([("a.txt", texts["a.txt"]), ("c/d.txt", texts["c/d.txt"])])
    assert source.content_hash() == want
    assert list(source.texts()) == [texts["a.txt"], texts["c/d.txt"]]

    def refuse(path):
        raise AssertionError(f"read {path} again")

    monkeypatch.setattr(corpus, "_read", refuse)
    assert corpus.load_text_corpus(str(folder), cache).content_hash() == want
    monkeypatch.undo()
    (folder / "a.txt").write_text("alpha beta changed\n")  # a changed file is read again
    assert corpus.load_text_corpus(str(folder), cache).content_hash() != want


class Interrupted(Exception):
    """What stops a preparation in the test (a preemption, a crash)."""


def test_an_interrupted_tokenization_continues_where_it_stopped(tmp_path, monkeypatch):
    """#26 item 5: token ids are written in parts as they are made, so a preparation cut short
    (a preemption, a crash) resumes with the next part; the result is the array a preparation
    without interruption writes."""
    from shardwise.data import prepare

    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(7):
        (folder / f"doc{i}.txt").write_text(f"document {i} " + "words and more words " * (i + 3))
    monkeypatch.setattr(prepare, "_ENCODE_BATCH", 2)  # 7 documents: 4 parts
    section = DataSection(source=str(folder), seq_len=8, vocab_size=300, val_fraction=0.2,
                          cache_dir=str(tmp_path / "cache"))
    real, calls = prepare._encode_batch, []

    def encode(*args):
        calls.append(len(args[1]))
        if len(calls) == 3:
            raise Interrupted  # the third part: cut short
        return real(*args)

    monkeypatch.setattr(prepare, "_encode_batch", encode)
    with pytest.raises(Interrupted):
        prepare_data(section)
    calls.clear()
    resumed = prepare_data(section)
    assert calls == [2, 1]  # only the parts not written before: the third and the fourth
    monkeypatch.setattr(prepare, "_encode_batch", real)
    fresh = prepare_data(DataSection(source=str(folder), seq_len=8, vocab_size=300,
                                     val_fraction=0.2, cache_dir=str(tmp_path / "other")))
    assert np.array_equal(np.concatenate([resumed.train, resumed.val]),
                          np.concatenate([fresh.train, fresh.val]))
    assert not list((tmp_path / "cache").rglob("*.parts"))  # parts go once the array is whole
