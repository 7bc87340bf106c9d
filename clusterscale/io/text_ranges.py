"""Byte ranges of a big JSON lines or TSV file, each read by its own ingest task (Hadoop's text splits).

A range [start, end) holds the lines whose first byte lies in it, a line being what ends at "\\n" (as the JSON lines
reader splits them): a line that crosses `end` belongs to this range, and the next range skips it, so concatenating
the ranges of a file gives the file. A TSV row may also end at a lone "\\r" (pyarrow's CSV reader splits there too):
such rows stay inside the "\\n"-line that holds them, so a file of "\\r"-ended rows is in effect one range. Rows keep
their number in the whole file (pair_id = file << 40 | row): a first pass counts each range's rows in tasks
(newlines, at memory speed), and a range's first row is the sum of the counts before it. Only files ingest reads line
by line are cut: uncompressed JSON lines and TSV. CSV (a quoted cell may hold line breaks), compressed files and
JSON arrays are read whole.
"""
from __future__ import annotations

import io
import math

import numpy as np
import pyarrow as pa


CHUNK_BYTES = 1 << 23  # read per request (an object store's latency is paid per request); memory per task
PROBE_BYTES = 1 << 16  # read first when looking for a range's first line start (doubled while no newline)
_TERMINATORS = np.frombuffer(b"\n\r", np.uint8)
UTF8_BOM = b"\xef\xbb\xbf"


def byte_ranges(size: int, range_bytes: int) -> list[tuple[int, int]]:
    """A file of `size` bytes cut into ranges of about `range_bytes` (equal ones; one range when it is no bigger,
    or when range_bytes is 0)."""
    n = 1 if range_bytes <= 0 else max(1, math.ceil(size / range_bytes))
    return [(size * i // n, size * (i + 1) // n) for i in range(n)]


class LineRange(io.RawIOBase):
    """The bytes of the lines that start in [start, end) of a random-access file: from the first line start at or
    after `start` to the first one at or after `end` (the line crossing `end` read to its "\\n")."""

    def __init__(self, raw: pa.NativeFile, start: int, end: int, size: int):
        super().__init__()
        self.raw, self.end, self.size = raw, end, size
        self.probe = PROBE_BYTES  # the next read past `end` (the crossing line's tail is often short)
        self.pos = start if start == 0 else self._after_newline(start - 1, end)
        self.finished = self.pos >= end  # a line crossing the whole range belongs to an earlier one

    def _after_newline(self, pos: int, limit: int) -> int:
        """The position after the first "\\n" in [pos, limit) (`limit` when there is none: no line starts there)."""
        probe = PROBE_BYTES
        while pos < limit:
            chunk = self.raw.read_at(min(probe, limit - pos), pos)
            found = chunk.find(b"\n")
            if found >= 0:
                return pos + found + 1
            pos, probe = pos + len(chunk), min(2 * probe, CHUNK_BYTES)
        return limit

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()

    def readinto(self, buffer) -> int:
        if self.finished or self.pos >= self.size:
            return 0
        want = len(buffer)
        if self.pos < self.end:  # inside the range: up to its end
            data = self.raw.read_at(min(want, self.end - self.pos), self.pos)
        else:  # past it: the crossing line, to its newline, in reads that grow from PROBE_BYTES
            data = self.raw.read_at(min(want, self.probe, self.size - self.pos), self.pos)
            self.probe = min(2 * self.probe, CHUNK_BYTES)
            found = data.find(b"\n")
            if found >= 0:
                data, self.finished = data[:found + 1], True
        if self.pos + len(data) == self.end and data.endswith(b"\n"):
            self.finished = True  # the range ends where a line does
        n = len(data)
        buffer[:n] = data
        self.pos += n
        return n


def open_range(fs, path: str, byte_range: tuple[int, int]) -> io.BufferedReader:
    """A buffered stream of the lines of `path` that start in `byte_range`."""
    raw = fs.open_input_file(path)
    return io.BufferedReader(LineRange(raw, byte_range[0], byte_range[1], raw.size()), CHUNK_BYTES)


def count_rows(fs, path: str, byte_range: tuple[int, int], fmt: str, header: bool) -> int:
    """The rows ingest reads from one range: JSON lines count every line (a blank one is a quarantined row); TSV
    counts the lines that are not empty, split at "\\n", "\\r\\n" or a lone "\\r" as pyarrow's CSV reader splits
    them (it skips empty lines), less the header line in the file's first range when `header`."""
    rows, last, previous = 0, b"\n", True  # previous: the byte before is a terminator (a range starts a line)
    with open_range(fs, path, byte_range) as stream:
        first = byte_range[0] == 0
        while chunk := stream.read(CHUNK_BYTES):
            if first and fmt == "tsv":  # pyarrow drops a byte-order mark: "BOM\n" is an empty line, no row
                chunk, first = chunk.removeprefix(UTF8_BOM), False
                if not chunk:
                    continue
            if fmt == "jsonl":
                rows += chunk.count(b"\n")
            else:
                ends = np.isin(np.frombuffer(chunk, np.uint8), _TERMINATORS)
                starts = ~ends
                starts[1:] &= ends[:-1]
                starts[0] &= previous
                rows += int(starts.sum())
                previous = bool(ends[-1])
            last = chunk[-1:]
    if fmt == "jsonl":
        rows += last != b"\n"  # a last line without its newline
    return rows - (1 if fmt == "tsv" and header and byte_range[0] == 0 and rows else 0)
