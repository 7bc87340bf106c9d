"""Why does a BERT trained from scratch with CLS pooling collapse? One factor changed at a time, at tiny size.

Runs the training step core (clusterscale.train.step, no Ray) on the bundled docstring pairs: a 2-layer,
hidden-128 BERT from scratch, global batch 64, the paper's schedule shape (linear warm-up, linear decay to
lr/10), the ingest normalisation skipped (the texts are already clean). Each variant changes one knob of the
baseline (the paper's recipe: CLS, tau 0.02, lr 4e-4). Per variant: mean loss and in-batch negative cosine
over the last 20 steps, the collapse guard's verdict, and held-out top-1 / NDCG@10 of 512 held-out queries
against their 512 passages. Deterministic given --seed; not a timing benchmark.

    python benchmarks/collapse_causes.py --steps 300 --json benchmarks/results/collapse_causes.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import pyarrow.parquet as pq
import torch

from clusterscale.io.builtin_data import builtin_docstrings_path
from clusterscale.config import TrainConfig
from clusterscale.train.optim import lr_at
from clusterscale.train.metrics import CollapseGuard, chance_loss
from clusterscale.modeling.student import build_student, embed
from clusterscale.train.step import contrastive_backward

BASE = dict(init="scratch", pooling="cls", scratch_hidden_size=128, scratch_num_layers=2, scratch_num_heads=2,
            scratch_intermediate_size=512, temperature=0.02, lr=4e-4, global_batch_size=64, query_max_length=32,
            passage_max_length=128, log_every_steps=10)
# name -> (TrainConfig changes, BertConfig changes, warm-up fraction of the steps)
VARIANTS = {
    "baseline: paper (CLS tau 0.02 lr 4e-4 warm-up 15%)": ({}, {}, 0.15),
    "pooling=mean": ({"pooling": "mean"}, {}, 0.15),
    "lr 1e-4": ({"lr": 1e-4}, {}, 0.15),
    "lr 1e-3": ({"lr": 1e-3}, {}, 0.15),
    "tau 0.05": ({"temperature": 0.05}, {}, 0.15),
    "tau 0.1": ({"temperature": 0.1}, {}, 0.15),
    "no warm-up": ({}, {}, 0.0),
    "warm-up 40%": ({}, {}, 0.4),
    "4 layers": ({"scratch_num_layers": 4}, {}, 0.15),
    "hidden 256 4 heads": ({"scratch_hidden_size": 256, "scratch_num_heads": 4, "scratch_intermediate_size": 1024},
                            {}, 0.15),
    "dropout 0": ({}, {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}, 0.15),
    "init std 0.002 (10x smaller)": ({}, {"initializer_range": 0.002}, 0.15),
    "init std 0.1 (5x larger)": ({}, {"initializer_range": 0.1}, 0.15),
    "pooling=mean + tau 0.05": ({"pooling": "mean", "temperature": 0.05}, {}, 0.15),
}


def build(tc: TrainConfig, bert_changes: dict):
    """build_student, with BertConfig fields the train config has no key for."""
    if not bert_changes:
        return build_student(tc)
    import transformers

    original = transformers.BertConfig.__init__

    def patched(self, *args, **kwargs):
        original(self, *args, **(kwargs | bert_changes))
    transformers.BertConfig.__init__ = patched
    try:
        return build_student(tc)
    finally:
        transformers.BertConfig.__init__ = original


@torch.no_grad()
def heldout_scores(model, tokenizer, pooling, tc, queries, passages) -> tuple[float, float]:
    model.eval()
    q = torch.cat([embed(model, tokenizer, queries[i:i + 128], tc.student.query_max_length, pooling, "cpu")
                   for i in range(0, len(queries), 128)])
    p = torch.cat([embed(model, tokenizer, passages[i:i + 128], tc.student.passage_max_length, pooling, "cpu")
                   for i in range(0, len(passages), 128)])
    scores = q @ p.T
    rank = (scores > scores.diag()[:, None]).sum(1)  # 0 = the positive is on top
    ndcg = torch.where(rank < 10, 1 / torch.log2(rank.float() + 2), torch.zeros(()))
    return float((rank == 0).float().mean()), float(ndcg.mean())


def run_variant(name, changes, bert_changes, warmup_frac, steps, seed, train_rows, heldout_rows) -> dict:
    tc = TrainConfig.of(**(BASE | changes | {"seed": seed, "warmup_steps": max(1, int(warmup_frac * steps)),
                                          "final_lr": (BASE | changes)["lr"] / 10}))
    torch.manual_seed(seed)
    model, tokenizer, pooling = build(tc, bert_changes)
    opt, batch = tc.optimizer, tc.schedule.global_batch_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    guard = CollapseGuard(chance_loss(batch), opt.warmup_steps if warmup_frac else 0, tc.logging.log_every_steps)
    rng = np.random.default_rng(seed)
    queries, passages = train_rows
    history, verdict_step, started = [], None, time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, opt, steps) if warmup_frac else opt.lr + (opt.final_lr - opt.lr) * step / steps
        rows = rng.choice(len(queries), batch, replace=False)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss, stats = contrastive_backward(model, tokenizer, [queries[i] for i in rows], [passages[i] for i in rows],
                                           tc, torch.device("cpu"), pooling=pooling)
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.max_grad_norm)
        optimizer.step()
        history.append((float(loss), float(stats["neg_cos_mean"]), float(stats["pos_cos"])))
        if guard.observe(step, float(loss), float(stats["neg_cos_mean"])) and verdict_step is None:
            verdict_step = step + 1
    top1, ndcg = heldout_scores(model, tokenizer, pooling, tc, *heldout_rows)
    tail = np.array(history[-20:])
    result = {"variant": name, "loss_last20": round(float(tail[:, 0].mean()), 3),
              "chance": round(math.log(batch), 3), "neg_cos_last20": round(float(tail[:, 1].mean()), 3),
              "pos_cos_last20": round(float(tail[:, 2].mean()), 3), "collapsed_at_step": verdict_step,
              "heldout_top1": round(top1, 4), "heldout_ndcg10": round(ndcg, 4), "seconds": round(time.time() - started, 1),
              "loss_every_25": [round(h[0], 3) for h in history[::25]],
              "neg_cos_every_25": [round(h[1], 3) for h in history[::25]],
              "history": [[round(v, 4) for v in h] for h in history]}
    print(json.dumps({k: v for k, v in result.items() if not k.endswith(("every_25", "history"))}), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help="Comma-separated variant names (default: all).")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = pq.read_table(builtin_docstrings_path(), columns=["query", "passage"])
    order = np.random.default_rng(1234).permutation(table.num_rows)
    queries, passages = table.column("query").to_pylist(), table.column("passage").to_pylist()
    held, train = order[:512], order[512:]
    train_rows = ([queries[i] for i in train], [passages[i] for i in train])
    heldout_rows = ([queries[i] for i in held], [passages[i] for i in held])
    names = args.only.split(",") if args.only else list(VARIANTS)
    results = [run_variant(n, *VARIANTS[n], args.steps, args.seed, train_rows, heldout_rows) for n in names]
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"steps": args.steps, "seed": args.seed, "train_pairs": len(train), "heldout": 512,
                       "base": BASE, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
