"""Synthetic runs: topical pairs and clustered unit vectors, written as ingest and embed would write them.

`clusterscale synth --run-dir R --rows N` fills pairs/, heldout/ (with its vectors), quarantine/ (empty) and embeddings/
with their done markers and RUN/config.yaml, one Ray task per data.rows_per_part rows, so fit, assign,
shard, mine, train and evaluate can be dry-run (and sized, and benchmarked) at any N without an encoder.
Every row is a pure function of (seed, row index): the output does not depend on how many tasks or
workers made it. With --set embed.side=both, embeddings/ also holds `emb_query` (synthetic query vectors near
their passages'), which mine.encoder=frozen needs on a synthetic run. `write_embeddings_stage` is the
in-process shortcut that tests and benchmarks use.
"""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import ray

from clusterscale.config import ConfigError
from clusterscale.stages.ingest import PAIR_SCHEMA, is_heldout
from clusterscale.io.rundir import SYNTHETIC_DATA, RunDir, StageResult
from clusterscale.runtime.resources import ClusterResources
from clusterscale.runtime.stage_context import StageContext
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS, emb_array

SYNTH_SCHEME = SYNTHETIC_DATA  # data.path of a synthetic run; it carries the generator's parameters into the fingerprint
BLOCK_ROWS = 1024  # rows drawn from one seeded generator: the unit that makes output independent of the split
QUERY_SPREAD = 0.3  # noise norm of a query's vector around its passage's (cosine ~0.96): closer than topic mates
BOILERPLATE_SPREAD = 0.07  # noise norm of a boilerplate row around the one vector: cosine ~0.995 to one another
WORDS_PER_TOPIC = 48
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


@dataclass(frozen=True)
class SynthSpec:
    """What `clusterscale synth` generates: rows (held-out ones included), vector dimension, topics, seed, the
    noise norm around each topic's direction, and the fraction of rows that are boilerplate (near-duplicates of one
    vector, within cosine ~0.99 of one another: they fall in one cluster)."""
    rows: int
    dim: int = 384
    topics: int = 100
    seed: int = 0
    spread: float = 0.6
    boilerplate: float = 0.0

    def data_path(self) -> str:
        return f"{SYNTH_SCHEME}rows={self.rows},dim={self.dim},topics={self.topics},seed={self.seed}," \
               f"spread={self.spread}" + (f",boilerplate={self.boilerplate}" if self.boilerplate else "")

    @classmethod
    def from_data_path(cls, data_path: str) -> SynthSpec:
        """The spec a synthetic run's data.path carries (the inverse of data_path)."""
        if not data_path.startswith(SYNTH_SCHEME):
            raise ConfigError(f"data.path={data_path!r} is not a synthetic run's ({SYNTH_SCHEME}...): write synthetic "
                              f"runs with `clusterscale synth`.")
        fields = dict(item.split("=", 1) for item in data_path.removeprefix(SYNTH_SCHEME).split(","))
        return cls(rows=int(fields["rows"]), dim=int(fields["dim"]), topics=int(fields["topics"]),
                   seed=int(fields["seed"]), spread=float(fields["spread"]),
                   boilerplate=float(fields.get("boilerplate", 0.0)))

    def check(self) -> None:
        for name in ("rows", "dim", "topics"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"synth --{name} must be a positive integer, got {getattr(self, name)}.")
        if self.seed < 0:
            raise ConfigError(f"synth --seed must be >= 0, got {self.seed}.")
        if not 0 <= self.boilerplate < 1:
            raise ConfigError(f"synth --boilerplate must be a fraction in [0, 1), got {self.boilerplate}.")


def topic_centers(d: int, n_topics: int, seed: int) -> np.ndarray:
    """The n_topics unit directions the vectors of `seed` cluster around."""
    centers = np.random.default_rng(seed).standard_normal((n_topics, d))
    return centers / np.linalg.norm(centers, axis=1, keepdims=True)


