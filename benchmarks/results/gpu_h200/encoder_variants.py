"""Encoder core variants on GPU: autocast fp32 weights (current) vs bf16 weights; texts per pass 256 vs 1024."""
import json, os, sys, tempfile, time
import torch
sys.argv = ["x"]
import clusterscale.io.builtin_data as b
b.builtin_docstrings_path = lambda: ".gpu/docstrings.parquet"
sys.path.insert(0, "benchmarks")
import bench_embed as be
from transformers import AutoTokenizer, BertConfig, BertModel
from clusterscale.modeling.encoder import Encoder, resolve_model_path, save_sentence_transformers_dir

out = os.environ["OUT"]
texts = be.msmarco_like_texts(40000)
def minilm_dir(d):
    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled"))
    torch.manual_seed(0)
    m = BertModel(BertConfig(vocab_size=len(tok), hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                             intermediate_size=1536), add_pooling_layer=False)
    save_sentence_transformers_dir(m, tok, d, pooling="mean", max_length=512)
    return d
res = {}
for name, make in (("bert-base", be.bert_base_dir), ("minilm", minilm_dir)):
    path = make(tempfile.mkdtemp())
    enc = Encoder(path, max_length=256, device="cuda")
    tok = enc.tokenize(texts)
    mean = float(tok.lengths.mean())
    fpt = be.flops_per_token(enc.model.config, mean)
    ref_rows = tok.lengths[:0]
    with torch.no_grad():
        enc32 = Encoder(path, max_length=256, device="cuda")
    sub = enc.tokenize(texts[:512])
    # fp32 reference without autocast
    enc32.device_type_backup = None
    import clusterscale.modeling.encoder as E
    for variant, bf16, bs, budget in (("autocast", False, 256, 65536), ("autocast", False, 1024, 65536),
                                      ("bf16-weights", True, 256, 65536), ("bf16-weights", True, 1024, 65536),
                                      ("bf16-weights", True, 1024, 131072)):
        if bf16:
            enc.model.to(torch.bfloat16)
        else:
            enc.model.to(torch.float32)
        enc.encode_tokens(tok, bs, budget); torch.cuda.synchronize()
        best = 1e9
        for _ in range(3):
            t0 = time.perf_counter(); enc.encode_tokens(tok, bs, budget); torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        rps = len(texts) / best
        key = f"{name} {variant} bs{bs} budget{budget}"
        res[key] = {"rows_per_s": round(rps), "mfu": round(rps * mean * fpt / 989e12, 4), "mean_tokens": round(mean, 1)}
        print(key, res[key], flush=True)
    # numerics: bf16 weights vs fp32 weights without autocast (CPU-equivalent reference) on 512 texts
    enc.model.to(torch.bfloat16); a = enc.encode_tokens(sub, 256)
    enc.model.to(torch.float32); c = enc.encode_tokens(sub, 256)
    with torch.autocast("cuda", enabled=False):
        pass
    enc.device = torch.device("cuda")
    m = enc.model
    with torch.inference_mode():
        from clusterscale.modeling.encoder import pool
        import numpy as np
        vec = []
        for i in range(0, 512, 64):
            bt = enc._collate(sub, np.arange(i, min(512, i + 64)))
            h = m(**bt).last_hidden_state
            vec.append(torch.nn.functional.normalize(pool(h.float(), bt["attention_mask"], enc.pooling), dim=-1))
        ref = torch.cat(vec).cpu().numpy()
    res[name + " min_cos_bf16_weights_vs_fp32"] = float((a * ref).sum(1).min())
    res[name + " min_cos_autocast_vs_fp32"] = float((c * ref).sum(1).min())
    print(name, "min cos bf16-weights", res[name + " min_cos_bf16_weights_vs_fp32"], "autocast",
          res[name + " min_cos_autocast_vs_fp32"], flush=True)
    del enc, enc32
    torch.cuda.empty_cache()
json.dump(res, open(out + "/variants.json", "w"), indent=1)
