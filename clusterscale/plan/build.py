"""`clusterscale plan`: gather the config, the row count, the rates (a run's costs, the calibration file, a GPU
calibration) and the cluster, then estimate every stage for each k, and N/4, N, 4N."""
from __future__ import annotations

import contextlib
import json
import math
import os
import posixpath
import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from clusterscale import config as config_mod
from clusterscale.config import Config, ConfigError
from clusterscale.errors import bounded_repr
from clusterscale.io.input_files import (DETECTED_COMPRESSIONS, columns_problem, find_input_files, infer_format,
                                         input_column_names, is_json_array, list_input_files, unused_negatives)
from clusterscale.io.text_ranges import byte_ranges
from clusterscale.io.layout import fit_stats_path, load_manifest, manifest_path
from clusterscale.io.rundir import RunDir
from clusterscale.plan.cluster import MAX_GPUS, MAX_NODES, load_cluster, this_machine
from clusterscale.plan.estimate import Models, Planner, plan_stages, preprocess_over_train, uncalibrated
from clusterscale.plan.rates import (Rates, embedding_dim, folder_bytes, load_calibration,
                                     load_gpu_calibration, merge_run_costs, rates_from_calibration)
from clusterscale.plan.shape import run_shape, shard_sizes, stage_work, train_shape

BERT_BASE_PARAMS = 109_482_240  # bert-base-uncased's count (the paper's encoder size), for a hub id not on disk
BERT_BASE_EMBEDDING_TABLES = (30_522 + 512 + 2) * 768  # its vocab, position and token-type tables
SAMPLE_BYTES = 1 << 20  # JSONL/CSV inputs: rows counted in a MiB of each file, scaled by the file size
_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
MAX_ROWS = 10 ** 15
"""The most pairs a plan takes (a million times the largest run in benchmarks/): its integer figures stay exact
through the table's 4 x N (< 2^53), and its memory and time do not grow with N or k (plan/sizes)."""
MAX_K_VALUES = 64  # --k values in one plan (each adds three rows to the table)
MAX_IMBALANCE = 1000.0  # faiss's imbalance factor: 1 = equal clusters, text embeddings ~1.1-2
MAX_PRICE_PER_GPU_HOUR = 1e6


@dataclass(frozen=True)
class PlanRequest:
    config: str | None
    overrides: list[str]
    run_dir: str | None
    rows: int | None
    k_values: list[int] | None
    cluster: str | None
    gpus: int | None
    gpu_type: str | None
    nodes: int | None
    price_per_gpu_hour: float | None
    calibration: str | None
    gpu_calibration: str | None
    imbalance: float | None


def load_config(request: PlanRequest) -> tuple[Config, RunDir | None, Config | None]:
    """(the config planned for, the run of --run-dir, the config that run was made with)."""
    run = RunDir(request.run_dir) if request.run_dir else None
    if run is None:
        return config_mod.load(request.config, request.overrides), None, None
    if not run.exists("config.yaml"):
        raise ConfigError(f"--run-dir {request.run_dir} holds no config.yaml: pass the run directory of a "
                          f"clusterscale run (its report/costs.json calibrates the plan), or leave --run-dir out.")
    saved = config_mod.parse_yaml(run.read_bytes("config.yaml"), run.path("config.yaml"))
    return (config_mod.load(request.config, request.overrides, run_config=saved), run,
            config_mod.load(None, [], run_config=saved))


def count_input_rows(cfg: Config) -> tuple[int, str]:
    """Rows of data.path: exact from Parquet footers and Arrow IPC files; JSONL/CSV (compressed ones decompressed)
    and Arrow streams counted in a sample from the start of each file, scaled by the file's size."""
    rows, rows_from, _ = count_input(cfg)
    return rows, rows_from