def topic_weights(n_topics: int) -> np.ndarray:
    # Zipf-like topic sizes: real corpora have a few big topics and a long tail.
    weights = 1.0 / np.arange(1, n_topics + 1) ** 0.7
    return weights / weights.sum()


def vectors_around(centers: np.ndarray, topic: np.ndarray, noise: np.ndarray, spread: float) -> np.ndarray:
    """fp16-representable unit vectors: each topic's center plus noise of norm ~spread."""
    x = centers[topic] + spread * noise / np.sqrt(centers.shape[1])
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    # Stored embeddings are fp16: round here so in-memory references see the same numbers as the fit.
    return x.astype(np.float16).astype(np.float32)


def clustered_unit_vectors(n: int, d: int, n_topics: int, seed: int = 0, spread: float = 0.6,
                           ) -> tuple[np.ndarray, np.ndarray]:
    """(x, topic): n fp16-representable unit vectors around n_topics random directions."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((n_topics, d))
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    topic = rng.choice(n_topics, size=n, p=topic_weights(n_topics))
    return vectors_around(centers, topic, rng.standard_normal((n, d)), spread), topic


def write_embeddings_stage(run: RunDir, x: np.ndarray, rows_per_file: int = 50_000, first_id: int = 0,
                           texts: bool = True, queries: np.ndarray | None = None) -> None:
    """RUN/embeddings/part-*.parquet (pair columns + emb fp16, and emb_query from `queries` as embed.side=both
    writes it) and its done marker, like `embed` writes."""
    n = len(x)
    run.clear("embeddings")
    for part, start in enumerate(range(0, n, rows_per_file)):
        stop = min(n, start + rows_per_file)
        ids = np.arange(first_id + start, first_id + stop, dtype=np.int64)
        columns = {"pair_id": pa.array(ids)}
        if texts:
            columns |= {"query": pa.array([f"query {i}" for i in ids]),
                        "passage": pa.array([f"passage {i}" for i in ids]),
                        "source": pa.array(["synthetic"] * (stop - start))}
        table = pa.table(columns).append_column("emb", emb_array(x[start:stop]))
        if queries is not None:
            table = table.append_column("emb_query", emb_array(queries[start:stop]))
        run.write_parquet(f"embeddings/part-{part:05d}.parquet", table, row_group_size=max(1, rows_per_file // 2))
    run.mark_done("embeddings", "synthetic", {"rows": n, "truncated": 0})


# --- synthetic pairs -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def topic_vocabularies(n_topics: int, seed: int) -> list[np.ndarray]:
    """WORDS_PER_TOPIC pseudo-words per topic (2-3 syllables): topics share few words, so texts are topical."""
    out = []
    for t in range(n_topics):
        rng = np.random.default_rng([seed, 1, t])
        syllables = rng.integers(0, len(_SYLLABLES), size=(WORDS_PER_TOPIC, 3))
        lengths = rng.integers(2, 4, size=WORDS_PER_TOPIC)
        out.append(np.array(["".join(_SYLLABLES[s] for s in row[:n]) for row, n in zip(syllables, lengths)]))
    return out


def synth_block(spec: SynthSpec, block: int, query_vectors: bool = False) -> pa.Table:
    """Rows [block * BLOCK_ROWS, +BLOCK_ROWS) of the synthetic corpus: pair columns and `emb`
    (and `emb_query` with query_vectors, as embed.side=both writes it).

    A passage is 12-40 words of its topic's vocabulary and its pair_id; the query is 3-6 of the passage's
    words and a code unique to the pair (a bijection of pair_id), so texts are distinct without the query
    naming its passage's id. The vector is noise around the topic's center; the query's vector is noise
    around its passage's, drawn from a generator of its own so `emb` does not depend on query_vectors."""
    rng = np.random.default_rng([spec.seed, 0, block])
    ids = np.arange(block * BLOCK_ROWS, min(spec.rows, (block + 1) * BLOCK_ROWS), dtype=np.int64)
    n = len(ids)
    topic = rng.choice(spec.topics, size=n, p=topic_weights(spec.topics))
    noise = rng.standard_normal((n, spec.dim))
    passage_len = rng.integers(12, 41, size=n)
    query_len = rng.integers(3, 7, size=n)
    words = rng.integers(0, WORDS_PER_TOPIC, size=(n, 40))
    picks = (rng.random((n, 6)) * passage_len[:, None]).astype(np.int64)
    codes = (ids.astype(np.uint64) * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)  # odd multiplier: a bijection
    vocab = topic_vocabularies(spec.topics, spec.seed)
    passages, queries = [], []
    for i in range(n):
        passage_words = vocab[topic[i]][words[i, :passage_len[i]]]
        passages.append(f"{' '.join(passage_words)} {ids[i]}")
        queries.append(f"{' '.join(passage_words[picks[i, :query_len[i]]])} {codes[i]:08x}")
    x = vectors_around(topic_centers(spec.dim, spec.topics, spec.seed), topic, noise, spec.spread)
    if spec.boilerplate:  # generators of their own: the other rows' vectors are those of a run without boilerplate
        boilerplate = np.random.default_rng([spec.seed, 3, block]).random(n) < spec.boilerplate
        anchor = np.random.default_rng([spec.seed, 4]).standard_normal((1, spec.dim))
        anchor /= np.linalg.norm(anchor)
        near = np.random.default_rng([spec.seed, 5, block]).standard_normal((int(boilerplate.sum()), spec.dim))
        x[boilerplate] = vectors_around(anchor, np.zeros(len(near), np.int64), near, BOILERPLATE_SPREAD)
    table = pa.table({"pair_id": pa.array(ids), "query": pa.array(queries), "passage": pa.array(passages),
                      "source": pa.array([f"topic-{t}" for t in topic]), "emb": emb_array(x)})
    if query_vectors:
        query_noise = np.random.default_rng([spec.seed, 2, block]).standard_normal((n, spec.dim))
        table = table.append_column("emb_query", emb_array(vectors_around(x, np.arange(n), query_noise, QUERY_SPREAD)))
    return table


