"""Ingest: read user pairs (Parquet/JSONL/JSON/CSV/Arrow, local or object store), validate, normalise, split.

One Ray task per work unit: a run of Parquet row groups of about data.rows_per_part rows (planned from the footers,
so one big Parquet file is read by many tasks), a byte range of an uncompressed JSON lines or TSV file bigger than
data.range_bytes (io/text_ranges: its rows numbered from a first pass of tasks that count each range's lines), or a
whole file of the other formats (CSV, compressed, JSON arrays, Arrow). Every input row ends in exactly one of
pairs/, heldout/ or quarantine/ (with a reason); a file that cannot be read stops ingest with its name, or is
skipped whole and listed in quarantine/bad_files.json (data.bad_files). pair_id = (file index << 40) | row index in
the file: stable, unique and independent of how the work is split. A passage column of lists (FlagEmbedding's `pos`)
gives one pair per text: the first keeps the row's pair_id, the others get extra_positive_id's.

data.limit: Parquet units get their exact row budget from the footers, byte ranges from their counts (counted in
file order only until the limit is covered), and all run at once. A unit of unknown size (a text or Arrow file) is
read speculatively alongside up to one task per CPU, each with the most rows it could be allowed; units that turn
out to lie past the limit are discarded, and the one that crosses it is re-read with its exact budget. Each unit
writes a marker (pairs/_units/) after its parts: a rerun of an interrupted attempt (same config, same input files)
keeps the units with a marker and runs the rest into the same names, and deletes what no kept unit wrote (a unit cut
short, a file read in byte ranges by one attempt and whole by the other), so the result is the same files. Run with
`clusterscale ingest [CONFIG] --run-dir R`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import posixpath
import time
import unicodedata
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from clusterscale.io.builtin_data import BUILTIN_DOCSTRINGS
from clusterscale.io.filesystems import filesystem_errors
from clusterscale.config import Config, DataConfig
from clusterscale.io.input_files import (ROW_BITS, UNREADABLE, IngestError, NotTextError, escaped, find_input_files,
                                         infer_format, input_column_names, is_encodable, iter_records,
                                         list_input_files, mapped_columns, negative_columns, refuse_run_dir_in_data,
                                         splittable, unused_negatives)
from clusterscale.io.input_identity import listing_digest, listing_table, record_inputs, refuse_changed_input_files
from clusterscale.redact import redact_uri
from clusterscale.io.rundir import RunDir, StageResult, changed_keys
from clusterscale.io.text_ranges import byte_ranges, count_rows
from clusterscale.runtime.progress import ProgressLine
from clusterscale.runtime.resources import ClusterResources
from clusterscale.runtime.stage_context import StageContext
from clusterscale.runtime.work_units import load_or_make_plan, split_done

PAIR_SCHEMA = pa.schema([("pair_id", pa.int64()), ("query", pa.string()), ("passage", pa.string()),
                         ("source", pa.string())])
QUARANTINE_SCHEMA = pa.schema([("pair_id", pa.int64()), ("reason", pa.string()), ("query", pa.string()),
                               ("passage", pa.string()), ("source", pa.string()), ("input_file", pa.string()),
                               ("input_row", pa.int64())])
NEGATIVES_COLUMN = "negatives"  # labeled hard negatives (data.negative_column): list<string>, maybe empty
BAD_FILES = "quarantine/bad_files.json"
PLAN = "pairs/_plan.json"  # the attempt's input listing digest and config fingerprint (a rerun finishes it)
UNITS_DIR = "pairs/_units"  # one marker per finished work unit: its counts and the parts it wrote
OUTPUTS = ("pairs", "heldout", "quarantine")
# A passage column of lists: at most this many texts (positives) per record, each a pair (extra_positive_id).
MAX_POSITIVES = 256
EXTRA_POSITIVE_BIT = 1 << (ROW_BITS - 1)  # in the pair_ids of a list's second and later texts only
QUARANTINE_WARN_SHARE = 0.05  # a run that quarantines this share of its rows or more says so at the end of ingest
DISTINCT_SAMPLE_ROWS = 10_000  # pairs read back to check that each text column varies (few_distinct_warnings)
FOOTER_READ_THREADS = 16  # Parquet footers read at once when planning units (object stores: latency-bound)
# C0/C1 control characters (NUL included) except tab, line feed and carriage return: they break tokenizers and
# terminals. Spaces in every format, raw or escaped (a JSON "\u0000" too: json_input reads raw ones alike).
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
    """(clean text, None) or (None, reason). NFC, control characters (_CONTROL) to spaces, stripped: the one rule of
    every format (docs/input.md)."""
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


WHOLE_FILE_WARN_BYTES = 2**30  # an input file this big that one task reads whole (not cut into units) is named

@dataclass(frozen=True)
class IngestUnit:
    """One task's share of the input: row groups of a Parquet file, a byte range of a JSON lines or TSV file, or a
    whole file (row_groups and byte_range None)."""

    file_index: int  # the file's place in sorted order: the high bits of its pair_ids
    path: str
    unit_index: int = 0  # the unit's place in its file
    row_start: int = 0  # index in the file of the unit's first row
    row_groups: tuple[int, ...] | None = None
    rows: int | None = None  # known from the Parquet footer or a byte range's count; None for a whole text file
    byte_range: tuple[int, int] | None = None  # [start, end) of a JSON lines or TSV file (io/text_ranges)


def plan_units(fs: pafs.FileSystem, files: list[str], data: DataConfig, sizes: dict[str, int] | None = None
               ) -> list[IngestUnit]:
    """The work units of every input file, in file order (footers read in threads); a byte range's row_start and
    rows are filled by count_ranges. sizes: the files' sizes as listed (else asked for when they matter)."""
    with ThreadPoolExecutor(FOOTER_READ_THREADS) as pool:
        per_file = pool.map(lambda item: file_units(fs, item[0], item[1], data, (sizes or {}).get(item[1])),
                            enumerate(files))
        return [unit for units in per_file for unit in units]


