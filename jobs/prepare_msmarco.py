"""The paper's data: MS MARCO passage ranking, as distributed, into clusterscale's pairs and an evaluation set.

    python jobs/prepare_msmarco.py MSMARCO_DIR OUT_DIR [--dev-distractors 100000] [--seed 0]

MSMARCO_DIR holds the passage-ranking files as https://microsoft.github.io/msmarco/ distributes them (collection
and queries unpacked from collectionandqueries.tar.gz): collection.tsv (pid, passage), queries.train.tsv and
queries.dev.tsv (qid, query), qrels.train.tsv and qrels.dev.small.tsv (qid, 0, pid, 1). It writes
  OUT_DIR/train-pairs/part-*.parquet: one row per train qrel (columns query, passage, qid, pid; ~532k rows): what
      data.path of cluster_configs/msmarco-paper.yaml reads (copy it to your bucket);
  OUT_DIR/dev/: the small dev set in BEIR layout (queries.jsonl, corpus.jsonl, qrels/test.tsv) for
      `clusterscale evaluate --mteb local:OUT_DIR/dev`: its ~7k queries against their relevant passages and
      --dev-distractors other passages of the collection (a seeded sample; 0 = the whole 8.8M collection);
  OUT_DIR/prepare.json: the counts (and the rows skipped, with why).
Memory: the qrels and queries (a few hundred MB), and only the passages they name; the collection is streamed.
No Ray: run it where the files are, once.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

ROWS_PER_FILE = 200_000  # pairs per Parquet file: one ingest task each (data.rows_per_part's default)
FILES = {"collection": "collection.tsv", "train_queries": "queries.train.tsv", "dev_queries": "queries.dev.tsv",
         "train_qrels": "qrels.train.tsv", "dev_qrels": "qrels.dev.small.tsv"}


def tsv_rows(path: str):
    """(first field, rest) per line of a tab-separated MS MARCO file; blank lines skipped."""
    with open(path, encoding="utf-8", newline="") as f:
        for line in f:
            line = line.rstrip("\r\n")
            if line:
                key, _, rest = line.partition("\t")
                yield key, rest


def read_qrels(path: str) -> list[tuple[str, str]]:
    """(qid, pid) of each relevant judgement (qid, 0, pid, relevance >= 1), in file order."""
    pairs = []
    with open(path, encoding="utf-8", newline="") as f:
        for n, row in enumerate(csv.reader(f, delimiter="\t"), 1):
            if not row:
                continue
            if len(row) != 4:
                raise SystemExit(f"{path}:{n}: a qrels line has 4 tab-separated fields (qid, 0, pid, relevance), "
                                 f"got {len(row)}.")
            if int(row[3]) >= 1:
                pairs.append((row[0], row[2]))
    return pairs


def distractor(pid: str, seed: int, fraction: float) -> bool:
    """A seeded, order-free sample of the collection: the same pids whatever order the file is read in."""
    digest = hashlib.blake2b(f"{seed}/{pid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


class PairFiles:
    """Pair rows written ROWS_PER_FILE to a Parquet file: folder/part-00000.parquet, part-00001.parquet, ..."""

    def __init__(self, folder: str, schema: pa.Schema):
        os.makedirs(folder, exist_ok=True)
        self.folder, self.schema, self.batch, self.rows, self.files = folder, schema, [], 0, 0

    def add(self, row: dict) -> None:
        self.batch.append(row)
        self.rows += 1
        if len(self.batch) >= ROWS_PER_FILE:
            self.close()

    def close(self) -> None:
        """Write the rows not yet written (the last, partial file)."""
        if self.batch:
            pq.write_table(pa.Table.from_pylist(self.batch, self.schema),
                           os.path.join(self.folder, f"part-{self.files:05d}.parquet"))
            self.files += 1
            self.batch = []


def judged_task(judged: list[tuple[str, str]], queries: dict[str, str], passages
                ) -> tuple[dict[str, str], list[tuple[str, str]], int, int]:
    """The judgements whose query and passage are known (`passages`: any container of passage ids): (their queries,
    those judgements in order, the number skipped for a missing query, for a missing passage)."""
    task_queries, kept, no_query, no_passage = {}, [], 0, 0
    for qid, pid in judged:
        if qid not in queries or pid not in passages:
            no_query, no_passage = no_query + (qid not in queries), no_passage + (qid in queries)
            continue
        task_queries[qid] = queries[qid]
        kept.append((qid, pid))
    return task_queries, kept, no_query, no_passage


def write_stats(out: str, stats: dict) -> None:
    """OUT_DIR/prepare.json: what a converter wrote and skipped."""
    with open(os.path.join(out, "prepare.json"), "w") as f:
        json.dump(stats, f, indent=1)


def write_task_queries(folder: str, queries: dict[str, str], judged: list[tuple[str, str]]) -> None:
    """A local MTEB task's queries.jsonl and qrels/test.tsv (each judgement relevant, score 1); its corpus.jsonl is
    written beside them."""
    os.makedirs(os.path.join(folder, "qrels"), exist_ok=True)
    with open(os.path.join(folder, "queries.jsonl"), "w", encoding="utf-8") as f:
        for qid, text in queries.items():
            f.write(json.dumps({"_id": qid, "text": text}, ensure_ascii=False) + "\n")
    with open(os.path.join(folder, "qrels", "test.tsv"), "w", encoding="utf-8") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for qid, pid in judged:
            f.write(f"{qid}\t{pid}\t1\n")


def prepare(src: str, out: str, dev_distractors: int, seed: int) -> dict:
    paths = {name: os.path.join(src, fname) for name, fname in FILES.items()}
    missing = [FILES[n] for n, p in paths.items() if not os.path.exists(p)]
    if missing:
        raise SystemExit(f"{src} lacks {', '.join(missing)}: unpack collectionandqueries.tar.gz and the qrels there "
                         f"(https://microsoft.github.io/msmarco/Datasets.html, passage ranking).")
    train_qrels, dev_qrels = read_qrels(paths["train_qrels"]), read_qrels(paths["dev_qrels"])
    wanted_q = {q for q, _ in train_qrels} | {q for q, _ in dev_qrels}
    queries = {qid: text for qid, text in tsv_rows(paths["train_queries"]) if qid in wanted_q}
    queries |= {qid: text for qid, text in tsv_rows(paths["dev_queries"]) if qid in wanted_q}
    wanted_p = {p for _, p in train_qrels} | {p for _, p in dev_qrels}
    dev_positive = {p for _, p in dev_qrels}
    n_collection = sum(1 for _ in tsv_rows(paths["collection"])) if dev_distractors else 0
    fraction = min(1.0, dev_distractors / max(1, n_collection)) if dev_distractors else 1.0
    passages: dict[str, str] = {}
    os.makedirs(os.path.join(out, "dev", "qrels"), exist_ok=True)
    corpus_rows = 0
    with open(os.path.join(out, "dev", "corpus.jsonl"), "w", encoding="utf-8") as corpus:
        for pid, text in tsv_rows(paths["collection"]):
            if pid in wanted_p:
                passages[pid] = text
            if pid in dev_positive or distractor(pid, seed, fraction):
                corpus.write(json.dumps({"_id": pid, "title": "", "text": text}, ensure_ascii=False) + "\n")
                corpus_rows += 1
    skipped = {"train_qrels_without_query": 0, "train_qrels_without_passage": 0, "dev_qrels_without_query": 0,
               "dev_qrels_without_passage": 0}
    pairs = PairFiles(os.path.join(out, "train-pairs"), pa.schema([("query", pa.string()), ("passage", pa.string()),
                                                                   ("qid", pa.int64()), ("pid", pa.int64())]))
    for qid, pid in train_qrels:
        if qid not in queries or pid not in passages:
            skipped["train_qrels_without_query" if qid not in queries else "train_qrels_without_passage"] += 1
            continue
        pairs.add({"query": queries[qid], "passage": passages[pid], "qid": int(qid), "pid": int(pid)})
    pairs.close()
    dev_queries, dev_judged, skipped["dev_qrels_without_query"], skipped["dev_qrels_without_passage"] = \
        judged_task(dev_qrels, queries, passages)
    write_task_queries(os.path.join(out, "dev"), dev_queries, dev_judged)
    rows, part = pairs.rows, pairs.files
    stats = {"train_pairs": rows, "train_files": part, "train_queries": len({q for q, _ in train_qrels}),
             "dev_queries": len(dev_queries), "dev_qrels": len(dev_judged), "dev_corpus": corpus_rows,
             "collection": n_collection or None, "skipped": skipped, "seed": seed, "dev_distractors": dev_distractors}
    write_stats(out, stats)
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("msmarco_dir", help="Folder of collection.tsv, queries.*.tsv and qrels.*.tsv.")
    parser.add_argument("out_dir")
    parser.add_argument("--dev-distractors", type=int, default=100_000,
                        help="Other passages beside the dev set's relevant ones in dev/corpus.jsonl (0 = all).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the distractor sample.")
    args = parser.parse_args(argv)
    if args.dev_distractors < 0:
        parser.error("--dev-distractors must be >= 0")
    stats = prepare(args.msmarco_dir, args.out_dir, args.dev_distractors, args.seed)
    print(f"{stats['train_pairs']} train pairs in {stats['train_files']} files -> {args.out_dir}/train-pairs/; dev: "
          f"{stats['dev_queries']} queries against {stats['dev_corpus']} passages -> {args.out_dir}/dev/; skipped "
          f"{sum(stats['skipped'].values())} ({args.out_dir}/prepare.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
