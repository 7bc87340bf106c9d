"""The whole pipeline on one GPU node, through the real Ray stages: `clusterscale run` on synthetic topical pairs with a
BERT-base-shaped encoder (random weights: the speed is the weights' shapes', not their values), every stage on the
GPU path (ray.vector_backend=auto: faiss-gpu where installed, else torch on CUDA), training with NCCL.

    python benchmarks/gpu_pipeline.py --out DIR [--rows 200000] [--gpu-check DIR/gpu_check.json] [--tokenizer DIR]
    python benchmarks/gpu_pipeline.py --out DIR --quick      (a tiny BERT on this CPU: checks the script only)

Per stage (report/costs.json of the run, one record each): wall time, the GPU's busy fraction while it ran (nvidia-smi
sampled every 200 ms: the share of time a kernel was running), rows/s, and the device that did the work (the stage's
own record where it keeps one, else "gpu" when the GPU was busy >= 5% of the stage). `clusterscale plan` is asked
beforehand for the same rows, config and GPU (with --gpu-check's rates) and its per-stage walls are put beside.
The JSON it writes (DIR/gpu_pipeline.json) is gpu_check.py's with "pipeline" and "plan" added, so `clusterscale plan
--gpu-calibration DIR/gpu_pipeline.json` reads it. benchmarks/gpu_pipeline.sh installs Ray from a wheelhouse first.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow.parquet as pq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from clusterscale.stages.synthetic import SynthSpec, synth_rows  # noqa: E402  (numpy and pyarrow only)

BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
BUSY_SAMPLE_S = 0.2
# A random encoder puts every text near every other (nearest-neighbour cosine 0.972-0.995 over 600 synth passages
# for both shapes, measured 2026-12-06): at the usual 0.95 dedup's held-out check would remove every pair. Above
# them, dedup still makes every comparison (the cost being timed) and removes what is really a near-copy.
SEMANTIC_THRESHOLD = 0.999


def write_encoder(out: str, shape: dict, tokenizer_dir: str | None) -> int:
    """A randomly initialised BERT of `shape` (seed 0) saved as a sentence-transformers folder with mean pooling, the
    tokenizer from tokenizer_dir (else the bundled MiniLM's); its parameter count without the embedding tables."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from clusterscale.modeling.encoder import resolve_model_path, save_sentence_transformers_dir

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or resolve_model_path("bundled"))
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **shape))
    save_sentence_transformers_dir(model, tokenizer, out, pooling="mean", max_length=128)
    tables = sum(p.numel() for n, p in model.named_parameters() if "embeddings" in n)
    return sum(p.numel() for p in model.parameters()) - tables


def write_pairs(path: str, rows: int) -> float:
    """`rows` synthetic topical pairs (clusterscale synth's texts: 12-40 pseudo-words per passage) as one Parquet
    file; the mean number of characters per passage."""
    spec = SynthSpec(rows=rows, dim=8, topics=100)
    writer, chars, step = None, 0, 50_000
    for start in range(0, rows, step):
        table = synth_rows(spec, start, min(rows, start + step)).select(["query", "passage", "source"])
        chars += sum(len(t) for t in table.column("passage").to_pylist())
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return chars / rows


