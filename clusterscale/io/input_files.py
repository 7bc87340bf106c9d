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
import re
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
from clusterscale.io.input_walk import InputWalk, file_stamp, walk_files
from clusterscale.io.json_input import brackets_balance, is_encodable, json_array_records, jsonl_records
from clusterscale.io.text_ranges import open_range
from clusterscale.redact import redact_uri

ROW_BITS = 40  # up to 2**39 rows per file (ingest.EXTRA_POSITIVE_BIT is the 40th), 2**23 files
BATCH_ROWS = 16_384
CSV_BLOCK_BYTES = 1 << 20  # pyarrow's default; a row must fit in one block
TEXT_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv"}
DELIMITERS = {"csv": ",", "tsv": "\t"}  # the separated formats, read alike but for quoting (a header line)
COMPRESSIONS = (".gz", ".bz2", ".zst")  # the compressed suffixes format inference knows
DETECTED_COMPRESSIONS = (*COMPRESSIONS, ".lz4")  # what the text readers' compression="detect" decompresses
SUFFIX_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".feather": "arrow", **TEXT_SUFFIXES,
                  **{suffix + packed: fmt for suffix, fmt in TEXT_SUFFIXES.items() for packed in COMPRESSIONS}}
# Files a data folder holds beside its data by convention (a dataset repository's card, license, configs, loading
# script, checksums, DVC files): skipped, and named in the log. Any other file of no format ingest reads stops it.
DOC_SUFFIXES = (".md", ".rst", ".yaml", ".yml", ".toml", ".cff", ".py", ".ipynb", ".sh", ".md5", ".sha1", ".sha256",
                ".sha512", ".dvc", ".lock")
DOC_NAMES = ("readme", "license", "licence", "copying", "notice", "citation", "changelog", "makefile", "md5sums",
             "sha1sums", "sha256sums", "sha512sums")
HUB_METADATA = ("dataset_infos.json", "dataset_info.json")  # a dataset repository's card data, not pairs
UTF8_BOM = b"\xef\xbb\xbf"
# A one-column header holding one of these (and not the file's delimiter): the cause; the fix, when ingest reads it.
OTHER_SEPARATORS = {";": ("semicolon", None), "\t": ("tab", "tsv"), "|": ("pipe", None), ",": ("comma", "csv")}
FIRST_LINE_BYTES = 1 << 24  # a JSON file starting with `[` whose first line runs longer is taken for one array
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
                      f"parquet, jsonl, csv, tsv or arrow.")


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
            walk = InputWalk(files=[root], stamps={root: file_stamp(info)})
        else:
            _refuse_dataset_dict(fs, root, path)
            walk = walk_files(fs, root)
            walk.files = _hf_data_files(fs, _folder_data_files(walk, data.format, path, root))
    if not walk.files:
        raise IngestError(f"No input files found at data.path {path!r} (looked for "
                          f"{', '.join(sorted(set(SUFFIX_FORMATS)))}; files and folders named _* or .* are "
                          f"skipped).")
    if len(walk.files) >= 1 << (63 - ROW_BITS):
        raise IngestError(f"{len(walk.files)} input files is more than pair_ids can number; merge them.")
    return InputListing(fs, walk)


