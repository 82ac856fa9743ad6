"""The sources of a run: the `sources` list checked and named, a reader of raw records for each file format,
and what makes a record malformed (hsextract.prepare.conversations turns the raw records into conversations).
One module, over 400 lines: a reader per file format, which share the locations and the malformed-record rules.

Files: JSONL (one record a line; a `.json` file too where it holds no list, but not one object over several
lines: refused), a JSON list, parquet, Arrow stream files, and `datasets.save_to_disk` directories (`hf_disk`: a
Dataset, or a DatasetDict with `split:`), read with `datasets.load_from_disk` where `datasets` is installed, else
from its Arrow files with pyarrow (the same rows: both convert them with pyarrow's to_pylist). JSONL and JSON are
UTF-8 text, a leading byte-order mark skipped; a compressed (gzip, zstd, bzip2, xz, zip) or UTF-16 file is refused
as a whole, saying how to make it text. A reader's `len()` is cheap (no parsing of JSONL or parquet content), so
counting the records of a run is.

Locations in errors: `file:LINE` (1-based line) for JSONL, `file:record N` (1-based) otherwise; for hf_disk
`dir:record N` over the whole dataset (its split's directory for a DatasetDict), so `ds[N - 1]` is the record.
"""

from __future__ import annotations

import codecs
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hsextract.config.guard import resolved_from
from hsextract.config.settings import Source, source_stem
from hsextract.errors import ConfigError

FORMATS = ("auto", "messages", "sharegpt", "ultrachat", "hf_disk")

# Malformed-record reasons (summary counters use these names).
BAD_JSON = "bad_json"
NON_UTF8 = "non_utf8"
WRONG_TYPE = "wrong_type"
MISSING_MESSAGES = "missing_messages"
MISSING_ROLE = "missing_role"
UNKNOWN_ROLE = "unknown_role"
EMPTY_CONTENT = "empty_content"


class MalformedRecordError(ConfigError):
    """An input record cannot be read as a conversation (strict mode). Names file, line/record and reason."""

    def __init__(self, location: str, reason: str, detail: str) -> None:
        super().__init__(
            f"{location}: malformed record ({reason}): {detail}. Fix or remove this record, or set "
            f"`strict: false` to skip malformed records (they are counted per reason in summary.json)."
        )
        self.location = location
        self.reason = reason
        self.detail = detail


SourceEntry = Source | Mapping[str, Any] | str | os.PathLike[str]


def parse_sources(sources: Sequence[SourceEntry]) -> list[Source]:
    """The `sources` list checked (paths exist; a mapping's keys and values, as the schema would) and each
    source named (`name`, else its file name's stem; a repeated name gets its index appended); ConfigError
    names the key that is wrong. Entries: the settings' Sources, config mappings, or bare paths."""
    if not isinstance(sources, Sequence) or isinstance(sources, (str, bytes)) or not sources:
        raise ConfigError("config key `sources` must be a non-empty list of {path, format, weight, max_records}")
    specs: list[Source] = []
    names: dict[str, int] = {}  # name -> the entry that has it
    for i, s in enumerate(sources):
        key = f"sources[{i}]"
        if isinstance(s, Source):
            s = s.as_dict()
        elif isinstance(s, (str, os.PathLike)):
            s = {"path": s}
        if not isinstance(s, Mapping) or "path" not in s:
            raise ConfigError(f"config key `{key}` must be a mapping with at least `path`")
        unknown = set(s) - {"path", "format", "weight", "max_records", "name", "split"}
        if unknown:
            raise ConfigError(f"config key `{key}` has unknown keys {sorted(unknown)}; allowed: path, format, "
                              f"weight, max_records, name, split")
        path = Path(s["path"])
        if not path.exists():
            raise ConfigError(f"config key `{key}.path`: {path} does not exist{resolved_from(path)} (local paths only)")
        fmt = s.get("format", "auto") or "auto"
        if fmt not in FORMATS:
            raise ConfigError(f"config key `{key}.format` is {fmt!r}; allowed: {', '.join(FORMATS)}")
        weight = s.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"config key `{key}.weight` must be a number >= 0, got {weight!r}")
        cap = s.get("max_records")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ConfigError(f"config key `{key}.max_records` must be an integer >= 0 or null, got {cap!r}")
        if s.get("split") is not None and not (path / "dataset_dict.json").is_file():
            raise ConfigError(f"config key `{key}.split`: {path} is no DatasetDict (a save_to_disk folder with a "
                              "dataset_dict.json), so a split means nothing there: remove `split`")
        name = str(s.get("name") or source_stem(path) or f"source{i}")
        if name in names:
            first, name = names[name], f"{name}{i}"
            if name in names:  # sample ids are <name>:<record>: two sources of one name would share them
                raise ConfigError(
                    f"config key `{key}`: its name {name[:-len(str(i))]!r} is sources[{first}]'s, and {name!r}, "
                    f"which it would get instead, is sources[{names[name]}]'s: give the sources distinct `name`s")
        names[name] = i
        specs.append(Source(path=str(path), format=fmt, weight=float(weight), max_records=cap, name=name,
                            split=s.get("split")))
    return specs


