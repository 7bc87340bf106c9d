"""A BEIR-layout dataset (corpus + queries + qrels, joined by id) into clusterscale's pairs and an evaluation set.

    python jobs/prepare_beir.py BEIR_DIR OUT_DIR [--split train] [--eval-split test] [--eval-distractors 100000]
                                [--no-title] [--seed 0]

BEIR_DIR holds a dataset as BEIR distributes it (https://github.com/beir-cellar/beir; NQ, HotpotQA, FiQA, MS MARCO,
SciFact, ... and many other retrieval sets in the same layout): corpus.jsonl ({"_id", "title", "text"} per line),
queries.jsonl ({"_id", "text"}), qrels/<split>.tsv (query-id, corpus-id, score, or TREC's 4 fields; a header
line or not); each may be .gz.
clusterscale reads (query, passage) rows, so the ids are joined here, once. It writes
  OUT_DIR/train-pairs/part-*.parquet: one row per judgement of --split with score > 0 (columns query, passage,
      query_id, corpus_id): what data.path reads (`--set data.path=OUT_DIR/train-pairs`);
  OUT_DIR/eval/ (with --eval-split): that split in BEIR layout for `clusterscale evaluate --mteb local:OUT_DIR/eval`:
      its judged queries against their judged passages and --eval-distractors other passages of the corpus (a seeded
      sample; 0 = the whole corpus);
  OUT_DIR/prepare.json: the counts, and the judgements skipped with why (an id missing from the corpus or queries).
A passage is "title text" (as MTEB scores BEIR's corpora), or the text alone with --no-title.
Memory: the split's judgements and queries, and the texts of the passages they name; the corpus is streamed.
No Ray: run it where the files are, once.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import io
import json
import os
import sys

import pyarrow as pa

from prepare_msmarco import PairFiles, distractor, judged_task, write_stats, write_task_queries


def data_file(folder: str, name: str) -> str:
    """folder/name, or folder/name.gz when that is what the folder holds."""
    for candidate in (name, name + ".gz"):
        if os.path.exists(os.path.join(folder, candidate)):
            return os.path.join(folder, candidate)
    raise SystemExit(f"{folder} lacks {name} (or {name}.gz): a BEIR dataset folder holds corpus.jsonl, queries.jsonl "
                     f"and qrels/<split>.tsv (https://github.com/beir-cellar/beir).")


def open_text(path: str) -> io.TextIOBase:
    return gzip.open(path, "rt", encoding="utf-8", newline="") if path.endswith(".gz") else \
        open(path, encoding="utf-8", newline="")


def jsonl_rows(path: str):
    """(line number, object) per non-blank line of a JSON Lines file, each checked for an id and a text."""
    with open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not a JSON object ({e.msg}).") from None
            if not isinstance(obj, dict) or obj.get("_id") is None or not isinstance(obj.get("text"), str):
                raise SystemExit(f"{path}:{n}: each line needs an \"_id\" and a \"text\" string (BEIR layout).")
            yield n, obj


def read_qrels(path: str) -> tuple[list[tuple[str, str]], int]:
    """((query id, corpus id) of each judgement with score > 0, in file order; judgements with score <= 0). A line is
    BEIR's `query-id corpus-id score` or TREC's `query-id iteration corpus-id score` (MS MARCO's qrels); a first
    line whose score is not a number is a header."""
    relevant, other = [], 0
    with open_text(path) as f:
        for n, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), 1):
            if not row:
                continue
            if len(row) not in (3, 4):
                raise SystemExit(f"{path}:{n}: a qrels line has 3 tab-separated fields (query-id, corpus-id, score; "
                                 f"BEIR) or 4 (query-id, iteration, corpus-id, score; TREC), got {len(row)}.")
            qid, pid, value = (row[0], row[1], row[2]) if len(row) == 3 else (row[0], row[2], row[3])
            try:
                score = float(value)
            except ValueError:
                if n == 1:
                    continue  # a header line
                raise SystemExit(f"{path}:{n}: the score {value!r} is not a number.") from None
            if score > 0:
                relevant.append((qid, pid))
            else:
                other += 1
    return relevant, other


def passage_text(doc: dict, title: bool) -> str:
    head = doc.get("title") if title and isinstance(doc.get("title"), str) else ""
    return f"{head} {doc['text']}".strip() if head else doc["text"]


def prepare(src: str, out: str, split: str, eval_split: str | None, eval_distractors: int, title: bool,
            seed: int) -> dict:
    corpus_path, queries_path = data_file(src, "corpus.jsonl"), data_file(src, "queries.jsonl")
    train, not_relevant = read_qrels(data_file(os.path.join(src, "qrels"), f"{split}.tsv"))
    judged, eval_not_relevant = read_qrels(data_file(os.path.join(src, "qrels"), f"{eval_split}.tsv")) \
        if eval_split else ([], 0)
    wanted_q = {q for q, _ in train} | {q for q, _ in judged}
    queries = {str(obj["_id"]): obj["text"] for _, obj in jsonl_rows(queries_path) if str(obj["_id"]) in wanted_q}
    wanted_p, eval_positive = {p for _, p in train}, {p for _, p in judged}
    n_corpus = sum(1 for _ in jsonl_rows(corpus_path)) if eval_split and eval_distractors else 0
    fraction = min(1.0, eval_distractors / max(1, n_corpus)) if eval_distractors else 1.0
    passages: dict[str, str] = {}
    found_eval: set[str] = set()
    corpus_rows = 0
    eval_dir = os.path.join(out, "eval")
    if eval_split:
        os.makedirs(eval_dir, exist_ok=True)
    with contextlib.ExitStack() as stack:
        corpus = stack.enter_context(open(os.path.join(eval_dir, "corpus.jsonl"), "w", encoding="utf-8")) \
            if eval_split else None
        for _, doc in jsonl_rows(corpus_path):
            pid = str(doc["_id"])
            if pid in wanted_p:
                passages.setdefault(pid, passage_text(doc, title))  # an id given twice: its first record
            sampled = pid in eval_positive or distractor(pid, seed, fraction)
            if corpus is not None and sampled and pid not in found_eval:  # a judged id given twice: written once
                corpus.write(json.dumps({"_id": pid, "title": (doc.get("title") or "") if title else "",
                                         "text": doc["text"]}, ensure_ascii=False) + "\n")
                corpus_rows += 1
                if pid in eval_positive:
                    found_eval.add(pid)
    skipped = {"without_query": 0, "without_passage": 0, "eval_without_query": 0, "eval_without_passage": 0}
    pairs = PairFiles(os.path.join(out, "train-pairs"), pa.schema([(name, pa.string()) for name in (
        "query", "passage", "query_id", "corpus_id")]))
    for qid, pid in train:
        if qid not in queries or pid not in passages:
            skipped["without_query" if qid not in queries else "without_passage"] += 1
            continue
        pairs.add({"query": queries[qid], "passage": passages[pid], "query_id": qid, "corpus_id": pid})
    pairs.close()
    eval_queries, eval_judged, skipped["eval_without_query"], skipped["eval_without_passage"] = judged_task(
        judged, queries, found_eval)
    if eval_split:
        write_task_queries(eval_dir, eval_queries, eval_judged)
    rows, part = pairs.rows, pairs.files
    stats = {"split": split, "train_pairs": rows, "train_files": part, "train_queries": len({q for q, _ in train}),
             "judgements_not_relevant": not_relevant, "eval_split": eval_split, "eval_queries": len(eval_queries),
             "eval_qrels": len(eval_judged), "eval_corpus": corpus_rows, "eval_not_relevant": eval_not_relevant,
             "corpus": n_corpus or None, "skipped": skipped, "title": title, "seed": seed,
             "eval_distractors": eval_distractors}
    if rows == 0:
        raise SystemExit(f"No train pairs: none of the {len(train)} judgements with score > 0 in qrels/{split}.tsv "
                         f"names a query of queries.jsonl and a passage of corpus.jsonl (skipped: {skipped}).")
    write_stats(out, stats)
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("beir_dir", help="Folder of corpus.jsonl, queries.jsonl and qrels/<split>.tsv.")
    parser.add_argument("out_dir")
    parser.add_argument("--split", default="train", help="The qrels split the pairs come from (qrels/SPLIT.tsv).")
    parser.add_argument("--eval-split", default=None,
                        help="Also write this split (e.g. test or dev) as a local MTEB task in OUT_DIR/eval/.")
    parser.add_argument("--eval-distractors", type=int, default=100_000,
                        help="Other passages beside the eval split's judged ones in eval/corpus.jsonl (0 = all).")
    parser.add_argument("--no-title", action="store_true", help="A passage is the text alone, without its title.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the distractor sample.")
    args = parser.parse_args(argv)
    if args.eval_distractors < 0:
        parser.error("--eval-distractors must be >= 0")
    if args.eval_split == args.split:
        parser.error(f"--eval-split {args.eval_split} is the split the pairs come from: evaluate on another one.")
    stats = prepare(args.beir_dir, args.out_dir, args.split, args.eval_split, args.eval_distractors,
                    not args.no_title, args.seed)
    evaluation = (f"; {args.eval_split}: {stats['eval_queries']} queries against {stats['eval_corpus']} passages -> "
                  f"{args.out_dir}/eval/" if args.eval_split else "")
    print(f"{stats['train_pairs']} train pairs in {stats['train_files']} files -> {args.out_dir}/train-pairs/"
          f"{evaluation}; skipped {sum(stats['skipped'].values())} ({args.out_dir}/prepare.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
