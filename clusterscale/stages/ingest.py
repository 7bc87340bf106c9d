"""Ingest: read user pairs (Parquet/JSONL/JSON/CSV/Arrow, local or object store), validate, normalise, split.

One Ray task per input file. Every input row ends in exactly one of pairs/, heldout/ or
quarantine/ (with a reason); a file that cannot be read stops ingest with its name, or is skipped
whole and listed in quarantine/bad_files.json (data.bad_files). pair_id = (file index << 40) | row
index in the file: stable, unique and independent of how the work is split. Run with `clusterscale ingest [CONFIG] --run-dir R`.
"""
from __future__ import annotations

import hashlib
import json
import time
import unicodedata
from dataclasses import asdict

import pyarrow as pa
import pyarrow.fs as pafs
import ray

from clusterscale.io.builtin_data import BUILTIN_DOCSTRINGS
from clusterscale.config import Config, DataConfig
from clusterscale.io.input_files import (ROW_BITS, UNREADABLE, IngestError, escaped, infer_format, is_encodable,
                                      iter_records, list_input_files)
from clusterscale.redact import redact_uri
from clusterscale.io.rundir import RunDir, StageResult

PAIR_SCHEMA = pa.schema([("pair_id", pa.int64()), ("query", pa.string()), ("passage", pa.string()),
                         ("source", pa.string())])
QUARANTINE_SCHEMA = pa.schema([("pair_id", pa.int64()), ("reason", pa.string()), ("query", pa.string()),
                               ("passage", pa.string()), ("source", pa.string()), ("input_file", pa.string()),
                               ("input_row", pa.int64())])
BAD_FILES = "quarantine/bad_files.json"
# C0/C1 control characters except tab and newline; they break tokenizers and terminals.
_CONTROL = {c: " " for c in list(range(0, 9)) + [11, 12] + list(range(14, 32)) + list(range(127, 160))}


def heldout_key(query: str) -> str:
    """What the held-out split hashes: the normalised query, case-folded, runs of spaces as one."""
    return " ".join(query.casefold().split())


def is_heldout(query: str, fraction: float) -> bool:
    """Whether a pair with this (normalised) query is held out. Every pair of one query falls on one
    side, so no held-out query is trained on, and a training pair identical to a held-out pair (same
    query and passage) cannot exist: it would have the same query. Per row, so it scales out."""
    digest = hashlib.blake2b(heldout_key(query).encode(), digest_size=8, person=b"heldout").digest()
    return int.from_bytes(digest, "little") / float(1 << 64) < fraction


def normalise_text(value) -> tuple[str | None, str | None]:
    """(clean text, None) or (None, reason). NFC, control characters to spaces, stripped."""
    if value is None:
        return None, "null"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, "invalid_utf8"
    if not isinstance(value, str):
        return None, f"not_string:{type(value).__name__}"
    if not is_encodable(value):
        return None, "lone_surrogate"
    text = unicodedata.normalize("NFC", value.translate(_CONTROL)).strip()
    if not text:
        return None, "empty"
    return text, None


class _PartWriter:
    """Rows of one input file buffered per output folder, written as fixed-size parts named by the
    file's index: a rerun of the file overwrites the same names, so nothing is duplicated."""

    def __init__(self, run: RunDir, file_index: int, rows_per_part: int):
        self.run, self.file_index, self.rows_per_part = run, file_index, rows_per_part
        self.buffers: dict[str, list[dict]] = {"pairs": [], "heldout": [], "quarantine": []}
        self.parts = dict.fromkeys(self.buffers, 0)

    def add(self, kind: str, row: dict) -> None:
        self.buffers[kind].append(row)

    def flush(self, final: bool = False) -> None:
        for kind, rows in self.buffers.items():
            while len(rows) >= self.rows_per_part or (final and rows):
                chunk, rows = rows[:self.rows_per_part], rows[self.rows_per_part:]
                schema = QUARANTINE_SCHEMA if kind == "quarantine" else PAIR_SCHEMA
                self.run.write_parquet(self._name(kind, self.parts[kind]), pa.Table.from_pylist(chunk, schema=schema))
                self.parts[kind] += 1
            self.buffers[kind] = rows

    def discard(self) -> None:
        """Remove what this file wrote so far: a file quarantined whole leaves no rows behind."""
        for kind, written in self.parts.items():
            for part in range(written):
                self.run.fs.delete_file(self.run.path(self._name(kind, part)))
        self.buffers = {kind: [] for kind in self.buffers}
        self.parts = dict.fromkeys(self.buffers, 0)

    def _name(self, kind: str, part: int) -> str:
        return f"{kind}/part-{self.file_index:05d}-{part:05d}.parquet"


def ingest_file(run_uri: str, file_index: int, fs: pafs.FileSystem, path: str, data_dict: dict,
                row_budget: int | None) -> dict:
    """Process one input file; write its pairs/heldout/quarantine parts. Returns its counts.

    A file that cannot be read is an IngestError naming it (data.bad_files=error), or is skipped
    whole and reported under "bad_file" (data.bad_files=quarantine)."""
    data = DataConfig(**data_dict)
    run = RunDir(run_uri)
    fmt = infer_format(path, data.format)
    writer = _PartWriter(run, file_index, data.rows_per_part)
    try:
        counts = _route_file(fs, path, fmt, file_index, data, writer, row_budget)
    except UNREADABLE as err:
        found = f"{type(err).__name__}: {err}"
        if data.bad_files == "error":
            raise IngestError(f"{path}: cannot be read as {fmt} ({found}). Repair or remove the file, or set "
                              f"data.bad_files=quarantine to skip unreadable files (they are listed in "
                              f"{BAD_FILES}).") from None
        writer.discard()
        counts = {"rows_in": 0, "pairs": 0, "heldout": 0, "quarantine": 0, "reasons": {}, "bad_file": found}
    run.write_json(f"pairs/_units/{file_index:05d}.json", {"path": path, **counts})
    return counts