def synth_rows(spec: SynthSpec, start: int, stop: int, query_vectors: bool = False) -> pa.Table:
    """Rows [start, stop) of the corpus, whatever range they are asked for in."""
    blocks = [synth_block(spec, b, query_vectors) for b in range(start // BLOCK_ROWS, (stop - 1) // BLOCK_ROWS + 1)]
    first = (start // BLOCK_ROWS) * BLOCK_ROWS
    return pa.concat_tables(blocks).slice(start - first, stop - start)


def synth_part(run_uri: str, spec: dict, part: int, start: int, stop: int, heldout_fraction: float,
               query_vectors: bool = False) -> dict:
    """One part: pairs/ and heldout/ rows split as ingest splits them, and the embeddings/ file of the pairs
    (with `emb_query` / `truncated_query` when query_vectors, the columns of embed.side=both).

    File names follow ingest (one input file, index `part`) and embed (one unit per pairs/ part), so a
    rerun overwrites the same names."""
    run = RunDir(run_uri)
    table = synth_rows(SynthSpec(**spec), start, stop, query_vectors)
    held = np.array([is_heldout(q, heldout_fraction) for q in table.column("query").to_pylist()], dtype=bool)
    pairs = table.filter(pa.array(~held))
    stem = f"part-{part:05d}-00000"
    if held.any():  # with its vectors, so dedup can check training pairs against held-out ones
        held_rows = table.filter(pa.array(held))
        vectors = [c for c in ("emb", "emb_query") if c in held_rows.column_names]
        run.write_parquet(f"heldout/{stem}.parquet", pa.Table.from_arrays(
            [*held_rows.select(PAIR_SCHEMA.names).cast(PAIR_SCHEMA).columns, *held_rows.select(vectors).columns],
            names=[*PAIR_SCHEMA.names, *vectors]))
    if pairs.num_rows:
        run.write_parquet(f"pairs/{stem}.parquet", pairs.select(PAIR_SCHEMA.names).cast(PAIR_SCHEMA))
        not_truncated = pa.array(np.zeros(pairs.num_rows, dtype=bool))
        embedded = pairs.select([*PAIR_SCHEMA.names, "emb"]).append_column("truncated", not_truncated)
        if query_vectors:
            embedded = embedded.append_column("emb_query", pairs.column("emb_query")) \
                .append_column("truncated_query", not_truncated)
        run.write_parquet(f"embeddings/{stem}-00000.parquet", embedded, row_group_size=EMBEDDINGS_ROW_GROUP_ROWS)
    return {"rows": table.num_rows, "pairs": pairs.num_rows, "heldout": int(held.sum())}


def synthetic_embeddings(run: RunDir) -> dict | None:
    """The generator parameters when embeddings/ of `run` came from `clusterscale synth` (no encoder), else None."""
    if not run.exists("embeddings/_DONE.json"):
        return None
    return run.done_marker("embeddings").config.get("synth")


def run_synth(ctx: StageContext) -> StageResult:
    """Write the synthetic run (Ray must be initialised) into pairs/, heldout/, quarantine/ and embeddings/;
    the stats are those of pairs/, the other folders' come as outputs (the executor marks all four done).

    The generator's spec is the one cfg.data.path carries (SynthSpec.data_path); ctx.max_tasks_in_flight: parts
    generated at once (default: the cluster's CPUs); it changes nothing in the output."""
    cfg, run, spec = ctx.cfg, ctx.run, SynthSpec.from_data_path(ctx.cfg.data.path)
    started = time.time()
    rows_per_part = cfg.data.rows_per_part
    ranges = [(p, s, min(spec.rows, s + rows_per_part)) for p, s in enumerate(range(0, spec.rows, rows_per_part))]
    window = ctx.max_tasks_in_flight or ClusterResources.current().cpus
    task = ray.remote(num_cpus=1, max_retries=2)(synth_part)
    print(f"[synth] {spec.rows} rows (d={spec.dim}, {spec.topics} topics, seed {spec.seed}) in {len(ranges)} "
          f"part(s) of {rows_per_part}", flush=True)
    results, pending = [], []
    for p, s, e in ranges:  # a bounded window: the driver holds O(window) refs, never the rows
        if len(pending) >= window:
            done, pending = ray.wait(pending, num_returns=1)
            results += ray.get(done)
        pending.append(task.remote(run.uri, asdict(spec), p, s, e, cfg.data.heldout_fraction,
                                   cfg.embed.side == "both"))
    results += ray.get(pending)
    wall = round(time.time() - started, 3)
    stats = {"input_files": 0, "rows_in": spec.rows, "pairs": sum(r["pairs"] for r in results),
             "heldout": sum(r["heldout"] for r in results), "quarantine": 0, "reasons": {}, "bad_files": [],
             "synthetic": True, "rows": spec.rows, "parts": len(ranges), "wall_s": wall,
             "worker_s": wall * min(window, len(ranges)), "rows_per_s": round(spec.rows / wall, 1) if wall > 0 else 0.0}
    embeddings = StageResult({"rows": stats["pairs"], "rows_embedded": 0, "units": len(ranges), "truncated": 0,
                              "synthetic": True, "wall_s": wall},
                             config={"embed": cfg.embed.to_dict(), "synth": asdict(spec)})
    print(f"[synth] pairs {stats['pairs']}, held out {stats['heldout']}, embeddings d={spec.dim}; {wall:.1f}s",
          flush=True)
    return StageResult(stats, outputs={"heldout": StageResult({"rows": stats["heldout"]}),
                                       "quarantine": StageResult({"rows": 0}), "embeddings": embeddings},
                       config={"data": cfg.data.to_dict()})