class Reader:
    """Raw records of one file: `len()` is cheap, `raw(i)` returns (location, bytes | dict)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def raw(self, i: int) -> tuple[str, Any]:
        raise NotImplementedError


def _jsonl_records(f: Any) -> Iterator[tuple[int, int, int]]:
    """(line number, start, end) of each record of a JSONL file open in binary: its non-blank lines. A leading
    UTF-8 byte-order mark (what Windows tools write, `utf-8-sig`) is no part of line 1."""
    pos = 0
    for lineno, line in enumerate(f, start=1):
        start, pos = pos, pos + len(line)
        if lineno == 1 and line.startswith(codecs.BOM_UTF8):
            start, line = start + len(codecs.BOM_UTF8), line[len(codecs.BOM_UTF8):]
        if line.strip():
            yield lineno, start, pos


class _JsonlReader(Reader):
    def __init__(self, path: Path) -> None:
        self.path = path
        self._offsets: list[tuple[int, int, int]] | None = None  # (line number, start, end)
        self._count: int | None = None

    def _index(self) -> list[tuple[int, int, int]]:
        if self._offsets is None:
            with open(self.path, "rb") as f:
                self._offsets = list(_jsonl_records(f))
        return self._offsets

    def __len__(self) -> int:
        if self._offsets is not None:
            return len(self._offsets)
        if self._count is None:
            # Blank lines are not records; counting them needs a scan but no JSON parsing.
            with open(self.path, "rb") as f:
                self._count = sum(1 for _ in _jsonl_records(f))
        return self._count

    def raw(self, i: int) -> tuple[str, Any]:
        lineno, start, end = self._index()[i]
        with open(self.path, "rb") as f:
            f.seek(start)
            return f"{self.path}:{lineno}", f.read(end - start)


class _JsonListReader(Reader):
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            data = json.loads(path.read_bytes().decode("utf-8-sig"))  # a leading BOM is no part of the JSON
        except UnicodeDecodeError as e:
            raise MalformedRecordError(f"{path}", NON_UTF8, f"the file is not UTF-8 ({e})") from None
        except json.JSONDecodeError as e:
            raise MalformedRecordError(f"{path}:{e.lineno}", BAD_JSON, f"the JSON list does not parse: {e.msg}") \
                from None
        if not isinstance(data, list):
            raise ConfigError(f"{path}: a .json source must hold a list of records, got {type(data).__name__}")
        self.records = data

    def __len__(self) -> int:
        return len(self.records)

    def raw(self, i: int) -> tuple[str, Any]:
        return f"{self.path}:record {i + 1}", self.records[i]


def _drop_nulls(x: Any) -> Any:
    """`x` with every null-valued key of its dicts removed, at any depth."""
    if isinstance(x, dict):
        return {k: _drop_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_nulls(v) for v in x]
    return x


def table_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row of a parquet or Arrow table as the record it was written from, where Arrow cannot keep it: a column
    of dicts is one struct type, so every dict holds the keys of all the others, null where it had none. In the
    free-form dicts a template prints whole (a row's `tools`, a tool call's `arguments`), those nulls would
    become trained text (`{"city": "Paris", "query": null}`): dropped there. A null meant as a value cannot be
    told apart, nor a record's own key order (a struct has the column's): store such arguments as a JSON string."""
    row = dict(row)
    if isinstance(row.get("tools"), list):
        row["tools"] = _drop_nulls(row["tools"])
    for key in ("messages", "conversations"):
        for m in row.get(key) or ():
            legacy = [m["function_call"]] if isinstance(m, dict) and isinstance(m.get("function_call"), dict) else []
            for call in [*(m.get("tool_calls") or ()), *legacy] if isinstance(m, dict) else ():
                fn = call.get("function", call) if isinstance(call, dict) else None  # or the flat {name, arguments}
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), dict):
                    fn["arguments"] = _drop_nulls(fn["arguments"])
    return row


