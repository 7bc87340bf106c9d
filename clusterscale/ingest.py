"""Ingest: read user pairs (Parquet/JSONL/CSV, local or object store), validate, normalise, split.

One Ray task per input file. Every input row ends in exactly one of pairs/, heldout/ or
quarantine/ (with a reason). pair_id = (file index << 40) | row index in the file: stable, unique
and independent of how the work is split. Run with `clusterscale ingest [CONFIG] --run-dir R`.
"""
from __future__ import annotations

import fnmatch
import io
import json
import posixpath
import time
import unicodedata
from dataclasses import asdict

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from clusterscale.builtin_data import BUILTIN_DOCSTRINGS, builtin_docstrings_path
from clusterscale.config import Config, DataConfig
from clusterscale.errors import UserError
from clusterscale.redact import redact_uri
from clusterscale.rundir import RunDir, resolve_filesystem

ROW_BITS = 40  # up to 2**40 rows per file, 2**23 files
SUFFIX_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
                  ".json": "jsonl", ".csv": "csv", ".jsonl.gz": "jsonl", ".csv.gz": "csv"}
PAIR_SCHEMA = pa.schema([("pair_id", pa.int64()), ("query", pa.string()), ("passage", pa.string()),
                         ("source", pa.string())])
QUARANTINE_SCHEMA = pa.schema([("pair_id", pa.int64()), ("reason", pa.string()), ("query", pa.string()),
                               ("passage", pa.string()), ("source", pa.string()), ("input_file", pa.string()),
                               ("input_row", pa.int64())])
# C0/C1 control characters except tab and newline; they break tokenizers and terminals.
_CONTROL = {c: " " for c in list(range(0, 9)) + [11, 12] + list(range(14, 32)) + list(range(127, 160))}


class IngestError(UserError, ValueError):
    """The input cannot be read as pairs; the message says what was found and what to do."""


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed 64-bit mix of int64 ids: the stable hash behind the held-out split and fit samples."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_unit(pair_ids: np.ndarray, salt: int = 0) -> np.ndarray:
    """A uniform number in [0, 1) per pair_id, fixed for a given salt."""
    mixed = splitmix64(np.asarray(pair_ids, dtype=np.int64) ^ np.int64(salt))
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def is_heldout(pair_ids: np.ndarray, fraction: float) -> np.ndarray:
    return hash_unit(pair_ids, salt=0x5EED) < fraction


def normalise_text(value) -> tuple[str | None, str | None]:
    """(clean text, None) or (None, reason). NFC, control characters to spaces, stripped."""
    if value is None:
        return None, "null"
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if not isinstance(value, str):
        return None, f"not_string:{type(value).__name__}"
    text = unicodedata.normalize("NFC", value.translate(_CONTROL)).strip()
    if not text:
        return None, "empty"
    return text, None


def infer_format(path: str, declared: str) -> str:
    if declared != "auto":
        return declared
    lower = path.lower()
    for suffix in sorted(SUFFIX_FORMATS, key=len, reverse=True):
        if lower.endswith(suffix):
            return SUFFIX_FORMATS[suffix]
    raise IngestError(f"Cannot infer the format of {path!r} from its suffix; set data.format to "
                      f"parquet, jsonl or csv.")


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
        files = [i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, pattern)]
    else:
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            raise IngestError(f"data.path {path!r} does not exist.")
        if info.type == pafs.FileType.File:
            files = [base]
        else:
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
            files = [i.path for i in infos if i.type == pafs.FileType.File
                     and not posixpath.basename(i.path).startswith((".", "_"))
                     and any(i.path.lower().endswith(s) for s in SUFFIX_FORMATS)]
    if not files:
        raise IngestError(f"No input files found at data.path {path!r} (looked for "
                          f"{', '.join(sorted(set(SUFFIX_FORMATS)))}).")
    if len(files) >= 1 << (63 - ROW_BITS):
        raise IngestError(f"{len(files)} input files is more than pair_ids can number; merge them.")
    return fs, sorted(files)


