"""What a user sees: one-line progress off a terminal, the `reused` line of a done stage, `--version`."""
from __future__ import annotations

import io

from clusterscale.runtime.progress import ProgressLine, format_duration, format_progress


def test_format_progress_line():
    assert format_progress("embed", 1200, 3781, 30.0) == "[embed] 1,200/3,781 rows (32%), 40.0 rows/s, ETA 1m05s"
    assert format_progress("assign", 0, 10, 0.0) == "[assign] 0/10 rows (0%), 0.0 rows/s, ETA ?"
    # a slow unit: per minute, per hour (a mine search group of a large cluster takes minutes), never "0.0 .../s"
    assert format_progress("mine", 1, 8, 45.0, "search groups") == \
        "[mine] 1/8 search groups (12%), 1.3 search groups/min, ETA 5m15s"
    assert format_progress("mine", 2, 500, 3600.0, "search groups") == \
        "[mine] 2/500 search groups (0%), 2.0 search groups/h, ETA 249h00m"
    assert [format_duration(s) for s in (4.4, 65, 3725)] == ["4s", "1m05s", "1h02m"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_line_prints_one_line_per_interval_and_none_at_the_end():
    stream, clock = io.StringIO(), Clock()  # StringIO is not a TTY, like a log file
    progress = ProgressLine("mine", 100, interval_s=10, stream=stream, clock=clock)
    for t, rows in [(1, 10), (11, 10), (12, 10), (25, 30), (40, 40)]:
        clock.now = t
        progress.advance(rows)
    assert stream.getvalue().splitlines() == ["[mine] 20/100 rows (20%), 1.8 rows/s, ETA 44s",
                                              "[mine] 60/100 rows (60%), 2.4 rows/s, ETA 17s"]


def test_progress_line_is_silent_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream, clock = Terminal(), Clock()
    progress = ProgressLine("embed", 100, interval_s=1, stream=stream, clock=clock)
    clock.now = 5
    progress.advance(50)
    assert stream.getvalue() == ""


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_heartbeat_speaks_while_no_unit_finishes_and_stops_with_the_work():
    """Off a terminal a stage whose units take long (a shuffle's barrier) still prints a line every heartbeat_s, with
    what runs before the first unit; the thread stops once the work is done, or once the line is dropped."""
    import gc
    import time

    stream = io.StringIO()
    progress = ProgressLine("mine", 8, unit="search groups", stream=stream, heartbeat_s=0.2,
                            before_first="the vectors are routed and shuffled to their search groups first")
    _wait_for(lambda: len(stream.getvalue().splitlines()) >= 2)
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 2, lines
    assert lines[0].startswith("[mine] 0/8 search groups (0%), 0.0 search groups/s, ETA ? (running for "), lines
    assert all(line.endswith("; the vectors are routed and shuffled to their search groups first)") for line in lines)
    progress.advance(1)
    _wait_for(lambda: stream.getvalue().splitlines()[-1].startswith("[mine] 1/8"))
    last = stream.getvalue().splitlines()[-1]
    assert last.startswith("[mine] 1/8 search groups (12%)") and "routed" not in last  # the note: before the first
    progress.advance(7)  # done: the heartbeat ends at once
    progress.heartbeat.join(timeout=5)
    assert not progress.heartbeat.is_alive()
    printed = stream.getvalue()
    time.sleep(0.5)
    assert stream.getvalue() == printed

    dropped = ProgressLine("dedup", 10, stream=io.StringIO(), heartbeat_s=0.2)  # a stage that failed midway
    thread = dropped.heartbeat
    assert thread.is_alive()
    del dropped
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_no_heartbeat_on_a_terminal_or_when_asked_for_none_or_closed():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    lines = [ProgressLine("embed", 100, stream=Terminal(), heartbeat_s=0.1),
             ProgressLine("embed", 100, stream=io.StringIO(), heartbeat_s=None)]
    assert all(line.heartbeat is None for line in lines)
    closed = ProgressLine("ingest", 5, stream=io.StringIO(), heartbeat_s=0.1)
    closed.close()  # counting stopped short of its total (data.limit covered)
    closed.heartbeat.join(timeout=5)
    assert not closed.heartbeat.is_alive() and closed.stream.getvalue() == ""


def test_version_prints_the_installed_version(capsys):
    import importlib.metadata

    import pytest

    from clusterscale import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"clusterscale {importlib.metadata.version('clusterscale')}"


def test_a_done_stage_says_reused_with_its_time(tmp_path, capsys):
    from clusterscale.io.rundir import RunDir

    run = RunDir(str(tmp_path / "run"))
    assert not run.is_done("embeddings", "abc")
    run.mark_done("embeddings", "abc", {"rows": 3})
    capsys.readouterr()
    assert run.is_done("embeddings", "abc")
    finished_at = run.read_json("embeddings/_DONE.json")["finished_at"]
    assert capsys.readouterr().out == f"[embeddings] reused (done at {finished_at})\n"


def test_ray_data_bars_only_on_a_terminal():
    import ray

    from clusterscale.runtime.session import ray_data_progress

    ctx = ray.data.DataContext.get_current()
    ray_data_progress(on_terminal=True)
    assert ctx.enable_progress_bars and ctx.print_on_execution_start
    ray_data_progress(on_terminal=False)  # what init_ray sets under pytest (stdout captured, not a TTY)
    assert not ctx.enable_progress_bars and not ctx.print_on_execution_start
