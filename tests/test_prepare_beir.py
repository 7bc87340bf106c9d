"""jobs/prepare_beir.py on a tiny dataset in BEIR's layout (a gzipped corpus with titles, string ids, graded and
zero-score judgements): train pairs that ingest reads with the default columns, the eval split as a local MTEB task,
every skipped judgement counted with its reason."""
from __future__ import annotations

import gzip
import json
import re

import pyarrow.parquet as pq

from clusterscale import config
from clusterscale.io.rundir import RunDir
from clusterscale.stages.ingest import IngestUnit, ingest_unit, list_input_files
from clusterscale.stages.mteb_eval import read_local_task
from tests.test_jobs_local import run_job

DOCS = {f"doc{i}": {"title": f"Title {i}" if i % 2 else "", "text": f"passage {i} about topic {i % 3}"}
        for i in range(30)}
QUERIES = {"q1": "what is topic zero", "q2": "tell me about topic one", "q3": "a test question",
           "q4": "another test question"}


def write_beir(folder) -> None:
    (folder / "qrels").mkdir(parents=True)
    with gzip.open(folder / "corpus.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"_id": pid, **doc}) + "\n" for pid, doc in DOCS.items())
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n"
                                                  for q, t in QUERIES.items()))
    # q1 has two positives (one graded 2) and a judged non-relevant passage; doc99 is not in the corpus; q9 is not a
    # query of queries.jsonl.
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tdoc3\t1\nq1\tdoc6\t2\nq1\tdoc7\t0\n"
                                                "q2\tdoc4\t1\nq2\tdoc99\t1\nq9\tdoc5\t1\n")
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq3\tdoc10\t1\nq4\tdoc11\t1\n"
                                               "q4\tdoc12\t1\n")


def test_prepare_beir_writes_pairs_ingest_reads_and_an_eval_task(tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "beir", tmp_path / "out"
    write_beir(src)
    assert run_job(monkeypatch, "prepare_beir", str(src), str(out), "--eval-split", "test",
                   "--eval-distractors", "10") == 0
    assert "3 train pairs" in capsys.readouterr().out
    pairs = pq.read_table(out / "train-pairs" / "part-00000.parquet").to_pylist()
    assert [(r["query_id"], r["corpus_id"]) for r in pairs] == [("q1", "doc3"), ("q1", "doc6"), ("q2", "doc4")]
    assert [r["passage"] for r in pairs] == ["Title 3 passage 3 about topic 0", "passage 6 about topic 0",
                                             "passage 4 about topic 1"]
    stats = json.loads((out / "prepare.json").read_text())
    assert stats["skipped"] == {"without_query": 1, "without_passage": 1, "eval_without_query": 0,
                                "eval_without_passage": 0}
    assert stats["judgements_not_relevant"] == 1 and stats["corpus"] == len(DOCS)
    task = read_local_task(str(out / "eval"))
    assert {q["id"]: q["text"] for q in task["queries"]} == {"q3": QUERIES["q3"], "q4": QUERIES["q4"]}
    assert task["qrels"] == {"q3": {"doc10": 1}, "q4": {"doc11": 1, "doc12": 1}}
    corpus = {d["id"] for d in task["corpus"]}
    assert {"doc10", "doc11", "doc12"} <= corpus and len(corpus) < len(DOCS)  # the judged ones and a sample

    # The pairs as clusterscale reads them: the default column names, nothing quarantined.
    cfg = config.load(None, [f"data.path={out / 'train-pairs'}", "data.heldout_fraction=0"])
    fs, files = list_input_files(cfg.data)
    counts = ingest_unit(RunDir(str(tmp_path / "run")).uri, fs, IngestUnit(0, files[0]), cfg.data)
    assert (counts["pairs"], counts["quarantine"]) == (3, 0)

    # Without titles; a split with no usable judgement stops with what was skipped.
    assert run_job(monkeypatch, "prepare_beir", str(src), str(tmp_path / "plain"), "--no-title") == 0
    assert pq.read_table(tmp_path / "plain" / "train-pairs").column("passage")[0].as_py() == DOCS["doc3"]["text"]
    (src / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq9\tdoc1\t1\n")
    # TREC's 4-field qrels (MS MARCO's: query-id, iteration, corpus-id, score), another header, no header line.
    (src / "qrels" / "trec.tsv").write_text("qid\titer\tdocid\trel\nq1\t0\tdoc3\t1\nq2\t0\tdoc4\t0\n")
    (src / "qrels" / "bare.tsv").write_text("q1\tdoc3\t1\nq2\tdoc4\t1\n")
    for split, expected in (("trec", [("q1", "doc3")]), ("bare", [("q1", "doc3"), ("q2", "doc4")])):
        assert run_job(monkeypatch, "prepare_beir", str(src), str(tmp_path / split), "--split", split) == 0
        assert [(r["query_id"], r["corpus_id"]) for r in pq.read_table(tmp_path / split / "train-pairs").to_pylist()
                ] == expected
    (src / "qrels" / "five.tsv").write_text("q1\t0\tdoc3\t1\textra\n")
    assert "got 5" in run_job(monkeypatch, "prepare_beir", str(src), str(tmp_path / "five"), "--split", "five")
    stopped = run_job(monkeypatch, "prepare_beir", str(src), str(tmp_path / "none"), "--split", "dev")
    assert re.search(r"No train pairs: none of the 1 judgements .* qrels/dev\.tsv", stopped)
    stopped = run_job(monkeypatch, "prepare_beir", str(tmp_path / "out"), str(tmp_path / "x"))
    assert "lacks corpus.jsonl (or corpus.jsonl.gz)" in stopped