class _TableReader(Reader):
    """Parquet file or Arrow stream files (HF save_to_disk); columnar, rows converted on access. Locations
    name each file, or `label` with the record's index over all files."""

    def __init__(self, path: Path, tables: Sequence[tuple[Path, Any]], label: Path | None = None) -> None:
        self.path = path
        self._label = label
        self._tables = list(tables)  # (file, loader returning a pa.Table) loaded lazily
        self._loaded: list[pa.Table | None] = [None] * len(self._tables)
        self._counts = [self._count(p) for p, _ in self._tables]
        self._starts = np.cumsum([0] + self._counts)

    @staticmethod
    def _count(p: Path) -> int:
        if p.suffix == ".parquet":
            return pq.ParquetFile(p).metadata.num_rows
        with pa.memory_map(str(p)) as src:
            try:
                reader = pa.ipc.open_stream(src)
            except pa.ArrowInvalid:
                return pa.ipc.open_file(src).read_all().num_rows
            return sum(b.num_rows for b in reader)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def raw(self, i: int) -> tuple[str, Any]:
        t = int(np.searchsorted(self._starts, i, side="right") - 1)
        if self._loaded[t] is None:
            self._loaded[t] = self._tables[t][1]()
        row = table_row(self._loaded[t].slice(i - int(self._starts[t]), 1).to_pylist()[0])
        if self._label is not None:
            return f"{self._label}:record {i + 1}", row
        return f"{self._tables[t][0]}:record {i - int(self._starts[t]) + 1}", row


class _DatasetReader(Reader):
    """A `datasets.Dataset` (memory-mapped by `load_from_disk`); rows as pyarrow's to_pylist gives them, as
    the pyarrow reader does (no decoding by the dataset's features)."""

    def __init__(self, label: Path, ds: Any) -> None:
        self.path = label
        self._ds = ds.with_format("arrow")

    def __len__(self) -> int:
        return len(self._ds)

    def raw(self, i: int) -> tuple[str, Any]:
        return f"{self.path}:record {i + 1}", table_row(self._ds[i].to_pylist()[0])


def _read_parquet(p: Path) -> pa.Table:
    """The whole file, decompressed (records are read in the mixture's shuffled order, which would decode a row
    group per record); refused, before the machine runs out of memory, where it cannot fit."""
    meta = pq.ParquetFile(p).metadata
    size = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    free = available_memory()
    if size > free // 2:
        raise ConfigError(
            f"{p}: its {meta.num_rows} records take {size / 1e9:.1f} GB decompressed, and prepare holds a parquet "
            f"source in memory, where {free / 1e9:.1f} GB are available: convert it to a save_to_disk folder, which "
            f"is read memory-mapped (python -c \"import datasets; datasets.Dataset.from_parquet('{p}')"
            f".save_to_disk('{p.with_suffix('')}-disk')\"), and name that folder as the source's path")
    return pq.read_table(p)


def available_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _read_arrow(p: Path) -> pa.Table:
    with pa.memory_map(str(p)) as src:
        try:
            return pa.ipc.open_stream(src).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(src).read_all()