def file_units(fs: pafs.FileSystem, file_index: int, path: str, data: DataConfig, size: int | None = None
               ) -> list[IngestUnit]:
    """A Parquet file as runs of whole row groups of >= data.rows_per_part rows (the last may be smaller); an
    uncompressed JSON lines or TSV file bigger than data.range_bytes as byte ranges of about that size (their rows
    not yet counted); any other file, or one whose footer cannot be read (its task reports that), as one unit."""
    fmt = infer_format(path, data.format)
    if fmt != "parquet":
        if fmt not in ("jsonl", "tsv") or not data.range_bytes:
            return [IngestUnit(file_index, path)]
        try:
            size = fs.get_file_info(path).size if size is None else size
            if size <= data.range_bytes or not splittable(fs, path, fmt):
                return [IngestUnit(file_index, path)]
        except UNREADABLE:  # its task reports it
            return [IngestUnit(file_index, path)]
        return [IngestUnit(file_index, path, i, byte_range=r)
                for i, r in enumerate(byte_ranges(size, data.range_bytes))]
    try:
        with fs.open_input_file(path) as f:
            meta = pq.ParquetFile(f).metadata
    except UNREADABLE:
        return [IngestUnit(file_index, path)]
    units, groups, rows, start = [], [], 0, 0
    for g in range(meta.num_row_groups):
        groups.append(g)
        rows += meta.row_group(g).num_rows
        if rows >= data.rows_per_part or g == meta.num_row_groups - 1:
            units.append(IngestUnit(file_index, path, len(units), start, tuple(groups), rows))
            start, groups, rows = start + rows, [], 0
    return units or [IngestUnit(file_index, path, row_groups=(), rows=0)]


def count_ranges(fs: pafs.FileSystem, units: list[IngestUnit], data: DataConfig,
                 known: dict[str, int] | None = None) -> list[IngestUnit]:
    """The units with each byte range's rows counted (one Ray task per range; `known`: the rows of the ranges an
    interrupted attempt finished, by marker) and its row_start the rows of the file's ranges before it, so that rows
    keep their number in the file. A file a range of which cannot be read becomes one whole unit again: its ingest
    task reports it (data.bad_files). Under data.limit nothing is counted here: run_units counts the ranges in file
    order, a wave at a time, only as far as the limit needs them (RangeCounter)."""
    counter = RangeCounter(fs, data, known)
    todo = [u for u in units if counter.uncounted(u)]
    if todo:
        until = f", in file order until data.limit={data.limit:,} rows" if data.limit is not None else ""
        print(f"[ingest] counting the rows of {len({u.file_index for u in todo})} big JSON lines/TSV file(s) in "
              f"{'up to ' if until else ''}{len(todo)} byte ranges (data.range_bytes={data.range_bytes:,}{until})",
              flush=True)
    if data.limit is not None:
        return units
    counter.count(todo)
    return counter.apply(units, 0)[0]


class RangeCounter:
    """The rows of byte ranges, counted by Ray tasks (one per range) and kept by marker name; a range that cannot
    be read counts as None."""

    def __init__(self, fs: pafs.FileSystem, data: DataConfig, known: dict[str, int] | None = None):
        self.fs, self.data = fs, data
        self.counts: dict[str, int | None] = dict(known or {})
        self.progress: ProgressLine | None = None

    def uncounted(self, unit: IngestUnit) -> bool:
        return unit.byte_range is not None and unit.rows is None and unit_marker(unit) not in self.counts

    def count(self, ranges: list[IngestUnit], total: int | None = None) -> None:
        """Count `ranges` (of `total` ranges to count at most, for the progress line)."""
        task = ray.remote(num_cpus=1, max_retries=2)(_count_rows)
        refs = [task.remote(self.fs, u.path, u.byte_range, infer_format(u.path, self.data.format),
                            not self.data.column_names) for u in ranges]
        self.progress = self.progress or ProgressLine("ingest", total or len(refs), unit="byte ranges counted",
                                                      on_tty=True)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            self.progress.advance(len(done))
        self.counts.update(zip((unit_marker(u) for u in ranges), ray.get(refs)))

    def waves(self, units: list[IngestUnit], start: int, remaining: int, skip: set[int]) -> None:
        """Count the ranges from units[start] on, in waves (_next_wave), until the rows known from there cover
        `remaining` (data.limit: the rows still to read), a unit of unknown size comes, or no range is left."""
        total = sum(1 for u in units[start:] if self.uncounted(u) and u.file_index not in skip)
        while wave := _next_wave(units[start:], self.counts, remaining, ClusterResources.current().cpus, skip):
            self.count(wave, total)
        if self.progress is not None:  # counting stops short of its total once the limit is covered
            self.progress.close()
            self.progress = None

    def apply(self, units: list[IngestUnit], start: int) -> tuple[list[IngestUnit], int]:
        """(units with the counted ranges' rows and row_starts, the index to go on from): a file with a range that
        cannot be read becomes one whole unit at its first unit's place (the index to go on from when that is
        before `start`), numbered after its ranges."""
        starts, out, go_on = {}, [], start
        unreadable = {u.file_index for u in units if u.byte_range is not None
                      and self.counts.get(unit_marker(u), 0) is None}
        ranges = Counter(u.file_index for u in units if u.file_index in unreadable)
        for unit in units:
            if unit.file_index in unreadable:
                if unit.unit_index == 0:  # named after the file's last range: no output name of a range is reused
                    go_on = min(go_on, len(out))
                    out.append(IngestUnit(unit.file_index, unit.path, unit_index=ranges[unit.file_index]))
                continue
            if unit.byte_range is not None and unit_marker(unit) in self.counts:
                begin = starts.get(unit.file_index, 0)
                unit = replace(unit, row_start=begin, rows=self.counts[unit_marker(unit)])
                starts[unit.file_index] = begin + unit.rows
            out.append(unit)
        return out, go_on