def _folder_data_files(walk: InputWalk, declared: str, path: str, root: str) -> list[str]:
    """The files of a data folder to read: those whose suffix names a format, and with data.format set those without
    a suffix too (a Hadoop part-00001); documentation, checksums and configs (README.md, LICENSE, *.yaml, *.sha256)
    are skipped and named in walk.docs_skipped. Any other file stops ingest: skipping it would drop its rows without
    a word (a .xlsx, a Snappy-compressed part, a part without a suffix when data.format is auto)."""
    known, docs, unknown = [], [], []
    for f in walk.files:
        name = posixpath.basename(f).lower()
        if any(name.endswith(suffix) for suffix in SUFFIX_FORMATS) and name not in HUB_METADATA:
            known.append(f)
        elif name.endswith(DOC_SUFFIXES) or name.startswith(DOC_NAMES) or name in HUB_METADATA:
            docs.append(f)
        else:
            (known if declared != "auto" and "." not in name else unknown).append(f)
    walk.docs_skipped = docs
    if unknown:
        names = [posixpath.relpath(f, root) for f in unknown]
        bare = any("." not in posixpath.basename(n) for n in names)
        other = any("." in posixpath.basename(n) for n in names)
        suffixes = collections.Counter(_suffix(f) for f in known)
        raise IngestError(
            f"data.path {redact_uri(path)!r} holds {len(unknown)} file(s) of no format ingest reads by their name: "
            f"{bounded_names(names, 10)}." +
            (" A file without a suffix is read as data.format when it is set (parquet, jsonl, csv, tsv or arrow)."
             if bare else "") +
            (" Convert files of another format (a .tsv, Snappy-compressed text) to one it reads "
             "(.parquet, .jsonl, .csv, .arrow; text also .gz, .bz2, .zst)." if other else "") +
            (f" To read only the others, point data.path at a glob of them, e.g. "
             f"{redact_uri(_with_glob(path, '*' + suffixes.most_common(1)[0][0]))!r}." if suffixes else ""))
    return known


def _suffix(path: str) -> str:
    """The format suffix a file's name ends with (the longest: .jsonl.gz before .gz)."""
    name = path.lower()
    return max((s for s in SUFFIX_FORMATS if name.endswith(s)), key=len, default="")


def _with_glob(path: str, pattern: str) -> str:
    """The folder data.path with a glob pattern appended (a URI's query kept after it)."""
    location, sep, query = path.partition("?") if "://" in path else (path, "", "")
    return f"{location.rstrip('/')}/{pattern}{sep}{query}"


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


def splittable(fs: pafs.FileSystem, path: str, fmt: str) -> bool:
    """Whether ingest may read `path` in byte ranges (io/text_ranges): JSON lines or TSV, not compressed, not a
    JSON array."""
    if fmt not in ("jsonl", "tsv") or path.lower().endswith(DETECTED_COMPRESSIONS):
        return False
    return fmt == "tsv" or not is_json_array(fs, path)


def iter_records(fs: pafs.FileSystem, path: str, fmt: str, columns: list[str], data: DataConfig,
                 row_groups: tuple[int, ...] | None = None, byte_range: tuple[int, int] | None = None
                 ) -> Iterator[list[dict]]:
    """Lists of row dicts (the wanted columns) from one file, streaming; of some row groups only (Parquet), or of
    the lines that start in a byte range (JSON lines, TSV: io/text_ranges)."""
    if fmt == "parquet":
        pf = pq.ParquetFile(fs.open_input_file(path))
        check_columns(pf.schema_arrow.names, path, data)
        groups = range(pf.num_row_groups) if row_groups is None else row_groups
        columns = file_columns(columns, pf.schema_arrow.names, data)
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=list(groups), columns=columns):
            yield batch.to_pylist()
    elif fmt == "arrow":
        yield from _arrow_records(fs, path, columns, data)
    elif fmt in DELIMITERS:
        yield from _csv_records(fs, path, columns, data, DELIMITERS[fmt], byte_range)
    else:
        _refuse_binary(fs, path, "json" if path.lower().endswith(".json") else "jsonl")
        columns = columns + [c for c in negative_columns(data.negative_column, []) if c not in columns]
        if byte_range is None and is_json_array(fs, path):
            yield from _json_array_records(fs, path, columns, data)
        else:
            yield from _jsonl_records(fs, path, columns, data, byte_range)


def columns_problem(fs: pafs.FileSystem, path: str, data: DataConfig) -> str | None:
    """What ingest would do about this file, read as ingest reads it but only its first batch of rows (for `plan`):
    'ingest would stop: <why>' for columns that are not the mapped ones or a file it cannot read ('ingest would skip
    it: ...' with data.bad_files=quarantine), or None."""
    columns = [data.query_column, data.passage_column] + ([data.source_column] if data.source_column else [])
    fmt = infer_format(path, data.format)
    try:
        next(iter_records(fs, path, fmt, columns, data), None)
    except IngestError as e:
        return f"ingest would stop: {e}"
    except UNREADABLE as err:
        found = str(err) if isinstance(err, NotTextError) else f"{type(err).__name__}: {err}"
        action = "skip it (data.bad_files=quarantine)" if data.bad_files == "quarantine" else "stop"
        return f"ingest would {action}: {path}: cannot be read as {fmt} ({found})."
    return None


