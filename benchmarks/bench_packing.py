"""Packed against padded passes on this machine's CPU: the training step and the embed stage's encoder core.

    python benchmarks/bench_packing.py --pairs 'RUN/pairs/*.parquet' [--passage-max-length 128] [--json OUT]

pairs: the default run's pairs/ (real docstring pairs of varied length). The training step is clusterscale's
(`contrastive_backward`, the bundled MiniLM as student, 32 random pairs a step, queries cut at 32 tokens) with the
student set to padded, then packed passes (`train.packing`), twice each in turn, the median of 5 steps after a
warm-up; the encoder core (`Encoder.encode_tokens`, 1,500 passages) likewise. Also the tokens each computes: a
padded batch pads every text to its longest. `--quick`: a tiny BERT and 64 pairs (a test of the script).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from clusterscale.config import TrainConfig  # noqa: E402
from clusterscale.modeling.encoder import Encoder, load_model, load_tokenizer, resolve_model_path  # noqa: E402
from clusterscale.modeling.student import choose_packing  # noqa: E402
from clusterscale.train.step import contrastive_backward  # noqa: E402

MODES = ("padded", "packed", "padded", "packed")  # in turn: drift of the machine shows as a spread


def train_steps(model_path: str, queries: list[str], passages: list[str], passage_len: int, steps: int,
                batch: int) -> dict:
    settings = TrainConfig.of(temperature=0.05, query_max_length=32, passage_max_length=passage_len, pooling="mean")
    out: dict = {}
    for mode in MODES:
        model, tokenizer = load_model(model_path), load_tokenizer(model_path)
        model.train()
        batching = choose_packing(model, tokenizer, "mean", mode, passage_len, "cpu")
        rng, times, tokens = np.random.default_rng(0), [], 0
        for _ in range(steps + 1):
            rows = rng.choice(len(queries), batch, replace=False)
            started = time.perf_counter()
            _, stats = contrastive_backward(model, tokenizer, [queries[i] for i in rows],
                                            [passages[i] for i in rows], settings, torch.device("cpu"))
            times.append(time.perf_counter() - started)
            tokens += stats["tokens"]
            model.zero_grad()
        entry = out.setdefault(mode, {"batching": batching, "step_s": [], "tokens_per_step": tokens / (steps + 1)})
        entry["step_s"].append(round(float(np.median(times[1:])), 4))
    out["packed_over_padded"] = round(min(out["packed"]["step_s"]) / min(out["padded"]["step_s"]), 3)
    return out


def encoder_core(model_path: str, passages: list[str], max_length: int) -> dict:
    out: dict = {}
    for mode in MODES:
        encoder = Encoder(model_path, max_length=max_length, device="cpu", threads=torch.get_num_threads(),
                          packing=mode)
        tokens = encoder.tokenize(passages)
        encoder.encode_tokens(encoder.tokenize(passages[:64]), 256)  # warm-up
        started = time.perf_counter()
        encoder.encode_tokens(tokens, 256)
        out.setdefault(mode, {"batching": encoder.batching, "passages_per_s": []})["passages_per_s"].append(
            round(len(passages) / (time.perf_counter() - started), 1))
    out["packed_over_padded"] = round(max(out["packed"]["passages_per_s"]) / max(out["padded"]["passages_per_s"]), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", help="Parquet glob with query and passage columns (the default run's pairs/).")
    parser.add_argument("--passage-max-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="A tiny BERT and 64 pairs: checks the script.")
    parser.add_argument("--model", default="bundled", help="Model folder (default: the bundled MiniLM).")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.pairs:
        table = pa.concat_tables([pq.read_table(f, columns=["query", "passage"]) for f in sorted(glob.glob(args.pairs))])
        queries, passages = table.column("query").to_pylist(), table.column("passage").to_pylist()
    else:
        from tests.conftest import make_pairs  # synthetic topical pairs of varied length

        table = make_pairs(64 if args.quick else 2000)
        queries, passages = table.column("q").to_pylist(), table.column("p").to_pylist()
    model = resolve_model_path(args.model)
    steps, batch, texts = (2, 8, 32) if args.quick else (5, 32, 1500)
    from bench_scale import machine  # the sibling module: how a benchmark records its machine

    before = machine()
    result = {"train_step": train_steps(model, queries, passages, args.passage_max_length, steps, batch),
              "encoder_core": encoder_core(model, passages[:texts], args.passage_max_length),
              "model": args.model, "pairs": args.pairs, "passage_max_length": args.passage_max_length,
              "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": before | {"uptime_after": machine()["uptime"]}, "command": " ".join(["python"] + sys.argv)}
    print(json.dumps({k: result[k] for k in ("train_step", "encoder_core")}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