def _next_wave(units: list[IngestUnit], counts: dict[str, int | None], limit: int, cpus: int,
               skip: set[int] = frozenset()) -> list[IngestUnit]:
    """The next byte ranges to count under data.limit (`limit`: rows still to read from units[0] on): uncounted
    ones in file order and none past the point where the rows known before a unit (Parquet footers, ranges counted)
    reach it, since ingest never reads beyond: one range first, then as many as the rows still missing need at the
    mean rows of the ranges counted so far (at most one per CPU). None past a unit of unknown size either (a whole
    file may hold the rest), nor of a file in `skip` (found unreadable: none of its rows count)."""
    seen = [n for n in counts.values() if n]
    wave, known, width = [], 0, 1
    for unit in units:
        if known >= limit or len(wave) == width:
            break
        if unit.file_index in skip:
            continue
        if unit.byte_range is None and unit.rows is None:
            break
        if unit.byte_range is not None:
            if (marker := unit_marker(unit)) not in counts:
                if not wave and seen:  # rows still missing / mean rows of a range, rounded up
                    width = min(cpus, max(1, -(-(limit - known) * len(seen) // sum(seen))))
                wave.append(unit)
            else:
                known += counts[marker] or 0
        elif unit.rows is not None:
            known += unit.rows
    return wave


def _count_rows(fs: pafs.FileSystem, path: str, byte_range: tuple[int, int], fmt: str, header: bool) -> int | None:
    """count_rows, or None when the file cannot be read."""
    try:
        return count_rows(fs, path, byte_range, fmt, header)
    except UNREADABLE:
        return None


def schemas(data: DataConfig) -> tuple[pa.Schema, pa.Schema]:
    """(pairs/ and heldout/ schema, quarantine/ schema): with data.negative_column, a `negatives` column each (the
    quarantine's holds the rejected value as text)."""
    if not data.negative_column:
        return PAIR_SCHEMA, QUARANTINE_SCHEMA
    return (PAIR_SCHEMA.append(pa.field(NEGATIVES_COLUMN, pa.list_(pa.string()))),
            QUARANTINE_SCHEMA.append(pa.field(NEGATIVES_COLUMN, pa.string())))


class _PartWriter:
    """Rows of one work unit buffered per output folder, written as fixed-size parts named by the
    unit's file and place in it: a rerun of the unit overwrites the same names, so nothing is duplicated."""

    def __init__(self, run: RunDir, unit: IngestUnit, rows_per_part: int,
                 schemas: tuple[pa.Schema, pa.Schema] = (PAIR_SCHEMA, QUARANTINE_SCHEMA)):
        self.run, self.unit, self.rows_per_part = run, unit, rows_per_part
        self.pair_schema, self.quarantine_schema = schemas
        self.buffers: dict[str, list[dict]] = {"pairs": [], "heldout": [], "quarantine": []}
        self.parts = dict.fromkeys(self.buffers, 0)

    def add(self, kind: str, row: dict) -> None:
        self.buffers[kind].append(row)

    def flush(self, final: bool = False) -> None:
        for kind, rows in self.buffers.items():
            while len(rows) >= self.rows_per_part or (final and rows):
                chunk, rows = rows[:self.rows_per_part], rows[self.rows_per_part:]
                schema = self.quarantine_schema if kind == "quarantine" else self.pair_schema
                self.run.write_parquet(self._name(kind, self.parts[kind]), pa.Table.from_pylist(chunk, schema=schema))
                self.parts[kind] += 1
            self.buffers[kind] = rows

    def written(self) -> list[str]:
        """The parts written so far (run-relative names)."""
        return [self._name(kind, part) for kind, written in self.parts.items() for part in range(written)]

    def discard(self) -> None:
        """Remove what this unit wrote so far: a file quarantined whole leaves no rows behind."""
        for name in self.written():
            self.run.remove(name)
        self.buffers = {kind: [] for kind in self.buffers}
        self.parts = dict.fromkeys(self.buffers, 0)

    def _name(self, kind: str, part: int) -> str:
        return f"{kind}/part-{self.unit.file_index:05d}-{self.unit.unit_index:05d}-{part:05d}.parquet"


def ingest_unit(run_uri: str, fs: pafs.FileSystem, unit: IngestUnit, data: DataConfig,
                row_budget: int | None = None) -> dict:
    """Process one work unit (its first row_budget rows, if given); write its pairs/heldout/quarantine
    parts. Returns its counts and the run-relative names of everything it wrote ("written").

    A file that cannot be read is an IngestError naming it (data.bad_files=error), or its unit writes
    nothing and reports the error under "bad_file" (data.bad_files=quarantine)."""
    run = RunDir(run_uri)
    fmt = infer_format(unit.path, data.format)
    writer = _PartWriter(run, unit, data.rows_per_part, schemas(data))
    try:
        counts = _route_unit(fs, unit, fmt, data, writer, row_budget)
    except UNREADABLE as err:
        found = str(err) if isinstance(err, NotTextError) else f"{type(err).__name__}: {err}"
        if data.bad_files == "error":
            raise IngestError(f"{unit.path}: cannot be read as {fmt} ({found}). Repair or remove the file, or set "
                              f"data.bad_files=quarantine to skip unreadable files (they are listed in "
                              f"{BAD_FILES}).") from None
        writer.discard()
        counts = {"rows_in": 0, "pairs": 0, "heldout": 0, "quarantine": 0, "reasons": {}, "bad_file": found}
    marker = unit_marker(unit)
    result = counts | {"written": writer.written() + [marker]}
    # Written last, after every part: a unit with its marker is complete, and a rerun takes its result from it.
    run.write_json(marker, {"path": unit.path, "row_start": unit.row_start, "budget": row_budget,
                            "byte_range": unit.byte_range, **result})
    return result


def unit_marker(unit: IngestUnit) -> str:
    return f"{UNITS_DIR}/{unit.file_index:05d}-{unit.unit_index:05d}.json"


def _route_unit(fs: pafs.FileSystem, unit: IngestUnit, fmt: str, data: DataConfig, writer: _PartWriter,
                row_budget: int | None) -> dict:
    """Send every record of one unit to pairs, heldout or quarantine; returns the counts."""
    # The negative columns data.negative_column names are added per file (input_files.file_columns: a glob's
    # matches, or a whole spec that is one column's name).
    columns = [data.query_column, data.passage_column] + ([data.source_column] if data.source_column else [])
    counts = {"rows_in": 0, "pairs": 0, "heldout": 0, "quarantine": 0, "reasons": {}}
    row_index = 0  # in the unit
    for records in iter_records(fs, unit.path, fmt, columns, data, unit.row_groups, unit.byte_range):
        if row_budget is not None:
            records = records[:max(0, row_budget - row_index)]
        if not records:
            break
        for row, rec in enumerate(records, start=unit.row_start + row_index):
            routed = _route_record(rec, (unit.file_index << ROW_BITS) | row, data)
            if len(routed) > 1:  # a list of passages: pairs beyond the record's one
                counts["extra_positives"] = counts.get("extra_positives", 0) + len(routed) - 1
            for kind, out in routed:
                if kind == "quarantine":
                    out.update(input_file=unit.path, input_row=row)
                    reason = out["reason"].split(":")[0]
                    counts["reasons"][reason] = counts["reasons"].get(reason, 0) + 1
                writer.add(kind, out)
                counts[kind] += 1
                if kind == "pairs" and data.negative_column:  # what training can draw (labeled_negatives_per_query)
                    given = len(out[NEGATIVES_COLUMN])
                    counts["labeled_negatives"] = counts.get("labeled_negatives", 0) + given
                    counts["without_labeled_negatives"] = counts.get("without_labeled_negatives", 0) + (given == 0)
        row_index += len(records)
        writer.flush()
    writer.flush(final=True)
    counts["rows_in"] = row_index
    return counts


def _route_record(rec: dict, pair_id: int, data: DataConfig) -> list[tuple[str, dict]]:
    """[(output folder, row)] of one input record: one row, or one pair per text of a list of passages (the first
    with the record's pair_id, the others with extra_positive_id's)."""
    reason = rec.get("__reason__")
    raw_q, raw_p = rec.get(data.query_column), rec.get(data.passage_column)
    raw_s = rec.get(data.source_column) if data.source_column else None
    source = _repr(raw_s)
    query, passages = None, []
    if reason is None:
        query, why_q = normalise_text(raw_q)
        passages, why_p = normalise_passages(raw_p)
        reason = f"query_{why_q}" if why_q else f"passage_{why_p}" if why_p else None
    if reason is None and len(query) > data.max_text_chars:
        reason = "over_long_query"
    if reason is None and max(map(len, passages)) > data.max_text_chars:
        reason = "over_long_passage"
    negatives, labeled = [], {}
    if data.negative_column:
        raw_n = labeled_value(rec, data)
        if reason is None:
            negatives, reason = normalise_negatives(raw_n, data.max_text_chars)
        labeled = {NEGATIVES_COLUMN: negatives} if reason is None else {NEGATIVES_COLUMN: _repr(raw_n)}
    if reason is not None:
        return [("quarantine", {"pair_id": pair_id, "reason": reason, "query": _repr(raw_q, rec),
                                "passage": _repr(raw_p), "source": source, **labeled})]
    kind = "heldout" if is_heldout(query, data.heldout_fraction) else "pairs"
    return [(kind, {"pair_id": pair_id if i == 0 else extra_positive_id(pair_id, i), "query": query,
                    "passage": passage, "source": source, **labeled}) for i, passage in enumerate(passages)]


def as_list(value) -> list | None:
    """A list value as a Python list (a JSON array, a NumPy or Arrow list read from Parquet); None for a text, a
    scalar or an object."""
    if isinstance(value, (str, bytes, dict)):
        return None
    if isinstance(value, (list, tuple)):
        return list(value)
    listed = value.tolist() if hasattr(value, "tolist") else None
    return listed if isinstance(listed, list) else None


def document_text(value):
    """A passage or labeled negative as read: an object with a "text" string (DPR's ctxs, a BEIR corpus record, a
    Parquet struct: {"title", "text", ...}) is its title and text joined by a space ("title text", as MTEB joins
    BEIR's; the text alone when the title is missing or empty); any other value as it is."""
    if not isinstance(value, dict) or not isinstance(value.get("text"), str):
        return value
    title = value.get("title")
    return f"{title} {value['text']}" if isinstance(title, str) and title.strip() else value["text"]


def normalise_texts(items: list, max_chars: int | None = None) -> tuple[list[str], str | None]:
    """(clean texts, None) or ([], reason) for a list of texts (or document_text objects): null elements and texts
    that normalise to nothing are skipped; the reason of the first element that is not text (normalise_text's), or
    `over_long` past max_chars."""
    texts = []
    for item in items:
        if item is None:
            continue
        text, why = normalise_text(document_text(item))
        if why == "empty":
            continue
        if why is not None:
            return [], why
        if max_chars is not None and len(text) > max_chars:
            return [], "over_long"
        texts.append(text)
    return texts, None


def normalise_passages(value) -> tuple[list[str], str | None]:
    """([clean texts], None) or ([], reason) for a record's passage: a text, or a list of texts (FlagEmbedding's
    `pos`), each a positive of the query (normalise_texts). A list left with no text is `empty`, more than
    MAX_POSITIVES texts `too_many_texts`."""
    items = as_list(value)
    if items is None:
        text, why = normalise_text(document_text(value))
        return ([text], None) if why is None else ([], why)
    texts, why = normalise_texts(items)
    if why is None and not texts:
        why = "empty"
    elif why is None and len(texts) > MAX_POSITIVES:
        why = "too_many_texts"
    return (texts, None) if why is None else ([], why)


def extra_positive_id(pair_id: int, i: int) -> int:
    """The pair_id of the i-th (i >= 1) text of a record's list of passages, the record's own pair_id being
    (file index << ROW_BITS) | row: (file index << ROW_BITS) | EXTRA_POSITIVE_BIT | row << 8 | (i - 1). The file
    index stays in the high bits and no row of a file reaches EXTRA_POSITIVE_BIT."""
    row = pair_id & ((1 << ROW_BITS) - 1)
    if row >= 1 << (ROW_BITS - 9):
        raise IngestError(f"Row {row} of an input file has a list of passages: pair_ids number such rows up to row "
                          f"{(1 << (ROW_BITS - 9)) - 1} of a file. Split the file.")
    return (pair_id - row) | EXTRA_POSITIVE_BIT | (row << 8) | (i - 1)


def labeled_value(rec: dict, data: DataConfig):
    """A record's labeled negatives as read: the value of data.negative_column's one column, or the values of the
    columns it names (comma-separated names and globs: input_files.negative_columns) as one list, a column's list
    spread into it and its null left out (None when every one is null or missing)."""
    spec = data.negative_column
    names = _negative_names(spec, tuple(rec), mapped_columns(data))
    if names == [spec]:
        return rec.get(spec)
    values, found = [], False
    for name in names:
        value = rec.get(name)
        if value is None:
            continue
        found = True
        items = as_list(value)
        values += items if items is not None else [value]
    return values if found else None


@functools.lru_cache(maxsize=256)
def _negative_names(spec: str, keys: tuple[str, ...], mapped: frozenset[str]) -> list[str]:
    return negative_columns(spec, list(keys), mapped)


def normalise_negatives(value, max_chars: int) -> tuple[list[str], str | None]:
    """(clean texts, None) or ([], reason) for a row's labeled negatives: a text or a list of texts (as_list);
    null, an empty list and texts that normalise to nothing are no negatives. A value of another type, or an element
    that is not text, quarantines the row (negative_not_string:<type>), as an element longer than
    data.max_text_chars does (over_long_negative)."""
    if value is None:
        return [], None
    items = [value] if isinstance(value, (str, bytes)) or document_text(value) is not value else as_list(value)
    if items is None:
        return [], f"negative_not_string:{type(value).__name__}"
    texts, why = normalise_texts(items, max_chars)
    if why == "over_long":
        return [], "over_long_negative"
    return (texts, None) if why is None else ([], f"negative_{why}")


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
    data = replace(cfg.data)  # a copy: the run's config is not changed
    if data.path == BUILTIN_DOCSTRINGS and data.source_column is None:
        data.source_column = "source"
    return data


def run_ingest(ctx: StageContext) -> StageResult:
    """Ingest every input file (one Ray task per work unit) into pairs/, heldout/ and quarantine/ (the executor
    marks all three done). An interrupted attempt with this config and these input files is finished: the units
    it finished are kept (resume_plan), the others run again into the same names."""
    cfg, run = ctx.cfg, ctx.run
    data = effective_data_config(cfg)
    refuse_run_dir_in_data(data, run.uri)
    with filesystem_errors(data.path):  # an unreachable store is named by data.path (redacted)
        listing = find_input_files(data)
    fs, files = listing.fs, listing.walk.files
    for f in files:
        infer_format(f, data.format)  # fail before any work on an unknown suffix
    started = time.time()
    units = plan_units(fs, files, data, {path: stamp[0] for path, stamp in listing.walk.stamps.items() if stamp})
    print(f"[ingest] {len(files)} input file(s) from {redact_uri(data.path)}, {len(units)} work unit(s)", flush=True)
    _print_skipped(listing.walk)
    _print_whole_files(listing.walk, data, units)
    if files and (note := unused_negatives(input_column_names(fs, files[0], data), data)):
        print(f"[ingest] note: {note}", flush=True)
    finished = resume_plan(ctx, listing_digest(listing_table(listing.walk)), units)
    # A finished range's rows, unless a data.limit budget may have cut it short.
    known = {name: marker["rows_in"] for name, marker in finished.items() if marker.get("byte_range")
             and (marker.get("budget") is None or marker["rows_in"] < marker["budget"]) and "bad_file" not in marker}
    units = count_ranges(fs, units, data, known)
    results = run_units(run, fs, units, data, finished, known)
    remove_strays(run, results)
    stats = _total(results)
    stats["links_skipped"] = listing.walk.links_skipped
    stats["run_dirs_skipped"] = [redact_uri(d) for d in listing.walk.run_dirs_skipped]
    stats["docs_skipped"] = len(listing.walk.docs_skipped)
    if data.path != BUILTIN_DOCSTRINGS:  # the bundled dataset is named by its package versions
        stats["inputs"] = record_inputs(run, "pairs", listing.walk)
    if stats["bad_files"]:
        run.write_json(BAD_FILES, stats["bad_files"])
    if stats["pairs"] == 0 and stats["heldout"]:
        raise IngestError(f"Every valid pair of {redact_uri(data.path)} was held out: {stats['heldout']} pairs of "
                          f"{stats['rows_in']} rows{more_pairs(stats)} went to heldout/ "
                          f"(data.heldout_fraction={data.heldout_fraction}), "
                          f"none are left to train on. Held-out pairs are chosen by a hash of the query: with few "
                          f"distinct queries every pair can fall on one side. Lower data.heldout_fraction (0 holds "
                          f"none out), or add pairs.")
    if stats["pairs"] == 0:
        raise IngestError(f"No valid pairs in {data.path}: {stats['rows_in']} rows read, "
                          f"{stats['quarantine']} quarantined ({stats['reasons']}), {len(stats['bad_files'])} "
                          f"unreadable file(s) skipped; see {run.path('quarantine')}.{first_rejected(run, data)}")
    stats["wall_s"] = round(time.time() - started, 3)
    stats["worker_s"] = stats["wall_s"]
    reasons = f" {stats['reasons']}" if stats["reasons"] else ""
    print(f"[ingest] rows in {stats['rows_in']}{more_pairs(stats)}: pairs {stats['pairs']}, held out "
          f"{stats['heldout']}, quarantined {stats['quarantine']}{reasons}", flush=True)
    if stats["bad_files"]:
        print(f"[ingest] {len(stats['bad_files'])} unreadable file(s) skipped (data.bad_files=quarantine), "
              f"listed with their errors in {run.path(BAD_FILES)}", flush=True)
    if stats["quarantine"] >= QUARANTINE_WARN_SHARE * stats["rows_in"]:
        print(f"[ingest] warning: {stats['quarantine']} of {stats['rows_in']} rows "
              f"({stats['quarantine'] / stats['rows_in']:.0%}) were quarantined ({stats['reasons']}): check the "
              f"data.*_column keys and the input; they are in {run.path('quarantine')}."
              f"{first_rejected(run, data)}", flush=True)
    stats["distinct_sample"] = distinct_sample(run)
    for line in few_distinct_warnings(stats["distinct_sample"], cfg.train.schedule.global_batch_size, data):
        print(line, flush=True)
    if not stats["heldout"] and data.heldout_fraction > 0:
        print(none_held_out(stats["distinct_sample"], data, stats["pairs"]), flush=True)
    return StageResult(stats, outputs={kind: StageResult({"rows": stats[kind]}) for kind in ("heldout", "quarantine")},
                       config={"data": data.to_dict()})


def none_held_out(sample: dict, data: DataConfig, pairs: int) -> str:
    """The warning of an ingest that was to hold pairs out and held none (few distinct queries, or a tiny fraction
    of them): evaluate will have nothing to score, and a `run` stops there, after training."""
    return (f"[ingest] warning: data.heldout_fraction={data.heldout_fraction} held out none of the {pairs:,} pairs: "
            f"held-out pairs are chosen by a hash of the query, and the first {sample['rows']:,} pairs hold "
            f"{sample['query']:,} distinct queries (~{data.heldout_fraction * sample['query']:.2g} expected held "
            f"out). evaluate will have nothing to score (a `run` stops there, after training). To evaluate, raise "
            f"data.heldout_fraction or bring more distinct queries; to train without an evaluation, set "
            f"data.heldout_fraction=0 (either in a new --run-dir, or with --replace).")


def first_rejected(run: RunDir, data: DataConfig, most: int = 200) -> str:
    """A sentence showing the first quarantined row (its reason and the rejected value, cut to `most` characters),
    for the error of an input with no valid pair: a text column that holds objects or numbers shows what it holds."""
    files = run.files("quarantine")
    if not files:
        return ""
    with run.fs.open_input_file(files[0]) as f:
        pf = pq.ParquetFile(f)
        names = [c for c in ("reason", "query", "passage", NEGATIVES_COLUMN) if c in pf.schema_arrow.names]
        row = next(iter(pf.iter_batches(batch_size=1, columns=names)), pa.table({"reason": []})).to_pylist()
    if not row:
        return ""
    row, keys = row[0], {"query": "query", "passage": "passage", "negative": NEGATIVES_COLUMN}
    side = next((side for side in keys if row["reason"].startswith((side, f"over_long_{side}"))), None)
    value = row.get(keys[side] if side else "query")  # a row that could not be read keeps its raw text as the query
    value = "null" if value is None else value if len(value) <= most else value[:most] + "..."
    where = f"data.{side}_column={getattr(data, f'{side}_column')!r} holds" if side else "the row reads"
    return f" The first: {row['reason']}, {where} {value}."


def more_pairs(stats: dict) -> str:
    """What the summary lines add to "rows in N" when records listed several passages: rows in + extra_positives =
    pairs + held out + quarantined."""
    extra = stats.get("extra_positives", 0)
    return f" (+{extra} pairs from the records' further passages)" if extra else ""


def distinct_sample(run: RunDir) -> dict:
    """Distinct query and passage texts among the first DISTINCT_SAMPLE_ROWS pairs of pairs/ (one bounded read)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    table = pads.dataset(run.files("pairs"), filesystem=run.fs, format="parquet").head(
        DISTINCT_SAMPLE_ROWS, columns=["query", "passage"])
    return {"rows": table.num_rows, **{side: len(pc.unique(table.column(side))) for side in ("query", "passage")}}


def few_distinct_warnings(sample: dict, global_batch: int, data: DataConfig) -> list[str]:
    """A warning per side whose texts barely vary in the sample: at most 1% of its rows distinct and fewer than a
    global batch (most often a column that is not the text: a label, a source, a constant). Training masks an
    in-batch negative that repeats the positive's text, so such a side leaves a batch with almost no negatives."""
    column = {"query": data.query_column, "passage": data.passage_column}
    return [f"[ingest] warning: the first {sample['rows']:,} pairs hold only {sample[side]:,} distinct {side} "
            f"text(s) (data.{side}_column={column[side]}): a global batch of {global_batch:,} pairs would then have "
            f"almost no in-batch negatives (training masks a candidate with the positive's passage text or the same "
            f"query as another positive). Check that data.{side}_column names the {side} text."
            for side in ("query", "passage")
            if sample["rows"] >= 2 and sample[side] <= max(1, sample["rows"] // 100) and sample[side] < global_batch]


def refuse_changed_inputs(ctx: StageContext, out: str) -> None:
    """The executor's check before `out` is reused: refused when an input file changed since (io/input_identity)."""
    refuse_changed_input_files(ctx.run, out, effective_data_config(ctx.cfg))


def _print_whole_files(walk, data: DataConfig, units: list[IngestUnit]) -> None:
    """Name the big input files one task reads whole (a CSV, compressed, JSON array or Arrow file is one work unit,
    and so is any file with data.range_bytes=0; Parquet files are split by row groups,
    uncompressed JSON lines and TSV by byte ranges), which then bound the stage's time whatever the cluster."""
    split = {u.path for u in units if u.byte_range is not None}
    big = [(path, size) for path in walk.files if path not in split and infer_format(path, data.format) != "parquet"
           and (size := (walk.stamps.get(path) or (None, None))[0] or 0) >= WHOLE_FILE_WARN_BYTES]
    if big:
        shown = ", ".join(f"{redact_uri(path)} ({size / 2**30:.1f} GiB)" for path, size in big[:5])
        print(f"[ingest] {len(big)} big file(s) each read whole by one task (CSV, compressed, JSON array and Arrow "
              f"files are; Parquet is split by row groups, uncompressed JSON lines and TSV by byte ranges of "
              f"data.range_bytes): {shown}{' ...' if len(big) > 5 else ''}. Split them into files of ~256 MB, or "
              f"write Parquet or uncompressed JSON lines, for a parallel ingest.", flush=True)


def _print_skipped(walk) -> None:
    if walk.links_skipped:
        print(f"[ingest] {walk.links_skipped} folder(s) or file(s) reached again under another name (a symlink "
              f"loop, or a link to something already listed) skipped: each file is read once", flush=True)
    if walk.run_dirs_skipped:
        print(f"[ingest] {len(walk.run_dirs_skipped)} clusterscale run directory(ies) inside data.path skipped "
              f"(their files are a run's outputs, not input pairs): "
              f"{', '.join(redact_uri(d) for d in walk.run_dirs_skipped)}", flush=True)
    if walk.docs_skipped:
        print(f"[ingest] {len(walk.docs_skipped)} documentation or config file(s) beside the data skipped: "
              f"{', '.join(redact_uri(d) for d in walk.docs_skipped[:10])}"
              + (" ..." if len(walk.docs_skipped) > 10 else ""), flush=True)


def resume_plan(ctx: StageContext, digest: str, units: list[IngestUnit]) -> dict[str, dict]:
    """The markers of the units an interrupted attempt finished ({marker path: its JSON}), read after ONE listing
    of UNITS_DIR; {} for a fresh attempt, which clears pairs/, heldout/ and quarantine/ first. An attempt made from
    input files that have changed since (another listing digest), or with another config (the usual fix after a
    failed first attempt: a column name), is started over: its rows are no rows of this ingest."""
    run = ctx.run
    if run.exists(PLAN):
        before = run.read_json(PLAN)
        if before.get("inputs") != digest:
            print("[ingest] the input files changed since the interrupted attempt: it is started over", flush=True)
            run.remove(PLAN)
        elif before.get("fingerprint") != ctx.fingerprint:
            print(f"[ingest] the interrupted attempt was made with another config (changed: "
                  f"{changed_keys(before.get('covers'), getattr(ctx.fingerprint, 'values', None))}): it is started "
                  f"over", flush=True)
            run.remove(PLAN)
        elif before.get("units", len(units)) != len(units):  # an older version cut the files otherwise
            print("[ingest] the interrupted attempt cut the input into other work units: it is started over",
                  flush=True)
            run.remove(PLAN)
    fresh = not run.exists(PLAN)
    load_or_make_plan(run, "pairs", PLAN, ctx.fingerprint, "ingest", lambda: {"inputs": digest, "units": len(units)})
    if fresh:
        for folder in OUTPUTS[1:]:
            run.clear(folder)
        return {}
    for folder in OUTPUTS:  # the temp files of writes a kill cut short
        split_done(run, folder, [])
    names = set(run.listdir(UNITS_DIR)) if run.exists(UNITS_DIR) else set()
    # and the whole unit a file cut into ranges falls back to when a range cannot be counted (RangeCounter.apply)
    ranges = Counter((u.file_index, u.path) for u in units if u.byte_range is not None)
    fallbacks = [IngestUnit(file_index, path, unit_index=n) for (file_index, path), n in ranges.items()]
    wanted = [unit_marker(u) for u in units + fallbacks if posixpath.basename(unit_marker(u)) in names]
    with ThreadPoolExecutor(FOOTER_READ_THREADS) as pool:
        finished = dict(zip(wanted, pool.map(run.read_json, wanted)))
    if finished:
        kept = sum(unit_marker(u) in finished for u in units)
        print(f"[ingest] resuming: {kept} of {len(units)} work units were finished by an earlier attempt", flush=True)
    return finished


def run_units(run: RunDir, fs: pafs.FileSystem, units: list[IngestUnit], data: DataConfig,
              finished: dict[str, dict] | None = None, known: dict[str, int] | None = None
              ) -> list[tuple[IngestUnit, dict]]:
    """Every unit through a Ray task, in rounds under data.limit (see the module docstring); the accepted
    (unit, counts) in unit order. finished: the markers of units an interrupted attempt finished (resume_plan):
    their results are taken as recorded, with the budget they ran with, and no task runs for them. Under data.limit
    the byte ranges not yet counted are counted here, a wave at a time when the rounds reach them (known: the
    counts the markers give), so that a file found unreadable gives its rows back to the files after it."""
    task = ray.remote(num_cpus=1, max_retries=2)(ingest_unit)
    width, finished = ClusterResources.current().cpus, finished or {}

    def rerun(unit: IngestUnit, budget: int) -> dict:
        return ray.get(task.remote(run.uri, fs, unit, data, budget))

    accepted, start = _Accepted(run, data.limit), 0
    counter = RangeCounter(fs, data, known)
    # At most one line every 10 s, on a terminal too (plain tasks: no Ray Data bars); not one per unit (an input of
    # thousands of files printed thousands of lines).
    progress = ProgressLine("ingest", len(units), unit="work units", on_tty=True)
    while start < len(units) and not accepted.full():
        if units[start].file_index in accepted.bad_files:  # the rest of a file found unreadable: nothing to read
            start += 1
            progress.advance(1)
            continue
        if units[start].byte_range is not None and units[start].rows is None:  # data.limit: the next ranges' rows
            counter.waves(units, start, accepted.remaining(), accepted.bad_files)
            units, go_on = counter.apply(units, start)
            if go_on < start:  # the file found unreadable part-way is one whole unit again, read from its start
                accepted.undo(units[go_on].file_index)
            start = go_on
            continue
        batch = speculative_batch(units[start:], accepted.remaining(), width)
        recorded = [_finished(finished, unit) for unit, _ in batch]
        refs = {i: task.remote(run.uri, fs, unit, data, budget)
                for i, ((unit, budget), found) in enumerate(zip(batch, recorded)) if found is None}
        progress.advance(len(batch) - len(refs))
        pending = list(refs.values())
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            progress.advance(len(done))
        results = dict(zip(refs, ray.get(list(refs.values()))))
        for i, ((unit, budget), found) in enumerate(zip(batch, recorded)):
            if found is None:
                accepted.add(unit, budget, results[i], rerun)
            else:
                accepted.add(unit, found["budget"], {k: v for k, v in found.items() if k not in _MARKER_ONLY},
                             rerun)
        start += len(batch)
    return accepted.results


def remove_strays(run: RunDir, results: list[tuple[IngestUnit, dict]]) -> None:
    """Delete the parts and markers no accepted unit wrote: a unit a kill cut short, or one of the other shape a
    file had in an earlier attempt (read in byte ranges there and whole here, or the reverse). One listing a folder;
    markers first, so that a kill part-way leaves no marker whose parts are gone."""
    written = {name for _, result in results for name in result["written"]}
    for folder in (UNITS_DIR, *OUTPUTS):
        for name in run.listdir(folder):
            if (name.startswith("part-") or folder == UNITS_DIR) and f"{folder}/{name}" not in written:
                run.remove(f"{folder}/{name}")


_MARKER_ONLY = ("path", "row_start", "budget", "byte_range")  # what a unit's marker holds beside its result


def _finished(finished: dict[str, dict], unit: IngestUnit) -> dict | None:
    """The marker of `unit` an earlier attempt left, if it is of this very unit: a file that one attempt read in byte
    ranges and another whole (a range it could not count) gives its first range and its whole unit one name."""
    found = finished.get(unit_marker(unit))
    same = found is not None and found.get("row_start") == unit.row_start and \
        tuple(found.get("byte_range") or ()) == tuple(unit.byte_range or ())
    return found if same else None


def speculative_batch(units: list[IngestUnit], remaining: int | None, width: int
                      ) -> list[tuple[IngestUnit, int | None]]:
    """The next units to run at once, each with the most rows it may read: every unit when there is no
    limit; else units until the rows they surely read reach `remaining`, at most `width` of unknown size."""
    if remaining is None:
        return [(unit, None) for unit in units]
    batch, surely_before, unknown = [], 0, 0
    for unit in units:
        if surely_before >= remaining or unknown == width or unit.byte_range is not None and unit.rows is None:
            break  # (a byte range not counted yet: run_units counts it first)
        batch.append((unit, remaining - surely_before))
        if unit.rows is None:
            unknown += 1
        else:
            surely_before += unit.rows
    return batch


class _Accepted:
    """The unit results kept so far, in unit order, and how many rows of data.limit they used.

    A result is kept when it read exactly the rows its unit is allowed given the units before it;
    otherwise its output is deleted and the unit re-run with that exact budget (or dropped when the
    limit is already reached). A file quarantined whole (data.bad_files) drops every unit of it."""

    def __init__(self, run: RunDir, limit: int | None):
        self.run, self.limit = run, limit
        self.results: list[tuple[IngestUnit, dict]] = []
        self.rows_in = 0
        self.bad_files: set[int] = set()

    def remaining(self) -> int | None:
        return None if self.limit is None else self.limit - self.rows_in

    def full(self) -> bool:
        return self.limit is not None and self.rows_in >= self.limit

    def add(self, unit: IngestUnit, given: int | None, result: dict, rerun) -> None:
        """Keep, redo or drop one unit's result; `given` is the budget it ran with."""
        if unit.file_index in self.bad_files:
            self._discard(result)
        elif "bad_file" in result:
            self._drop_file(unit.file_index)
            self.results.append((unit, result))
        elif self._exact(given, result["rows_in"]):
            self.results.append((unit, result))
            self.rows_in += result["rows_in"]
        else:
            self._discard(result)
            if self.remaining() > 0:
                self.add(unit, self.remaining(), rerun(unit, self.remaining()), rerun)

    def _exact(self, given: int | None, rows_in: int) -> bool:
        """Whether a unit that ran with budget `given` and read `rows_in` rows read what it is allowed."""
        allowed = self.remaining()
        if allowed is None:
            return True
        cut_short = given is not None and given < allowed and rows_in >= given  # it may hold more rows
        return rows_in <= allowed and not cut_short

    def undo(self, file_index: int) -> None:
        """Forget a file's units (deleting their output): it is read again, whole."""
        self.bad_files.discard(file_index)
        for unit, result in [item for item in self.results if item[0].file_index == file_index]:
            self._discard(result)
            self.rows_in -= result["rows_in"]
        self.results = [item for item in self.results if item[0].file_index != file_index]

    def _drop_file(self, file_index: int) -> None:
        self.undo(file_index)
        self.bad_files.add(file_index)

    def _discard(self, result: dict) -> None:
        for name in reversed(result["written"]):  # its marker first: a kill part-way leaves no finished unit
            self.run.remove(name)


def _total(results: list[tuple[IngestUnit, dict]]) -> dict:
    """The stage stats: the per-unit counts summed, and the files skipped as unreadable with their errors."""
    stats = {"input_files": len({unit.file_index for unit, _ in results}), "rows_in": 0, "pairs": 0,
             "heldout": 0, "quarantine": 0, "reasons": {}, "bad_files": []}
    for unit, r in results:
        for key in ("rows_in", "pairs", "heldout", "quarantine"):
            stats[key] += r[key]
        for key in ("labeled_negatives", "without_labeled_negatives", "extra_positives"):  # when there are any
            if key in r:
                stats[key] = stats.get(key, 0) + r[key]
        for reason, n in r["reasons"].items():
            stats["reasons"][reason] = stats["reasons"].get(reason, 0) + n
        if "bad_file" in r:
            stats["bad_files"].append({"path": unit.path, "error": r["bad_file"]})
    return stats
