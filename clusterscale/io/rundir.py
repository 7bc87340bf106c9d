"""The run directory: one folder (local or any pyarrow filesystem URI) holding every stage's output.

Stages write their files, then a `_DONE.json` marker carrying the fingerprint of the config that
produced them and the values it covers. A stage is complete only when its marker exists; a rerun with
the same fingerprint skips it, a rerun with another fingerprint refuses to mix outputs (naming the
changed keys) unless told to replace them. A stage in progress holds a lock under RUN/locks/. When a stage is
locked, begun, marked done or replaced is the executor's protocol (clusterscale/run_protocol.py).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import posixpath
import shlex
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import yaml
from clusterscale.errors import UserError, storage_error

from clusterscale.config import Config, to_yaml
from clusterscale.io.filesystems import resolve_filesystem
from clusterscale.io.records import DoneMarker
from clusterscale.redact import redact_uri, redact_values

DONE = "_DONE.json"
FOOTER_THREADS = 32  # Parquet footers read at once (I/O-bound: round trips to the store)
COSTS = "report/costs.json"
SYNTHETIC_DATA = "synth://"  # data.path of a run written by `clusterscale synth` (its generator's parameters follow)


@dataclass
class StageResult:
    """What a stage's run function returns (the one shape of every stage).

    stats: the stage's figures, written to its done marker and its cost record. outputs: what callers use
    beyond the stats (evaluate: the results per model; report: the report path; a stage that writes more
    than one marked folder: a StageResult per extra folder, marked with the same protocol). config: the
    config values recorded in the done marker. complete: False when the stage stopped early on purpose
    (train.stop_after_steps), so no done marker is written."""
    stats: dict
    outputs: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    complete: bool = True


class StageMissingError(UserError, RuntimeError):
    """An input of a stage is missing; the message names the verb to run first."""


class StageInputChangedError(StageMissingError):
    """A file that an input folder's done marker lists is gone or has another size (lost, cut short or overwritten
    after its stage finished), or a stray Parquet file was added that a reader would read with the others; the
    message names the file and the command that rebuilds the folder."""


class UnreadableFileError(UserError, ValueError):
    """A file of the run directory that does not parse (JSON cut short, a Parquet file without its footer): the
    message names it and what makes it again. `rel`: its path in the run; `generic`: the advice is the default one
    of its kind of file, which the executor replaces with the verb that rebuilds the folder holding it (`advised`)."""

    def __init__(self, message: str, rel: str = "", shown: str = "", problem: str = "", generic: bool = False):
        super().__init__(message)
        self.rel, self.shown, self.problem, self.generic = rel, shown, problem, generic

    @classmethod
    def of(cls, run: RunDir, rel: str, problem: str, advice: str = "") -> UnreadableFileError:
        """`advice`: what makes the file again; default: by what the file is (_default_advice)."""
        error = cls("", rel, redact_uri(run.child_uri(rel)), problem)
        return error.advised(advice or _default_advice(rel), generic=not advice)

    def advised(self, advice: str, generic: bool = False) -> UnreadableFileError:
        """The same error, ending with `advice` (what makes the file again)."""
        return UnreadableFileError(f"{self.shown}: {self.problem}; it was cut short or overwritten after it was "
                                   f"written. {advice[:1].upper()}{advice[1:]}.", self.rel, self.shown, self.problem,
                                   generic)


class ConfigMismatchError(UserError, RuntimeError):
    """Outputs exist that were made with a different config; `stage_dir` is the refused output."""

    def __init__(self, message: str, stage_dir: str = ""):
        super().__init__(message)
        self.stage_dir = stage_dir


def join_uri(uri: str, *parts: str) -> str:
    """`uri` with path parts appended before its query (s3://b/run?endpoint_override=.. keeps its options)."""
    base, sep, query = uri.partition("?")
    return posixpath.join(base, *parts) + sep + query


def local_copy(uri_or_path: str) -> str:
    """A local folder holding the files under `uri_or_path`; local paths are returned unchanged.

    Object-store folders (a model in a bucket, a trained model in an s3:// run) are downloaded once
    per node into the temp dir; the cache key includes every file's size and mtime, so a changed
    folder is fetched again. Download goes to a temporary name first, so a reader never sees half.
    """
    if "://" not in uri_or_path or uri_or_path.startswith("file://"):
        return resolve_filesystem(uri_or_path)[1]
    fs, root = resolve_filesystem(uri_or_path)
    infos = [i for i in fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
             if i.type == pafs.FileType.File]
    if not infos:
        raise FileNotFoundError(f"No files under {uri_or_path}: check the URI and the credentials of this node.")
    listing = sorted((posixpath.relpath(i.path, root), i.size, str(i.mtime)) for i in infos)
    key = hashlib.sha256(json.dumps([uri_or_path.partition("?")[0], listing]).encode()).hexdigest()[:16]
    target = os.path.join(tempfile.gettempdir(), "clusterscale-copies", key)
    if os.path.isdir(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{key}-", dir=os.path.dirname(target))
    for rel, _, _ in listing:
        os.makedirs(os.path.dirname(os.path.join(staging, rel)), exist_ok=True)
        with fs.open_input_stream(posixpath.join(root, rel)) as src, open(os.path.join(staging, rel), "wb") as dst:
            shutil.copyfileobj(src, dst)
    try:
        os.rename(staging, target)
    except OSError:  # another process on this node finished first: same content, keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    return target


class RunDirMissing(UserError, ValueError):
    """No run directory was given (an empty --run-dir: e.g. an unset shell variable)."""


class RunDir:
    def __init__(self, uri: str):
        if not uri:
            raise RunDirMissing("--run-dir is empty: give a local folder or a URI such as s3://bucket/run (an unset "
                                "shell variable in `--run-dir $RUN` gives an empty one).")
        self.fs, self.root = resolve_filesystem(uri)
        # Absolute, so that Ray workers (which run in their own working directory) find the same folder.
        self.uri = uri if "://" in uri else self.root
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)
        if self.is_local:
            _refuse_file_in_the_way(self.root)

    # paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts) if parts else self.root

    def child_uri(self, *parts: str) -> str:
        """A URI (or local path) of a file or folder inside the run that any process can resolve."""
        return join_uri(self.uri, *parts) if "://" in self.uri else self.path(*parts)

    def exists(self, *parts: str) -> bool:
        return self.fs.get_file_info(self.path(*parts)).type != pafs.FileType.NotFound

    def listdir(self, *parts: str) -> list[str]:
        """Base names directly inside a folder, sorted; [] when it does not exist."""
        if not self.exists(*parts):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(*parts), recursive=False))
        return sorted(posixpath.basename(i.path) for i in infos)

    def files(self, *parts: str, suffix: str = ".parquet", include_private: bool = False) -> list[str]:
        """Full paths of the data files under a folder (recursive), sorted, skipping temp files (and, unless
        include_private, markers such as _DONE.json)."""
        if not self.exists(*parts):
            return []
        hidden = (".",) if include_private else (".", "_")
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(*parts), recursive=True))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix)
                      and not posixpath.basename(i.path).startswith(hidden))

    def footers(self, paths: list[str]) -> list[pq.FileMetaData]:
        """The Parquet footers of `paths` (full paths), in order, read FOOTER_THREADS at a time: on an object store
        each is a round trip or two, so one after another they took minutes at 25k files (pyarrow's filesystems
        are thread-safe)."""
        def read(path: str) -> pq.FileMetaData:
            with self.fs.open_input_file(path) as f:
                try:
                    return pq.ParquetFile(f).metadata
                except pa.ArrowInvalid as err:  # no footer: cut short, or not Parquet
                    raise UnreadableFileError.of(self, posixpath.relpath(path, self.root),
                                                 f"not a readable Parquet file ({err})") from None

        if len(paths) < 2:
            return [read(p) for p in paths]
        with concurrent.futures.ThreadPoolExecutor(min(FOOTER_THREADS, len(paths))) as pool:
            return list(pool.map(read, paths))

    def makedirs(self, *parts: str) -> None:
        self.fs.create_dir(self.path(*parts), recursive=True)

    def remove(self, *parts: str) -> None:
        p = self.path(*parts)
        info = self.fs.get_file_info(p)
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(p)
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(p)

    # atomic files ----------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write to a temporary name, then rename: readers never see a half-written file."""
        final = self.path(rel)
        tmp = posixpath.join(posixpath.dirname(final), f".tmp-{uuid.uuid4().hex}-{posixpath.basename(final)}")
        try:
            self.fs.create_dir(posixpath.dirname(final), recursive=True)
            with self.fs.open_output_stream(tmp) as out:
                out.write(data)
            self.fs.move(tmp, final)
        except OSError as err:  # pyarrow names the path only sometimes: a full disk's message names it always
            found = storage_error(err, redact_uri(self.child_uri(rel)))
            if found is None:
                raise
            raise found from None

    def write_parquet(self, rel: str, table: pa.Table, **write_options: Any) -> None:
        """Write `table` as one Parquet file at `rel`, atomically (write_bytes); options go to pq.write_table."""
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **write_options)
        self.write_bytes(rel, sink.getvalue())

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def write_json(self, rel: str, obj: Any) -> None:
        """Stored JSON (markers, costs, reports) never holds credentials; the run keeps real URIs in memory."""
        self.write_bytes(rel, json.dumps(redact_values(obj), indent=2, sort_keys=False,
                                         default=_json_default).encode())

    def read_json(self, rel: str, advice: str = "") -> Any:
        """The JSON at `rel`; one that does not parse is an UnreadableFileError naming it, with `advice` (what makes
        it again; default: by what the file is)."""
        try:
            return json.loads(self.read_bytes(rel))
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise UnreadableFileError.of(self, rel, f"not valid JSON ({err})", advice) from None

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, redact_uri(text).encode())

    # stage markers -----------------------------------------------------------------------------
    def is_done(self, stage_dir: str, fingerprint: str, quiet: bool = False) -> bool:
        """True when `stage_dir` is complete for this fingerprint (said unless quiet); raises if made by another
        config."""
        if not self.exists(stage_dir, DONE):
            return False
        done = self.done_marker(stage_dir)
        if done.fingerprint != fingerprint:
            raise ConfigMismatchError(
                f"{self.path(stage_dir)} was made with a different config; changed: "
                f"{changed_keys(done.covers, getattr(fingerprint, 'values', None))}. "
                f"Outputs are never mixed.", stage_dir)
        if not quiet:
            print(f"[{stage_dir}] reused (done at {done.finished_at})", flush=True)
        return True

    def clear(self, stage_dir: str) -> None:
        """An empty `stage_dir`: whatever it held is removed (the leftovers of an interrupted attempt)."""
        if self.exists(stage_dir):
            self.remove(stage_dir)
        self.makedirs(stage_dir)

    def mark_done(self, stage_dir: str, fingerprint: str, stats: dict, config_subset: dict | None = None,
                  unlisted: tuple[str, ...] = ()) -> None:
        """`covers`: the config values the fingerprint hashes, so a refused rerun can name what changed; `files`:
        what the folder holds now (listed_files, less `unlisted`), checked by the stages that read it."""
        self.write_json(posixpath.join(stage_dir, DONE), DoneMarker(
            fingerprint, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), stats, config_subset or {},
            getattr(fingerprint, "values", None), files=self.listed_files(stage_dir, unlisted)).to_json())

    def listed_files(self, stage_dir: str, unlisted: tuple[str, ...] = ()) -> dict[str, int]:
        """{path inside `stage_dir`: bytes} of the files it holds, from ONE recursive listing (an object store
        lists ~1,000 files per request; never a request per file). Leaves out temp files (a name starting with
        '.'), done markers, the folders inside that hold their own done marker (other outputs: shards/k=<k>/random/,
        dedup/kept/) and `unlisted` (paths inside the folder; a folder ends with '/')."""
        root = self.path(stage_dir)
        infos = self.fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        files = {posixpath.relpath(i.path, root): i.size for i in infos if i.type == pafs.FileType.File}
        skipped = (*unlisted, *(posixpath.dirname(p) + "/" for p in files if posixpath.basename(p) == DONE
                                and "/" in p))
        return {p: files[p] for p in sorted(files) if posixpath.basename(p) != DONE and not p.startswith(skipped)
                and not any(part.startswith(".") for part in p.split("/"))}

    def check_complete(self, stage_dir: str, what: str, verb: str, strays: bool = True) -> None:
        """Refuse `stage_dir` when a file its done marker lists is gone or has another size (lost, cut short or
        overwritten after `verb` finished it) or, with `strays` (its reader reads every Parquet file in it), when a
        Parquet file was added that the reader would read with them. One listing of the folder; a marker that
        predates the file list is not checked. Other added files are not an error."""
        marker = self.done_marker(stage_dir, advice=self.rebuild_advice(stage_dir, verb))
        if marker.files is None:
            return
        found = self.listed_files(stage_dir)
        problems = [(name, "is missing" if name not in found else
                     f"holds {found[name]:,} bytes, not the {size:,} it was written with")
                    for name, size in marker.files.items() if found.get(name) != size]
        added = [(name, f"is not one of the files `{verb}` wrote, and would be read with them")
                 for name in found if strays and name not in marker.files and name.endswith(".parquet")
                 and not posixpath.basename(name).startswith("_")]
        if not problems + added:
            return
        name, problem = (problems + added)[0]
        more = len(problems) + len(added) - 1
        rows = marker.stats.get("rows")
        held = f"{len(marker.files):,} files" + (f", {rows:,} rows" if isinstance(rows, int) else "")
        advice = self.rebuild_advice(stage_dir, verb, marker) if problems else \
            f"move it out of {stage_dir}/ (or rebuild the folder: {self.rebuild_advice(stage_dir, verb, marker)})"
        raise StageInputChangedError(
            f"{redact_uri(self.child_uri(stage_dir, name))} {problem}"
            f"{f' (and {more} more file(s) of {stage_dir}/ missing, changed or added)' if more else ''}: "
            f"{what} in {redact_uri(self.child_uri(stage_dir))} changed after `{verb}` finished ({held} then). "
            f"{advice[:1].upper()}{advice[1:]}.")

    def rebuild_advice(self, stage_dir: str, verb: str, marker: DoneMarker | None = None) -> str:
        """What makes `stage_dir` again: `verb` with --replace (which removes it and what was made from it, and
        reruns it), or, for a folder written by `clusterscale synth`, a new synthetic run."""
        data_path = str((((marker.covers if marker else None) or {}).get("data") or {}).get("path", ""))
        if data_path.startswith(SYNTHETIC_DATA):
            return f"{stage_dir}/ was written by `clusterscale synth`: write the synthetic run again in a new --run-dir"
        return (f"rebuild {stage_dir}/ with `clusterscale {verb} --run-dir {shlex.quote(redact_uri(self.uri))} "
                f"--replace` (plus any --set keys the run was made with; --replace also removes what was made from it)")

    def covers(self, stage_dir: str) -> dict | None:
        """The covered values of `stage_dir`'s marker; None for one that does not parse (replace removes what it
        is asked to; what was made from an unreadable marker cannot be told)."""
        try:
            return self.done_marker(stage_dir).covers
        except UnreadableFileError:
            return None

    def done_marker(self, stage_dir: str, advice: str = "") -> DoneMarker:
        """The done marker of `stage_dir` (which must exist); one that does not parse is an UnreadableFileError
        ending with `advice` (default: delete the folder and rerun what made it)."""
        rel = posixpath.join(stage_dir, DONE)
        data = self.read_json(rel, advice)
        if not isinstance(data, dict):
            raise UnreadableFileError.of(self, rel, "not a done marker (a JSON object)", advice)
        return DoneMarker.from_json(data)

    def done_stats(self, stage_dir: str) -> dict:
        return self.done_marker(stage_dir).stats

    def require(self, stage_dir: str, verb: str, what: str) -> None:
        if not self.exists(stage_dir, DONE):
            unfinished = self.exists(stage_dir) and self.listdir(stage_dir)  # an attempt that stopped midway
            rerun = (" (its last attempt stopped before it finished: `clusterscale train --resume` continues it from "
                     "its latest checkpoint)" if unfinished and verb == "train" else
                     " (its last attempt stopped before it finished: the same command finishes it)" if unfinished
                     else "")
            raise StageMissingError(f"{what} not found in {self.path(stage_dir)}: run `clusterscale {verb}` "
                                    f"(with the same config and --run-dir) first{rerun}.")

    def write_config(self, cfg: Config) -> None:
        self.write_text("config.yaml", to_yaml(cfg))

    def config_in_force(self) -> dict | None:
        """RUN/config.yaml once a stage completed with it; None for a new run, or for one whose first attempt
        completed nothing (so a first command that failed, e.g. on a wrong column, can be corrected)."""
        if not self.exists("config.yaml") or not any(self.exists(d, DONE) for d in ("pairs", "embeddings")):
            return None
        return yaml.safe_load(self.read_bytes("config.yaml"))

