"""Input files of ingest: which files data.path names, and one streaming record reader per format.

Readers yield lists of row dicts holding the wanted columns. A record that cannot be read as a row
(invalid JSON, invalid UTF-8, a CSV row with the wrong number of cells) is yielded as
{"__reason__": ..., "__raw__": its text} so ingest quarantines it; a file that cannot be read at all
raises one of UNREADABLE, which ingest turns into an error naming the file or a quarantined file.
"""
from __future__ import annotations

import codecs
import collections
import csv
import fnmatch
import io
import json
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from clusterscale.io.builtin_data import BUILTIN_DOCSTRINGS, builtin_docstrings_path
from clusterscale.config import DataConfig
from clusterscale.errors import UserError
from clusterscale.io.filesystems import resolve_filesystem
from clusterscale.io.input_walk import InputWalk, walk_files
from clusterscale.redact import redact_uri

ROW_BITS = 40  # up to 2**40 rows per file, 2**23 files
BATCH_ROWS = 16_384
CSV_BLOCK_BYTES = 1 << 20  # pyarrow's default; a row must fit in one block
SUFFIX_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
                  ".json": "jsonl", ".csv": "csv", ".jsonl.gz": "jsonl", ".csv.gz": "csv", ".arrow": "arrow"}
# Hugging Face `save_to_disk` writes these next to its .arrow shards; they describe the data, they are not data.
HF_STATE, HF_SIDECARS, HF_DATASET_DICT = "state.json", ("dataset_info.json", "state.json"), "dataset_dict.json"
# What reading a damaged or mislabelled file raises (pyarrow, decompression, strict UTF-8, the JSON array parser).
UNREADABLE = (pa.ArrowException, OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError)


class IngestError(UserError, ValueError):
    """The input cannot be read as pairs; the message says what was found and what to do."""


def infer_format(path: str, declared: str) -> str:
    if declared != "auto":
        return declared
    lower = path.lower()
    for suffix in sorted(SUFFIX_FORMATS, key=len, reverse=True):
        if lower.endswith(suffix):
            return SUFFIX_FORMATS[suffix]
    raise IngestError(f"Cannot infer the format of {path!r} from its suffix; set data.format to "
                      f"parquet, jsonl, csv or arrow.")


def list_input_files(data: DataConfig) -> tuple[pafs.FileSystem, list[str]]:
    """The input files of data.path (file, folder or glob), sorted: their order defines pair_ids."""
    listing = find_input_files(data)
    return listing.fs, listing.walk.files


@dataclass
class InputListing:
    fs: pafs.FileSystem
    walk: InputWalk  # the files, and what the walk skipped (symlinked repeats, run directories)


def find_input_files(data: DataConfig) -> InputListing:
    """The input files of data.path (file, folder or glob), sorted, and what listing them skipped."""
    path = builtin_docstrings_path() if data.path == BUILTIN_DOCSTRINGS else data.path
    if not path:
        raise IngestError("data.path is empty: set it to a file, folder or glob of pairs.")
    fs, root, pattern = _listing_root(path)
    if pattern is not None:
        walk = walk_files(fs, root)
        walk.files = [f for f in walk.files if fnmatch.fnmatch(f, pattern)]
    else:
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise IngestError(f"data.path {path!r} does not exist.")
        if info.type == pafs.FileType.File:
            walk = InputWalk(files=[root])
        else:
            _refuse_dataset_dict(fs, root, path)
            walk = walk_files(fs, root)
            walk.files = _hf_data_files(fs, [f for f in walk.files
                                             if any(f.lower().endswith(s) for s in SUFFIX_FORMATS)])
    if not walk.files:
        raise IngestError(f"No input files found at data.path {path!r} (looked for "
                          f"{', '.join(sorted(set(SUFFIX_FORMATS)))}; files and folders named _* or .* are "
                          f"skipped).")
    if len(walk.files) >= 1 << (63 - ROW_BITS):
        raise IngestError(f"{len(walk.files)} input files is more than pair_ids can number; merge them.")
    return InputListing(fs, walk)


def _listing_root(path: str) -> tuple[pafs.FileSystem, str, str | None]:
    """(filesystem, the file or folder data.path names or its glob starts from, the glob pattern or None)."""
    base = _glob_base(path)
    if base is None:
        return (*resolve_filesystem(path), None)
    fs, root = resolve_filesystem(base)
    return fs, root.rstrip("/"), resolve_filesystem(path)[1]