def _hf_disk_dir(path: Path, split: str | None) -> Path:
    """The Dataset directory of a `save_to_disk` directory: itself, or its split's for a DatasetDict (one
    Dataset directory per split: loading only that one leaves the other splits unread)."""
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        if split is None:
            if len(splits) != 1:
                raise ConfigError(f"{path} is a DatasetDict with splits {splits}: set `split:` on this source")
            split = splits[0]
        if split not in splits:
            raise ConfigError(f"{path}: split {split!r} not in {splits}")
        path = path / split
    if not (path / "state.json").exists():
        raise ConfigError(f"{path}: not a `datasets.save_to_disk` directory (no state.json or dataset_dict.json)")
    return path


def _hf_disk_files(path: Path) -> list[Path]:
    """Arrow files of one Dataset directory of `save_to_disk`, in order (state.json `_data_files`)."""
    files = [path / f["filename"] for f in json.loads((path / "state.json").read_text(encoding="utf-8"))["_data_files"]]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise ConfigError(f"{path}: state.json lists Arrow files that are missing: {missing}")
    return files


def _hf_disk_reader(path: Path, split: str | None) -> Reader:
    """`datasets.load_from_disk` where `datasets` is installed, else pyarrow on the Arrow files."""
    ds_dir = _hf_disk_dir(path, split)
    files = _hf_disk_files(ds_dir)  # checked here for both readers: one error message for a missing file
    try:
        import datasets
    except ImportError:
        return _TableReader(path, [(f, (lambda f=f: _read_arrow(f))) for f in files], label=ds_dir)
    return _DatasetReader(ds_dir, datasets.load_from_disk(str(ds_dir)))


# What a compressed (or UTF-16) file opens with, what it is, and what makes it UTF-8 text.
_DECOMPRESS = "decompress it ({}) and give the decompressed file as the source's `path`"
_TO_UTF8 = "convert it to UTF-8 (`iconv -f UTF-16 -t UTF-8`) and give that file as the source's `path`"
_NOT_TEXT = ((b"\x1f\x8b", "gzip-compressed", _DECOMPRESS.format("`gunzip`")),
             (b"\x28\xb5\x2f\xfd", "zstd-compressed", _DECOMPRESS.format("`zstd -d`")),
             (b"BZh", "bzip2-compressed", _DECOMPRESS.format("`bunzip2`")),
             (b"\xfd7zXZ\x00", "xz-compressed", _DECOMPRESS.format("`unxz`")),
             (b"PK\x03\x04", "a zip archive", _DECOMPRESS.format("`unzip`")),
             (b"\xff\xfe", "UTF-16 text", _TO_UTF8), (b"\xfe\xff", "UTF-16 text", _TO_UTF8))
_RECORD_KEYS = ("messages", "conversations", "data")


def _refuse_binary(p: Path, head: bytes) -> None:
    """A JSONL or JSON source that is compressed (or UTF-16) would be read as lines of bytes, each one a
    malformed record: refused as a whole, saying what it is and how to make it text."""
    for magic, what, fix in _NOT_TEXT:
        if head.startswith(magic):
            raise ConfigError(f"{p}: the file is {what} (it starts with the bytes {magic.hex(' ')}), and a JSONL or "
                              f"JSON source is read as UTF-8 text: {fix}")
    nul = head.count(0)
    if not nul:
        return
    # ASCII in UTF-16 without a byte-order mark: NULs at every other byte, and nearly none between
    at_even, at_odd = head[0::2].count(0), head[1::2].count(0)
    if max(at_even, at_odd) * 4 > len(head) and min(at_even, at_odd) * 16 < len(head):
        codec = "UTF-16LE" if at_odd > at_even else "UTF-16BE"
        raise ConfigError(f"{p}: the file looks like {codec} text without a byte-order mark (a NUL every other byte), "
                          f"and a JSONL or JSON source is read as UTF-8 text: convert it to UTF-8 (`iconv -f {codec} "
                          "-t UTF-8`) and give that file as the source's `path`")
    # a shard, an archive: bytes that are not UTF-8, or NULs all over (a tar's headers); one NUL in UTF-8 text is
    # one malformed record
    if not _utf8(head) or nul * 100 > len(head):
        raise ConfigError(f"{p}: the file is binary ({nul} NUL bytes in its first {len(head):,}, the first at offset "
                          f"{head.index(0)}), and a JSONL or JSON source is read as UTF-8 text: give a conversations "
                          "file as the source's `path`")


