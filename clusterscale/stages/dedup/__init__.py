"""Dedup: remove exact and semantic duplicates, and training pairs that duplicate held-out ones, before sharding.

Run with `clusterscale dedup [CONFIG] --run-dir R` (after `assign`; `run` runs it when dedup.exact or
dedup.semantic_threshold is set). Three Ray Data steps over assign/k=<k>/ (read one row group per task, hash
shuffles in ~64 MiB map tasks, through local files with ray.disk_shuffle: runtime/bounded_data.py), none of
which holds all rows nor all held-out vectors:
  1. a map: each row's 128-bit key of its normalised dedup.key text, its keep rank (dedup.keep), whether its
     query or passage text equals a held-out pair's (every task holds the held-out text keys: O(held-out x
     32 B), not their texts nor vectors), and the shuffle keys of steps 2 and 3;
  2. group by a hash bucket of the key (dedup.exact), one bucket of ~ROWS_PER_BUCKET rows per reduce task: in
     each key, the first row in keep order stays;
  3. group by cluster, one cluster per reduce task, with the held-out vectors routed there: a map over heldout/
     sends each held-out vector to its dedup.heldout_nprobe nearest clusters (rows marked HELDOUT_PROBE, never
     written). Per cluster: the training rows still kept whose vector has cosine >= the threshold to a held-out
     vector routed there are held-out leaks (so a semantic leak is found when the held-out vector's
     heldout_nprobe nearest clusters include the training row's cluster: near-duplicates at cosine >= 0.9 almost
     always share the nearest centroid; heldout_nprobe = cluster.k is the all-pairs check); then semantic groups
     within the cluster (runtime/dedup_core.py, in blocks); the cluster's kept rows go to dedup/kept/ and its
     removed rows to dedup/removed/ (pair_id, duplicate_of, similarity, reason, cluster); the task returns its
     counts. A cluster over dedup.max_group_rows rows arrives in blocks of about that many instead (one per
     reduce task), and Ray tasks compare them block x block and walk the keep order over the edge list they
     return (blocks.py): no task holds a whole cluster.
Both shuffles group by stand-ins of the bucket / cluster ids that land one per partition
(bounded_data.one_key_per_partition), as mine does: a reduce task then holds one bucket or one cluster, not the
several that hashing the ids puts in the fullest partition, so its memory does not grow with N (an exact bucket
holds ~ROWS_PER_BUCKET rows whatever N; a cluster is the unit of the semantic pass).
Order of the rules: held-out text leaks, exact duplicates, held-out vector leaks, semantic duplicates; each
among the rows the earlier ones kept.
The output describes one clustering (the semantic pass is per cluster; dedup/_DONE.json's stats carry k): dedup
at another cluster.k replaces it (a sweep deduplicates every k in turn, and a rerun of a finished sweep does it
again). The shard stage reads dedup/kept/ instead of assign/k=<k>/ when dedup is on and dedup.apply_to_shards
(shard_input), and is refused when dedup/kept/ holds another clustering's rows; a training run with
train.dedup=true trains the clustered sampler on a shard set written from it (shards/k=<k>/dedup/: compare's
clustered_dedup arm).

One module per phase: policy (which rows the shards read, train.dedup's config), exact (the mark step and
exact duplicates per key bucket), heldout (held-out text keys, routing held-out vectors, their leaks), semantic
(per cluster: held-out vector leaks, semantic duplicates, the output files), partitions and blocks (the clusters split
into blocks) and stage (the Ray Data steps, the stats). The report's dedup section is in stages/report.py.
"""
from __future__ import annotations

from clusterscale.stages.dedup.exact import MARK_FIELDS, mark_rows, resolve_exact
from clusterscale.stages.dedup.heldout import heldout_keys, route_heldout
from clusterscale.stages.dedup.policy import dedup_applied, shard_input, train_dedup_config
from clusterscale.stages.dedup.semantic import dedup_cluster, semantic_pass
from clusterscale.stages.dedup.stage import removed_table, run_dedup

__all__ = ["MARK_FIELDS", "dedup_applied", "dedup_cluster", "heldout_keys", "mark_rows",
           "removed_table", "resolve_exact", "route_heldout", "run_dedup", "semantic_pass", "shard_input",
           "train_dedup_config"]