def count_input(cfg: Config) -> tuple[int, str, int]:
    """(count_input_rows's rows and where they come from, the rows of ingest's largest work unit as
    stages/ingest.file_units cuts the files: a Parquet file's run of row groups of >= data.rows_per_part rows, a byte
    range of ~data.range_bytes of an uncompressed JSON lines or TSV file, any other file whole)."""
    if cfg.data.path.startswith(("builtin:", "synth://")):
        raise ConfigError(f"data.path {cfg.data.path} is not a file input: pass --rows N.")
    listing = find_input_files(cfg.data)
    fs, files = listing.fs, listing.walk.files
    exact, total, largest = True, 0.0, 0.0
    for path in files:
        fmt = infer_format(path, cfg.data.format)
        if fmt == "parquet":
            with fs.open_input_file(path) as f:
                meta = pq.ParquetFile(f).metadata
            total += meta.num_rows
            unit = 0
            for g in range(meta.num_row_groups):
                unit += meta.row_group(g).num_rows
                if unit >= cfg.data.rows_per_part:
                    largest, unit = max(largest, unit), 0
            largest = max(largest, unit)
            continue
        # the size the listing gave (one request less per file on an object store), else asked for
        size = (listing.walk.stamps.get(path) or (None, None))[0]
        size = fs.get_file_info(path).size if size is None else size
        # a JSON array (pretty-printed, an element spans lines) by its elements' query keys, not its lines
        key = cfg.data.query_column if fmt == "jsonl" and is_json_array(fs, path) else None
        rows, whole = _arrow_rows(fs, path, size) if fmt == "arrow" else _text_rows(fs, path, size, fmt, key,
                                                                                  bool(cfg.data.column_names))
        total += rows
        # ingest reads an uncompressed JSON lines or TSV file in byte ranges of ~data.range_bytes (file_units)
        ranges = 1 if fmt not in ("jsonl", "tsv") or key is not None \
            or path.lower().endswith(DETECTED_COMPRESSIONS) or not cfg.data.range_bytes \
            else len(byte_ranges(size, cfg.data.range_bytes))
        largest = max(largest, rows / ranges)
        exact = exact and whole
    if cfg.data.limit:
        total, largest = min(total, cfg.data.limit), min(largest, cfg.data.limit)
    return (int(total), f"data.path ({len(files)} files, {'exact counts' if exact else 'a sample of each file'})",
            int(largest))


def input_warnings(cfg: Config) -> list[str]:
    """What ingest would do about the first input file (input_files.columns_problem: its columns, whether it reads),
    or what it would leave unread (input_files.unused_negatives: columns of labeled negatives no key names)."""
    fs, files = list_input_files(cfg.data)
    if not files:
        return []
    problem = columns_problem(fs, files[0], cfg.data) or unused_negatives(input_column_names(fs, files[0], cfg.data),
                                                                          cfg.data)
    return [problem] if problem else []


def _scaled(rows: float, consumed: int, size: int, whole: bool) -> tuple[float, bool]:
    """Rows of a file from the rows in its first `consumed` bytes (on disk) of `size`."""
    if whole or not consumed:
        return rows, whole
    return rows * size / consumed, False