class BusySampler:
    """nvidia-smi's utilization.gpu every BUSY_SAMPLE_S, stamped with this clock; nothing where there is no GPU."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          f"-lms={int(BUSY_SAMPLE_S * 1000)}"], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((time.time(), float(line.split(",")[0]) / 100))
            except ValueError:
                pass

    def busy(self, start: float, end: float) -> float | None:
        inside = [u for t, u in self.samples if start <= t <= end]
        return round(float(np.mean(inside)), 3) if inside else None

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()


def clusterscale(*args: str, log: str, env: dict) -> None:
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "clusterscale.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                              env=env)
    if done.returncode:
        sys.exit(f"`clusterscale {' '.join(args[:1])}` failed (exit {done.returncode}): see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Folder for gpu_pipeline.json, plan.json and the logs.")
    parser.add_argument("--work", help="Folder for the pairs, the encoder and the run directory (default: a "
                                       "temporary folder, removed at the end).")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--gpu-check", help="gpu_check.py's JSON from this node: plan's GPU rates, and the base of "
                                            "the JSON written here.")
    parser.add_argument("--tokenizer", help="A tokenizer folder (default: the bundled MiniLM's).")
    parser.add_argument("--quick", action="store_true", help="A tiny BERT on the CPU and 3,000 rows: a test.")
    args = parser.parse_args()
    rows = 3_000 if args.quick else args.rows
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    work = os.path.abspath(args.work) if args.work else tempfile.mkdtemp(prefix="gpu-pipeline-")
    run, encoder, pairs = (os.path.join(work, name) for name in ("run", "encoder", "pairs.parquet"))
    shutil.rmtree(run, ignore_errors=True)
    try:
        measure(args, rows, out, run, encoder, pairs)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def measure(args, rows: int, out: str, run: str, encoder: str, pairs: str) -> None:
    started = time.time()
    params = write_encoder(encoder, TINY if args.quick else BERT_BASE, args.tokenizer)
    passage_chars = write_pairs(pairs, rows)
    print(f"[gpu_pipeline] {rows} pairs and a {params / 1e6:.1f}M-parameter encoder written in "
          f"{time.time() - started:.0f}s", flush=True)
    gpu = not args.quick
    keys = [f"data.path={pairs}", "data.source_column=source", f"embed.model={encoder}", "embed.side=both",
            "embed.max_length=128", f"embed.batch_size={512 if gpu else 64}", f"cluster.k={args.k if gpu else 4}",
            "dedup.exact=true", f"dedup.semantic_threshold={SEMANTIC_THRESHOLD}", f"train.init={encoder}", f"train.tokenizer={encoder}",
            f"train.use_gpu={str(gpu).lower()}", "train.num_workers=1",
            f"train.global_batch_size={256 if gpu else 32}", f"train.steps={args.train_steps if gpu else 4}",
            "train.query_max_length=32", "train.passage_max_length=128",
            "ray.vector_backend=auto"]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # This machine (its CPUs, memory and GPUs: plan.cluster.this_machine), at the run's rows and keys.
    plan_args = ["plan", "--rows", str(rows), "--json", os.path.join(out, "plan.json"), "--set", *keys]
    if args.gpu_check:
        plan_args[3:3] = ["--gpu-calibration", args.gpu_check]
    clusterscale(*plan_args, log=os.path.join(out, "plan.log"), env=env)
    sampler = BusySampler()
    run_started = time.time()
    try:
        clusterscale("run", "--run-dir", run, "--set", *keys, log=os.path.join(out, "run.log"), env=env)
        # mine after the run, not inside it: training with mined negatives writes sidecars through Ray Data's join,
        # which needs polars (a 54 MB wheel: Ray's and it do not fit one 64 MiB carry); the search is mine's GPU work.
        clusterscale("mine", "--run-dir", run, "--set", *keys, log=os.path.join(out, "mine.log"), env=env)
    finally:
        sampler.stop()
    run_wall = time.time() - run_started
    shutil.copy(os.path.join(run, "report", "costs.json"), os.path.join(out, "costs.json"))
    with open(os.path.join(run, "report", "costs.json")) as f:
        costs = json.load(f)
    with open(os.path.join(out, "plan.json")) as f:
        plan = json.load(f)
    stages = {}
    for name, record in costs.items():
        begin = record.get("started_unix")
        wall = float(record.get("wall_s") or record.get("invocation_s") or 0.0)
        busy = sampler.busy(begin, begin + float(record.get("invocation_s", wall))) if begin else None
        stage_rows = (record.get("rows_embedded") or record.get("assigned") or record.get("n_sample")
                      or record.get("rows"))  # fit: the sample, once per Lloyd step
        device = record.get("device") or ("gpu" if (busy or 0) >= 0.05 else "cpu")
        predicted = plan.get("stages", {}).get(name.split(":")[0], {})
        stages[name] = {"device": device, "wall_s": round(wall, 2), "gpu_busy": busy,
                        "rows_per_s": record.get("pairs_per_s") or (round(stage_rows / wall, 1)
                                                                     if stage_rows and wall else None),
                        "plan_wall_s": None if predicted.get("wall_s") is None else round(predicted["wall_s"], 1),
                        "plan_runs_on": predicted.get("runs_on")}
    result = {}
    if args.gpu_check:
        with open(args.gpu_check) as f:
            result = json.load(f)
    embed = costs.get("embed", {})
    texts_per_s = 2 * embed.get("rows_embedded", 0) / max(1e-9, float(embed.get("wall_s", 0) or 1e-9))
    tokens = mean_tokens(encoder, pairs)
    peak = result.get("peak_flops")
    result |= {"format": result.get("format", "clusterscale-gpu-check/1"), "pipeline_rows": rows,
               "pipeline_wall_s": round(run_wall, 1), "pipeline_quick": args.quick, "pipeline": stages,
               "pipeline_keys": keys,
               "plan_wall_s": round(sum(s["wall_s"] or 0 for s in plan.get("stages", {}).values()), 1),
               "embed_pipeline": {"texts_per_s": round(texts_per_s, 1), "mean_tokens": tokens, "params": params,
                                  "batching": embed.get("batching"),
                                  "mfu": round(2 * params * tokens * texts_per_s / peak, 3) if peak else None},
               "machine": {"python": platform.python_version(), "host": platform.node(),
                           "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}}
    with open(os.path.join(out, "gpu_pipeline.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n| stage | device | wall s | GPU busy | rows/s | plan wall s |\n|---|---|---|---|---|---|")
    for name, s in stages.items():
        print(f"| {name} | {s['device']} | {s['wall_s']} | {s['gpu_busy']} | {s['rows_per_s']} | {s['plan_wall_s']} |")
    print(f"\nrun {run_wall:.0f}s; embed {texts_per_s:.0f} texts/s at {tokens:.0f} tokens (passages {passage_chars:.0f} "
          f"chars), MFU {result['embed_pipeline']['mfu']}, {embed.get('batching')} batches; {os.path.join(out, 'gpu_pipeline.json')}", flush=True)


def mean_tokens(encoder: str, pairs: str, sample: int = 2000) -> float:
    """Mean tokens per embedded text (queries and passages, as embed.side=both embeds them) over a sample."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(encoder)
    table = pq.read_table(pairs).slice(0, sample)
    texts = table.column("query").to_pylist() + table.column("passage").to_pylist()
    ids = tokenizer(texts, truncation=True, max_length=128)["input_ids"]
    return round(float(np.mean([len(i) for i in ids])), 1)


if __name__ == "__main__":
    main()