def _glob_base(path: str) -> str | None:
    """The folder (path or URI, query kept) a glob in data.path starts from; None when it holds no glob."""
    # In a URI '?' starts the query (s3://b/p?endpoint_override=...), so it is a wildcard only in local paths.
    location, sep, query = path.partition("?") if "://" in path else (path, "", "")
    if not any(ch in location for ch in ("*[" if sep or "://" in path else "*?[")):
        return None
    return location.split("*")[0].rsplit("/", 1)[0] + "/" + sep + query


def refuse_run_dir_in_data(data: DataConfig, run_uri: str) -> None:
    """A run directory inside the folder ingest lists would have its own files (locks, outputs) read as input;
    data inside the folders ingest replaces would be deleted. Compared by name, without opening a store."""
    if data.path == BUILTIN_DOCSTRINGS or not data.path or ("://" in data.path) != ("://" in run_uri):
        return
    root = _glob_base(data.path) or data.path
    if "://" in root:
        root, run_path = _uri_location(root), _uri_location(run_uri)
    else:
        root, run_path = os.path.realpath(os.path.expanduser(root)), os.path.realpath(os.path.expanduser(run_uri))
    if run_path == root or run_path.startswith(root + "/"):
        raise IngestError(
            f"--run-dir {redact_uri(run_uri)} is inside data.path {redact_uri(data.path)}: ingest reads every "
            f"file under {redact_uri(root)}, so it would read this run's own files (its locks and outputs) as "
            f"input pairs. Choose a --run-dir outside that folder.")
    written = [f"{run_path}/{folder}" for folder in ("pairs", "heldout", "quarantine")]
    if any(root == w or root.startswith(w + "/") for w in written):
        raise IngestError(f"data.path {redact_uri(data.path)} is inside the folders ingest replaces in --run-dir "
                          f"{redact_uri(run_uri)} (pairs/, heldout/, quarantine/): it would delete its own input. "
                          f"Copy those files out of the run, or ingest into another --run-dir.")


def _uri_location(uri: str) -> str:
    """scheme://bucket/path of a URI: no credentials, no query, no trailing slash."""
    scheme, _, rest = uri.partition("?")[0].partition("://")
    return f"{scheme.lower()}://{rest.rsplit('@', 1)[-1]}".rstrip("/")


def _refuse_dataset_dict(fs: pafs.FileSystem, base: str, path: str) -> None:
    """A DatasetDict folder holds several splits (train, test, ...): ingesting them all would mix them."""
    marker = posixpath.join(base, HF_DATASET_DICT)
    if fs.get_file_info(marker).type != pafs.FileType.File:
        return
    splits = _read_hf_json(fs, marker).get("splits", [])
    raise IngestError(f"data.path {path!r} is a Hugging Face DatasetDict folder with the splits "
                      f"{', '.join(map(repr, splits))}; point data.path at one split's folder, e.g. "
                      f"{posixpath.join(path, splits[0] if splits else 'train')}.")


def _hf_data_files(fs: pafs.FileSystem, files: list[str]) -> list[str]:
    """Drop the metadata of Hugging Face `save_to_disk` folders, keeping the .arrow shards their
    state.json lists (map() caches, cache-*.arrow, live in the same folder and are not the dataset)."""
    keep = set(files)
    for state in [f for f in files if posixpath.basename(f) == HF_STATE]:
        folder = posixpath.dirname(state)
        arrows = {f for f in files if posixpath.dirname(f) == folder and f.endswith(".arrow")}
        if not arrows:
            continue
        listed = {posixpath.join(folder, d["filename"]) for d in _read_hf_json(fs, state).get("_data_files", [])}
        keep -= {posixpath.join(folder, name) for name in HF_SIDECARS}
        keep -= (arrows - listed) if listed else set()
    return [f for f in files if f in keep]


def _read_hf_json(fs: pafs.FileSystem, path: str) -> dict:
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError) as err:
        raise IngestError(f"{path}: this Hugging Face dataset metadata file cannot be read ({err}); save the "
                          f"dataset again with save_to_disk, or point data.path at its .arrow files.") from None


