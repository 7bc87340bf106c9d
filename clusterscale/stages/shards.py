"""Shard: write the assigned rows as one seeded-shuffled Parquet set per cluster, then the manifest.

shards/k=<k>/cluster=<c>/part-<group>-<part>.parquet and shards/k=<k>/manifest.json (written last).
Two Ray Data passes: per-cluster sums from cluster, cos and emb only (added up in Ray tasks, k x d to the driver), then
the text rows shuffled by (shard, sub-group); a cluster over shard.max_group_rows is split into sub-groups
by a seeded hash of pair_id. Clusters smaller than one global batch follow shard.small_cluster_policy.
Run with `clusterscale shard [CONFIG] --run-dir R` (after `assign`; reads dedup/kept/ when dedup is on).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from clusterscale.stages.dedup import shard_input
from clusterscale.stages.kmeans import ClusteringError, load_centroids
from clusterscale.io.layout import DEDUP_KEPT, dedup_set_dir, shard_file, shards_dir
from clusterscale.io.records import ShardEntry, ShardManifest
from clusterscale.runtime.hashing import sub_groups
from clusterscale.io.sizing import GroupSizes, file_sizes, groups_per_shard, writer_sizing
from clusterscale.runtime.nodes import map_spread, node_stats, this_node, unit_delay_for_tests
from clusterscale.runtime.progress import ProgressLine
from clusterscale.runtime.bounded_data import bounded_shuffle_maps, read_row_groups, shuffle_for
from clusterscale.runtime.resources import ClusterResources, Resources, plan_actors
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.runtime.stage_context import StageContext
from clusterscale.runtime.vectors import SIDE_COLUMNS, clustered_matrix, emb_matrix
from clusterscale.runtime.work_units import load_or_make_plan

# What the shard files carry: training reads pair_id, query and passage; the source sampler's set is built from
# `source`. Each column costs every row group ~60 B of footer that a training rank reads (train/data.py), so
# the assignment's `cluster` and `cos` stay in assign/k=<k>/ (the manifest lists each shard's member clusters).
SHARD_COLUMNS = ["pair_id", "query", "passage", "source"]
LABELED_COLUMNS = ["negatives"]  # with data.negative_column: the labeled hard negatives, carried when present


def mean_pairwise_cosine(vector_sum: np.ndarray, n: int) -> float | None:
    """Mean cosine over distinct pairs of n unit vectors from their sum: (|sum|^2 - n) / (n(n-1))."""
    if n < 2:
        return None
    return float((np.dot(vector_sum, vector_sum) - n) / (n * (n - 1)))


def plan_small_clusters(counts: np.ndarray, centroids: np.ndarray, min_rows: int, policy: str) -> dict:
    """Map every original cluster to the shard that receives its rows.

    Returns {"target": int array (k,), "pool_id": int | None, "moved": {orig: target}}. With 'merge',
    a small cluster goes to the most similar (centroid cosine) cluster that is not small.
    """
    k = len(counts)
    target = np.arange(k)
    small = (counts > 0) & (counts < min_rows)
    big = np.flatnonzero(counts >= min_rows)
    if counts.sum() < min_rows:  # no policy gives a batch: pooling every pair still holds fewer than one
        raise ClusteringError(f"The {int(counts.sum())} training pairs are fewer than one global batch "
                              f"(train.global_batch_size={min_rows}): lower train.global_batch_size below "
                              f"{int(counts.sum())}, or bring more data.")
    moved: dict[int, int] = {}
    pool_id = None
    if small.any():
        if policy == "pool":
            pool_id = k
            for c in np.flatnonzero(small):
                target[c] = pool_id
                moved[int(c)] = pool_id
        else:
            if len(big) == 0:
                raise ClusteringError(
                    f"Every cluster has fewer rows ({int(counts.max())} at most) than one global batch "
                    f"(train.global_batch_size={min_rows}): lower cluster.k or train.global_batch_size, or use "
                    f"shard.small_cluster_policy=pool.")
            sims = centroids @ centroids[big].T
            for c in np.flatnonzero(small):
                target[c] = int(big[int(np.argmax(sims[c]))])
                moved[int(c)] = int(target[c])
    return {"target": target, "pool_id": pool_id, "moved": moved}


@dataclass
class ClusterStats:
    """Per original cluster: rows, sum of cos to the centroid and sum of the unit vectors (O(k x d))."""

    rows: np.ndarray
    cos_sum: np.ndarray
    vector_sum: np.ndarray


def block_cluster_stats(batch: pa.Table, side: str = "passage", dims: int = 0) -> pa.Table:
    """Map step: one row per cluster present in the batch, with its row count, cos sum and fp64 sum of the vectors
    cluster.side clusters (on cluster.dims)."""
    labels = batch.column("cluster").to_numpy()
    order = np.argsort(labels, kind="stable")
    present, starts = np.unique(labels[order], return_index=True)
    emb = clustered_matrix(batch, side, dims)[order]
    vector_sum = np.add.reduceat(emb, starts, axis=0, dtype=np.float64) if len(order) else emb.astype(np.float64)
    cos = batch.column("cos").to_numpy().astype(np.float64)[order]
    return pa.table({"cluster": present.astype(np.int64), "rows": np.diff(np.append(starts, len(order))),
                     "cos_sum": np.add.reduceat(cos, starts) if len(order) else cos,
                     "vector_sum": pa.FixedSizeListArray.from_arrays(pa.array(vector_sum.reshape(-1)),
                                                                   emb.shape[1])})


STATS_FAN_IN = 16  # inputs (block stats or partial sums) one reduce task adds up


def add_stats(k: int, *parts: pa.Table | ClusterStats) -> ClusterStats:
    """Reduce task: the dense k-cluster sums of block_cluster_stats tables and/or earlier partial sums."""
    total = None
    for part in parts:
        if part is None:  # the sums of empty blocks only
            continue
        if isinstance(part, pa.Table):
            if not part.num_rows:
                continue
            labels = part.column("cluster").to_numpy()
            vectors = emb_matrix(part.column("vector_sum"), dtype=np.float64)
            part = ClusterStats(np.bincount(labels, part.column("rows").to_numpy(), k).astype(np.int64),
                                np.bincount(labels, part.column("cos_sum").to_numpy(), k),
                                np.zeros((k, vectors.shape[1])))
            np.add.at(part.vector_sum, labels, vectors)
        if total is None:
            total = ClusterStats(part.rows.copy(), part.cos_sum.copy(), part.vector_sum.copy())
        else:
            total.rows += part.rows
            total.cos_sum += part.cos_sum
            total.vector_sum += part.vector_sum
    return total


def _add_blocks(k: int, *blocks: pa.Table) -> tuple[int, ClusterStats | None]:
    """Reduce task over block stats: (their rows, for the driver's progress line; their sums)."""
    total = add_stats(k, *blocks)
    return (0 if total is None else int(total.rows.sum())), total


def cluster_stats(run: RunDir, k: int, n_rows: int, folder: str, side: str = "passage", dims: int = 0) -> ClusterStats:
    """Per-cluster sums from a Ray Data pass over cluster, cos and emb only of `folder`'s rows, added up in Ray
    tasks: each task adds STATS_FAN_IN blocks' (or partial sums') k x d float64 sums as they stream in, and the
    driver receives the one k x d total (the blocks' sums, ~75 GB at 100M rows and k = 1,000, stay in tasks)."""
    ds = read_row_groups(run, run.files(folder), ["cluster", "cos", *SIDE_COLUMNS[side]])
    # One read block (a Parquet row group: 8,192 rows as assign writes them) per call, fused into the read task. A
    # batch_size larger than a block made Ray Data assemble batches in a separate worker whose heap grew with N
    # (469 -> 678 MB at 150k -> 600k rows; 218 -> 228 MB this way).
    ds = ds.map_batches(block_cluster_stats, fn_kwargs={"side": side, "dims": dims}, batch_size=None,
                        batch_format="pyarrow")
    add_blocks = ray.remote(num_returns=2)(_add_blocks)
    add_partials = ray.remote(add_stats)
    blocks, partials, counts = [], [], []
    progress = ProgressLine("shard stats", n_rows)
    for bundle in ds.iter_internal_ref_bundles():  # references only: no block reaches the driver
        blocks += bundle.block_refs
        if len(blocks) >= STATS_FAN_IN:
            count, partial = add_blocks.remote(k, *blocks)
            blocks, counts = [], counts + [count]
            partials.append(partial)
        if len(partials) >= STATS_FAN_IN:
            partials = [add_partials.remote(k, *partials)]
        done, counts = ray.wait(counts, num_returns=len(counts), timeout=0) if counts else ([], [])
        progress.advance(sum(ray.get(done)))
    if blocks:
        partials.append(add_blocks.remote(k, *blocks)[1])
    stats = ray.get(add_partials.remote(k, *partials)) if partials else None
    if stats is None:
        raise ClusteringError(f"{folder}/ holds no rows: rerun `clusterscale assign` (and `dedup`, when on).")
    return stats


def add_group_keys(batch: pa.Table, target: np.ndarray, num_groups: np.ndarray, seed: int) -> pa.Table:
    """Map step: the shard (after the small-cluster policy) and the sub-group of every row."""
    shard = target[batch.column("cluster").to_numpy()]
    sub = sub_groups(batch.column("pair_id").to_numpy(), num_groups[shard], seed)
    return batch.append_column("shard", pa.array(shard)).append_column("sub", pa.array(sub))


def bytes_per_row(run: RunDir, files: list[str], columns: list[str], max_files: int = 4) -> float:
    """Uncompressed bytes per row of `columns`, from the Parquet footers of the first few files."""
    size = rows = 0
    for path in files[:max_files]:
        meta = pq.ParquetFile(run.fs.open_input_file(path)).metadata
        rows += meta.num_rows
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            size += sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
                        if group.column(c).path_in_schema.split(".")[0] in columns)
    return size / max(1, rows)