def input_column_names(fs: pafs.FileSystem, path: str, data: DataConfig) -> list[str]:
    """The column names of an input file: a Parquet or Arrow schema's, a CSV/TSV header's (or data.column_names), the
    keys of a JSON file's objects in its first batch of rows; [] when it cannot be read so (ingest says why)."""
    fmt = infer_format(path, data.format)
    try:
        if fmt == "parquet":
            with fs.open_input_file(path) as f:
                return pq.ParquetFile(f).schema_arrow.names
        if fmt == "arrow":
            try:
                return pa.ipc.open_stream(fs.open_input_stream(path)).schema.names
            except pa.ArrowInvalid:
                return pa.ipc.open_file(fs.open_input_file(path)).schema.names
        if fmt in DELIMITERS:
            return list(data.column_names) or _header(fs, path, fmt) or []
        rows = next(iter_records(fs, path, fmt, [data.query_column, data.passage_column], data), [])
        return list(dict.fromkeys(key for row in rows if "__reason__" not in row for key in row))
    except (IngestError, *UNREADABLE):
        return []


def unused_negatives(names: list[str], data: DataConfig) -> str | None:
    """A note when data.negative_column is unset and the file has columns named as labeled hard negatives (BGE's
    `neg`, sentence-transformers' `negative`/`negative_1..`, DPR's `hard_negative_ctxs`): ingest reads no negatives
    then, and training draws none. None otherwise."""
    if data.negative_column:
        return None
    present = [name for name in names if name]
    taken = set(mapped_columns(data)) & set(present)
    lowered = {name.lower(): name for name in reversed(present)}
    found = _negatives_hint(present, taken) or next(
        (lowered[n] for n in NEGATIVE_NAMES if n in lowered and lowered[n] not in taken), None)
    if found is None:
        return None
    return (f"the input has {'columns' if ',' in found or '*' in found else 'a column'} {found!r} that look"
            f"{'' if ',' in found or '*' in found else 's'} like labeled hard negatives, but data.negative_column "
            f"is unset: they are not read, and training draws none. To train with them: --set "
            f"data.negative_column={shell_word(found)} train.labeled_negatives_per_query=1 (or more).")


def _header(fs: pafs.FileSystem, path: str, fmt: str) -> list[str] | None:
    """A CSV/TSV file's first line as cells (None for an empty file); a TSV's cells are never quoted."""
    with fs.open_input_stream(path, compression="detect") as stream:
        return next(csv.reader(io.TextIOWrapper(stream, encoding="utf-8-sig", errors="replace"),
                               delimiter=DELIMITERS[fmt],
                               quoting=csv.QUOTE_NONE if fmt == "tsv" else csv.QUOTE_MINIMAL), None)


def _arrow_records(fs: pafs.FileSystem, path: str, columns: list[str], data: DataConfig) -> Iterator[list[dict]]:
    """Arrow IPC: the stream format (what Hugging Face datasets write) or the file format (Feather v2)."""
    try:
        reader = pa.ipc.open_stream(fs.open_input_stream(path))
        batches = iter(reader)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(fs.open_input_file(path))
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    check_columns(reader.schema.names, path, data)
    columns = file_columns(columns, reader.schema.names, data)
    for batch in batches:
        for start in range(0, batch.num_rows, BATCH_ROWS):
            yield batch.slice(start, BATCH_ROWS).select(columns).to_pylist()


