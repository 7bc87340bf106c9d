"""The evaluation set: the distractor pool (per row group) and the held-out queries (a hash threshold) chosen in
Ray tasks, the same however pairs/ and heldout/ are split, and equal to the single-process choice."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale.stages import eval_set
from clusterscale.stages.eval_set import (EVAL_SALT, distractor_passages, heldout_queries, merge_candidates,
                                          unit_candidates)
from clusterscale.stages.evaluate import build_eval_set
from clusterscale.stages.ingest import heldout_key
from clusterscale.runtime.hashing import hash_unit
from clusterscale.io.rundir import RunDir

NUM_DISTRACTORS = 40


def _pairs(n: int = 700) -> pa.Table:
    ids = np.random.default_rng(1).choice(10**9, size=n, replace=False).astype(np.int64)
    return pa.table({"pair_id": ids, "query": [f"q{i}" for i in ids], "passage": [f"passage {i}" for i in ids],
                     "source": [None] * n})


def _write(tmp_path, name: str, table: pa.Table, cuts: list[int], row_group_size: int) -> RunDir:
    folder = tmp_path / name / "pairs"
    folder.mkdir(parents=True)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        pq.write_table(table.slice(a, b - a), folder / f"part-{i:05d}-00000.parquet", row_group_size=row_group_size)
    return RunDir(str(tmp_path / name))


def _choice_before_the_distributed_pass(table: pa.Table) -> list[str]:
    """build_eval_set's pick until now: every pair_id read on the driver, the smallest keys, in pairs/ order."""
    pick = np.sort(np.argsort(hash_unit(table.column("pair_id").to_numpy(), salt=EVAL_SALT))[:NUM_DISTRACTORS])
    return table.take(pa.array(pick)).column("passage").to_pylist()


def test_pool_is_the_same_for_one_or_three_files_and_equals_the_old_choice(tmp_path):
    table = _pairs()
    one = _write(tmp_path, "one", table, [0, 700], row_group_size=700)
    three = _write(tmp_path, "three", table, [0, 100, 450, 700], row_group_size=64)
    expected = _choice_before_the_distributed_pass(table)
    assert len(expected) == NUM_DISTRACTORS
    assert distractor_passages(one, NUM_DISTRACTORS) == expected
    assert distractor_passages(three, NUM_DISTRACTORS) == expected
    assert distractor_passages(three, 10_000) == table.column("passage").to_pylist()  # D > N: every pair, in order


def test_a_unit_returns_at_most_d_candidates_and_the_merge_stays_bounded(tmp_path):
    run = _write(tmp_path, "run", _pairs(), [0, 700], row_group_size=300)
    candidates = [unit_candidates(run.uri, (0, run.files("pairs")[0], g, 300 * g), 25) for g in range(3)]
    assert [c.num_rows for c in candidates] == [25, 25, 25]
    assert candidates[1].column("row").to_numpy().min() >= 300  # positions count from the file's start
    best = None
    for c in candidates:
        best = merge_candidates(best, c, 25)
        assert best.num_rows == 25
    keys = hash_unit(_pairs().column("pair_id").to_numpy(), salt=EVAL_SALT)
    assert np.array_equal(np.sort(best.column("key").to_numpy()), np.sort(keys)[:25])


def test_ray_tasks_pick_the_same_pool(tmp_path, ray_local):
    table = _pairs()
    three = _write(tmp_path, "three", table, [0, 100, 450, 700], row_group_size=64)
    assert distractor_passages(three, NUM_DISTRACTORS) == _choice_before_the_distributed_pass(table)


# --- the held-out queries: chosen in tasks by a hash threshold, equal to grouping all of heldout/ in one process ---
def _heldout(n: int, queries: int, seed: int) -> pa.Table:
    """n held-out pairs over `queries` distinct queries (written in varied case and spacing, as the split groups
    them), in a shuffled order, so one query's pairs sit in several files and row groups."""
    rng = np.random.default_rng(seed)
    which = rng.integers(0, queries, n)
    spellings = ["what is q{}", "What is  Q{}", "WHAT IS q{}"]
    ids = rng.choice(10**9, size=n, replace=False).astype(np.int64)
    return pa.table({"pair_id": ids, "query": [spellings[i % 3].format(w) for i, w in enumerate(which)],
                     "passage": [f"passage {i} of {w}" for i, w in enumerate(which)],
                     "source": [f"s{w % 3}" for w in which]})


def _eval_set_in_one_process(table: pa.Table, max_queries: int) -> tuple[list, list]:
    """build_eval_set's pick until now: all of heldout/ grouped on the driver, the max_queries groups whose first
    pair has the smallest key, in the order of their first pair; per group its passages."""
    groups: dict[str, list[int]] = {}
    for row, query in enumerate(table.column("query").to_pylist()):
        groups.setdefault(heldout_key(query), []).append(row)
    members = list(groups.values())
    firsts = table.column("pair_id").to_numpy()[[rows[0] for rows in members]]
    chosen = np.sort(np.argsort(hash_unit(firsts, salt=EVAL_SALT))[:max_queries])
    passages = table.column("passage").to_pylist()
    ids = table.column("pair_id").to_pylist()
    return [ids[members[g][0]] for g in chosen], [sorted(passages[r] for r in members[g]) for g in chosen]


def _write_heldout(tmp_path, name: str, table: pa.Table, files: int, row_group_size: int) -> RunDir:
    run = _write(tmp_path, name, _pairs(50), [0, 50], row_group_size=50)
    folder = tmp_path / name / "heldout"
    folder.mkdir()
    cuts = np.linspace(0, table.num_rows, files + 1).astype(int)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        pq.write_table(table.slice(a, b - a), folder / f"part-{i:05d}-00000.parquet", row_group_size=row_group_size)
    return run


@pytest.mark.parametrize("n, queries, max_queries", [(900, 800, 30),  # ~1 pair per query: one threshold
                                                      (900, 60, 12),  # ~15 per query: the threshold is raised
                                                      (300, 40, 100)])  # fewer queries than max_queries: all
def test_heldout_queries_equal_grouping_everything_in_one_process(tmp_path, n, queries, max_queries):
    table = _heldout(n, queries, seed=n + queries)
    run = _write_heldout(tmp_path, "run", table, files=4, row_group_size=70)
    expected_ids, expected_passages = _eval_set_in_one_process(table, max_queries)
    es = build_eval_set(run, max_queries=max_queries, num_distractors=10)
    assert es["query_ids"] == expected_ids
    assert [sorted(es["pool"][i] for i in rel) for rel in es["qrels"]] == expected_passages
    held, members = heldout_queries(run, max_queries)
    assert held.num_rows == sum(len(p) for p in expected_passages)  # the driver got the chosen groups' rows only


def test_heldout_candidates_stay_near_max_queries(tmp_path):
    """The first pass's threshold lets through ~SAFETY x max_queries groups, not the split."""
    table = _heldout(3000, 2900, seed=5)
    run = _write_heldout(tmp_path, "run", table, files=3, row_group_size=500)
    work, total = eval_set.units(run, "heldout")
    threshold = eval_set.SAFETY * 20 / total
    candidates = sum(len(eval_set.unit_groups(run.uri, u, threshold)) for u in work)
    assert 20 <= candidates <= 150


def test_ray_tasks_choose_the_same_heldout_queries(tmp_path, ray_local):
    table = _heldout(900, 60, seed=3)
    run = _write_heldout(tmp_path, "run", table, files=3, row_group_size=100)
    assert build_eval_set(run, max_queries=12, num_distractors=10)["query_ids"] == \
        _eval_set_in_one_process(table, 12)[0]
