"""Tokenizers: a byte-level BPE trained locally with `tokenizers` (cached by corpus hash), or a
given `tokenizer.json` (a Hugging Face model's own), with the document separator it implies."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardwise.data.corpus import TextSource
from shardwise.errors import UserError
from shardwise.spec.training import DataSection
from shardwise.utils.files import atomic_write_text

EOS = "<|endoftext|>"
# end-of-text tokens of common model families, tried in order when tokenizer_config.json names none
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


def train_bpe(corpus: TextSource, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.texts(), trainer=trainer)
    return tok


def load_or_train(corpus: TextSource, vocab_size: int, cache: Path) -> tuple[Tokenizer, str]:
    """The tokenizer for this corpus and vocabulary size, and the SHA-256 of its JSON."""
    path = cache / f"tokenizer-bpe{vocab_size}.json"
    if not path.exists():
        atomic_write_text(path, train_bpe(corpus, vocab_size).to_str())
    text = path.read_text()
    return Tokenizer.from_str(text), hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class GivenTokenizer:
    """A tokenizer.json the user (or the model's directory) supplies."""

    tokenizer: Tokenizer
    path: Path
    sha256: str  # of the file's bytes: the run's tokenizer_hash
    eos_id: int | None  # the document separator; None: documents are simply concatenated


def load_tokenizer_file(name: str) -> GivenTokenizer:
    """`data.tokenizer` (a tokenizer.json, or a folder holding one), with a UserError naming the
    path when it is missing or not a `tokenizers` file."""
    path = Path(name).expanduser()
    folder = path.is_dir()
    if folder:
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"data.tokenizer {name!r} {'has no tokenizer.json' if folder else 'does not exist'}. "
            "Point it at a tokenizer.json (the `tokenizers` format Hugging Face models ship; "
            "AutoTokenizer's save_pretrained(DIR) writes one), or set data.tokenizer = \"\" to "
            "train a byte-level BPE on the corpus.")
    raw = path.read_bytes()
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception for every parse problem
        raise UserError(f"data.tokenizer {name!r} is not a tokenizer.json the `tokenizers` "
                        f"library can read ({str(err)[:200]}). Point it at a model's "
                        "tokenizer.json, not its tokenizer_config.json or a SentencePiece "
                        ".model file.") from None
    return GivenTokenizer(tok, path, hashlib.sha256(raw).hexdigest(), separator_id(tok, path))


def separator_id(tok: Tokenizer, path: Path) -> int | None:
    """The end-of-text token put between documents: the `eos_token` of a neighbouring
    tokenizer_config.json, else the first of EOS_CANDIDATES in the vocabulary, else None."""
    config = path.parent / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (OSError, ValueError, AttributeError) as err:
            raise UserError(f"{config} (next to data.tokenizer) is not a readable JSON object "
                            f"({err}); fix or remove it.") from None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return tok.token_to_id(eos)
    for name in EOS_CANDIDATES:
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    return None


def resolve_tokenizer(data: DataSection, default: str | Path | None) -> DataSection:
    """`data` with `tokenizer` set to the tokenizer.json in `default` (a model directory, or the
    file itself) when the user named none, so that a model fine-tuned from a directory reads
    text as it was trained to. A data.tokenizer the user set wins; token-id and `py:` sources
    are returned unchanged. Call it on the spec before launch, so every worker and every resume
    sees the same data.tokenizer."""
    if data.tokenizer or default is None or data.is_samples or data.source.endswith(".npy"):
        return data
    path = Path(default).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{path} has no tokenizer.json, so the model's own tokenizer cannot "
                        "tokenize data.source. Save it there (AutoTokenizer.from_pretrained(...)"
                        ".save_pretrained(DIR)), or set data.tokenizer to a tokenizer.json.")
    return dataclasses.replace(data, tokenizer=str(file))