def _utf8(head: bytes) -> bool:
    """Whether `head` is UTF-8 (a character cut at its end allowed)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


_ONE_OBJECT_MAX_BYTES = 256 << 20


def _refuse_json_object(p: Path) -> None:
    """A .json file that opens with `{`: JSON lines (a .json file often holds them, as `datasets` reads it), unless
    it is one object over several lines, which read as lines would be one malformed record a line: refused."""
    with open(p, "rb") as f:
        first = next(_jsonl_records(f), None)
        if first is None:
            return
        f.seek(first[1])
        try:
            json.loads(f.read(first[2] - first[1]))
            return  # line 1 is a record: JSON lines
        except ValueError:
            pass
    if p.stat().st_size > _ONE_OBJECT_MAX_BYTES:
        return  # not parsed whole (this runs when the workflow is parsed): its lines are read, each error named
    try:
        obj = json.loads(p.read_bytes().decode("utf-8-sig"))
    except ValueError:
        return  # nor one JSON document: JSON lines with a bad line 1, reported as that record
    if not isinstance(obj, dict):
        return
    head = f"{p}: a .json source holds a list of records (or one record a line, JSON lines), and this one holds one " \
           f"JSON object over several lines"
    items = next((obj[k] for k in _RECORD_KEYS if isinstance(obj.get(k), list)), None)
    if items and (isinstance(items[0], str) or (isinstance(items[0], Mapping) and
                                                ("role" in items[0] or "from" in items[0]))):
        raise ConfigError(f"{head}, which is one record (keys: {sorted(obj)[:8]}): put it in a list (`[{{...}}]`) "
                          "or write it on one line")
    lists = [k for k, v in obj.items() if isinstance(v, list)]
    where = f"; if the records are the list under `{lists[0]}`, write that list as the file" if len(lists) == 1 else ""
    raise ConfigError(f"{head} (keys: {sorted(obj)[:8]}), not a record{where}")


def data_files(spec: Source) -> list[Path]:
    """The files a source's reader reads: the file, or the Arrow files of its save_to_disk split."""
    p = Path(spec.path)
    if p.is_dir() or spec.format == "hf_disk":
        return _hf_disk_files(_hf_disk_dir(p, spec.split))
    return [p]


def _opens_with_a_list(p: Path) -> bool:
    """A JSON list written over several lines (its first line no JSON value alone), or one line holding it all; a
    JSON-lines file whose first record is a list, malformed, is read as JSON lines (that record counted)."""
    with open(p, "rb") as f:
        first = b""
        while not first.strip() and (line := f.readline(_ONE_OBJECT_MAX_BYTES)):  # blank lines are no record
            first = line
        more = f.read(1 << 16).strip()
    try:
        json.loads(first.decode("utf-8-sig"))
    except ValueError:
        return True
    return not more


def open_reader(spec: Source) -> Reader:
    """The reader of a source's file (or save_to_disk directory), by its format and suffix."""
    p = Path(spec.path)
    if p.is_dir() or spec.format == "hf_disk":
        return _hf_disk_reader(p, spec.split)
    if p.suffix == ".parquet":
        return _TableReader(p, [(p, lambda: _read_parquet(p))])
    if p.suffix == ".arrow":
        return _TableReader(p, [(p, lambda: _read_arrow(p))])
    with open(p, "rb") as f:
        head = f.read(4096)
    _refuse_binary(p, head)
    head = head.removeprefix(codecs.BOM_UTF8).lstrip()
    if p.suffix == ".json" and head.startswith(b"["):
        return _JsonListReader(p)
    if p.suffix == ".json" and head.startswith(b"{"):
        _refuse_json_object(p)
    if head.startswith(b"[") and _opens_with_a_list(p):  # read as lines: one malformed record a line
        raise ConfigError(f"{p}: this file holds a JSON list (it opens with `[`), which is read as JSON lines by its "
                          f"name ({p.suffix or 'no suffix'}): name it `.json` to read it as a list of records, or "
                          "write one record a line")
    return _JsonlReader(p)


__all__ = ["FORMATS", "MalformedRecordError", "Reader", "SourceEntry", "data_files",
           "open_reader", "parse_sources"]