def _text_rows(fs, path: str, size: int, fmt: str, key: str | None = None, header_less: bool = False
               ) -> tuple[float, bool]:
    """(rows, counted whole) of a JSONL/CSV file: lines in SAMPLE_BYTES read at four places along it (the middles
    of its quarters), scaled by the file's size; with `key`, the occurrences of "key": (a JSON array's elements). A
    compressed one (by suffix: the bytes of a .gz are not its lines) is counted in the decompression of its first
    64 KiB, 256 KiB, ... up to SAMPLE_BYTES of compressed bytes, until that gives a MiB of text."""
    codec = _CODECS.get(posixpath.splitext(path.lower())[1])
    with fs.open_input_file(path) as raw:  # never decompressed on its own
        if not codec:  # a quarter MiB around 1/8, 3/8, 5/8 and 7/8 of the file: rows that grow along it count
            piece = SAMPLE_BYTES // 4
            pieces = [raw.read_at(piece, size * (2 * i + 1) // 8 - piece // 2) for i in range(4)] \
                if size > SAMPLE_BYTES else [raw.read(SAMPLE_BYTES)]
            head = b"".join(pieces)
            consumed = len(head)
        else:
            consumed = 1 << 16
            while True:
                raw.seek(0)
                prefix = raw.read(min(consumed, size))
                head = _decompressed(prefix, codec)
                consumed = len(prefix)
                if len(head) >= SAMPLE_BYTES or consumed >= min(size, SAMPLE_BYTES):
                    break
                consumed *= 4
    if not head:
        return 0.0, True
    whole = consumed >= size
    if key is not None:
        return _scaled(max(1, len(re.findall(b'"' + re.escape(key.encode()) + rb'"\s*:', head))), consumed, size,
                       whole)
    header = 1 if fmt in ("csv", "tsv") and not header_less else 0
    lines = head.count(b"\n") + (not head.endswith(b"\n") and whole) - header
    return _scaled(max(1, lines), consumed, size, whole)


def _decompressed(prefix: bytes, codec: str) -> bytes:
    """The text the first bytes of a compressed file hold (a truncated stream ends where its bytes do)."""
    stream, out = pa.CompressedInputStream(pa.BufferReader(prefix), codec), []
    with contextlib.suppress(OSError):  # "Truncated compressed stream": the prefix's end
        while chunk := stream.read(1 << 16):
            out.append(chunk)
    return b"".join(out)


def _arrow_rows(fs, path: str, size: int) -> tuple[float, bool]:
    """(rows, counted whole) of an Arrow IPC file: exact from the file format's footer, else (the stream format of
    Hugging Face datasets) the record batches in its first SAMPLE_BYTES, scaled by the file's size."""
    try:
        return float(pads.dataset([path], filesystem=fs, format="ipc").count_rows()), True  # batch headers only
    except pa.ArrowInvalid:
        pass
    rows = 0
    with fs.open_input_file(path) as raw:
        reader, whole = pa.ipc.open_stream(raw), True
        for batch in reader:
            rows += batch.num_rows
            if raw.tell() >= SAMPLE_BYTES:
                whole = False
                break
        consumed = raw.tell()
    return _scaled(rows, consumed, size, whole)


def run_measurements(run: RunDir, cfg: Config, rates: Rates) -> dict:
    """What a finished run tells the plan: its stage rates (costs.json), bytes per row of each folder, its cluster
    sizes and imbalance at cfg.cluster.k, its embedding dimension."""
    out: dict = {"sizes": None, "dim": None, "rows": None}
    k = cfg.cluster.k
    if run.exists(fit_stats_path(k)):
        stats = run.read_json(fit_stats_path(k))
        out["dim"] = stats.get("dim")
        rates.imbalance_factor = stats.get("imbalance_factor") or rates.imbalance_factor
    if run.exists(manifest_path(k)):
        manifest = load_manifest(run, k)
        out["sizes"] = [int(n) for n in manifest.original_counts]
    if not run.exists("report/costs.json"):
        return out
    costs = run.read_json("report/costs.json")
    rows_in = (costs.get("ingest") or {}).get("rows_in")
    train_rows = (costs.get("embed") or costs.get("assign") or {}).get("rows") or (costs.get("ingest") or {}).get("pairs")
    if not train_rows:
        return out
    rows_in = rows_in or round(train_rows / (1 - cfg.data.heldout_fraction))
    out["rows"] = rows_in
    dim, _ = embedding_dim(cfg, out["dim"])
    shape = run_shape(cfg, rows_in, k, dim, out["sizes"])
    work = {stage: stage_work(stage, cfg, shape) for stage in plan_stages() if stage != "train"}
    for key, rec in costs.items():
        if key.startswith("train") and rec.get("steps"):
            work[key] = float(rec["steps"] * rec.get("global_batch_size", cfg.train.schedule.global_batch_size))
    sizes = folder_bytes(run.root) if run.fs.type_name == "local" else {}
    per_row = {"pairs": shape.train_rows, "heldout": shape.heldout_rows}
    rates.bytes_per_row.update({folder: sizes[folder] / rows for folder, rows in per_row.items()
                                if sizes.get(folder) and rows})
    cpus = cfg.ray.num_cpus or os.cpu_count() or 1
    planner = Planner(cfg, shape, this_machine(), rates, Models(0, 0, 0, 0, 0, 0, ""), None)  # the run's k terms
    k_terms = {stage: planner.k_terms(stage, cpus) for stage in ("fit", "assign", "dedup", "shard")}
    merge_run_costs(rates, costs, work, cpus, f"measured in {run.uri} (report/costs.json)", k_terms)
    return out


def embedding_table_params(model: str, hidden: int | None = None) -> int | None:
    """Parameters of a BERT-like model's embedding tables ((vocab + positions + token types) x hidden), which do
    no FLOPs per token; from its config.json (a local folder), or the tokenizer's vocab for a from-scratch shape."""
    from clusterscale.modeling.encoder import load_tokenizer, resolve_model_path

    try:
        with open(os.path.join(resolve_model_path(model), "config.json")) as f:
            c = json.load(f)
        if hidden is None:
            return (c["vocab_size"] + c.get("max_position_embeddings", 0) + c.get("type_vocab_size", 0)) * c["hidden_size"]
        return (len(load_tokenizer(resolve_model_path(model))) + c.get("max_position_embeddings", 512) + 2) * hidden
    except Exception:  # a hub id not on disk
        return None


def models_of(cfg: Config, tokens: dict | None = None) -> Models:
    """Parameters (all, for memory; without the embedding tables, for FLOPs) and tokens of the encoder and student:
    `tokens` (stages/costs.mean_tokens over a sample of a run's pairs, capped at cfg's lengths) when given, else the
    configured caps."""
    from clusterscale.stages.costs import param_count, student_param_count

    st = cfg.train.student
    embed, student = param_count(cfg.embed.model), student_param_count(cfg)
    embed_table = embedding_table_params(cfg.embed.model) if embed else None
    student_table = (embedding_table_params(st.tokenizer, st.scratch_hidden_size) if st.init == "scratch"
                     else embedding_table_params(st.init)) if student else None
    notes = []
    if embed is None:
        notes.append(f"{cfg.embed.model} not on disk: taken as BERT-base ({BERT_BASE_PARAMS / 1e6:.0f}M parameters)")
    if student is None:
        notes.append(f"student not on disk: taken as BERT-base ({BERT_BASE_PARAMS / 1e6:.0f}M parameters)")
    if tokens:
        embed_tokens, train_tokens = tokens["embed"], tokens["train_query"] + tokens["train_passage"]
        notes.append(f"FLOPs = 2 (forward) or 6 (training) x parameters without the embedding tables x tokens, tokens "
                     f"the mean of {tokens['sample_rows']:,} pairs of the run (embed {embed_tokens:.1f}; train "
                     f"{tokens['train_query']:.1f} + {tokens['train_passage']:.1f}, capped at the configured lengths)")
    else:
        embed_tokens, train_tokens = cfg.embed.max_length, st.query_max_length + st.passage_max_length
        notes.append(f"FLOPs = 2 (forward) or 6 (training) x parameters without the embedding tables x tokens, tokens "
                     f"at the configured caps (embed {cfg.embed.max_length}; train {st.query_max_length} + "
                     f"{st.passage_max_length}): an upper bound, real texts are shorter (--run-dir of a run on your "
                     f"data measures them)")
    embed, student = embed or BERT_BASE_PARAMS, student or BERT_BASE_PARAMS
    return Models(embed, student, embed - (embed_table or BERT_BASE_EMBEDDING_TABLES),
                  student - (student_table or BERT_BASE_EMBEDDING_TABLES), embed_tokens, train_tokens,
                  "; ".join(notes))


def _shown(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return bounded_repr(value)
    if isinstance(value, int) and abs(value) < 10 ** 30:
        return f"{value:,}"
    if isinstance(value, int):
        return bounded_repr(value)
    if math.isfinite(value) and value == int(value) and abs(value) < 1e18:
        return f"{int(value):,}"
    return f"{value:,.6g}"


def check_number(what: str, value, low: float, high: float, unit: str = "") -> None:
    """A number inside [low, high] (None: not given), or a ConfigError naming it, the value and the range."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                              and low <= value <= high):
        raise ConfigError(f"{what} must be {unit}from {_shown(low)} to {_shown(high)}; got {_shown(value)}.")


def check_request(request: PlanRequest) -> None:
    """Every numeric flag inside its range, before anything is read or computed."""
    check_number("--rows", request.rows, 1, MAX_ROWS, "a number of pairs ")
    if request.k_values is not None and len(request.k_values) > MAX_K_VALUES:
        raise ConfigError(f"--k lists {len(request.k_values):,} cluster counts; a plan takes at most {MAX_K_VALUES}: "
                          f"split them over several plans.")
    for k in request.k_values or []:
        check_number("--k", k, 1, MAX_ROWS, "a number of clusters ")
    check_number("--gpus", request.gpus, 1, MAX_GPUS, "a whole number of GPUs ")
    check_number("--nodes", request.nodes, 1, MAX_NODES, "a whole number of nodes ")
    check_number("--price-per-gpu-hour", request.price_per_gpu_hour, 0, MAX_PRICE_PER_GPU_HOUR)
    check_number("--imbalance", request.imbalance, 1.0, MAX_IMBALANCE, "an imbalance factor ")


def make_plan(request: PlanRequest) -> dict:
    """The plan as a JSON-ready dict: stages of the first k at N, the training shape, warnings, the ratio, and a
    table over every k and N/4, N, 4N."""
    check_request(request)
    cfg, run, run_cfg = load_config(request)
    data, path = load_calibration(request.calibration)
    rates = rates_from_calibration(data, path) if data else Rates()
    load_gpu_calibration(request.gpu_calibration, rates)
    measured = run_measurements(run, run_cfg, rates) if run else {"sizes": None, "dim": None, "rows": None}
    data_warnings: list[str] = []
    unit_share = None  # ingest's largest work unit / the input rows, when the input files were read
    if request.rows is not None:
        rows, rows_from = request.rows, "--rows"
    elif run is None or measured["rows"] is None:
        rows, rows_from, largest_unit = count_input(cfg)
        unit_share = largest_unit / rows if rows else None
        data_warnings = input_warnings(cfg)
    else:
        rows, rows_from = measured["rows"], "the run's ingest"
    check_number(f"The row count of {rows_from}", rows, 1, MAX_ROWS, "a number of pairs ")
    k_values = request.k_values or [cfg.cluster.k]
    for k in k_values:
        if k > rows:
            raise ConfigError(f"{'--k' if request.k_values else 'cluster.k'} {k:,} is more clusters than the "
                              f"{rows:,} pairs planned ({rows_from}): k must be from 1 to the number of pairs.")
    cluster = load_cluster(request.cluster, request.gpus, request.gpu_type, request.nodes)
    if cfg.train.compute.use_gpu and not cluster.gpus:
        rates.notes.append("train.use_gpu is true but the cluster has no GPUs: training is planned on its CPUs")
    elif cluster.gpus and not cfg.train.compute.use_gpu:
        rates.notes.append(f"train.use_gpu is false: training is planned on the cluster's CPUs, not its "
                           f"{cluster.gpus:,} GPUs (--set train.use_gpu=true plans it on them; "
                           f"cluster_configs/msmarco-paper.yaml and scale-100m.yaml set it)")
    if cluster.source != "this machine":
        rates.notes.append(f"CPU stages: the measured CPU-seconds spread over the cluster's {cluster.cpus:,} CPUs "
                           f"(assumed: the calibration machine's per-core speed, linear scaling); start-ups as "
                           f"measured")
    dim, dim_from = embedding_dim(cfg, measured["dim"])
    from clusterscale.stages.costs import mean_tokens

    models = models_of(cfg, mean_tokens(run, cfg) if run else None)
    imbalance = request.imbalance or rates.imbalance_factor
    check_number("The imbalance_factor of the calibration file or the run", imbalance, 0.0, MAX_IMBALANCE)

    def planner(n: int, k: int) -> Planner:
        sizes = measured["sizes"] if run_cfg and k == run_cfg.cluster.k else None
        return Planner(cfg, run_shape(cfg, n, k, dim, sizes, imbalance, unit_share), cluster, rates, models,
                       request.price_per_gpu_hour)

    main = planner(rows, k_values[0])
    stages = main.plan()
    epochs = cfg.train.schedule.epochs
    t = main.train
    out = {"rows": rows, "rows_from": rows_from, "k": k_values[0], "cluster": cluster.describe(),
           "embedding_dim": dim, "embedding_dim_from": dim_from, "epochs": epochs,
           "stages": {name: s.to_json() for name, s in stages.items()},
           "preprocess_over_train": preprocess_over_train(stages, epochs),
           "train_shape": {"steps_per_epoch": t.steps_per_epoch, "unused_pairs_per_epoch": t.unused_pairs_per_epoch,
                           "global_batches_per_cluster": dict(zip(("min", "median", "max"), t.batches_per_cluster)),
                           "mean_global_batches_per_cluster": t.mean_batches_per_cluster,
                           "shards": main.shards.items, "cluster_sizes_from": main.shape.sizes_from},
           "warnings": data_warnings + main.warnings(stages), "notes": [models.note, *rates.notes] + (
               [f"no rate for {', '.join(uncalibrated(stages))}: left out of the sums and the ratio"]
               if uncalibrated(stages) else []),
           "price_per_gpu_hour": request.price_per_gpu_hour, "table": []}
    for k in k_values:
        for n in sorted({max(1, rows // 4), rows, rows * 4}):
            p = planner(n, k)
            s = p.plan()
            pre = sum(v.wall_s for name, v in s.items() if name not in ("train", "evaluate")
                      and not v.runs_on.startswith("skipped") and not math.isnan(v.wall_s))
            out["table"].append({"k": k, "rows": n, "preprocess_s": pre, "train_epoch_s": s["train"].wall_s,
                                 "preprocess_over_train": preprocess_over_train(s, epochs),
                                 "steps_per_epoch": p.train.steps_per_epoch,
                                 "mean_global_batches_per_cluster": p.train.mean_batches_per_cluster,
                                 "unused_fraction": p.train.unused_pairs_per_epoch / max(1, p.shape.train_rows),
                                 "cost": None if request.price_per_gpu_hour is None else sum(
                                     v.cost or 0.0 for v in s.values() if not math.isnan(v.wall_s))})
    return out


__all__ = ["PlanRequest", "make_plan", "count_input_rows", "count_input", "train_shape", "shard_sizes"]