def _csv_records(fs: pafs.FileSystem, path: str, columns: list[str], data: DataConfig, delimiter: str = ",",
                 byte_range: tuple[int, int] | None = None) -> Iterator[list[dict]]:
    """CSV, or TSV with delimiter "\t": a TSV cell is never quoted (a tab or line break ends it, a quote is text, as in
    MS MARCO's files: with CSV's quoting one cell that starts with an unmatched quote would swallow the rows after
    it). Cells arrive as bytes (so invalid UTF-8 is a quarantined row, not a failed file); only
    the empty cell is null ("NA", "null", "NaN" are text); rows with the wrong number of cells are quarantined in
    their place, so every row keeps its number in the file (blank lines are not rows). Of a byte range (TSV): its
    lines, read with the header line's names; row numbers from the range's first row."""
    fmt = "tsv" if delimiter == "\t" else "csv"
    _refuse_binary(fs, path, fmt)
    named = list(data.column_names)  # a file without a header line: its columns by data.column_names
    header = named or _header(fs, path, fmt)
    if header is None:
        raise pa.ArrowInvalid(f"empty {fmt.upper()} file: no header line")
    separator = next((found for char, found in OTHER_SEPARATORS.items()
                      if not named and char != delimiter and len(header) == 1 and char in header[0]), None)
    try:
        check_columns(header, path, data)
    except IngestError as err:
        if separator is None and not named:  # a first line of data taken for the header
            raise IngestError(f"{err} If the file has no header line, name its columns in order with data.column_names "
                              f"(e.g. --set 'data.column_names=[query,positive,negative]').") from None
        if separator is None:
            raise
        name, readable = separator
        fix = (f"Set data.format={readable}" if readable and data.format != "auto" else
               f"Name it .{readable} (or set data.format={readable})" if readable else
               f"Save it {'with commas' if fmt == 'csv' else 'with tabs'} (or as JSON lines or Parquet)")
        raise IngestError(f"{path}: its header line {bounded_names(header)} is one column holding a {name}: the "
                          f"file is {name}-separated, and {fmt.upper()} input is read "
                          f"{'comma' if fmt == 'csv' else 'tab'}-separated. {fix}.") from None
    columns = file_columns(columns, header, data)
    ragged: collections.deque[tuple[int, dict]] = collections.deque()
    # A range past the file's first is read with the header's names (its first line is data, as without a header).
    names = named or (list(header) if byte_range and byte_range[0] > 0 else None)

    def on_ragged(row) -> str:
        # row.number counts records from 1 with the header line if any (serial parsing): the data row index is
        # number - 2, or number - 1 without a header line.
        reason = f"csv_cells:{row.actual_columns}_of_{row.expected_columns}"
        ragged.append((row.number - (1 if names else 2), {"__reason__": reason, "__raw__": row.text}))
        return "skip"

    stream = fs.open_input_stream(path, compression="detect") if byte_range is None else \
        open_range(fs, path, byte_range)
    if byte_range is not None and not stream.peek(1):
        return  # no line starts in the range (one crosses it whole): pyarrow calls an empty input a bad file
    reader = pacsv.open_csv(
        stream,
        read_options=pacsv.ReadOptions(use_threads=False, block_size=CSV_BLOCK_BYTES, column_names=names),
        parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char='"' if fmt == "csv" else False,
                                         invalid_row_handler=on_ragged),
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


