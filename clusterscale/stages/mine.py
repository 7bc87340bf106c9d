"""Mine: hard negatives for every training query from the training passages (the ANCE step), sharded by cluster.

Run with `clusterscale mine [CONFIG] --run-dir R` (after `shard`). The search is split by the k-means
clusters of cluster.k: a query searches only the passages of its mine.nprobe nearest clusters (nprobe >=
k: exact search over all passages). A counting pass (map tasks; k-vectors summed on the driver) gives each
cluster's passages and probing queries; a cluster with more than mine.max_group_rows passages (auto: what a
quarter of a search task's memory holds, mine_search.auto_group_bounds), or more than nprobe times that many
probing queries, is split into several search groups (mine_search.SearchGroups). A cluster within those
bounds is one group: its passages travel once, each query once per probed cluster. Then three Ray Data
steps, none of which holds all passages:
  1. route (map tasks over assign/k=<k>/): each passage to the groups of its own cluster, each query to the
     groups of every probed cluster, each row with the text keys of its pair (runtime/hashing.text_hashes);
  2. group by search group: one faiss index over the group's passages, searched by the queries routed there
     (top mine.range_max, ties broken by pair_id);
  3. group by a hash bucket of the query's pair_id: merge each query's top mine.range_max over its search
     groups, keep ranks [range_min, range_max) that are not a positive of the query (a pair with the same
     query text), not a duplicate of its positive passage text and, with mine.margin, score <= margin x the
     positive's score; write negatives/part-<bucket>.parquet atomically.
The driver holds the centroids (k x d) and counters; every other process holds O(a block) or O(a group).
Vectors: mine.encoder=frozen uses assign/ (the
queries' emb_query, or the queries embedded by an actor pool when embed.side=passage); any other encoder
re-embeds every training pair into the child run mine_encoder/, joined to assign/ by pair_id, and a query
then probes the clusters nearest to its own pair's centroid (the centroids live in the frozen space).
The stage reruns as a whole to the same output. Output columns: pair_id, neg_pair_ids list<int64>,
neg_scores list<float32> (best first), pos_score. Then (stages/mine_rows.py) a padding pool goes to
negatives/padding.parquet and, when the config trains with mined negatives, the texts of the candidates its
training draws (not every candidate's) to sidecar pieces aligned to the shard files it reads.
"""
from __future__ import annotations

import json
import math
import posixpath
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from clusterscale.config import Config, ConfigError, EmbedConfig, MineConfig, variant
from clusterscale.stages.kmeans import load_centroids
from clusterscale.stages.mine_rows import sidecars_for_training
from clusterscale.stages.mine_search import (CANDIDATE_BYTES, DROP_REASONS, PASSAGE, ROUTED_ROW_BYTES, SearchGroups,
                                             auto_group_bounds, cluster_counts, merge_candidates,
                                             queries_from_neighbours, route_rows, search_chunks)
from clusterscale.io.sizing import QUERIES_PER_FILE
from clusterscale.io.layout import NEGATIVES, assign_dir, model_dir
from clusterscale.runtime.progress import ProgressLine
from clusterscale.io.rundir import RunDir, StageMissingError, StageResult
from clusterscale.runtime.resources import ActorPlan, ClusterResources, Resources, plan_actors
from clusterscale.runtime.bounded_data import (ShuffleSettings, bounded_shuffle_maps, one_key_per_partition,
                                               read_row_groups, release_freed_memory, shuffle_for)
from clusterscale.runtime.work_units import load_or_make_plan, split_done
from clusterscale.runtime import faiss_index
from clusterscale.runtime.session import faiss_runtime_env
from clusterscale.runtime.stage_context import StageContext
from clusterscale.runtime.vector_search import wants_gpus
from clusterscale.runtime.nodes import node_stats, this_node, unit_delay_for_tests
from clusterscale.stages.synthetic import synthetic_embeddings