def _iter_records(fs: pafs.FileSystem, path: str, fmt: str, columns: list[str], data: DataConfig):
    """Yield lists of row dicts (only the wanted columns) from one file, streaming."""
    if fmt == "parquet":
        pf = pq.ParquetFile(fs.open_input_file(path))
        _check_columns(pf.schema_arrow.names, path, data)
        for batch in pf.iter_batches(batch_size=16_384, columns=columns):
            yield batch.to_pylist()
    elif fmt == "csv":
        stream = fs.open_input_stream(path, compression="detect")
        reader = pacsv.open_csv(stream, convert_options=pacsv.ConvertOptions(
            column_types={c: pa.string() for c in columns}, strings_can_be_null=True))
        _check_columns(reader.schema.names, path, data)
        for batch in reader:
            yield batch.select(columns).to_pylist()
    else:  # jsonl: parsed line by line so one bad line is quarantined, not fatal
        stream = fs.open_input_stream(path, compression="detect")
        text = io.TextIOWrapper(stream, encoding="utf-8", errors="replace")
        rows, checked = [], False
        for line in text:
            line = line.strip()
            if not line:
                rows.append({"__reason__": "blank_line"})
            else:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    obj = {"__reason__": "invalid_json", "__raw__": line[:1000]}
                if not isinstance(obj, dict):
                    obj = {"__reason__": "not_an_object", "__raw__": line[:1000]}
                elif not checked and "__reason__" not in obj:
                    _check_columns(list(obj), path, data)
                    checked = True
                rows.append(obj)
            if len(rows) == 16_384:
                yield rows
                rows = []
        if rows:
            yield rows


def _check_columns(found: list[str], path: str, data: DataConfig) -> None:
    wanted = {"data.query_column": data.query_column, "data.passage_column": data.passage_column}
    if data.source_column:
        wanted["data.source_column"] = data.source_column
    missing = [f"{key}={col!r}" for key, col in wanted.items() if col not in found]
    if missing:
        raise IngestError(f"{path}: column(s) {', '.join(missing)} not found. Columns found: "
                          f"{', '.join(map(repr, found))}. Set the data.*_column keys to match "
                          f"(e.g. --set data.query_column=question data.passage_column=answer).")


def ingest_file(run_uri: str, file_index: int, fs: pafs.FileSystem, path: str, data_dict: dict,
                row_budget: int | None) -> dict:
    """Process one input file; write its pairs/heldout/quarantine parts. Returns its counts."""
    data = DataConfig(**data_dict)
    run = RunDir(run_uri)
    fmt = infer_format(path, data.format)
    columns = [data.query_column, data.passage_column] + ([data.source_column] if data.source_column else [])
    buffers = {"pairs": [], "heldout": [], "quarantine": []}
    parts = {"pairs": 0, "heldout": 0, "quarantine": 0}
    counts = {"rows_in": 0, "pairs": 0, "heldout": 0, "quarantine": 0, "reasons": {}}

    def flush(kind: str, final: bool = False) -> None:
        rows = buffers[kind]
        while len(rows) >= data.rows_per_part or (final and rows):
            chunk, rows = rows[:data.rows_per_part], rows[data.rows_per_part:]
            schema = QUARANTINE_SCHEMA if kind == "quarantine" else PAIR_SCHEMA
            sink = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(chunk, schema=schema), sink)
            run.write_bytes(f"{kind}/part-{file_index:05d}-{parts[kind]:05d}.parquet", sink.getvalue())
            parts[kind] += 1
        buffers[kind] = rows

    row_index = 0
    for records in _iter_records(fs, path, fmt, columns, data):
        if row_budget is not None:
            records = records[:max(0, row_budget - row_index)]
        if not records:
            break
        ids = (np.int64(file_index) << np.int64(ROW_BITS)) + np.arange(row_index, row_index + len(records),
                                                                       dtype=np.int64)
        held = is_heldout(ids, data.heldout_fraction)
        for pid, heldout, rec in zip(ids.tolist(), held.tolist(), records):
            reason = rec.get("__reason__")
            raw_q, raw_p = rec.get(data.query_column), rec.get(data.passage_column)
            raw_s = rec.get(data.source_column) if data.source_column else None
            query = passage = None
            if reason is None:
                query, why_q = normalise_text(raw_q)
                passage, why_p = normalise_text(raw_p)
                reason = (f"query_{why_q}" if why_q else f"passage_{why_p}" if why_p else None)
            if reason is None and max(len(query), len(passage)) > data.max_text_chars:
                reason = "over_long_query" if len(query) > data.max_text_chars else "over_long_passage"
            source = None if raw_s is None else str(raw_s)
            if reason is not None:
                buffers["quarantine"].append({
                    "pair_id": pid, "reason": reason, "query": _repr(raw_q, rec), "passage": _repr(raw_p),
                    "source": source, "input_file": path, "input_row": pid & ((1 << ROW_BITS) - 1)})
                counts["reasons"][reason.split(":")[0]] = counts["reasons"].get(reason.split(":")[0], 0) + 1
                kind = "quarantine"
            else:
                kind = "heldout" if heldout else "pairs"
                buffers[kind].append({"pair_id": pid, "query": query, "passage": passage, "source": source})
            counts[kind] += 1
        row_index += len(records)
        for kind in buffers:
            flush(kind)
    for kind in buffers:
        flush(kind, final=True)
    counts["rows_in"] = row_index
    run.write_json(f"pairs/_units/{file_index:05d}.json", {"path": path, **counts})
    return counts