def is_json_array(fs: pafs.FileSystem, path: str) -> bool:
    """Whether a (possibly compressed) JSON file is one array, not JSON lines: its first character (after a
    byte-order mark and blanks) is `[`, and its first line is not a whole value with more lines after it (a JSON
    line holding an array, however deep, is that row's fault). A file of one line starting with `[` is an array."""
    with fs.open_input_stream(path, compression="detect") as stream:
        chunks, size, head = [], 0, b""
        while size < FIRST_LINE_BYTES and (chunk := stream.read(1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
            if b"\n" in chunk:  # the first line ends here unless the file starts with blank lines
                head = b"".join(chunks).removeprefix(UTF8_BOM).lstrip()
                if b"\n" in head:
                    break
        head = head if b"\n" in head else b"".join(chunks).removeprefix(UTF8_BOM).lstrip()
        if head[:1] != b"[":
            return False
        first, newline, rest = head.partition(b"\n")
        if not newline or not brackets_balance(first.decode("utf-8", "replace")):
            return True
        while not rest.strip():
            if not (rest := stream.read(1 << 16)):
                return True  # nothing after the first line
        return False


def _jsonl_records(fs: pafs.FileSystem, path: str, columns: list[str], data: DataConfig,
                   byte_range: tuple[int, int] | None = None) -> Iterator[list[dict]]:
    """JSON lines, parsed line by line so one bad line is quarantined, not fatal. Lines end at "\\n" only (a raw
    carriage return inside a string is text, as in CSV); a UTF-8 byte-order mark before the first line is skipped.
    Of a byte range: its lines; the column mapping is checked in the file's first range only, as on a whole file
    (on its first batch of rows)."""
    first = byte_range is None or byte_range[0] == 0
    if byte_range is not None and first:  # the mapping checked as on the whole file (its first batch of objects)
        _check_jsonl_mapping(fs, path, columns, data)
    stream = fs.open_input_stream(path, compression="detect") if byte_range is None else \
        open_range(fs, path, byte_range)
    # surrogateescape keeps undecodable bytes recoverable, so such a line is quarantined with its bytes.
    text = io.TextIOWrapper(stream, encoding="utf-8-sig" if first else "utf-8", errors="surrogateescape",
                            newline="\n")
    return _checked_batches(jsonl_records(text, columns), path, data, check=byte_range is None)


def _check_jsonl_mapping(fs: pafs.FileSystem, path: str, columns: list[str], data: DataConfig) -> None:
    """The whole file's column check (_checked_batches) without its rows: read from the start until the first batch
    that holds an object has been checked (BATCH_ROWS lines, or more when the first hold no object)."""
    with fs.open_input_stream(path) as stream:
        text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="surrogateescape", newline="\n")
        for batch in _checked_batches(jsonl_records(text, columns), path, data):
            if any("__reason__" not in row for row in batch):
                return


def _json_array_records(fs: pafs.FileSystem, path: str, columns: list[str], data: DataConfig
                        ) -> Iterator[list[dict]]:
    """A file holding one JSON array of objects, read element by element (memory: one element)."""
    stream = fs.open_input_stream(path, compression="detect")
    return _checked_batches(json_array_records(io.TextIOWrapper(stream, encoding="utf-8-sig"), columns), path, data)


def _checked_batches(records: Iterator[dict], path: str, data: DataConfig, check: bool = True
                     ) -> Iterator[list[dict]]:
    """Row dicts in batches of BATCH_ROWS, the column mapping checked on the first batch that holds an object: a
    mapped key named twice in the file's first object is the file's shape, an error (in a later object, that row's
    fault); a mapped key that no object of that batch holds is a wrong mapping, an error (an object without it,
    among others with it, is that row's fault: quarantined, as a JSON file's objects need not share their keys)."""
    rows, first, keys = [], check, {}  # keys: of the checked batch's objects, in order of appearance
    for row in records:
        if first:
            if "__keys__" in row and not keys:
                check_columns(row["__keys__"], path, data)
            if "__reason__" not in row:
                keys.update(dict.fromkeys(row))
        row.pop("__keys__", None)
        rows.append(row)
        if len(rows) == BATCH_ROWS:
            if first and keys:
                check_columns(list(keys), path, data,
                              scope=f" in any of its first objects (a batch of {len(rows):,} rows)")
                first = False
            yield rows
            rows = []
    if first and keys:
        check_columns(list(keys), path, data, scope=" in any of its objects")
    if rows:
        yield rows


GLOB_CHARS = frozenset("*?[")


def mapped_columns(data: DataConfig) -> frozenset[str]:
    """The query, passage and source columns: never one of the negative columns a glob matches."""
    return frozenset(c for c in (data.query_column, data.passage_column, data.source_column) if c)


def negative_columns(spec: str | None, names: list[str], mapped: frozenset[str] = frozenset()) -> list[str]:
    """The columns data.negative_column names among a file's (or a JSON object's) `names`: the spec whole when a
    column has that very name (one holding a comma or a `*`); else comma-separated names and globs (`negative_*`: the
    matching names in natural order, negative_2 before negative_10, never a `mapped` column nor an internal `__` key),
    each once, in order. A literal name is kept whether or not it is there (check_columns names it if missing)."""
    if not spec:
        return []
    if spec in names:
        return [spec]
    out: dict[str, None] = {}
    for token in _spec_tokens(spec):
        if GLOB_CHARS & set(token):
            out.update(dict.fromkeys(sorted(_glob_matches(token, names, mapped), key=_natural)))
        else:
            out[token] = None
    return list(out)


def _spec_tokens(spec: str) -> list[str]:
    if spec.startswith("[") and spec.endswith("]") and "," in spec:  # --set 'data.negative_column=[a, b]': a list
        spec = spec[1:-1]
    return [t for t in (t.strip().strip("'\"") for t in spec.split(",")) if t]


def _glob_matches(pattern: str, names: list[str], mapped: frozenset[str]) -> list[str]:
    return [n for n in names if fnmatch.fnmatchcase(n, pattern) and n not in mapped and not n.startswith("__")]


def _natural(name: str) -> list:
    """Sort key: runs of digits compare as numbers (negative_2 < negative_10)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in _DIGITS.split(name) if part]


_DIGITS = re.compile(r"(\d+)")


def file_columns(columns: list[str], names: list[str], data: DataConfig) -> list[str]:
    """The columns to read from a file whose columns are `names`: `columns` (query, passage, source) and the
    negative columns data.negative_column names there."""
    found = negative_columns(data.negative_column, names, mapped_columns(data))
    return columns + [c for c in found if c not in columns]


def check_columns(found: list[str], path: str, data: DataConfig, scope: str = "") -> None:
    """The mapped columns are in the file, each once (a name twice would read one of them, silently); scope: where
    they were looked for, for the message (a JSON file's objects)."""
    wanted = {"data.query_column": data.query_column, "data.passage_column": data.passage_column}
    if data.source_column:
        wanted["data.source_column"] = data.source_column
    spec, patterns = data.negative_column, []
    if spec and (spec in found or [spec] == _spec_tokens(spec) and not GLOB_CHARS & set(spec)):
        wanted["data.negative_column"] = spec
    elif spec:
        patterns = [t for t in _spec_tokens(spec) if GLOB_CHARS & set(t)]
        wanted.update({f"data.negative_column[{t}]": t for t in _spec_tokens(spec) if t not in patterns})
        wanted.update({f"data.negative_column[{t}]": name for t in patterns  # a glob's columns are each read once too
                       for name in _glob_matches(t, found, mapped_columns(data))})
    repeated = {col: [i + 1 for i, name in enumerate(found) if name == col] for col in set(wanted.values())}
    repeated = {col: places for col, places in repeated.items() if len(places) > 1}
    if repeated:
        keys = list(dict.fromkeys(key for key, col in wanted.items() if col in repeated))
        raise IngestError(f"{path}: the column name(s) " + ", ".join(
            f"{col!r} (columns {', '.join(map(str, places))})" for col, places in sorted(repeated.items())) +
            f" appear more than once among the {len(found)} columns {bounded_names(found)}, so which one holds "
            f"the text is a guess. Rename the repeated columns in the file to unique names, or map "
            f"{'/'.join(keys)} to a column whose name appears once.")
    missing = [f"{key}={col!r}" for key, col in wanted.items() if col not in found]
    missing += [f"data.negative_column={spec!r} (its pattern {t!r} matches none besides the query, passage and source "
                f"columns)" for t in patterns if not _glob_matches(t, found, mapped_columns(data))]
    if missing:
        raise IngestError(f"{path}: column(s) {', '.join(missing)} not found{scope}. Columns found: "
                          f"{bounded_names(found)}. {mapping_hint(found, data)}")


# Column names of the pair layouts users bring, best first (sentence-transformers' anchor/positive/negative and
# query/positive/negative_1.., FlagEmbedding's query/pos/neg, DPR's question/positive_ctxs/hard_negative_ctxs,
# Tevatron's query/positive_passages/negative_passages, MS MARCO's triples, question/answer, sentence1/sentence2):
# the columns-not-found message proposes the mapping a file's own names fit.
QUERY_NAMES = ("query", "anchor", "question", "queries", "q", "sentence1", "text1", "prompt", "instruction")
PASSAGE_NAMES = ("passage", "positive", "pos", "positive_ctxs", "positive_passages", "document", "doc", "answer",
                 "context", "text", "sentence2", "text2", "response", "content", "p")
NEGATIVE_NAMES = ("negative", "neg", "negatives", "hard_negative", "hard_negatives", "hard_negative_ctxs",
                  "negative_passages", "negative_ctxs")
_NUMBERED_NEGATIVE = re.compile(r"^(neg|negative|hard_negative)_?\d+$", re.IGNORECASE)


def mapping_hint(found: list[str], data: DataConfig) -> str:
    """What to set: for each key whose column is missing (query, passage, a literal negative column), the column among
    `found` that fits the known layouts' names and no other key reads; data.negative_column too when unset and the
    file has negatives. A key no column fits is named; no fit at all gives a generic example."""
    present = [name for name in found if name]
    lowered = {name.lower(): name for name in reversed(present)}  # the first of names differing only in case
    literal_negatives = [t for t in _spec_tokens(data.negative_column or "") if not GLOB_CHARS & set(t)]
    taken = (set(mapped_columns(data)) | set(literal_negatives)) & set(present)

    def pick(names: tuple[str, ...]) -> str | None:
        return next((lowered[n] for n in names if n in lowered and lowered[n] not in taken), None)

    settings, unfit = {}, []
    wanted = [("data.query_column", data.query_column, QUERY_NAMES),
              ("data.passage_column", data.passage_column, PASSAGE_NAMES)]
    if data.negative_column and len(literal_negatives) == 1 and data.negative_column not in present:
        wanted.append(("data.negative_column", data.negative_column, NEGATIVE_NAMES))
    for key, column, names in wanted:
        if column in present:
            continue
        choice = pick(names)
        if choice is None:
            unfit.append(key)
            continue
        settings[key] = choice
        taken.add(choice)
    if settings and not unfit and not data.negative_column:
        negatives = _negatives_hint(present, taken) or pick(NEGATIVE_NAMES)
        if negatives:
            settings["data.negative_column"] = negatives
    if not settings:
        return ("Set the data.*_column keys to match (e.g. --set data.query_column=question "
                "data.passage_column=answer).")
    shown = " ".join(f"{key}={shell_word(value)}" for key, value in settings.items())
    if unfit:
        return (f"This file's names fit --set {shown}; no column's name says which is {' or '.join(unfit)}: set "
                f"{'it' if len(unfit) == 1 else 'them'} to one of the columns found.")
    negatives = (" (data.negative_column: its labeled negatives, optional)" if "data.negative_column" in settings
                 and not data.negative_column else "")
    return f"This file's names fit: --set {shown}{negatives}."


def _negatives_hint(present: list[str], taken: set[str]) -> str | None:
    """Numbered negative columns (negative_1 .. negative_n): a glob when it matches exactly them, else their names
    comma-separated (one: its name); None for none."""
    numbered = [name for name in present if _NUMBERED_NEGATIVE.match(name) and name not in taken]
    if len(numbered) < 2:
        return numbered[0] if numbered else None
    glob = re.match(r"^\D*", numbered[0]).group(0) + "*"
    if set(_glob_matches(glob, present, frozenset(taken))) == set(numbered):
        return glob
    return ",".join(numbered)


def shell_word(text: str) -> str:
    """text as one shell word (quoted when it holds anything but letters, digits and ._-,)."""
    return text if re.fullmatch(r"[\w.,-]+", text) else "'" + text.replace("'", "'\\''") + "'"


def bounded_names(names: list[str], most: int = 20) -> str:
    """The column names for a message: the first `most`, each cut to 60 characters."""
    shown = ", ".join(repr(n if len(n) <= 60 else n[:60] + "...") for n in names[:most])
    return shown + (f", ... ({len(names)} in all)" if len(names) > most else "")


def escaped(text: str) -> str:
    """`text` made writable without losing what it held: lone surrogates as \\uXXXX escapes (never the
    U+FFFD replacement character)."""
    return text if is_encodable(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")