PLAN = f"{NEGATIVES}/_plan.json"
SEARCH_DIR = f"{NEGATIVES}/_search"  # each search group's results until every bucket is merged
# A search group's queries per results file, the most a lost search task costs: about SEARCH_CHUNK_MACS multiply-adds
# (queries x the group's passages x d: a few seconds of one CPU core), within SEARCH_CHUNK_QUERIES (the lower bound
# keeps the files few: ~24k at 100M pairs with nprobe 4). The plan records the rule (a rerun cuts the chunks an
# earlier attempt cut); a plan without it chunks as before it was recorded (32,768 queries).
SEARCH_CHUNK_MACS = 2**37
SEARCH_CHUNK_QUERIES = (16_384, 32_768)
UNRECORDED_CHUNKS = {"macs": 0, "min": 32_768, "max": 32_768}
SEARCH_COLUMNS = ["bucket", "pair_id", "pos_score", "cand_scores", "cand_ids", "cand_flags"]
SEARCH_ROW_BYTES = 28  # a search result row besides its candidates: bucket, pair_id, pos_score, 3 list offsets
ENCODER_RUN = "mine_encoder"  # child run directory holding the re-embedding of a non-frozen encoder
MIN_BUCKETS, MIN_BUCKET_QUERIES = 16, 1_000  # at least 16 files (of >= 1,000 queries): what a killed merge loses
DEFAULT_TASK_MEMORY_BYTES = 2 * 1024**3  # a search task's memory where Ray reports none
COUNTS_KEY = "clusterscale.mine.counts"  # a negatives/ file's counts, in its Parquet footer
FOOTER_THREADS = 16  # parallel footer reads of the resume path (object stores: one request each)
# The bucket files' encoding: zstd, no dictionary, the scores' bytes split by significance (40% less than snappy
# with dictionaries on synth candidates: 219 -> 130 bytes per query of 29 candidates).
PARTS_WRITE = {"compression": "zstd", "use_dictionary": False,
               "column_encoding": {"neg_scores.list.element": "BYTE_STREAM_SPLIT", "pos_score": "BYTE_STREAM_SPLIT"}}


# --- which vectors ----------------------------------------------------------------------------------------
def resolve_encoder(cfg: Config, run: RunDir) -> str | None:
    """None for the frozen encoder, else a local model folder or hub id to re-embed with."""
    encoder = cfg.mine.encoder
    if encoder == "frozen":
        if cfg.embed.side == "query":
            raise ConfigError("mine.encoder=frozen needs passage vectors in embeddings/, but embed.side=query: "
                              "use embed.side=passage or both (new --run-dir), or set mine.encoder to a model.")
        if cfg.embed.side != "both" and synthetic_embeddings(run):
            raise ConfigError("mine.encoder=frozen on a synthetic run (`clusterscale synth`) needs the synthetic "
                              f"query vectors, but this run has embed.side={cfg.embed.side}: {cfg.embed.model} "
                              "cannot embed queries into the space of synthetic passage vectors. Write the synth "
                              "run with --set embed.side=both (new --run-dir).")
        return None
    if encoder.startswith("train:"):
        name = encoder.split(":", 1)[1]
        if not run.exists(model_dir(name)):
            raise StageMissingError(f"mine.encoder={encoder}: no exported model at {run.path(model_dir(name))}; "
                                    f"run `clusterscale train --set train.name={name}` first.")
        return run.child_uri(model_dir(name))  # every node can read it (object stores: copied per node)
    return encoder


def vectors_run(ctx: StageContext, encoder: str | None) -> tuple[RunDir, dict]:
    """(the run directory whose embeddings/ is mined, the stats of making it): the embed stage, run through the
    executor (so the child run has its own done marker), into a child run reading run's pairs."""
    cfg, run = ctx.cfg, ctx.run
    if encoder is None:
        return run, {}
    child = RunDir(run.child_uri(ENCODER_RUN))
    child_cfg = variant(cfg, embed={"model": encoder, "side": "both", "pooling": "auto", "query_prompt": None,
                                    "passage_prompt": None})  # that model's own prompts (a training's: its own)
    print(f"[mine] re-embedding every training pair (queries and passages) with {encoder}", flush=True)
    return child, ctx.stage("embed", child_cfg, child, source=run, cost_key="").stats