def iter_records(fs: pafs.FileSystem, path: str, fmt: str, columns: list[str], data: DataConfig,
                 row_groups: tuple[int, ...] | None = None) -> Iterator[list[dict]]:
    """Lists of row dicts (the wanted columns) from one file, streaming; of some row groups only (Parquet)."""
    if fmt == "parquet":
        pf = pq.ParquetFile(fs.open_input_file(path))
        check_columns(pf.schema_arrow.names, path, data)
        groups = range(pf.num_row_groups) if row_groups is None else row_groups
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=list(groups), columns=columns):
            yield batch.to_pylist()
    elif fmt == "arrow":
        yield from _arrow_records(fs, path, columns, data)
    elif fmt == "csv":
        yield from _csv_records(fs, path, columns, data)
    else:
        _refuse_binary(fs, path, "json" if path.lower().endswith(".json") else "jsonl")
        if _starts_with(fs, path, "["):
            yield from _json_array_records(fs, path, columns, data)
        else:
            yield from _jsonl_records(fs, path, columns, data)


def _arrow_records(fs: pafs.FileSystem, path: str, columns: list[str], data: DataConfig) -> Iterator[list[dict]]:
    """Arrow IPC: the stream format (what Hugging Face datasets write) or the file format (Feather v2)."""
    try:
        reader = pa.ipc.open_stream(fs.open_input_stream(path))
        batches = iter(reader)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(fs.open_input_file(path))
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    check_columns(reader.schema.names, path, data)
    for batch in batches:
        for start in range(0, batch.num_rows, BATCH_ROWS):
            yield batch.slice(start, BATCH_ROWS).select(columns).to_pylist()


def _csv_records(fs: pafs.FileSystem, path: str, columns: list[str], data: DataConfig) -> Iterator[list[dict]]:
    """Cells arrive as bytes (so invalid UTF-8 is a quarantined row, not a failed file); only the empty
    cell is null ("NA", "null", "NaN" are text); rows with the wrong number of cells are quarantined in
    their place, so every row keeps its number in the file (blank lines are not rows)."""
    _refuse_binary(fs, path, "csv")
    with fs.open_input_stream(path, compression="detect") as stream:
        header = next(csv.reader(io.TextIOWrapper(stream, encoding="utf-8-sig", errors="replace")), None)
    if header is None:
        raise pa.ArrowInvalid("empty CSV file: no header line")
    check_columns(header, path, data)
    ragged: collections.deque[tuple[int, dict]] = collections.deque()

    def on_ragged(row) -> str:
        # row.number counts records from 1 with the header (serial parsing): the data row index is number - 2.
        ragged.append((row.number - 2, {"__reason__": f"csv_cells:{row.actual_columns}_of_{row.expected_columns}",
                                        "__raw__": row.text}))
        return "skip"

    reader = pacsv.open_csv(
        fs.open_input_stream(path, compression="detect"),
        read_options=pacsv.ReadOptions(use_threads=False, block_size=CSV_BLOCK_BYTES),
        parse_options=pacsv.ParseOptions(invalid_row_handler=on_ragged),
        convert_options=pacsv.ConvertOptions(include_columns=columns, column_types={c: pa.binary() for c in columns},
                                             strings_can_be_null=True, null_values=[""]))
    row = 0  # the file's data row the next record is
    for batch in reader:
        # The parser is ahead of the batches it yields: every ragged row before this batch's end is known.
        merged = []
        for record in batch.to_pylist():
            while ragged and ragged[0][0] <= row:
                merged.append(ragged.popleft()[1])
                row += 1
            merged.append(record)
            row += 1
        yield merged
    rest = [record for _, record in ragged]
    for start in range(0, len(rest), BATCH_ROWS):
        yield rest[start:start + BATCH_ROWS]


# The first bytes of files that are not text, for telling a user what a mislabelled file is.
BINARY_MAGIC = {b"PAR1": ("Parquet", "parquet"), b"ARROW1": ("an Arrow IPC file", "arrow"),
                b"\xff\xff\xff\xff": ("an Arrow IPC stream", "arrow"), b"\x1f\x8b": ("gzip-compressed", None),
                b"PK\x03\x04": ("a zip archive (an .xlsx workbook?)", None), b"(\xb5/\xfd": ("zstd-compressed", None)}
