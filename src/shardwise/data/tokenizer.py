"""A byte-level BPE tokenizer trained locally with `tokenizers`, cached by corpus hash."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardwise.data.corpus import TextCorpus
from shardwise.utils.files import atomic_write_text

EOS = "<|endoftext|>"


def train_bpe(corpus: TextCorpus, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in corpus.documents), trainer=trainer)
    return tok


def load_or_train(corpus: TextCorpus, vocab_size: int, cache: Path) -> tuple[Tokenizer, str]:
    """The tokenizer for this corpus and vocabulary size, and the SHA-256 of its JSON."""
    path = cache / f"tokenizer-bpe{vocab_size}.json"
    if not path.exists():
        atomic_write_text(path, train_bpe(corpus, vocab_size).to_str())
    text = path.read_text()
    return Tokenizer.from_str(text), hashlib.sha256(text.encode()).hexdigest()
