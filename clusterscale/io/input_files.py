"""Input files of ingest: which files data.path names, and one streaming record reader per format.

Readers yield lists of row dicts holding the wanted columns. A record that cannot be read as a row
(invalid JSON, invalid UTF-8, a CSV row with the wrong number of cells) is yielded as
{"__reason__": ..., "__raw__": its text} so ingest quarantines it; a file that cannot be read at all
raises one of UNREADABLE, which ingest turns into an error naming the file or a quarantined file.
"""
from __future__ import annotations

import csv
import fnmatch
import io
import json
import posixpath
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from clusterscale.io.builtin_data import BUILTIN_DOCSTRINGS, builtin_docstrings_path
from clusterscale.config import DataConfig
from clusterscale.errors import UserError
from clusterscale.io.filesystems import resolve_filesystem

ROW_BITS = 40  # up to 2**40 rows per file, 2**23 files
BATCH_ROWS = 16_384
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


def _is_hidden(path: str, root: str) -> bool:
    """Files and folders named `_*` or `.*` (Spark/Hive markers, temp files, .git) are not data."""
    return any(part.startswith((".", "_")) for part in posixpath.relpath(path, root).split("/"))


def list_input_files(data: DataConfig) -> tuple[pafs.FileSystem, list[str]]:
    """The input files of data.path (file, folder or glob), sorted: their order defines pair_ids."""
    path = builtin_docstrings_path() if data.path == BUILTIN_DOCSTRINGS else data.path
    if not path:
        raise IngestError("data.path is empty: set it to a file, folder or glob of pairs.")
    # In a URI '?' starts the query (s3://b/p?endpoint_override=...), so it is a wildcard only in local paths.
    location, sep, query = path.partition("?") if "://" in path else (path, "", "")
    has_glob = any(ch in location for ch in ("*[" if sep or "://" in path else "*?["))
    fs, base = resolve_filesystem(location.split("*")[0].rsplit("/", 1)[0] + "/" + sep + query if has_glob else path)
    if has_glob:
        _, pattern = resolve_filesystem(path)
        root = base.rstrip("/")
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        files = [i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, pattern)
                 and not _is_hidden(i.path, root)]
    else:
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            raise IngestError(f"data.path {path!r} does not exist.")
        if info.type == pafs.FileType.File:
            files = [base]
        else:
            _refuse_dataset_dict(fs, base, path)
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
            files = [i.path for i in infos if i.type == pafs.FileType.File and not _is_hidden(i.path, base)
                     and any(i.path.lower().endswith(s) for s in SUFFIX_FORMATS)]
            files = _hf_data_files(fs, files)
    if not files:
        raise IngestError(f"No input files found at data.path {path!r} (looked for "
                          f"{', '.join(sorted(set(SUFFIX_FORMATS)))}; files and folders named _* or .* are "
                          f"skipped).")
    if len(files) >= 1 << (63 - ROW_BITS):
        raise IngestError(f"{len(files)} input files is more than pair_ids can number; merge them.")
    return fs, sorted(files)


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
    elif _starts_with(fs, path, "["):
        yield from _json_array_records(fs, path, data)
    else:
        yield from _jsonl_records(fs, path, data)


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
    cell is null ("NA", "null", "NaN" are text); rows with the wrong number of cells are quarantined."""
    with fs.open_input_stream(path, compression="detect") as stream:
        header = next(csv.reader(io.TextIOWrapper(stream, encoding="utf-8-sig", errors="replace")), None)
    if header is None:
        raise pa.ArrowInvalid("empty CSV file: no header line")
    check_columns(header, path, data)
    ragged: list[dict] = []

    def on_ragged(row) -> str:
        ragged.append({"__reason__": f"csv_cells:{row.actual_columns}_of_{row.expected_columns}",
                       "__raw__": row.text})
        return "skip"

    reader = pacsv.open_csv(
        fs.open_input_stream(path, compression="detect"),
        read_options=pacsv.ReadOptions(use_threads=False),
        parse_options=pacsv.ParseOptions(invalid_row_handler=on_ragged),
        convert_options=pacsv.ConvertOptions(include_columns=columns, column_types={c: pa.binary() for c in columns},
                                             strings_can_be_null=True, null_values=[""]))
    for batch in reader:
        yield batch.to_pylist()
    # The parser reads ahead of the batches it yields, so ragged rows come last: their ids stay stable.
    for start in range(0, len(ragged), BATCH_ROWS):
        yield ragged[start:start + BATCH_ROWS]


def _starts_with(fs: pafs.FileSystem, path: str, char: str) -> bool:
    """Whether the first non-blank character of a (possibly compressed) text file is `char`."""
    with fs.open_input_stream(path, compression="detect") as stream:
        while chunk := stream.read(1 << 16):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1] == char.encode()
    return False


def _jsonl_records(fs: pafs.FileSystem, path: str, data: DataConfig) -> Iterator[list[dict]]:
    """JSON lines, parsed line by line so one bad line is quarantined, not fatal."""
    stream = fs.open_input_stream(path, compression="detect")
    # surrogateescape keeps undecodable bytes recoverable, so such a line is quarantined with its bytes.
    text = io.TextIOWrapper(stream, encoding="utf-8", errors="surrogateescape")
    return _checked_batches((_jsonl_record(line.strip()) for line in text), path, data)


def _jsonl_record(line: str) -> dict:
    if not line:
        return {"__reason__": "blank_line"}
    if not is_encodable(line):  # the undecodable bytes kept as \xNN escapes
        return {"__reason__": "invalid_utf8",
                "__raw__": line.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")}
    try:
        return _json_record(json.loads(line), line)
    except json.JSONDecodeError:
        return {"__reason__": "invalid_json", "__raw__": line}


def _json_record(value: object, raw: str) -> dict:
    """The row dict of one parsed JSON value, or the reason it is not one (with its raw text kept)."""
    if not isinstance(value, dict):
        return {"__reason__": "not_an_object", "__raw__": raw}
    return value


def _json_array_records(fs: pafs.FileSystem, path: str, data: DataConfig) -> Iterator[list[dict]]:
    """A file holding one JSON array of objects, read element by element (memory: one element)."""
    stream = fs.open_input_stream(path, compression="detect")
    items = _json_array_items(io.TextIOWrapper(stream, encoding="utf-8"))
    return _checked_batches((_json_record(value, raw) for value, raw in items), path, data)


def _checked_batches(records: Iterator[dict], path: str, data: DataConfig) -> Iterator[list[dict]]:
    """Row dicts in batches of BATCH_ROWS; the first good row's keys are checked against the column mapping."""
    rows, checked = [], False
    for row in records:
        rows.append(row)
        if not checked and "__reason__" not in row:
            check_columns(list(row), path, data)
            checked = True
        if len(rows) == BATCH_ROWS:
            yield rows
            rows = []
    if rows:
        yield rows


def _json_array_items(text: io.TextIOBase, chunk_chars: int = 1 << 20) -> Iterator[tuple[object, str]]:
    """(value, its JSON text) per element of the top-level array; raises JSONDecodeError where it is invalid."""
    decoder, buf, pos = json.JSONDecoder(), "", 0

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
    wanted = {"data.query_column": data.query_column, "data.passage_column": data.passage_column}
    if data.source_column:
        wanted["data.source_column"] = data.source_column
    missing = [f"{key}={col!r}" for key, col in wanted.items() if col not in found]
    if missing:
        raise IngestError(f"{path}: column(s) {', '.join(missing)} not found. Columns found: "
                          f"{', '.join(map(repr, found))}. Set the data.*_column keys to match "
                          f"(e.g. --set data.query_column=question data.passage_column=answer).")


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
