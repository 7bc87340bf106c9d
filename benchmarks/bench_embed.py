"""Embedding throughput: clusterscale's encoder core vs SentenceTransformer.encode, same texts, one process.

    python benchmarks/bench_embed.py                    # bundled MiniLM, docstring passages, CPU fp32
    python benchmarks/bench_embed.py --json out.json    # also write the figures as JSON
    python benchmarks/bench_embed.py --gpu              # BERT-base-sized random encoder, ~60-word texts, bf16

What is timed on the clusterscale side is `clusterscale.modeling.encoder.Encoder` (tokenise once, sort by
length, token-budget batches, SDPA attention): the compute core that each actor of the `embed`
stage runs on its work units. `--stage` additionally times the whole Ray stage (the embed stage) on the
same texts, start-up included (`--skip-st` leaves out sentence-transformers, for large `--rows`), and
every run measures the stage's tokenise step (tokens per CPU-second, one thread) and the CPUs per
GPU that tokenising needs at the GPU goal. Both sides embed the same texts with the same model and max length;
the runs alternate (ST, clusterscale, ST, ...) and the best of `--repeats` is kept, so a noisy
shared machine hurts both alike. MFU = useful model FLOPs (no padding) / peak FLOP/s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from clusterscale.modeling.encoder import Encoder, resolve_model_path, save_sentence_transformers_dir  # noqa: E402
from clusterscale.modeling.tokens import TextTokenizer, single_threaded  # noqa: E402

H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA spec sheet, dense (no sparsity)
GPU_GOAL_PASSAGES_PER_S = 28_000  # BERT-base, ~60-word passages, bf16, one H200 at ~40% MFU (README)


def docstring_passages() -> list[str]:
    """The bundled docstring dataset's passages (harvested from installed packages, then cached), in a
    seeded order."""
    import pyarrow.dataset as pads

    from clusterscale.io.builtin_data import builtin_docstrings_path

    table = pads.dataset(builtin_docstrings_path(), format="parquet").to_table(columns=["passage"])
    texts = table.column("passage").to_pylist()
    return [texts[i] for i in np.random.default_rng(0).permutation(len(texts))]


def docstring_texts(rows: int) -> list[str]:
    """Real passages: `rows` docstring passages (~13.6k exist here); beyond those, distinct windows of
    30-90 consecutive words of the same docstring text."""
    passages = docstring_passages()
    picked = passages[:rows]
    return picked + word_windows(" ".join(passages).split(), rows - len(picked))


def word_windows(pool: list[str], rows: int, words: int = 60, seed: int = 1) -> list[str]:
    """`rows` passages of words/2 .. 3 words/2 consecutive words of `pool`, at seeded positions."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, max(1, len(pool) - words), size=max(0, rows))
    return [" ".join(pool[s:s + int(rng.integers(words // 2, words * 3 // 2))]) for s in starts]


def msmarco_like_texts(rows: int, words: int = 60) -> list[str]:
    """~60-word passages cut from the docstring text (MSMARCO passages average ~56 words)."""
    try:
        pool = " ".join(docstring_passages()).split()
    except Exception:  # no harvestable packages: a fixed synthetic vocabulary
        rng = np.random.default_rng(0)
        pool = [f"word{i}" for i in rng.integers(0, 5000, size=rows * words)]
    return word_windows(pool, rows, words)


def flops_per_token(config, mean_length: float) -> float:
    """Forward FLOPs per token: 2 x (dense weights per layer) + attention scores and mixing."""
    d, layers = config.hidden_size, config.num_hidden_layers
    ff = config.intermediate_size
    dense = 2 * layers * (4 * d * d + 2 * d * ff)
    attention = 4 * layers * mean_length * d
    return dense + attention


def measured_matmul_flops(threads: int) -> float:
    """The CPU's fp32 matmul ceiling here, measured (the 'peak' of a CPU MFU)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(2):
        a @ b
    started, n = time.perf_counter(), 10
    for _ in range(n):
        a @ b
    return n * 2 * 2048 ** 3 / (time.perf_counter() - started)


def bert_base_dir(out: str) -> str:
    """A BERT-base-sized encoder with random weights and the bundled uncased vocab (throughput only)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("bundled"))
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(tokenizer)), add_pooling_layer=False)
    save_sentence_transformers_dir(model, tokenizer, out, pooling="cls", max_length=512)
    return out


def loadavg() -> str:
    """The 1/5/15-minute load averages (Linux), recorded with every figure: a busy box skews them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def time_it(fn) -> float:
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def tokenize_per_cpu(tokenizer: TextTokenizer, texts: list[str], repeats: int = 3) -> dict:
    """The embed stage's tokenise step (one single-threaded Rust tokenizer, as in a tokenise task) per
    CPU-second of this process: process time, so a busy machine slows it less than wall time would."""
    single_threaded()
    tokenizer(texts[:64])
    best, tokens = float("inf"), None
    for _ in range(repeats):
        started = time.process_time()
        tokens = tokenizer(texts)
        best = min(best, time.process_time() - started)
    return {"texts": len(texts), "mean_tokens": round(float(tokens.lengths.mean()), 1),
            "texts_per_cpu_s": round(len(texts) / best), "tokens_per_cpu_s": round(float(tokens.lengths.sum()) / best)}


def tokenize_figures(tokenizer: TextTokenizer, texts: list[str]) -> dict:
    """Tokens/s per CPU on the benchmark's texts and on ~60-word passages, and the CPUs one GPU's
    tokenise tasks need at the goal (GPU_GOAL_PASSAGES_PER_S BERT-base passages/s of ~60 words)."""
    ours = tokenize_per_cpu(tokenizer, texts)
    passages = tokenize_per_cpu(tokenizer, msmarco_like_texts(5_000))
    return {"max_length": tokenizer.max_length, "these_texts": ours, "msmarco_like_60_words": passages,
            "goal_passages_per_s_per_gpu": GPU_GOAL_PASSAGES_PER_S,
            "cpus_per_gpu_for_goal": round(GPU_GOAL_PASSAGES_PER_S / passages["texts_per_cpu_s"], 1)}


def stage_figures(texts: list[str], model: str, max_length: int) -> dict:
    """The whole Ray stage on these texts as passages: ingest, then a timed embed stage (its stats)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from clusterscale import config as config_mod
    from clusterscale.pipeline import run_stage
    from clusterscale.io.rundir import RunDir
    from clusterscale.runtime.session import init_ray

    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(pa.table({"query": [t[:40] for t in texts], "passage": texts}), f"{tmp}/in.parquet")
        cfg = config_mod.load(None, [f"data.path={tmp}/in.parquet", "data.heldout_fraction=0",
                                     f"embed.model={model}", f"embed.max_length={max_length}"])
        init_ray(cfg.ray)
        run = RunDir(f"{tmp}/run")
        run_stage("ingest", cfg, run)
        return run_stage("embed", cfg, run).stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1500)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--st-batch-size", type=int, default=32, help="SentenceTransformer.encode batch size "
                        "(32, its default)")
    parser.add_argument("--batch-size", type=int, default=256, help="clusterscale: most texts per pass")
    parser.add_argument("--max-tokens-per-batch", type=int, default=0, help="clusterscale token budget; "
                        "0 = the Encoder default for the device")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="BERT-base random weights, ~60-word texts, bf16")
    parser.add_argument("--stage", action="store_true", help="also time the Ray stage (embed)")
    parser.add_argument("--skip-st", action="store_true", help="time only clusterscale (core, stage): for "
                        "large --rows, where each SentenceTransformer pass takes as long as the core's")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    if args.gpu:
        if not torch.cuda.is_available():
            sys.exit("--gpu needs a CUDA device.")
        model_path, texts, device = bert_base_dir(tmp.name), msmarco_like_texts(args.rows), "cuda"
        st = SentenceTransformer(model_path, device=device, model_kwargs={"dtype": torch.bfloat16})
        peak, peak_name = H200_BF16_DENSE_FLOPS, "H200 bf16 dense spec"
    else:
        model_path, texts, device = resolve_model_path("bundled"), docstring_texts(args.rows), "cpu"
        st = SentenceTransformer(model_path, device=device)
        peak, peak_name = measured_matmul_flops(args.threads), "measured fp32 matmul"
    st.max_seq_length = args.max_length
    ours = Encoder(model_path, max_length=args.max_length, device=device, threads=args.threads,
                   max_tokens_per_batch=args.max_tokens_per_batch)
    warm = texts[:64]
    st.encode(warm, batch_size=args.st_batch_size)
    ours.encode(warm, batch_size=args.batch_size)

    load_before = loadavg()
    st_s, cs_s = [], []
    for _ in range(args.repeats):
        if not args.skip_st:
            st_s.append(time_it(lambda: st.encode(texts, batch_size=args.st_batch_size)))
        cs_s.append(time_it(lambda: ours.encode(texts, batch_size=args.batch_size)))
    a = ours.encode(texts[:200], batch_size=args.batch_size)
    b = st.encode(texts[:200], batch_size=args.st_batch_size, normalize_embeddings=True, convert_to_numpy=True)
    min_cos = float((a * b.astype(np.float32)).sum(1).min())

    tokens = ours.tokenize(texts)
    mean_len = float(tokens.lengths.mean())
    fpt = flops_per_token(ours.model.config, mean_len)
    cs_rps = len(texts) / min(cs_s)
    st_rps = len(texts) / min(st_s) if st_s else float("nan")
    result = {"command": " ".join(sys.argv), "load_before": load_before,
        "mode": "gpu" if args.gpu else "cpu", "device": torch.cuda.get_device_name() if args.gpu else
        f"cpu x{args.threads} threads", "model": "bert-base (random)" if args.gpu else "all-MiniLM-L6-v2",
        "rows": len(texts), "max_length": args.max_length, "mean_tokens": round(mean_len, 1),
        "truncated": int(tokens.truncated.sum()), "timed": "clusterscale.modeling.encoder.Encoder.encode",
        "clusterscale_rows_per_s": round(cs_rps, 1), "sentence_transformers_rows_per_s": round(st_rps, 1),
        "ratio": round(cs_rps / st_rps, 3) if st_s else None, "flops_per_token": round(fpt),
        "peak_flops": round(peak), "peak": peak_name,
        "clusterscale_mfu": round(cs_rps * mean_len * fpt / peak, 4),
        "sentence_transformers_mfu": round(st_rps * mean_len * fpt / peak, 4) if st_s else None,
        "min_cosine_vs_st": round(min_cos, 5),
        "settings": {"st_batch_size": args.st_batch_size, "batch_size": args.batch_size,
                     "max_tokens_per_batch": ours.max_tokens_per_batch, "repeats": args.repeats},
    }
    result["tokenize"] = tokenize_figures(ours.text_tokenizer, texts)
    if args.stage:
        stage = stage_figures(texts, model_path, args.max_length)
        result["stage"] = {key: stage[key] for key in ("rows", "units", "actors", "wall_s", "rows_per_s", "busy_s")}
        result["stage_rows_per_s"] = stage["rows_per_s"]
        result["stage_over_core"] = round(stage["rows_per_s"] / cs_rps, 3)
    result["load_after"] = loadavg()
    print(f"{len(texts)} texts, mean {mean_len:.0f} tokens (max {args.max_length}), {result['device']}")
    if st_s:
        print(f"sentence-transformers: {st_rps:8.1f} rows/s  MFU {result['sentence_transformers_mfu']:.1%}")
    print(f"clusterscale Encoder:  {cs_rps:8.1f} rows/s  MFU {result['clusterscale_mfu']:.1%}")
    print(f"ratio to ST {result['ratio']}; min cosine to ST {min_cos:.5f}; peak = {peak_name} {peak / 1e9:.0f} GFLOP/s")
    tok = result["tokenize"]
    print(f"tokenise (1 thread, max length {args.max_length}): {tok['these_texts']['tokens_per_cpu_s']:,} tokens "
          f"per CPU-s on these texts; {tok['msmarco_like_60_words']['texts_per_cpu_s']:,} ~60-word passages per "
          f"CPU-s => {tok['cpus_per_gpu_for_goal']} CPUs per GPU at {GPU_GOAL_PASSAGES_PER_S:,} passages/s")
    if args.stage:
        print(f"Ray stage (embed, start-up included): {result['stage_rows_per_s']:.1f} rows/s = "
              f"{result['stage_over_core']:.0%} of the core's")
    print(f"load average before {load_before}, after {result['load_after']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