@dataclass(frozen=True)
class SetLayout:
    """Where and how a shard set's files are written: under `folder`, one `<partition>=<name>` folder per shard
    (the pool shard, if any, named 'pool'), files of rows_per_file rows in row groups of row_group_rows."""

    folder: str
    partition: str
    seed: int
    rows_per_file: int
    row_group_rows: int
    num_samples: int
    pool_id: int | None = None


class WriteClusterShard:
    """Ray Data map_groups fn: one call per (shard, sub-group); sorts by pair_id, permutes with a seeded RNG,
    writes files of at most rows_per_file rows."""

    def __init__(self, run_uri: str, k: int, layout: SetLayout, columns: list[str]):
        self.run, self.k, self.layout, self.columns = RunDir(run_uri), k, layout, columns

    def __call__(self, group: pa.Table) -> pa.Table:
        unit_delay_for_tests("shard")
        lay = self.layout
        shard_id, sub = int(group.column("shard")[0].as_py()), int(group.column("sub")[0].as_py())
        group = group.sort_by("pair_id")  # arrival order after the shuffle is not deterministic
        perm = np.random.default_rng([lay.seed, self.k, shard_id, sub]).permutation(group.num_rows)
        group = group.take(pa.array(perm)).select(self.columns)
        name = "pool" if shard_id == lay.pool_id else str(shard_id)
        files, file_rows = [], []
        for part, start in enumerate(range(0, group.num_rows, lay.rows_per_file)):
            rel = shard_file(lay.folder, lay.partition, name, sub, part)
            # Row groups of row_group_rows: a training rank reads only the groups of its slice (train/data.py),
            # plus the file's footer. No statistics and no dictionary pages keep that footer at ~60 B per column
            # chunk (both would be per-row-group metadata that no reader uses; texts rarely repeat in a group).
            self.run.write_parquet(rel, group.slice(start, lay.rows_per_file), row_group_size=lay.row_group_rows,
                                   write_statistics=False, use_dictionary=False)
            files.append(rel)
            file_rows.append(min(lay.rows_per_file, group.num_rows - start))
        record = {"shard": shard_id, "sub": sub, "name": name, "rows": group.num_rows, "files": files,
                  "file_rows": file_rows, "samples": group.column("query").slice(0, lay.num_samples).to_pylist(),
                  "node": this_node()}
        self.run.write_json(group_record(lay.folder, shard_id, sub), record)  # after its files: the group is done
        return pa.table({key: [value] for key, value in record.items()})


