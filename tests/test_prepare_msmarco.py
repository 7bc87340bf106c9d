"""jobs/prepare_msmarco.py on a tiny fixture in MS MARCO's own file formats: train pairs as clusterscale reads them,
the dev set as a local MTEB (BEIR) task, every skipped judgement counted with its reason."""
from __future__ import annotations

import json

import pyarrow.parquet as pq

from clusterscale.stages.mteb_eval import read_local_task
from tests.test_jobs_local import run_job

PASSAGES = {str(pid): f"passage number {pid} about topic {pid % 3}" for pid in range(40)}
TRAIN_QUERIES = {"100": "what is topic zero", "101": "tell me about topic one", "102": "a query never judged"}
DEV_QUERIES = {"200": "dev question on topic two", "201": "another dev question"}


def write_msmarco(folder) -> None:
    """collection.tsv, queries.{train,dev}.tsv, qrels.train.tsv and qrels.dev.small.tsv as distributed."""
    folder.mkdir()
    (folder / "collection.tsv").write_text("".join(f"{pid}\t{text}\n" for pid, text in PASSAGES.items()))
    (folder / "queries.train.tsv").write_text("".join(f"{q}\t{t}\n" for q, t in TRAIN_QUERIES.items()))
    (folder / "queries.dev.tsv").write_text("".join(f"{q}\t{t}\n" for q, t in DEV_QUERIES.items()))
    # query 100 has two positives; pid 999 is not in the collection; query 150 is not in queries.train.tsv
    (folder / "qrels.train.tsv").write_text("100\t0\t3\t1\n100\t0\t6\t1\n101\t0\t4\t1\n101\t0\t999\t1\n150\t0\t5\t1\n")
    (folder / "qrels.dev.small.tsv").write_text("200\t0\t8\t1\n201\t0\t11\t1\n201\t0\t14\t1\n")


def test_prepare_msmarco_writes_pairs_and_a_dev_task(tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "msmarco", tmp_path / "out"
    write_msmarco(src)
    assert run_job(monkeypatch, "prepare_msmarco", str(src), str(out), "--dev-distractors", "10") == 0
    assert "3 train pairs" in capsys.readouterr().out
    pairs = pq.read_table(out / "train-pairs" / "part-00000.parquet").to_pylist()
    assert [(r["qid"], r["pid"]) for r in pairs] == [(100, 3), (100, 6), (101, 4)]
    assert pairs[0]["query"] == TRAIN_QUERIES["100"] and pairs[0]["passage"] == PASSAGES["3"]
    stats = json.loads((out / "prepare.json").read_text())
    assert stats["skipped"] == {"train_qrels_without_query": 1, "train_qrels_without_passage": 1,
                                "dev_qrels_without_query": 0, "dev_qrels_without_passage": 0}
    task = read_local_task(str(out / "dev"))
    assert {q["id"]: q["text"] for q in task["queries"]} == DEV_QUERIES
    assert task["qrels"] == {"200": {"8": 1}, "201": {"11": 1, "14": 1}}
    corpus = {d["id"]: d["text"] for d in task["corpus"]}
    assert {"8", "11", "14"} <= set(corpus) and corpus["8"] == PASSAGES["8"]
    assert 3 < len(corpus) < len(PASSAGES)  # the relevant passages and a seeded sample of the others
    again = tmp_path / "again"
    assert run_job(monkeypatch, "prepare_msmarco", str(src), str(again), "--dev-distractors", "10") == 0
    assert (again / "dev" / "corpus.jsonl").read_text() == (out / "dev" / "corpus.jsonl").read_text()


def test_missing_files_name_what_to_unpack(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    said = run_job(monkeypatch, "prepare_msmarco", str(tmp_path / "empty"), str(tmp_path / "out"))
    assert "lacks collection.tsv" in str(said) and "unpack collectionandqueries" in str(said)
