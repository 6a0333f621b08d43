"""Corpus sources other than the embedded plays: a folder of .txt files and a .npy of token ids."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.data import prepare_data
from shardwise.errors import UserError
from shardwise.spec.runspec import DataSection


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