PLAN_FILE = "_plan.json"  # the clustered set's attempt: its fingerprint (runtime/work_units)
GROUPS_DIR = "_groups"  # a set folder's records of the (shard, sub) groups written, until its manifest is


def group_record(folder: str, shard: int, sub: int) -> str:
    return f"{folder}/{GROUPS_DIR}/{shard}-{sub}.json"


def written_groups(run: RunDir, folder: str) -> list[dict]:
    """The records of the groups an interrupted attempt wrote whole (one listing, then a read per record)."""
    if not run.exists(folder, GROUPS_DIR):
        return []
    names = [n for n in run.listdir(folder, GROUPS_DIR) if n.endswith(".json") and not n.startswith(".")]
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(lambda n: run.read_json(f"{folder}/{GROUPS_DIR}/{n}"), names))


def _drop_written(batch: pa.Table, done: np.ndarray) -> pa.Table:
    """The rows of groups not yet written (done: shard << 32 | sub of the groups written)."""
    keys = (batch.column("shard").to_numpy().astype(np.int64) << 32) | batch.column("sub").to_numpy().astype(np.int64)
    return batch.filter(pa.array(~np.isin(keys, done)))


def write_groups(ds: ray.data.Dataset, run: RunDir, k: int, layout: SetLayout, columns: list[str],
                 sizes: GroupSizes, input_files: list[str], what: str, need: Resources) -> dict[int, list[dict]]:
    """Write a dataset keyed by (shard, sub) with WriteClusterShard, one actor call per key (each asking for
    `need`); returns the written groups of each shard, in sub-group order. Actor memory comes from the input
    files' bytes per row."""
    partitions, memory = writer_sizing(sizes, bytes_per_row(run, input_files, columns))
    cluster = ClusterResources.current()
    # Fractional CPUs leave room for the read and shuffle tasks (whole-CPU actors starve them on small nodes).
    plan = plan_actors(replace(need, memory_bytes=memory), cpu_actors=cluster.cpus, work_units=partitions,
                       cluster=cluster)
    # One writer per node from the start, spread (as assign's pool), where a node still has a CPU for the shuffle's
    # tasks beside its writer: on 1-CPU nodes writers on every node would leave no task a CPU (a deadlock).
    room = cluster.cpus_per_node - (plan.num_cpus or 1) >= 1
    first = min(plan.actors, cluster.nodes) if room else 1
    before = written_groups(run, layout.folder)  # an interrupted attempt's (the folder's plan has this fingerprint)
    progress, groups = ProgressLine(what, sizes.rows, before_first="the pairs are shuffled to their groups first"), {}
    for r in before:
        groups.setdefault(r["shard"], []).append(r)
        progress.advance(r["rows"])
    if before:
        print(f"[{what}] resuming: {len(before)} of {sizes.groups} groups were written by an earlier attempt",
              flush=True)
        done = np.array([(r["shard"] << 32) | r["sub"] for r in before], np.int64)
        ds = ds.map_batches(_drop_written, fn_kwargs={"done": done}, batch_format="pyarrow")
    if len(before) < sizes.groups:
        written = map_spread(
            ds.groupby(["shard", "sub"], num_partitions=partitions).map_groups, WriteClusterShard,
            first_actors=first, fn_constructor_args=(run.uri, k, layout, columns), batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(min_size=first, max_size=max(first, plan.actors)), **plan.options)
        for r in written.iter_rows():
            groups.setdefault(r["shard"], []).append(r)
            progress.advance(r["rows"])
    return {shard: sorted(rows, key=lambda r: r["sub"]) for shard, rows in groups.items()}