def _refuse_file_in_the_way(root: str) -> None:
    """A local run directory (or a folder above it) that is a file cannot hold a run: say so before any write."""
    path = root
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        where = "" if path == root else f" (inside {path})"
        raise UserError(f"--run-dir {root}{where}: {path} exists and is not a folder (a file?), so it cannot hold "
                        f"a run. Pass a --run-dir that is a folder: an existing run, or a new path (it is created).")


def _default_advice(rel: str) -> str:
    """What makes a run file again when its reader does not know the verb."""
    if posixpath.basename(rel) == DONE:
        return f"delete {posixpath.dirname(rel)}/ and rerun the command that made it (its stage then makes it again)"
    if rel == COSTS:
        return (f"move it aside: the stages run from now on record their costs in a new {COSTS} (the report then "
                f"lacks the costs of the stages done before)")
    return "delete it and rerun the command that wrote it"


def changed_keys(old: dict | None, new: dict | None) -> str:
    """'section.key old -> new, ...' between two fingerprints' covered values."""
    if not old or not new:
        return "unknown (the existing output's marker predates recorded values; its config is in its _DONE.json)"
    flat_old, flat_new = _flatten(old), _flatten(new)
    keys = sorted(k for k in flat_old.keys() | flat_new.keys() if flat_old.get(k, "-") != flat_new.get(k, "-"))
    return ", ".join(f"{k} {flat_old.get(k, '-')!r} -> {flat_new.get(k, '-')!r}" for k in keys)


def _flatten(values: dict) -> dict:
    return {f"{section}.{key}": v for section, keys in values.items() for key, v in (keys or {}).items()}


def _json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o)}")
