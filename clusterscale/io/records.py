"""The typed records stages leave in a run directory for later stages: the done marker of every output
(RUN/<folder>/_DONE.json) and the manifest of a shard set (shards/k=<k>/manifest.json and each sampler's set).

Each record carries a `version`; files written before records were versioned (no `version` key) are read as
version 0 with the same fields, so a run directory made by an older clusterscale is reused, not redone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DONE_MARKER_VERSION = 1
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class DoneMarker:
    """RUN/<folder>/_DONE.json: the folder is complete for `fingerprint`."""
    fingerprint: str
    """The hash of the config values (and extras) the output depends on; a rerun with another one is refused."""
    finished_at: str | None = None
    stats: dict = field(default_factory=dict)
    """The stage's figures (its StageResult.stats): what later stages and the report read."""
    config: dict = field(default_factory=dict)
    """The config values the stage chose to record (StageResult.config)."""
    covers: dict | None = None
    """The values the fingerprint hashes, by section, so a refused rerun can name what changed; None in markers
    that predate it."""
    version: int = DONE_MARKER_VERSION
    files: dict[str, int] | None = None
    """What the folder held when it was marked done: {path inside the folder: bytes}, from one listing (RunDir.
    listed_files); a stage reading the folder checks it before it starts (RunDir.check_complete). The row count is
    the stats' `rows`. Not in the fingerprint; None in markers that predate it (their folders are not checked)."""

    def to_json(self) -> dict:
        return {"version": self.version, "fingerprint": self.fingerprint, "finished_at": self.finished_at,
                "stats": self.stats, "config": self.config, "covers": self.covers} | (
            {} if self.files is None else {"files": self.files})

    @classmethod
    def from_json(cls, data: dict) -> DoneMarker:
        return cls(fingerprint=data.get("fingerprint", ""), finished_at=data.get("finished_at"),
                   stats=data.get("stats") or {}, config=data.get("config") or {}, covers=data.get("covers"),
                   version=int(data.get("version", 0)), files=data.get("files"))


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a set (a cluster, a small-cluster pool, or a sampler's stratum): its rows and files."""
    cluster: int
    """Its index in the set (the schedule's stratum)."""
    name: str
    rows: int
    files: list[str]
    """Its files relative to the run, in row order."""
    file_rows: list[int] | None = None
    """Rows of each file (None in manifests of shard stages before it was recorded)."""
    groups: int = 0
    samples: list[str] = field(default_factory=list)
    """A few of its queries, for inspection."""
    members: list[int] | None = None
    """Clustered sets: the clusters of cluster.k merged into this shard."""
    mean_intra_cosine: float | None = None
    mean_cos_to_centroid: float | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: dict) -> ShardEntry:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


_SET_ONLY = ("sampler", "clustered_fingerprint")
_CLUSTERED_ONLY = ("small_cluster_policy", "max_group_rows", "keep_emb", "original_counts", "moved",
                   "empty_clusters")


@dataclass(frozen=True)
class ShardManifest:
    """The manifest of a shard set, written last by the stage that writes the set (shard, shard_set,
    dedup_shards): what training reads to find every row without listing files."""
    k: int
    fingerprint: str
    """The fingerprint of the set's done marker."""
    global_batch_size: int
    """The batch the set was planned for (row-group size, small-cluster policy)."""
    clusters: list[ShardEntry]
    """The set's shards (the sampler's strata), in schedule order."""
    stats: dict
    row_group_rows: int = 1
    """Rows per Parquet row group (io/layout.row_group_rows_for); 1 in manifests of shard stages before it was
    recorded, whose row groups are whole files."""
    rows_per_file: int | None = None
    seed: int | None = None
    small_cluster_policy: str | None = None
    """Clustered sets: shard.small_cluster_policy, and how it moved clusters (`moved`: cluster -> target)."""
    moved: dict[str, int] | None = None
    original_counts: list[int] | None = None
    empty_clusters: list[int] | None = None
    max_group_rows: int | None = None
    keep_emb: bool | None = None
    sampler: str | None = None
    """Sampler sets (shards/k=<k>/<sampler>/): the sampler, and the fingerprint of the clustered set they come from."""
    clustered_fingerprint: str | None = None
    version: int = MANIFEST_VERSION

    @property
    def strata_sizes(self) -> list[int]:
        """The rows of each shard: the sizes of its sampler's strata, in schedule order."""
        return [int(c.rows) for c in self.clusters]

    @property
    def files(self) -> list[str]:
        """Every file of the set (relative to the run), shard by shard in manifest order, each shard's files in
        row order: files aligned to these (mined negatives) can be found from the manifest alone."""
        return [f for c in self.clusters for f in c.files]

    def to_json(self) -> dict:
        out: dict[str, Any] = {"version": self.version}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "clusters":
                value = [c.to_json() for c in value]
            if f.name != "version" and (value is not None or f.name not in (*_SET_ONLY, *_CLUSTERED_ONLY)):
                out[f.name] = value
        return out

    @classmethod
    def from_json(cls, data: dict) -> ShardManifest:
        known = {f.name for f in dataclasses.fields(cls)} - {"clusters", "version"}
        return cls(clusters=[ShardEntry.from_json(c) for c in data["clusters"]],
                   version=int(data.get("version", 0)), **{k: v for k, v in data.items() if k in known})