def write_shards(ctx: StageContext, target: np.ndarray, shard_rows: np.ndarray, pool_id: int | None,
                 rows_per_file: int, row_group_rows: int, source: str, folder: str) -> dict[int, list[dict]]:
    """Shuffle text rows (no `emb` unless shard.keep_emb) of `source` by (shard, sub-group) and write them under
    `folder`; returns the written groups of each shard, in sub-group order."""
    cfg, run, sc = ctx.cfg, ctx.run, ctx.cfg.shard
    k, files, n_rows = cfg.cluster.k, run.files(source), int(shard_rows.sum())
    with run.fs.open_input_file(files[0]) as f:
        present = pq.read_schema(f).names
    columns = SHARD_COLUMNS + [c for c in LABELED_COLUMNS if c in present] + (["emb"] if sc.keep_emb else [])
    num_groups = groups_per_shard(shard_rows, sc.max_group_rows)
    largest_group = int((shard_rows / np.maximum(num_groups, 1)).max())  # a hash split overshoots by ~sqrt
    ds = read_row_groups(run, files, columns + ["cluster"])  # cluster keys the rows; the writer drops it
    ds = ds.map_batches(add_group_keys, fn_args=(target, num_groups, cfg.cluster.seed), batch_format="pyarrow")
    layout = SetLayout(folder, "cluster", cfg.cluster.seed, rows_per_file, row_group_rows, sc.num_samples,
                       pool_id)
    sizes = GroupSizes(n_rows, int(num_groups.sum()), largest_group, sc.max_group_rows)
    return write_groups(ds, run, k, layout, columns, sizes, files, "shard", ctx.resources)


