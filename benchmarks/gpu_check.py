"""GPU rates for `clusterscale plan`, measured with the stages' compute cores and nothing but torch, transformers,
pyarrow and numpy (the lent GPU machine has no Ray and no faiss):

  - the encoder forward in bf16: passages/s and MFU of MiniLM-L6 and BERT-base at 256 tokens (randomly
    initialised from their configs: the FLOPs are the weights', not their values);
  - the embed stage's encoder core (clusterscale Encoder) on BERT-base at 40-160-token passages, padded and packed
    (embed.packing; issue 52's goal: >= 40% MFU);
  - the training step: InfoNCE (clusterscale.train.loss) with GradCache (clusterscale.train.gradcache) on a
    BERT-base student, AdamW, bf16 autocast: pairs/s and MFU;
  - assignment as a torch matmul + argmax against k centroids: rows/s;
  - a mine search group's exact top-k (runtime/vector_search, the torch backend): queries/s with the float64
    rescoring on the device (TorchIPIndex.top_k, as shipped) against the float32 search on the device and the
    rescoring on one CPU core (top_k's CPU path, as before), and the rows both return compared.

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.json] [--quick] [--budget-s 420]

MFU = model FLOPs / time / the GPU's datasheet bf16 peak (train/metrics.GPU_PEAK_TFLOPS); model FLOPs are
2 x params x tokens for a forward and 6 x params x tokens for a training step (params without the embedding
tables) (attention's s^2 terms left out,
GradCache's re-forward counted as overhead, so that plan's 6 x params x tokens / MFU gives the time). --quick runs
tiny models on the CPU in seconds (a test of the script, not a figure).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from clusterscale.train.gradcache import grad_cache_backward  # noqa: E402  (torch-only cores)
from clusterscale.train.loss import info_nce  # noqa: E402
from clusterscale.runtime import vector_search  # noqa: E402  (numpy and torch; faiss only when asked for)

FORMAT = "clusterscale-gpu-check/1"  # plan/rates.GPU_CALIBRATION_FORMAT
# Shapes from the models' config.json files: all-MiniLM-L6-v2 and bert-base-uncased.
ENCODERS = {"minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
            "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    try:
        from clusterscale.train.metrics import GPU_PEAK_TFLOPS
    except ImportError:  # metrics needs the config layer's dependencies; the figure then has no MFU
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in GPU_PEAK_TFLOPS.items() if k in name), None)


def bert(shape: dict, device: torch.device):
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=30522, max_position_embeddings=512, **shape), add_pooling_layer=False)
    return model.to(device)


def params_of(model) -> int:
    """Parameters without the embedding tables (they do no FLOPs per token), as clusterscale plan counts them."""
    return sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.embeddings.parameters())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MIN_ITERS = 3


def timed(fn, device: torch.device, seconds: float) -> tuple[float, int]:
    """Mean seconds per call over at least MIN_ITERS calls and about `seconds`, after a warm-up call."""
    fn()
    sync(device)
    iters, started = 0, time.perf_counter()
    while iters < MIN_ITERS or time.perf_counter() - started < seconds:
        fn()
        iters += 1
    sync(device)
    return (time.perf_counter() - started) / iters, iters


def encoder_rate(name: str, shape: dict, device, tokens: int, batch: int, seconds: float, peak) -> dict:
    model = bert(shape, device).eval()
    ids = torch.randint(1000, 30000, (batch, tokens), device=device)
    mask = torch.ones_like(ids)

    def forward():
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0].float()

    per_call, iters = timed(forward, device, seconds)
    params = params_of(model)
    flops_per_s = 2.0 * params * tokens * batch / per_call
    del model
    return {"params": params, "tokens": tokens, "batch": batch, "iters": iters,
            "passages_per_s": batch / per_call, "flops_per_s": flops_per_s,
            "mfu": flops_per_s / peak if peak else None}


def encoder_core_rates(shape: dict, device, texts: int, seconds: float, peak) -> dict:
    """What the embed stage's GPU actors run (clusterscale Encoder.encode_tokens: length-sorted token-budget batches)
    on ~100-token passages of varied length (40-160 tokens, like real passages), padded and packed
    (embed.packing): passages/s and MFU of each, and which attention kernel packing used."""
    import tempfile

    import numpy as np

    from clusterscale.modeling.encoder import Encoder, save_sentence_transformers_dir
    from clusterscale.modeling.model_files import resolve_model_path
    from clusterscale.modeling.tokens import Tokens
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("bundled"))
    folder = tempfile.mkdtemp(prefix="gpu-check-encoder-")
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **shape))  # as AutoModel loads
    save_sentence_transformers_dir(model, tokenizer, folder, "cls", 256)
    rng = np.random.default_rng(0)
    lengths = rng.integers(40, 161, size=texts)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(1000, 30000, size=int(offsets[-1])).astype(np.int32)
    tokens = Tokens(ids, offsets, np.zeros(texts, dtype=bool))
    out = {"texts": texts, "mean_tokens": float(lengths.mean())}
    for mode in ("padded", "packed"):
        try:
            encoder = Encoder(folder, device=str(device), packing=mode)
        except Exception as exc:  # noqa: BLE001 - packing refused by this model or machine: say so, go on
            out[mode] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        per_call, iters = timed(lambda: encoder.encode_tokens(tokens, batch_size=1024), device, seconds)
        params = params_of(encoder.model)
        flops_per_s = 2.0 * params * float(lengths.sum()) / per_call
        out[mode] = {"batching": encoder.batching, "passages_per_s": texts / per_call, "iters": iters,
                     "mfu": flops_per_s / peak if peak else None}
        del encoder
    return out


def train_rate(shape: dict, device, batch: int, chunk: int, q_tokens: int, p_tokens: int, seconds: float,
               peak) -> dict:
    model = bert(shape, device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    q = torch.randint(1000, 30000, (batch, q_tokens), device=device)
    p = torch.randint(1000, 30000, (batch, p_tokens), device=device)
    keys = torch.arange(batch, device=device)

    def forward_chunk(rows: slice):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            eq = model(input_ids=q[rows]).last_hidden_state[:, 0]
            ep = model(input_ids=p[rows]).last_hidden_state[:, 0]
        return torch.nn.functional.normalize(eq.float(), dim=-1), torch.nn.functional.normalize(ep.float(), dim=-1)

    def step():
        opt.zero_grad(set_to_none=True)
        grad_cache_backward(model, forward_chunk, batch, chunk,
                            lambda eq, ep: info_nce(eq, ep, 0.02, keys, keys), device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    per_call, iters = timed(step, device, seconds)
    params = params_of(model)
    flops_per_s = 6.0 * params * (q_tokens + p_tokens) * batch / per_call
    memory = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    del model, opt
    return {"params": params, "pairs_per_step": batch, "grad_cache_chunk": chunk, "tokens": q_tokens + p_tokens,
            "iters": iters, "pairs_per_s": batch / per_call, "flops_per_s": flops_per_s,
            "mfu": flops_per_s / peak if peak else None, "max_memory_gib": memory}


def assign_rate(device, rows: int, dim: int, k: int, seconds: float) -> dict:
    x = torch.nn.functional.normalize(torch.randn(rows, dim, device=device), dim=-1).to(torch.bfloat16)
    c = torch.nn.functional.normalize(torch.randn(k, dim, device=device), dim=-1).to(torch.bfloat16)

    def assign():
        sims = x @ c.T
        sims.max(dim=1)

    per_call, iters = timed(assign, device, seconds)
    return {"rows": rows, "dim": dim, "k": k, "iters": iters, "rows_per_s": rows / per_call,
            "rows_x_k_x_d_per_s": rows * k * dim / per_call}


def search_rate(device, passages: int, queries: int, dim: int, k: int, seconds: float) -> dict:
    """A mine search group (mine_search.search_chunks: one block of mine.query_batch_size queries against the group's
    passages, range_max candidates): top_k with the rescoring on the device, against the float32 search there and
    the float64 rescoring on the CPU (vector_search.rescore, top_k's CPU path, one thread as a search task has)."""
    import numpy as np

    rng = np.random.default_rng(0)
    base = rng.standard_normal((passages, dim), dtype=np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    q = rng.standard_normal((queries, dim), dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    index = vector_search.TorchIPIndex(base, device.type)
    wide = min(k + vector_search.RESCORE_MARGIN, passages)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    on_device, _ = timed(lambda: index.top_k(q, k), device, seconds)
    search_only, _ = timed(lambda: index.search(q, wide), device, seconds)
    rows = index.search(q, wide)[1]
    rescore_cpu, _ = timed(lambda: vector_search.rescore(q, base, rows, k), torch.device("cpu"), seconds)
    cpu_scores, cpu_rows = vector_search.rescore(q, base, rows, k)  # top_k's CPU path, its blocks
    scores, found = index.top_k(q, k)
    torch.set_num_threads(threads)
    return {"passages": passages, "queries": queries, "dim": dim, "k": k,
            "queries_per_s_rescored_on_device": queries / on_device,
            "queries_per_s_rescored_on_cpu": queries / (search_only + rescore_cpu),
            "search_s": search_only, "rescore_cpu_s": rescore_cpu, "top_k_on_device_s": on_device,
            "same_rows": bool((found == cpu_rows).all()),
            "max_score_diff": float(np.abs(scores - cpu_scores).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="Tiny models on the CPU, a second each (a test).")
    parser.add_argument("--seconds", type=float, default=20.0, help="Timed seconds per measurement.")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    peak = peak_flops(device)
    seconds = 0.0 if args.quick else args.seconds
    if args.quick:
        global MIN_ITERS
        MIN_ITERS = 1
    started = time.time()
    out = {"format": FORMAT, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor()})",
           "peak_flops": peak, "torch": torch.__version__, "quick": args.quick, "encoder": {}}
    for name, shape in ENCODERS.items():
        out["encoder"][name] = encoder_rate(name, TINY if args.quick else shape, device, 32 if args.quick else 256,
                                            4 if args.quick else 512, seconds, peak)
        print(f"encoder {name}: {out['encoder'][name]['passages_per_s']:,.0f} passages/s, MFU "
              f"{out['encoder'][name]['mfu']}", flush=True)
    out["encoder_core"] = encoder_core_rates(TINY if args.quick else ENCODERS["bert-base"], device,
                                             64 if args.quick else 20_000, seconds, peak)
    for mode in ("padded", "packed"):
        core = out["encoder_core"][mode]
        print(f"encoder core, BERT-base shape, {mode}: " + (core["error"] if "error" in core else
              f"{core['passages_per_s']:,.0f} passages/s at {out['encoder_core']['mean_tokens']:.0f} tokens, "
              f"MFU {core['mfu']} ({core['batching']})"), flush=True)
    out["train_step"] = train_rate(TINY if args.quick else ENCODERS["bert-base"], device, 8 if args.quick else 512,
                                   4 if args.quick else 128, 8 if args.quick else 32, 16 if args.quick else 256,
                                   seconds, peak)
    print(f"train step: {out['train_step']['pairs_per_s']:,.0f} pairs/s, MFU {out['train_step']['mfu']}", flush=True)
    out["assign"] = [assign_rate(device, 1024 if args.quick else 1_000_000, 32 if args.quick else 768, k, seconds)
                     for k in ((8,) if args.quick else (1000, 10000))]
    out["search"] = [search_rate(device, p, 512 if args.quick else 4096, 32 if args.quick else d, 30, seconds / 4)
                     for p, d in (((600, 32),) if args.quick else ((25_000, 384), (100_000, 768)))]
    for r in out["search"]:
        print(f"mine search, {r['passages']:,} passages at d = {r['dim']}: "
              f"{r['queries_per_s_rescored_on_device']:,.0f} "
              f"queries/s rescored on the device, {r['queries_per_s_rescored_on_cpu']:,.0f} with the CPU's rescoring "
              f"(same rows: {r['same_rows']})", flush=True)
    out["wall_s"] = time.time() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"written {args.out} in {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