def _repr(value, rec: dict | None = None) -> str | None:
    """The rejected value kept as text (JSON for non-strings), so nothing is lost."""
    if value is None and rec is not None and "__raw__" in rec:
        return rec["__raw__"]
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def effective_data_config(cfg: Config) -> DataConfig:
    """The bundled dataset carries its package name as the source column."""
    data = DataConfig(**asdict(cfg.data))
    if data.path == BUILTIN_DOCSTRINGS and data.source_column is None:
        data.source_column = "source"
    return data


def run_ingest(cfg: Config, run: RunDir) -> dict:
    """Ingest every input file (one Ray task each); idempotent per file. Returns the stage stats."""
    fingerprint = cfg.fingerprint(("data",))
    if run.is_done("pairs", fingerprint):
        return run.done_stats("pairs")
    data = effective_data_config(cfg)
    fs, files = list_input_files(data)
    for f in files:
        infer_format(f, data.format)  # fail before any work on an unknown suffix
    started = time.time()
    for kind in ("pairs", "heldout", "quarantine"):  # partial output of an interrupted attempt
        run.begin(kind)
    task = ray.remote(num_cpus=1, max_retries=2)(ingest_file)
    print(f"[ingest] {len(files)} input file(s) from {redact_uri(data.path)}", flush=True)
    results: list[dict] = []
    if data.limit is not None:  # row budget flows in file order, so files are done one by one
        remaining = data.limit
        for i, f in enumerate(files):
            if remaining <= 0:
                break
            results.append(ray.get(task.remote(run.uri, i, fs, f, asdict(data), remaining)))
            remaining -= results[-1]["rows_in"]
    else:
        refs = [task.remote(run.uri, i, fs, f, asdict(data), None) for i, f in enumerate(files)]
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=1)
            print(f"[ingest] files done: {len(files) - len(pending)}/{len(files)}", flush=True)
        results = ray.get(refs)
    stats = {"input_files": len(results), "rows_in": 0, "pairs": 0, "heldout": 0, "quarantine": 0, "reasons": {}}
    for r in results:
        for key in ("rows_in", "pairs", "heldout", "quarantine"):
            stats[key] += r[key]
        for reason, n in r["reasons"].items():
            stats["reasons"][reason] = stats["reasons"].get(reason, 0) + n
    if stats["pairs"] == 0:
        raise IngestError(f"No valid pairs in {data.path}: {stats['rows_in']} rows read, "
                          f"{stats['quarantine']} quarantined ({stats['reasons']}); see {run.path('quarantine')}.")
    stats["wall_s"] = round(time.time() - started, 3)
    stats["worker_s"] = stats["wall_s"]
    for kind in ("heldout", "quarantine"):
        run.mark_done(kind, fingerprint, {"rows": stats[kind]})
    run.mark_done("pairs", fingerprint, stats, {"data": asdict(data)})
    print(f"[ingest] rows in {stats['rows_in']}: pairs {stats['pairs']}, held out {stats['heldout']}, "
          f"quarantined {stats['quarantine']} {stats['reasons'] or ''}", flush=True)
    return stats