def shard_entry(shard: int, groups: list[dict], members: np.ndarray, sums: ClusterStats,
                num_samples: int) -> ShardEntry:
    """The manifest entry of one shard from its written groups and its member clusters' sums."""
    rows = sum(g["rows"] for g in groups)
    expected = int(sums.rows[members].sum())
    if rows != expected:
        raise RuntimeError(f"Shard {groups[0]['name']} holds {rows} rows, its clusters {expected}: rerun `shard`.")
    return ShardEntry(cluster=shard, name=groups[0]["name"], rows=rows, files=[f for g in groups for f in g["files"]],
                      file_rows=[int(n) for g in groups for n in g["file_rows"]], groups=len(groups),
                      samples=[q for g in groups for q in g["samples"]][:num_samples], members=members.tolist(),
                      mean_intra_cosine=mean_pairwise_cosine(sums.vector_sum[members].sum(axis=0), rows),
                      mean_cos_to_centroid=float(sums.cos_sum[members].sum() / rows))


def run_shard(ctx: StageContext) -> StageResult:
    """Write shards/k=<k>/: one shuffled shard set per cluster (small clusters by the policy, large ones in
    sub-groups) and the manifest, which records the fingerprint."""
    return write_clustered_set(ctx, shard_input(ctx.cfg), shards_dir(ctx.cfg.cluster.k))


def run_dedup_shards(ctx: StageContext) -> StageResult:
    """Write the clustered shards of the pairs dedup kept (dedup/kept/ of this k) into shards/k=<k>/dedup/, for
    train.dedup=true, beside the run's shards of every assigned pair."""
    return write_clustered_set(ctx, DEDUP_KEPT, dedup_set_dir(ctx.cfg.cluster.k))