SNIFF_BYTES = 1 << 16


def _refuse_binary(fs: pafs.FileSystem, path: str, fmt: str) -> None:
    """A text format's file that starts like a binary format, or is full of NUL bytes, is refused whole rather
    than read as garbled rows; a stray NUL or bad byte in text is left to its row (quarantined)."""
    with fs.open_input_stream(path, compression="detect") as stream:
        head = stream.read(SNIFF_BYTES)
    nuls = head.count(b"\0")
    if not nuls and _is_utf8_start(head):
        return
    for magic, (what, fix_format) in BINARY_MAGIC.items():
        if head.startswith(magic):
            fix = (f"rename it to .{fix_format} or set data.format={fix_format}" if fix_format else
                   "decompress it, or give it the suffix of its compression (.gz)" if "compressed" in what else
                   "export it as CSV, JSONL or Parquet")
            raise NotTextError(f"this is not {fmt.upper()} (it looks like {what}: it starts with {magic!r}); {fix}")
    if nuls > max(8, len(head) // 100):
        raise NotTextError(f"this is not {fmt.upper()} text: it holds NUL bytes (binary data, or text in UTF-16/32); "
                           f"save it as UTF-8 {fmt.upper()}, or set data.format to its format")


def _is_utf8_start(head: bytes) -> bool:
    """Whether `head` is valid UTF-8 (a character cut at its end allowed)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


class NotTextError(pa.ArrowInvalid):
    """A text-format file holds binary data (a mislabelled Parquet file, a compressed file without its suffix)."""


def _starts_with(fs: pafs.FileSystem, path: str, char: str) -> bool:
    """Whether the first non-blank character of a (possibly compressed) text file is `char`."""
    with fs.open_input_stream(path, compression="detect") as stream:
        while chunk := stream.read(1 << 16):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1] == char.encode()
    return False


def _jsonl_records(fs: pafs.FileSystem, path: str, columns: list[str], data: DataConfig) -> Iterator[list[dict]]:
    """JSON lines, parsed line by line so one bad line is quarantined, not fatal."""
    stream = fs.open_input_stream(path, compression="detect")
    # surrogateescape keeps undecodable bytes recoverable, so such a line is quarantined with its bytes.
    text = io.TextIOWrapper(stream, encoding="utf-8", errors="surrogateescape")
    return _checked_batches((_jsonl_record(line.strip(), columns) for line in text), path, data)


def _jsonl_record(line: str, columns: list[str]) -> dict:
    if not line:
        return {"__reason__": "blank_line"}
    if not is_encodable(line):  # the undecodable bytes kept as \xNN escapes
        return {"__reason__": "invalid_utf8",
                "__raw__": line.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")}
    try:
        return _json_record(_JSON.decode(line), line, columns)
    except json.JSONDecodeError:
        return {"__reason__": "invalid_json", "__raw__": line}


class _KeysRepeated(dict):
    """A JSON object that named some key twice (json keeps the last value silently); `keys_in_order` lists all."""

    keys_in_order: list[str]


def _json_object(pairs: list[tuple[str, object]]) -> dict:
    value = dict(pairs)
    if len(value) < len(pairs):
        value = _KeysRepeated(value)
        value.keys_in_order = [key for key, _ in pairs]
    return value


_JSON = json.JSONDecoder(object_pairs_hook=_json_object)


def _json_record(value: object, raw: str, columns: list[str]) -> dict:
    """The row dict of one parsed JSON value, or the reason it is not one (with its raw text kept)."""
    if not isinstance(value, dict):
        return {"__reason__": "not_an_object", "__raw__": raw}
    if isinstance(value, _KeysRepeated):
        twice = [c for c in columns if value.keys_in_order.count(c) > 1]
        if twice:  # which value is the text is a guess: the row is quarantined (the file's first object: an error)
            return {"__reason__": "repeated_key:" + ",".join(twice), "__raw__": raw, "__keys__": value.keys_in_order}
    return value


def _json_array_records(fs: pafs.FileSystem, path: str, columns: list[str], data: DataConfig
                        ) -> Iterator[list[dict]]:
    """A file holding one JSON array of objects, read element by element (memory: one element)."""
    stream = fs.open_input_stream(path, compression="detect")
    items = _json_array_items(io.TextIOWrapper(stream, encoding="utf-8"))
    return _checked_batches((_json_record(value, raw, columns) for value, raw in items), path, data)


def _checked_batches(records: Iterator[dict], path: str, data: DataConfig) -> Iterator[list[dict]]:
    """Row dicts in batches of BATCH_ROWS; the first object's keys are checked against the column mapping
    (a mapped key named twice there is the file's shape, an error; in a later row, that row's fault)."""
    rows, checked = [], False
    for row in records:
        if not checked and ("__reason__" not in row or "__keys__" in row):
            check_columns(row.pop("__keys__", None) or list(row), path, data)
            checked = True
        row.pop("__keys__", None)
        rows.append(row)
        if len(rows) == BATCH_ROWS:
            yield rows
            rows = []
    if rows:
        yield rows


def _json_array_items(text: io.TextIOBase, chunk_chars: int = 1 << 20) -> Iterator[tuple[object, str]]:
    """(value, its JSON text) per element of the top-level array; raises JSONDecodeError where it is invalid."""
    decoder, buf, pos = _JSON, "", 0

    def next_char() -> str:  # the next non-blank character, reading on as needed; "" at the end of the file
        nonlocal buf, pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                return buf[pos]
            buf, pos = text.read(chunk_chars), 0
            if not buf:
                return ""

    if next_char() != "[":
        raise json.JSONDecodeError("expected '['", buf, pos)
    pos += 1
    if next_char() == "]":
        pos += 1
    else:
        while True:
            next_char()
            while True:  # an element may span chunks; a number at the chunk's end may go on in the next
                more = ""
                try:
                    value, end = decoder.raw_decode(buf, pos)
                    if end < len(buf) or not (more := text.read(chunk_chars)):
                        break
                except json.JSONDecodeError:
                    if not (more := text.read(chunk_chars)):
                        raise
                buf, pos = buf[pos:] + more, 0
            yield value, buf[pos:end]
            pos = end
            sep = next_char()
            pos += 1
            if sep == "]":
                break
            if sep != ",":
                raise json.JSONDecodeError("expected ',' or ']' after an array element", buf, pos - 1)
    if next_char():
        raise json.JSONDecodeError("extra data after the JSON array", buf, pos)


def check_columns(found: list[str], path: str, data: DataConfig) -> None:
    """The mapped columns are in the file, each once (a name twice would read one of them, silently)."""
    wanted = {"data.query_column": data.query_column, "data.passage_column": data.passage_column}
    if data.source_column:
        wanted["data.source_column"] = data.source_column
    repeated = {col: [i + 1 for i, name in enumerate(found) if name == col] for col in set(wanted.values())}
    repeated = {col: places for col, places in repeated.items() if len(places) > 1}
    if repeated:
        keys = [key for key, col in wanted.items() if col in repeated]
        raise IngestError(f"{path}: the column name(s) " + ", ".join(
            f"{col!r} (columns {', '.join(map(str, places))})" for col, places in sorted(repeated.items())) +
            f" appear more than once among the {len(found)} columns {bounded_names(found)}, so which one holds "
            f"the text is a guess. Rename the repeated columns in the file to unique names, or map "
            f"{'/'.join(keys)} to a column whose name appears once.")
    missing = [f"{key}={col!r}" for key, col in wanted.items() if col not in found]
    if missing:
        raise IngestError(f"{path}: column(s) {', '.join(missing)} not found. Columns found: "
                          f"{bounded_names(found)}. Set the data.*_column keys to match "
                          f"(e.g. --set data.query_column=question data.passage_column=answer).")


def bounded_names(names: list[str], most: int = 20) -> str:
    """The column names for a message: the first `most`, each cut to 60 characters."""
    shown = ", ".join(repr(n if len(n) <= 60 else n[:60] + "...") for n in names[:most])
    return shown + (f", ... ({len(names)} in all)" if len(names) > most else "")


def is_encodable(text: str) -> bool:
    """False when `text` holds lone surrogates (undecodable bytes kept by surrogateescape, or a JSON
    "\\ud800" escape): such text cannot be written as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def escaped(text: str) -> str:
    """`text` made writable without losing what it held: lone surrogates as \\uXXXX escapes (never the
    U+FFFD replacement character)."""
    return text if is_encodable(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")