def _route_file(fs: pafs.FileSystem, path: str, fmt: str, file_index: int, data: DataConfig,
                writer: _PartWriter, row_budget: int | None) -> dict:
    """Send every record of one file to pairs, heldout or quarantine; returns the counts."""
    columns = [data.query_column, data.passage_column] + ([data.source_column] if data.source_column else [])
    counts = {"rows_in": 0, "pairs": 0, "heldout": 0, "quarantine": 0, "reasons": {}}
    row_index = 0
    for records in iter_records(fs, path, fmt, columns, data):
        if row_budget is not None:
            records = records[:max(0, row_budget - row_index)]
        if not records:
            break
        for row, rec in enumerate(records, start=row_index):
            kind, out = _route_record(rec, (file_index << ROW_BITS) | row, data)
            if kind == "quarantine":
                out.update(input_file=path, input_row=row)
                reason = out["reason"].split(":")[0]
                counts["reasons"][reason] = counts["reasons"].get(reason, 0) + 1
            writer.add(kind, out)
            counts[kind] += 1
        row_index += len(records)
        writer.flush()
    writer.flush(final=True)
    counts["rows_in"] = row_index
    return counts


def _route_record(rec: dict, pair_id: int, data: DataConfig) -> tuple[str, dict]:
    """(output folder, row) of one input record."""
    reason = rec.get("__reason__")
    raw_q, raw_p = rec.get(data.query_column), rec.get(data.passage_column)
    raw_s = rec.get(data.source_column) if data.source_column else None
    source = _repr(raw_s)
    query = passage = None
    if reason is None:
        query, why_q = normalise_text(raw_q)
        passage, why_p = normalise_text(raw_p)
        reason = f"query_{why_q}" if why_q else f"passage_{why_p}" if why_p else None
    if reason is None and max(len(query), len(passage)) > data.max_text_chars:
        reason = "over_long_query" if len(query) > data.max_text_chars else "over_long_passage"
    if reason is not None:
        return "quarantine", {"pair_id": pair_id, "reason": reason, "query": _repr(raw_q, rec),
                              "passage": _repr(raw_p), "source": source}
    kind = "heldout" if is_heldout(query, data.heldout_fraction) else "pairs"
    return kind, {"pair_id": pair_id, "query": query, "passage": passage, "source": source}


def _repr(value, rec: dict | None = None) -> str | None:
    """The rejected value kept as writable text (JSON for non-strings, escapes for bad bytes), so nothing is lost."""
    if value is None:
        return escaped(rec["__raw__"]) if rec is not None and "__raw__" in rec else None
    if isinstance(value, str):
        return escaped(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="backslashreplace")
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


def run_ingest(cfg: Config, run: RunDir) -> StageResult:
    """Ingest every input file (one Ray task each) into pairs/, heldout/ and quarantine/ (cleared by the
    executor, which marks all three done)."""
    data = effective_data_config(cfg)
    fs, files = list_input_files(data)
    for f in files:
        infer_format(f, data.format)  # fail before any work on an unknown suffix
    started = time.time()
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
    stats = _total(results, files)
    if stats["bad_files"]:
        run.write_json(BAD_FILES, stats["bad_files"])
    if stats["pairs"] == 0:
        raise IngestError(f"No valid pairs in {data.path}: {stats['rows_in']} rows read, "
                          f"{stats['quarantine']} quarantined ({stats['reasons']}), {len(stats['bad_files'])} "
                          f"unreadable file(s) skipped; see {run.path('quarantine')}.")
    stats["wall_s"] = round(time.time() - started, 3)
    stats["worker_s"] = stats["wall_s"]
    print(f"[ingest] rows in {stats['rows_in']}: pairs {stats['pairs']}, held out {stats['heldout']}, "
          f"quarantined {stats['quarantine']}" + (f" {stats['reasons']}" if stats["reasons"] else ""), flush=True)
    if stats["bad_files"]:
        print(f"[ingest] {len(stats['bad_files'])} unreadable file(s) skipped (data.bad_files=quarantine), "
              f"listed with their errors in {run.path(BAD_FILES)}", flush=True)
    return StageResult(stats, outputs={kind: StageResult({"rows": stats[kind]}) for kind in ("heldout", "quarantine")},
                       config={"data": asdict(data)})


def _total(results: list[dict], files: list[str]) -> dict:
    """The stage stats: the per-file counts summed, and the files skipped as unreadable with their errors."""
    stats = {"input_files": len(results), "rows_in": 0, "pairs": 0, "heldout": 0, "quarantine": 0, "reasons": {},
             "bad_files": []}
    for path, r in zip(files, results):
        for key in ("rows_in", "pairs", "heldout", "quarantine"):
            stats[key] += r[key]
        for reason, n in r["reasons"].items():
            stats["reasons"][reason] = stats["reasons"].get(reason, 0) + n
        if "bad_file" in r:
            stats["bad_files"].append({"path": path, "error": r["bad_file"]})
    return stats