# --- the pairs with their vectors and cluster ---------------------------------------------------------------
class EncodeQueries:
    """Ray Data callable class: adds emb_query (the frozen encoder's query vectors) to a batch of pairs."""

    def __init__(self, ec: EmbedConfig, threads: int):
        import torch

        from clusterscale.modeling.encoder import Encoder, frozen_prompts  # torch: in these actors only

        torch.set_num_threads(threads)
        self.batch_size = ec.batch_size
        self.encoder = Encoder(ec.model, pooling=ec.pooling, max_length=ec.max_length,
                               trust_remote_code=ec.trust_remote_code, max_tokens_per_batch=ec.max_tokens_per_batch,
                               packing=ec.packing)
        self.prompt = frozen_prompts(ec)[0]

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = [self.prompt + t for t in batch.column("query").to_pylist()]
        q = np.ascontiguousarray(self.encoder.encode(texts, self.batch_size), np.float32)
        return batch.append_column("emb_query", pa.FixedSizeListArray.from_arrays(pa.array(q.reshape(-1)), q.shape[1]))


def encoder_pool(mc: MineConfig, need: Resources) -> ActorPlan:
    """Query-encoder actors: one per GPU, or on CPU a few (one per 8 CPUs) using the CPUs as torch threads."""
    cluster = ClusterResources.current()
    return plan_actors(need, max_actors=mc.num_actors,
                       cpu_actors=max(1, cluster.cpus // 8), cluster=cluster)


def _schema(run: RunDir, folder: str) -> list[str]:
    with run.fs.open_input_file(run.files(folder)[0]) as f:
        return pq.read_schema(f).names


def pairs_with_vectors(cfg: Config, run: RunDir, source: RunDir, encoder: str | None,
                       need: Resources) -> tuple[ray.data.Dataset, bool]:
    """(rows of pair_id, query, passage, emb, emb_query, cluster; whether the queries are embedded here)."""
    assigned = assign_dir(cfg.cluster.k)
    text = ["pair_id", "query", "passage", "cluster"]
    if encoder is not None:  # re-embedded vectors, joined to the frozen clusters by pair_id
        frozen = read_row_groups(run, run.files(assigned), text)
        vectors = read_row_groups(source, source.files("embeddings"), ["pair_id", "emb", "emb_query"])
        partitions = max(1, len(run.files(assigned)))
        return frozen.join(vectors, "inner", partitions, on=("pair_id",)), False
    has_queries = "emb_query" in _schema(run, assigned)
    if has_queries:
        return read_row_groups(run, run.files(assigned), text + ["emb", "emb_query"]), False
    ds = read_row_groups(run, run.files(assigned), text + ["emb"])
    pool = encoder_pool(cfg.mine, need)
    # CPU actors reserve at most half the CPUs (they still run pool.threads threads), so the read and
    # grouping tasks are never starved (a whole-CPU pool deadlocks Ray Data on a small box).
    options = pool.options if pool.on_gpu else {"num_cpus": min(pool.num_cpus, ClusterResources.current().cpus / 2)}
    # Whole read blocks (one row group each) as batches: a query's vector (its padding, its sub-batch) then never
    # depends on which rows arrived with it, so a rerun ranks near-ties the same way.
    return ds.map_batches(EncodeQueries, fn_constructor_args=(cfg.embed, pool.threads), batch_size=None,
                          batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=pool.actors),
                          **options), True


# --- the search groups ---------------------------------------------------------------------------------------
def _count(batch: pa.Table, centroids: np.ndarray, nprobe: int) -> pa.Table:
    passages, queries = cluster_counts(batch, centroids, nprobe)
    return pa.table({"passages": [passages.tolist()], "queries": [None if queries is None else queries.tolist()]})


def vector_layout(run: RunDir, source: RunDir, cfg: Config, encoder: str | None) -> tuple[int, int]:
    """(d, bytes per stored value) of the vectors mine routes (d: cluster.dims for the frozen vectors when set):
    float16 only when both passage and query vectors are stored as float16 (mine_search._vector_dtype); queries
    embedded during the stage are float32."""
    folder = "embeddings" if encoder is not None else assign_dir(cfg.cluster.k)
    files = (source if encoder is not None else run).files(folder)
    with (source if encoder is not None else run).fs.open_input_file(files[0]) as f:
        schema = pq.read_schema(f)
    types = [schema.field(c).type for c in ("emb", "emb_query") if c in schema.names]
    half = len(types) == 2 and all(t.value_type == pa.float16() for t in types)
    width = types[0].list_size
    if encoder is None and cfg.cluster.dims:  # the frozen vectors are routed on cluster.dims (mine_search.route_rows)
        width = min(width, cfg.cluster.dims)
    return width, 2 if half else 4


def group_bounds(cfg: Config, run: RunDir, source: RunDir, encoder: str | None, k: int) -> tuple[int, int]:
    """(most passages, most queries) of one search group: mine.max_group_rows passages and nprobe x as many
    queries, or with 'auto' what a search task's memory holds (mine_search.auto_group_bounds)."""
    mc = cfg.mine
    nprobe = min(mc.nprobe, k)
    if mc.max_group_rows != "auto":
        return int(mc.max_group_rows), int(mc.max_group_rows) * nprobe
    dim, stored = vector_layout(run, source, cfg, encoder)
    memory = ClusterResources.current().task_memory_bytes or DEFAULT_TASK_MEMORY_BYTES
    return auto_group_bounds(memory, dim, stored, nprobe, mc.query_batch_size, mc.range_max)


def plan_search_groups(cfg: Config, run: RunDir, centroids: np.ndarray, count_queries: bool,
                       bounds: tuple[int, int], n_rows: int = 0) -> SearchGroups:
    """Passages and probing queries per cluster (a pass over assign/; the driver sums k-vectors), split into
    groups of at most bounds = (passages, queries) (group_bounds). count_queries: route each query by its
    emb_query in assign/; otherwise queries probe their own cluster's neighbours (exact for a re-embedding, an
    estimate when the queries are embedded during the stage)."""
    k = len(centroids)
    ds = read_row_groups(run, run.files(assign_dir(cfg.cluster.k)),
                         ["cluster"] + (["emb_query"] if count_queries else []))
    env = {"runtime_env": faiss_runtime_env()} if faiss_runtime_env() else {}
    ds = ds.map_batches(_count, fn_kwargs={"centroids": centroids, "nprobe": cfg.mine.nprobe},
                        batch_format="pyarrow", **env)
    passages, queries = np.zeros(k, np.int64), np.zeros(k, np.int64)
    progress = ProgressLine("mine", n_rows, unit="rows counted")  # n_rows: the rows of assign/ (0: no line)
    for row in ds.iter_rows():
        counted = np.asarray(row["passages"], np.int64)
        passages += counted
        progress.advance(int(counted.sum()))
        if count_queries:
            queries += np.asarray(row["queries"], np.int64)
    if not count_queries:
        queries = queries_from_neighbours(passages, centroids, cfg.mine.nprobe)
    return SearchGroups.plan(passages, queries, *bounds)


# --- the three steps as Ray Data tasks ---------------------------------------------------------------------
# The shuffles group by a stand-in of the group / bucket id that lands in a partition of its own
# (bounded_data.one_key_per_partition): a reduce task then holds one search group or one bucket, whatever N.
# Each search group's results go to negatives/_search/group-<g>/part-<c>.parquet, a chunk of its queries per file
# (chunk_rule), then searched-<g> says the group is done; each bucket goes to its file, written whole: a rerun
# (or Ray's retry) searches only the groups not done, in them only the chunks not written, and merges only the
# buckets not yet written, and the result is the same files (SEARCH_DIR goes once every bucket is written).
def _route(batch: pa.Table, centroids: np.ndarray, nprobe: int, by_query: bool, groups: SearchGroups,
           group_keys: np.ndarray) -> pa.Table:
    """Route a block's rows to the search groups still to do (group_keys: the group's shuffle key, -1 when done)."""
    routed = route_rows(batch, centroids, nprobe, by_query, groups, todo=group_keys >= 0)
    return routed.set_column(routed.schema.get_field_index("group"), "group",
                             pa.array(group_keys[routed.column("group").to_numpy()]))


def chunk_rule() -> dict:
    """How search groups are cut into chunks of queries (recorded in the plan)."""
    return {"macs": SEARCH_CHUNK_MACS, "min": SEARCH_CHUNK_QUERIES[0], "max": SEARCH_CHUNK_QUERIES[1]}


def chunk_queries(rule: dict, passages: int, dim: int) -> int:
    """Queries per chunk of a group of `passages` vectors of `dim`: rule["macs"] multiply-adds, within its bounds."""
    return int(min(rule["max"], max(rule["min"], rule["macs"] // max(1, passages * dim))))


def _search(group: pa.Table, run_uri: str, mine: MineConfig, buckets: int, group_keys: np.ndarray,
            backend: str = "faiss", chunks: dict | None = None) -> pa.Table:
    """Search one group and write its results (one row per routed query: its bucket and top candidates), a chunk of
    its queries per file (chunks: the plan's chunk_rule); the chunks an earlier attempt wrote are kept."""
    faiss_index.set_threads(1)  # one CPU per task: Ray runs one task per CPU
    index = int(np.flatnonzero(group_keys == group.column("group")[0].as_py())[0])
    run, folder = RunDir(run_uri), search_folder(index)
    written = frozenset(int(name[5:10]) for name in (run.listdir(folder) if run.exists(folder) else [])
                        if name.startswith("part-") and name.endswith(".parquet"))
    passages = int((group.column("kind").to_numpy() == PASSAGE).sum())
    size = chunk_queries(chunks or chunk_rule(), passages, group.schema.field("vec").type.list_size)
    queries = 0
    for chunk, out in search_chunks(group, mine, buckets, backend, bool(ray.get_gpu_ids()), size, written):
        unit_delay_for_tests("mine")
        run.write_parquet(f"{folder}/part-{chunk:05d}.parquet", out, compression="zstd")
        queries += out.num_rows
    run.write_bytes(searched_marker(index), b"")  # after every chunk: the group is done
    release_freed_memory()
    return pa.table({"queries": [queries]})


def _to_merge(batch: pa.Table, bucket_keys: np.ndarray) -> pa.Table:
    """Search results of the buckets still to write, keyed for the merge's shuffle (bucket_keys: -1 when done)."""
    keys = bucket_keys[batch.column("bucket").to_numpy()]
    batch = batch.set_column(batch.schema.get_field_index("bucket"), "bucket", pa.array(keys))
    return batch.filter(pa.array(keys >= 0))


def _merge_and_write(group: pa.Table, run_uri: str, mine: MineConfig, bucket_keys: np.ndarray) -> pa.Table:
    """Merge one bucket's queries and write its negatives file, its counts in the footer; returns them (one row)
    and the node that wrote it."""
    unit_delay_for_tests("mine")
    out, drops = merge_candidates(group, mine)
    bucket = int(np.flatnonzero(bucket_keys == group.column("bucket")[0].as_py())[0])
    lengths = pc_list_lengths(out.column("neg_pair_ids"))
    counts = {"rows": out.num_rows, "negatives": int(lengths.sum()), "without_negatives": int((lengths == 0).sum()),
              **{f"dropped_{k}": int(v) for k, v in drops.items()}}
    RunDir(run_uri).write_parquet(bucket_file(bucket), with_counts(out, counts), **PARTS_WRITE)
    release_freed_memory()
    return pa.table({**{k: [v] for k, v in counts.items()}, "node": [this_node()]})


def search_folder(group: int) -> str:
    return f"{SEARCH_DIR}/group-{group:05d}"


def searched_marker(group: int) -> str:
    return f"{SEARCH_DIR}/searched-{group:05d}"


def keys_for(todo: list[int], total: int) -> np.ndarray:
    """(total,) shuffle keys: unit todo[i] gets the stand-in of partition i, a unit not in todo -1."""
    keys = np.full(total, -1, np.int64)
    keys[todo] = one_key_per_partition(len(todo))
    return keys


def with_counts(table: pa.Table, counts: dict) -> pa.Table:
    """table with its bucket's counts in the schema metadata (the Parquet footer), read back by bucket_counts."""
    return table.replace_schema_metadata({COUNTS_KEY: json.dumps(counts)})


def bucket_counts(run: RunDir, files: list[str]) -> list[dict]:
    """The counts of finished bucket files from their footers (threads: one small read per file); a file without
    them (written before they were recorded) is counted by Ray tasks, never by reading its rows here."""
    def footer(path: str) -> dict | None:
        with run.fs.open_input_file(path) as f:
            found = (pq.read_metadata(f).metadata or {}).get(COUNTS_KEY.encode())
        return json.loads(found) if found is not None else None

    with ThreadPoolExecutor(max_workers=FOOTER_THREADS) as pool:
        counts = list(pool.map(footer, files))
    unrecorded = [path for path, c in zip(files, counts) if c is None]
    if unrecorded:
        ds = read_row_groups(run, unrecorded, ["neg_pair_ids"]).map_batches(_count_lists, batch_format="pyarrow")
        counts += list(ds.iter_rows())
    return [c for c in counts if c is not None]


def _count_lists(batch: pa.Table) -> pa.Table:
    lengths = pc_list_lengths(batch.column("neg_pair_ids"))
    return pa.table({"rows": [len(lengths)], "negatives": [int(lengths.sum())],
                     "without_negatives": [int((lengths == 0).sum())]})


def bucket_file(bucket: int) -> str:
    return f"{NEGATIVES}/part-{bucket:05d}.parquet"


def shuffles(cfg: Config, run: RunDir, source: RunDir, encoder: str | None, n_rows: int
             ) -> tuple[ShuffleSettings, ShuffleSettings]:
    """How the two shuffles run (bounded_data.shuffle_for), by the bytes they move: the routed rows (each passage
    once per search group of its cluster, each query once per probed cluster: a vector and ROUTED_ROW_BYTES, no
    text), then the search results (a query once per probed cluster, range_max candidates each)."""
    dim, stored = vector_layout(run, source, cfg, encoder)
    copies = min(cfg.mine.nprobe, cfg.cluster.k)
    route = shuffle_for(cfg.ray, run, [], n_rows * (1 + copies), row_bytes=stored * dim + ROUTED_ROW_BYTES)
    merge = shuffle_for(cfg.ray, run, [], n_rows * copies,
                        row_bytes=cfg.mine.range_max * CANDIDATE_BYTES + SEARCH_ROW_BYTES)
    return route, merge


def mine_all(cfg: Config, run: RunDir, source: RunDir, encoder: str | None, need: Resources, plan: dict,
             todo: list[dict], n_rows: int, merge_shuffle: ShuffleSettings = ShuffleSettings()
             ) -> tuple[list[dict], int]:
    """Search the groups not yet searched, then merge the buckets of `todo` (that shuffle with merge_shuffle); (their
    counts, queries embedded)."""
    mine, embedded = cfg.mine, 0
    groups = SearchGroups(np.asarray(plan["groups"]["passage_parts"], np.int64),
                          np.asarray(plan["groups"]["query_parts"], np.int64))
    env = {"runtime_env": faiss_runtime_env()} if faiss_runtime_env() else {}
    searched = f"{SEARCH_DIR}/_SEARCHED.json"
    if not run.exists(searched):
        listed = set(run.listdir(SEARCH_DIR)) if run.exists(SEARCH_DIR) else set()
        left = [g for g in range(groups.num_groups) if posixpath.basename(searched_marker(g)) not in listed]
        if len(left) < groups.num_groups:
            print(f"[mine] resuming: {groups.num_groups - len(left)} of {groups.num_groups} search groups were "
                  f"searched by an earlier attempt", flush=True)
        ds, embeds_queries = pairs_with_vectors(cfg, run, source, encoder, need)
        ds = ds.map_batches(_route, fn_kwargs={"centroids": load_centroids(run, cfg.cluster.k),
                                               "nprobe": mine.nprobe, "by_query": encoder is None, "groups": groups,
                                               "group_keys": keys_for(left, groups.num_groups)},
                            batch_format="pyarrow", **env)
        # One shuffle partition per group: a partition's size then follows the bound, not N.
        # A GPU per search task when the cluster has GPUs the backend can use (vector_search.wants_gpus).
        gpus = {"num_gpus": 1} if wants_gpus(cfg.ray.vector_backend, ClusterResources.current().gpus) else {}
        ds = ds.groupby("group", num_partitions=max(1, len(left))).map_groups(
            _search, fn_kwargs={"run_uri": run.uri, "mine": mine, "buckets": len(plan["units"]),
                                "group_keys": keys_for(left, groups.num_groups), "backend": cfg.ray.vector_backend,
                                "chunks": plan.get("search_chunks", UNRECORDED_CHUNKS)},
            batch_format="pyarrow", **env, **gpus)
        first = ("the queries are embedded, routed and shuffled" if embeds_queries else
                 "the vectors are joined to their pairs, routed and shuffled" if encoder is not None else
                 "the vectors are routed and shuffled")
        progress = ProgressLine("mine", len(left), unit="search groups",
                                before_first=f"{first} to their search groups first")
        for _ in ds.iter_rows():  # one row per group searched (a group no row reached gives none)
            progress.advance(1)
        progress.close()
        run.write_json(searched, {"groups": groups.num_groups})
        embedded = n_rows if embeds_queries else 0
    indices = [int(posixpath.basename(u["output"])[5:10]) for u in todo]  # part-<bucket>.parquet
    files = run.files(SEARCH_DIR)  # every chunk of every group (a group no row reached wrote none)
    if not files:
        return [], embedded
    with bounded_shuffle_maps(merge_shuffle):
        ds = read_row_groups(run, files, SEARCH_COLUMNS) \
            .map_batches(_to_merge, fn_kwargs={"bucket_keys": keys_for(indices, len(plan["units"]))},
                         batch_format="pyarrow")
        ds = ds.groupby("bucket", num_partitions=max(1, len(indices))).map_groups(
            _merge_and_write, fn_kwargs={"run_uri": run.uri, "mine": mine,
                                         "bucket_keys": keys_for(indices, len(plan["units"]))}, batch_format="pyarrow")
    progress, results = ProgressLine("mine", n_rows, unit="queries merged",
                                     before_first="the search results are shuffled to their buckets first"), []
    for result in ds.iter_rows():
        results.append(result)
        progress.advance(result["rows"])
    return results, embedded


# --- the stage ---------------------------------------------------------------------------------------------
def plan_units(n_rows: int, cfg: Config, groups: SearchGroups, bounds: tuple[int, int]) -> dict:
    """One unit per negatives/ file (a hash bucket of pair_ids), and the search groups (fixed with the plan, so a
    rerun finds the groups an earlier attempt wrote); work_units.load_or_make_plan stores it."""
    buckets = max(1, math.ceil(n_rows / QUERIES_PER_FILE), min(MIN_BUCKETS, n_rows // MIN_BUCKET_QUERIES))
    return {"mine": cfg.mine.to_dict(), "units": [{"output": bucket_file(b)} for b in range(buckets)],
            "groups": {"passage_parts": groups.passage_parts.tolist(), "query_parts": groups.query_parts.tolist()},
            "bounds": list(bounds), "search_chunks": chunk_rule()}


def write_empty_buckets(run: RunDir, plan: dict) -> None:
    """A bucket no query hashed into still gets its (empty) file, so the plan's every unit has its output."""
    _, missing = split_done(run, NEGATIVES, plan["units"])
    schema = pa.schema([("pair_id", pa.int64()), ("neg_pair_ids", pa.list_(pa.int64())),
                        ("neg_scores", pa.list_(pa.float32())), ("pos_score", pa.float32())])
    zeros = {"rows": 0, "negatives": 0, "without_negatives": 0, **{f"dropped_{d}": 0 for d in DROP_REASONS}}
    for unit in missing:
        run.write_parquet(unit["output"], with_counts(schema.empty_table(), zeros), **PARTS_WRITE)


def _search_plan(cfg: Config, run: RunDir, source: RunDir, encoder: str | None, n_rows: int) -> dict:
    """A fresh plan: the search groups from a counting pass over assign/ (one k-vector per block on the driver)."""
    centroids = load_centroids(run, cfg.cluster.k)
    bounds = group_bounds(cfg, run, source, encoder, len(centroids))
    count_queries = encoder is None and "emb_query" in _schema(run, assign_dir(cfg.cluster.k))
    return plan_units(n_rows, cfg, plan_search_groups(cfg, run, centroids, count_queries, bounds, n_rows), bounds)


def run_mine(ctx: StageContext) -> StageResult:
    """Mine negatives for every training query; an interrupted attempt with this fingerprint is finished: the
    search groups and buckets it wrote are kept (the same files as an uninterrupted run). A non-frozen
    mine.encoder first re-embeds the pairs (vectors_run)."""
    cfg, run, fingerprint = ctx.cfg, ctx.run, ctx.fingerprint
    started = time.time()
    k = cfg.cluster.k
    run.require(assign_dir(k), "assign", f"Cluster assignments for k={k}")
    encoder = resolve_encoder(cfg, run)
    source, embed_cost = vectors_run(ctx, encoder)
    n_rows = int(run.done_stats(assign_dir(k))["rows"])
    if n_rows <= cfg.mine.range_min:
        raise ConfigError(f"mine.range_min={cfg.mine.range_min} is not below the number of training passages "
                          f"({n_rows}): lower it.")
    results, worker_s, embedded = [], 0.0, 0
    t0 = time.time()
    route, merge = shuffles(cfg, run, source, encoder, n_rows)
    with bounded_shuffle_maps(route):  # before any dataset exists: each Dataset copies the DataContext it is made in
        def make() -> dict:
            return _search_plan(cfg, run, source, encoder, n_rows)

        plan = load_or_make_plan(run, NEGATIVES, PLAN, fingerprint, "mining", make)
        if "groups" not in plan:  # an interrupted attempt of an older version (no search groups recorded): afresh
            run.remove(PLAN)
            plan = load_or_make_plan(run, NEGATIVES, PLAN, fingerprint, "mining", make)
        done, todo = split_done(run, NEGATIVES, plan["units"])
        if todo:
            if len(todo) < len(plan["units"]):
                print(f"[mine] resuming: {len(plan['units']) - len(todo)} of {len(plan['units'])} negatives files "
                      f"were written by an earlier attempt", flush=True)
            results, embedded = mine_all(cfg, run, source, encoder, ctx.resources, plan, todo, n_rows, merge)
            write_empty_buckets(run, plan)
            groups = SearchGroups(np.asarray(plan["groups"]["passage_parts"]), np.asarray(plan["groups"]["query_parts"]))
            print(f"[mine] {groups.num_groups} search groups over {k} clusters (at most {plan['bounds'][0]} passages "
                  f"and {plan['bounds'][1]} queries each; mine.max_group_rows={cfg.mine.max_group_rows})", flush=True)
        if run.exists(SEARCH_DIR):
            run.remove(SEARCH_DIR)
        sidecars = sidecars_for_training(cfg, run, run)
    worker_s = (time.time() - t0) * ClusterResources.current().cpus
    if todo and done:  # a resumed attempt: the counts of the files written before, from their footers
        results += bucket_counts(run, [run.path(u["output"]) for u in done])
    stats = _stage_stats(run, plan, results, n_rows, time.time() - started, worker_s, embed_cost, encoder, embedded)
    stats |= sidecars | node_stats(r.get("node") for r in results)  # none from a resumed attempt's footers
    print(f"[mine] {stats['rows']} queries in {stats['wall_s']:.1f}s: {stats['negatives_per_query']:.1f} negatives "
          f"per query kept ({stats['without_negatives']} with none); dropped {stats['dropped_positive']} positives, "
          f"{stats['dropped_duplicate']} duplicates of the positive, {stats['dropped_margin']} by the margin",
          flush=True)
    return StageResult(stats, config={"mine": cfg.mine.to_dict()})


def _stage_stats(run: RunDir, plan: dict, results: list[dict], n_passages: int, wall: float, worker_s: float,
                 embed_cost: dict, encoder: str | None, queries_embedded: int) -> dict:
    if not results:  # every file was written by an earlier attempt (killed before its done marker): count them
        results = bucket_counts(run, [run.path(u["output"]) for u in plan["units"]])
    totals = {k: sum(r.get(k, 0) for r in results) for k in ("rows", "negatives", "without_negatives",
                                                             *[f"dropped_{d}" for d in DROP_REASONS])}
    if totals["rows"] != n_passages:
        raise RuntimeError(f"negatives/ covers {totals['rows']} queries but there are {n_passages} training pairs: "
                           f"delete negatives/ and rerun `clusterscale mine`.")
    embedded = queries_embedded + int(embed_cost.get("rows_embedded", 0)) * (2 if encoder else 1)
    return totals | {"negatives_per_query": round(totals["negatives"] / max(1, totals["rows"]), 3),
                     "passages": n_passages, "encoder": encoder or "frozen", "texts_embedded": embedded,
                     "embed_worker_s": float(embed_cost.get("worker_s", 0.0)), "wall_s": round(wall, 3),
                     "worker_s": round(worker_s + float(embed_cost.get("worker_s", 0.0)), 3),
                     "rows_per_s": round(totals["rows"] / wall, 2) if wall > 0 else 0.0}


def pc_list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(pc.list_value_length(column).fill_null(0))
