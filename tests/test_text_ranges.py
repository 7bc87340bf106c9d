"""Byte ranges of big JSON lines and TSV files (io/text_ranges): each line read once, rows numbered as in the whole
file, and ingest's output the same as one task reading the file whole."""
from __future__ import annotations

import json
import random

import pyarrow.fs as pafs
import pytest

from clusterscale import config
from clusterscale.io.rundir import RunDir
from clusterscale.io.text_ranges import byte_ranges, count_rows, open_range
from clusterscale.pipeline import run_stage
from tests.test_ingest import _kinds_by_id, _table

def _lines(stream) -> bytes:
    with stream:
        return stream.read()


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(6))
def test_ranges_hold_each_line_once_and_count_its_rows(tmp_path, seed):
    rng = random.Random(seed)
    pieces = [b"", b"\n", b"\r\n", b"\r", b"x", b"\xc3\xa9", b"\t", b"long " * 40]
    data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 300)))
    path = tmp_path / "f.txt"
    path.write_bytes(data)
    fs = pafs.LocalFileSystem()
    for n in (1, 2, 3, 7, 50):
        ranges = byte_ranges(len(data), max(1, len(data) // n)) if data else [(0, 0)]
        parts = [_lines(open_range(fs, str(path), r)) for r in ranges]
        assert b"".join(parts) == data, (n, ranges)
        offset = 0
        for (start, end), part in zip(ranges, parts):  # a part is the lines whose first byte is in its range
            assert not part or (start <= offset < end and (offset == 0 or data[offset - 1:offset] == b"\n"))
            offset += len(part)
        whole_lines = data.count(b"\n") + (bool(data) and not data.endswith(b"\n"))
        assert sum(count_rows(fs, str(path), r, "jsonl", False) for r in ranges) == whole_lines
        # TSV: the records pyarrow's reader makes (non-empty lines, split at \n, \r\n or \r)
        records = sum(1 for line in data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n") if line)
        assert sum(count_rows(fs, str(path), r, "tsv", False) for r in ranges) == records


@pytest.mark.unit
def test_a_range_with_no_newline_reads_nothing_past_its_end(tmp_path):
    """A file of "\\r"-ended rows (no "\\n"): the first range holds it all, the others read only their own bytes."""
    path = tmp_path / "cr.tsv"
    path.write_bytes(b"q\tp\r" + b"".join(b"query %d\tpassage %d\r" % (i, i) for i in range(2000)))
    fs, size = pafs.LocalFileSystem(), path.stat().st_size
    read = []

    class Counting:
        def __init__(self, raw):
            self.raw = raw

        def read_at(self, n, pos):
            read.append(n)
            return self.raw.read_at(n, pos)

        def close(self):
            self.raw.close()

    from clusterscale.io.text_ranges import LineRange
    ranges = byte_ranges(size, size // 8)
    for r in ranges[1:]:
        with LineRange(Counting(fs.open_input_file(str(path))), *r, size) as stream:
            assert stream.read() == b""
    assert sum(read) <= size  # each range probed its own bytes only
    assert [count_rows(fs, str(path), r, "tsv", True) for r in ranges] == [2000] + [0] * 7


@pytest.mark.unit
def test_under_a_limit_ranges_are_counted_in_waves_and_never_past_it():
    from clusterscale.stages.ingest import IngestUnit, _next_wave, unit_marker

    units = [IngestUnit(0, "a.parquet", 0, 0, (0,), 100)]  # a Parquet unit of 100 rows, then a big JSONL file
    units += [IngestUnit(1, "b.jsonl", i, byte_range=(i * 10, i * 10 + 10)) for i in range(20)]
    units += [IngestUnit(2, "c.csv")]  # a whole file: rows unknown
    counts: dict = {}
    waves = []
    while wave := _next_wave(units, counts, 1000, 4):
        waves.append([u.unit_index for u in wave])
        counts.update({unit_marker(u): 50 for u in wave})
    # one range first; then (1000 - 100 - 50) / 50 = 17 ranges are missing: 4 (one per CPU) at a time
    assert waves == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17]]
    assert 100 + 50 * sum(map(len, waves)) == 1000  # the ranges past the limit (18, 19) are never counted
    counts = {unit_marker(units[1]): None}  # an unreadable range counts as no rows
    assert _next_wave(units, counts, 300, 4) == [units[2]]  # and nothing seen to size a wave by
    assert _next_wave(units, {}, 100, 4) == []  # the Parquet unit's 100 rows cover the limit: no range is read
    assert _next_wave(units, {}, 1000, 4, skip={1}) == []  # a file found unreadable: its ranges are not counted
    d = [IngestUnit(3, "d.jsonl", i, byte_range=(i * 10, i * 10 + 10)) for i in range(2)]
    seen = {unit_marker(units[1]): 50}  # a range counted elsewhere: waves of up to 4
    assert _next_wave([*d[:1], units[-1], *d[1:]], seen, 1000, 4) == d[:1]  # none past a file of unknown size
    assert _next_wave(d, seen, 1000, 4) == d


@pytest.mark.unit
def test_what_is_not_split(tmp_path):
    from clusterscale.io.input_files import splittable

    fs = pafs.LocalFileSystem()
    for name, fmt in (("a.jsonl.gz", "jsonl"), ("a.jsonl.lz4", "jsonl"), ("a.csv", "csv"), ("a.tsv.zst", "tsv")):
        (tmp_path / name).write_bytes(b"x")
        assert not splittable(fs, str(tmp_path / name), fmt), name
    (tmp_path / "array.json").write_text('[{"q": "a", "p": "b"},\n{"q": "c", "p": "d"}]\n')
    (tmp_path / "lines.json").write_text('{"q": "a", "p": "b"}\n{"q": "c", "p": "d"}\n')
    assert not splittable(fs, str(tmp_path / "array.json"), "jsonl")
    assert splittable(fs, str(tmp_path / "lines.json"), "jsonl") and splittable(fs, str(tmp_path / "lines.json"), "tsv")


@pytest.mark.unit
def test_byte_ranges():
    assert byte_ranges(10, 0) == [(0, 10)] and byte_ranges(10, 10) == [(0, 10)]
    assert byte_ranges(10, 4) == [(0, 3), (3, 6), (6, 10)]


def _ingest(tmp_path, name, path, *extra):
    cfg = config.load(None, [f"data.path={path}", "data.query_column=q", "data.passage_column=p",
                             "data.heldout_fraction=0.2", *extra])
    run = RunDir(str(tmp_path / name))
    return run, run_stage("ingest", cfg, run).stats


def _quarantined(run):
    return sorted((r["pair_id"], r["reason"], r["input_row"], r["query"])
                  for r in _table(run, "quarantine").to_pylist())


def test_a_jsonl_file_read_in_byte_ranges_gives_the_whole_file_ingest(tmp_path, ray_local, capsys):
    rng = random.Random(0)
    lines = []
    for i in range(400):
        roll = rng.random()
        if roll < 0.03:
            lines.append("")  # a blank line is a (quarantined) row
        elif roll < 0.06:
            lines.append("{not json")
        else:
            q = f"query {i} " + "é" * rng.randint(0, 30) + "\r" * (i % 50 == 0)  # multi-byte text, a raw CR
            lines.append(json.dumps({"q": q, "p": f"passage {i} " + "long " * rng.randint(0, 60)},
                                    ensure_ascii=False))
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode())  # a byte-order mark, CRLF, no final newline
    whole, whole_stats = _ingest(tmp_path, "whole", path)
    size = path.stat().st_size
    capsys.readouterr()
    split, stats = _ingest(tmp_path, "split", path, f"data.range_bytes={size // 13}")
    said = capsys.readouterr().out
    assert "1 input file(s)" in said and "13 work unit(s)" in said and "in 13 byte ranges" in said, said
    assert {k: stats[k] for k in ("rows_in", "pairs", "heldout", "quarantine", "reasons")} == \
        {k: whole_stats[k] for k in ("rows_in", "pairs", "heldout", "quarantine", "reasons")}
    assert stats["rows_in"] == 400 and stats["reasons"]["blank_line"] > 0
    assert _kinds_by_id(split) == _kinds_by_id(whole) and _quarantined(split) == _quarantined(whole)
    for kind in ("pairs", "heldout"):
        assert sorted(_table(split, kind).to_pylist(), key=lambda r: r["pair_id"]) == \
            sorted(_table(whole, kind).to_pylist(), key=lambda r: r["pair_id"])
    # Killed after its parts and before the markers of two ranges: a rerun reads those two ranges only, same rows.
    import os

    from clusterscale.stages.ingest import UNITS_DIR
    for kind in ("pairs", "heldout", "quarantine"):
        os.remove(split.path(f"{kind}/_DONE.json"))
    for name in sorted(split.listdir(UNITS_DIR))[5:7]:
        os.remove(split.path(f"{UNITS_DIR}/{name}"))
    capsys.readouterr()
    _, again = _ingest(tmp_path, "split", path, f"data.range_bytes={size // 13}")
    said = capsys.readouterr().out
    assert "resuming: 11 of 13 work units" in said and "in 2 byte ranges" in said  # only those two counted
    assert again["rows_in"] == 400 and _kinds_by_id(split) == _kinds_by_id(whole)
    # data.limit: ranges counted in file order only until the limit is covered; those past it are never read
    capsys.readouterr()
    limited, stats = _ingest(tmp_path, "limited", path, f"data.range_bytes={size // 13}", "data.limit=150")
    said = capsys.readouterr().out
    assert "in up to 13 byte ranges" in said and "until data.limit=150 rows" in said, said
    markers = limited.listdir(UNITS_DIR)
    assert 150 // 31 <= len(markers) < 13, markers  # ~31 rows a range: the ranges that hold the first 150 rows
    whole_limited, whole_stats = _ingest(tmp_path, "whole_limited", path, "data.limit=150")
    assert stats["rows_in"] == whole_stats["rows_in"] == 150
    assert _kinds_by_id(limited) == _kinds_by_id(whole_limited) and _quarantined(limited) == _quarantined(whole_limited)
    # killed before its last marker (the range the limit cut short): the rerun counts that range again, same rows
    for kind in ("pairs", "heldout", "quarantine"):
        os.remove(limited.path(f"{kind}/_DONE.json"))
    os.remove(limited.path(f"{UNITS_DIR}/{sorted(markers)[-1]}"))
    _, again = _ingest(tmp_path, "limited", path, f"data.range_bytes={size // 13}", "data.limit=150")
    assert again["rows_in"] == 150 and _kinds_by_id(limited) == _kinds_by_id(whole_limited)


def test_a_tsv_file_read_in_byte_ranges_gives_the_whole_file_ingest(tmp_path, ray_local):
    rows = ["q\tp"]
    for i in range(300):
        rows.append(f"query {i}\tpassage {i} {'x' * (i % 37)}" if i % 23 else f"ragged {i}")  # wrong cell count
        if i % 41 == 0:
            rows.append("")  # blank lines are not rows
    path = tmp_path / "big.tsv"
    path.write_text("\r\n".join(rows) + "\r\n")
    size = path.stat().st_size
    whole, whole_stats = _ingest(tmp_path, "whole", path)
    split, stats = _ingest(tmp_path, "split", path, f"data.range_bytes={size // 9}")
    assert stats["rows_in"] == whole_stats["rows_in"] == 300 and stats["quarantine"] == whole_stats["quarantine"] > 0
    assert _kinds_by_id(split) == _kinds_by_id(whole) and _quarantined(split) == _quarantined(whole)
    # a file without a header line, its columns named; a byte-order mark on a blank first line (no row)
    path.write_bytes(b"\xef\xbb\xbf\n" + ("\n".join(rows[1:]) + "\n").encode())
    named = ["data.column_names=[q,p]"]
    whole, whole_stats = _ingest(tmp_path, "whole_named", path, *named)
    split, stats = _ingest(tmp_path, "split_named", path, *named, f"data.range_bytes={size // 9}")
    assert stats["rows_in"] == whole_stats["rows_in"] == 300
    assert _kinds_by_id(split) == _kinds_by_id(whole) and _quarantined(split) == _quarantined(whole)


def test_the_jsonl_column_check_is_the_whole_files(tmp_path, ray_local):
    """The mapping is checked on the file's first batch of objects, however the file is cut: the first range's
    objects lacking a key that later objects of that batch hold is those rows' fault, not a wrong mapping."""
    lines = [json.dumps({"q": f"query {i}", "passage": f"p {i}"}) for i in range(20)]
    lines += [json.dumps({"q": f"query {i}", "p": f"passage {i} " + "x" * 50}) for i in range(20, 200)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    whole, whole_stats = _ingest(tmp_path, "whole", path)
    split, stats = _ingest(tmp_path, "split", path, f"data.range_bytes={path.stat().st_size // 10}")
    assert stats["quarantine"] == whole_stats["quarantine"] == 20 and _kinds_by_id(split) == _kinds_by_id(whole)
    # a mapping no object has: the same error, from the first range's task
    from clusterscale.stages.ingest import IngestError
    with pytest.raises(IngestError, match="data.passage_column='body' not found"):
        _ingest(tmp_path, "wrong", path, f"data.range_bytes={path.stat().st_size // 10}", "data.passage_column=body")


def test_under_a_limit_a_file_found_unreadable_gives_its_rows_to_the_files_after_it(tmp_path, ray_local,
                                                                                    monkeypatch):
    """Ranges are counted only as far as data.limit needs, so the rows of a file that counts but cannot be read
    (a gzip named .jsonl) go to the next file's ranges, as when every file is read whole; and a file whose later
    range cannot be counted after its first ranges were read is read again whole, from its start."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_bytes(b"\x1f\x8b\x08\x00" + b"x\n" * 500)  # its newlines count, its text does not read
    (data / "b.jsonl").write_text("".join(json.dumps({"q": f"query {i}", "p": f"passage {i}"}) + "\n"
                                          for i in range(300)))
    keys = ["data.bad_files=quarantine", "data.limit=100"]
    whole, whole_stats = _ingest(tmp_path, "whole", data, *keys)
    split, stats = _ingest(tmp_path, "split", data, *keys, "data.range_bytes=600")
    assert stats["rows_in"] == whole_stats["rows_in"] == 100 and len(stats["bad_files"]) == 1
    assert _kinds_by_id(split) == _kinds_by_id(whole) and all(pid >> 40 == 1 for pid in _kinds_by_id(split))
    from clusterscale.stages.ingest import UNITS_DIR
    assert [m for m in split.listdir(UNITS_DIR) if m.startswith("00000-")] == ["00000-00000.json"]  # a: one task

    from clusterscale.stages import ingest
    counted = ingest._count_rows
    size = (data / "b.jsonl").stat().st_size
    seventh = byte_ranges(size, 600)[6][0]

    def unreadable_from_the_seventh(fs, path, byte_range, fmt, header):  # as if the store failed on b's 7th range on
        return None if path.endswith("b.jsonl") and byte_range[0] >= seventh else counted(fs, path, byte_range, fmt,
                                                                                           header)

    # a's 20 counted rows and b's first 6 ranges cover the limit: they run; a gives its 20 rows back, b's 7th range
    # cannot be counted: b is read again, whole, from its start
    monkeypatch.setattr(ingest, "_count_rows", unreadable_from_the_seventh)
    (data / "a.jsonl").write_bytes(b"\x1f\x8b\x08\x00" + b"x" * 700 + b"\n" * 20)
    undone = []
    monkeypatch.setattr(ingest._Accepted, "undo", lambda self, i, undo=ingest._Accepted.undo: (undone.append(i),
                                                                                                undo(self, i)))
    keys = ["data.bad_files=quarantine", "data.limit=100"]
    whole, whole_stats = _ingest(tmp_path, "whole_b", data, *keys)
    split, stats = _ingest(tmp_path, "split_b", data, *keys, "data.range_bytes=600")
    assert stats["rows_in"] == whole_stats["rows_in"] == 100 and _kinds_by_id(split) == _kinds_by_id(whole)
    assert 1 in undone and sorted(split.listdir(ingest.UNITS_DIR))[-1] == "00001-00020.json"  # b's whole unit


def test_a_rerun_that_reads_a_file_in_another_shape_leaves_no_rows_of_the_first(tmp_path, ray_local, monkeypatch):
    """An attempt read a file in byte ranges and was killed; the rerun cannot count one of its ranges (a store
    error) and reads the file whole, or the reverse: the output holds each row once, and only the rerun's markers."""
    import os

    import pyarrow.dataset as pads

    from clusterscale.stages import ingest
    data = tmp_path / "data"
    data.mkdir()
    (data / "b.jsonl").write_text("".join(json.dumps({"q": f"query {i}", "p": f"passage {i}"}) + "\n"
                                          for i in range(300)))
    # ~15 rows a range: the limit ends in the 7th, which a rerun counts again (the limit may have cut it short)
    seventh = byte_ranges((data / "b.jsonl").stat().st_size, 600)[6][0]
    counted = ingest._count_rows

    def seventh_unreadable(fs, path, byte_range, fmt, header):
        return None if byte_range[0] == seventh else counted(fs, path, byte_range, fmt, header)

    def ids(run):
        return pads.dataset(run.files("pairs") + run.files("heldout"), format="parquet").to_table(
            columns=["pair_id"]).column(0).to_pylist()

    keys = ["data.limit=100", "data.range_bytes=600", "data.rows_per_part=30"]
    whole, _ = _ingest(tmp_path, "whole", data, "data.limit=100")
    for first, second in ((counted, seventh_unreadable), (seventh_unreadable, counted)):
        name = f"shapes-{first is counted}"
        monkeypatch.setattr(ingest, "_count_rows", first)
        run, _ = _ingest(tmp_path, name, data, *keys)
        for kind in ("pairs", "heldout", "quarantine"):  # killed before the done markers
            os.remove(run.path(f"{kind}/_DONE.json"))
        monkeypatch.setattr(ingest, "_count_rows", second)
        run, stats = _ingest(tmp_path, name, data, *keys)
        assert stats["rows_in"] == 100 and sorted(ids(run)) == sorted(set(ids(run))) == sorted(_kinds_by_id(whole))
        assert run.listdir(ingest.UNITS_DIR) == (["00000-00020.json"] if second is seventh_unreadable else
                                                 [f"00000-{i:05d}.json" for i in range(7)])