def write_clustered_set(ctx: StageContext, source: str, folder: str) -> StageResult:
    """One shuffled shard set per cluster of the rows of `source` under `folder`, and its manifest."""
    cfg, run, fingerprint = ctx.cfg, ctx.run, ctx.fingerprint
    k = cfg.cluster.k
    started = time.time()
    # An attempt with this fingerprint that stopped midway left the groups it wrote whole (write_groups keeps them);
    # another config's attempt is refused, a fresh plan clears the folder.
    n_assigned = run.done_stats(source).get("rows")  # dedup on: the kept rows
    sums = cluster_stats(run, k, n_assigned or 0, source, cfg.cluster.side, cfg.cluster.dims)
    counts = sums.rows
    centroids = load_centroids(run, k)
    plan = plan_small_clusters(counts, centroids, cfg.train.schedule.global_batch_size, cfg.shard.small_cluster_policy)
    # After the check of the batch size: a refused config leaves no plan that would refuse the corrected one.
    load_or_make_plan(run, folder, f"{folder}/{PLAN_FILE}", fingerprint, "sharding", lambda: {"units": []})
    target = plan["target"]
    shard_rows = np.bincount(target, weights=counts, minlength=k + 1).astype(np.int64)
    rows_per_file, row_group_rows = file_sizes(cfg)
    shuffle = shuffle_for(cfg.ray, run, run.files(source), int(counts.sum()))
    with bounded_shuffle_maps(shuffle):  # 64 MiB shuffle maps, through files or not (runtime/bounded_data)
        groups = write_shards(ctx, target, shard_rows, plan["pool_id"], rows_per_file, row_group_rows, source,
                              folder)
    clusters = [shard_entry(shard, groups[shard], np.flatnonzero((target == shard) & (counts > 0)), sums,
                            cfg.shard.num_samples) for shard in sorted(groups)]
    n_total = sum(c.rows for c in clusters)
    for expected in (int(counts.sum()), n_assigned if n_assigned is not None else n_total):
        if n_total != expected:
            raise RuntimeError(f"Shard row count {n_total} != assigned rows {expected}: rerun `shard`.")
    stats = {"k": k, "shards": len(clusters), "rows": n_total, "files": sum(len(c.files) for c in clusters),
             "min_rows": min(c.rows for c in clusters), "max_rows": max(c.rows for c in clusters),
             "groups": sum(c.groups for c in clusters),
             "overall_mean_cosine": mean_pairwise_cosine(sums.vector_sum.sum(axis=0), n_total),
             "wall_s": round(time.time() - started, 3),
             **node_stats(g["node"] for written in groups.values() for g in written)}
    stats["worker_s"] = stats["wall_s"]
    manifest = ShardManifest(k=k, fingerprint=fingerprint, global_batch_size=cfg.train.schedule.global_batch_size,
                             clusters=clusters, stats=stats, row_group_rows=row_group_rows, rows_per_file=rows_per_file,
                             seed=cfg.cluster.seed, small_cluster_policy=cfg.shard.small_cluster_policy,
                             moved={str(a): b for a, b in plan["moved"].items()}, original_counts=counts.tolist(),
                             empty_clusters=np.flatnonzero(counts == 0).tolist(),
                             max_group_rows=cfg.shard.max_group_rows, keep_emb=cfg.shard.keep_emb)
    run.write_json(f"{folder}/manifest.json", manifest.to_json())
    run.remove(folder, GROUPS_DIR)
    moved = f", {len(plan['moved'])} small cluster(s) -> {cfg.shard.small_cluster_policy}" if plan["moved"] else ""
    print(f"[shard] {n_total} rows into {len(clusters)} shards ({stats['files']} files), sizes "
          f"{stats['min_rows']}..{stats['max_rows']}{moved}", flush=True)
    moved_rows = int(sum(counts[int(c)] for c in plan["moved"]))
    if moved_rows > n_total / 2:
        print(f"[shard] warning: {moved_rows} of {n_total} rows ({moved_rows / n_total:.0%}) were in clusters smaller "
              f"than one global batch ({cfg.train.schedule.global_batch_size}) and went to "
              f"{'the pool' if plan['pool_id'] is not None else 'the nearest large cluster'}: the shards no longer "
              f"follow the clustering. Lower cluster.k (about rows / (4 x batch) = "
              f"{max(1, n_total // (4 * cfg.train.schedule.global_batch_size))} here) or train.global_batch_size.",
              flush=True)
    return StageResult(stats)


def cluster_table(manifest: ShardManifest, num_samples: int = 3) -> dict:
    """The paper's Table 1 for one k: rows and mean intra-cluster cosine per shard, the whole-dataset
    mean cosine, and a few sample queries per shard (the paper's Appendix B)."""
    clusters = [{"cluster": c.name, "rows": c.rows, "members": c.members,
                 "mean_intra_cosine": c.mean_intra_cosine, "mean_cos_to_centroid": c.mean_cos_to_centroid,
                 "sample_queries": c.samples[:num_samples]} for c in manifest.clusters]
    return {"k": manifest.k, "rows": manifest.stats["rows"], "shards": len(clusters),
            "overall_mean_cosine": manifest.stats["overall_mean_cosine"],
            "small_cluster_policy": manifest.small_cluster_policy, "moved": manifest.moved,
            "clusters": clusters}


def format_cluster_table(table: dict) -> str:
    overall = table["overall_mean_cosine"]
    lines = [f"k={table['k']}: {table['rows']} rows in {table['shards']} shards; whole-dataset mean cosine "
             + ("-" if overall is None else f"{overall:.3f}")]
    if table["moved"]:
        lines.append(f"small clusters ({table['small_cluster_policy']}): "
                     + ", ".join(f"{a}->{'pool' if b == table['k'] else b}" for a, b in table["moved"].items()))
    lines.append(f"{'cluster':>8} {'rows':>9} {'intra cos':>9}  sample queries")
    for c in table["clusters"]:
        intra = "-" if c["mean_intra_cosine"] is None else f"{c['mean_intra_cosine']:.3f}"
        lines.append(f"{c['cluster']:>8} {c['rows']:>9} {intra:>9}  "
                     + " | ".join(q[:60] for q in c["sample_queries"]))
    return "\n".join(lines)

