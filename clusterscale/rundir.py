"""The run directory: one folder (local or any pyarrow filesystem URI) holding every stage's output.

Stages write their files, then a `_DONE.json` marker carrying the fingerprint of the config that
produced them. A stage is complete only when its marker exists; a rerun with the same fingerprint
skips it, a rerun with another fingerprint refuses to mix outputs.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import tempfile
import time
import uuid
from typing import Any

import pyarrow.fs as pafs
from clusterscale.errors import UserError

from clusterscale.config import Config, to_yaml
from clusterscale.redact import redact_uri, redact_values

DONE = "_DONE.json"


class StageMissingError(UserError, RuntimeError):
    """An input of a stage is missing; the message names the verb to run first."""


class ConfigMismatchError(UserError, RuntimeError):
    """Outputs exist that were made with a different config."""


def resolve_filesystem(uri_or_path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or a pyarrow filesystem URI."""
    if "://" in uri_or_path:
        return pafs.FileSystem.from_uri(uri_or_path)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri_or_path))


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


class RunDir:
    def __init__(self, uri: str):
        if not uri:
            raise ValueError("--run-dir is required: a local folder or a URI such as s3://bucket/run.")
        self.uri = uri
        self.fs, self.root = resolve_filesystem(uri)
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)

    # paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts) if parts else self.root

    def uri_of(self, *parts: str) -> str:
        """A string Ray Data / Ray Train accept together with `self.fs`."""
        return self.path(*parts)

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

    def files(self, *parts: str, suffix: str = ".parquet") -> list[str]:
        """Full paths of the data files under a folder (recursive), sorted, skipping temp files."""
        if not self.exists(*parts):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(*parts), recursive=True))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix)
                      and not posixpath.basename(i.path).startswith((".", "_")))

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
        self.fs.create_dir(posixpath.dirname(final), recursive=True)
        tmp = posixpath.join(posixpath.dirname(final), f".tmp-{uuid.uuid4().hex}-{posixpath.basename(final)}")
        with self.fs.open_output_stream(tmp) as out:
            out.write(data)
        self.fs.move(tmp, final)

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def write_json(self, rel: str, obj: Any) -> None:
        """Stored JSON (markers, costs, reports) never holds credentials; the run keeps real URIs in memory."""
        self.write_bytes(rel, json.dumps(redact_values(obj), indent=2, sort_keys=False,
                                         default=_json_default).encode())

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, redact_uri(text).encode())

    # stage markers -----------------------------------------------------------------------------
    def is_done(self, stage_dir: str, fingerprint: str) -> bool:
        """True when `stage_dir` is complete for this fingerprint; raises if made by another config."""
        marker = posixpath.join(stage_dir, DONE)
        if not self.exists(marker):
            return False
        done = self.read_json(marker)
        if done.get("fingerprint") != fingerprint:
            raise ConfigMismatchError(
                f"{self.path(stage_dir)} was made with a different config (fingerprint "
                f"{done.get('fingerprint')}, now {fingerprint}; its config is in {DONE} there). "
                f"Outputs are never mixed: use a new --run-dir, or delete {stage_dir}/ and what depends on it.")
        print(f"[{stage_dir}] reused (done at {done.get('finished_at')})", flush=True)
        return True

    def begin(self, stage_dir: str) -> None:
        """Clear the leftovers of an interrupted attempt of an incomplete stage."""
        if self.exists(stage_dir):
            self.remove(stage_dir)
        self.makedirs(stage_dir)

    def mark_done(self, stage_dir: str, fingerprint: str, stats: dict, config_subset: dict | None = None) -> None:
        self.write_json(posixpath.join(stage_dir, DONE), {
            "fingerprint": fingerprint, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "stats": stats, "config": config_subset or {}})

    def done_stats(self, stage_dir: str) -> dict:
        return self.read_json(posixpath.join(stage_dir, DONE)).get("stats", {})

    def require(self, stage_dir: str, verb: str, what: str) -> None:
        if not self.exists(stage_dir, DONE):
            raise StageMissingError(f"{what} not found in {self.path(stage_dir)}: run `clusterscale {verb}` "
                                    f"(with the same config and --run-dir) first.")

    def write_config(self, cfg: Config) -> None:
        self.write_text("config.yaml", to_yaml(cfg))

    # costs -------------------------------------------------------------------------------------
    def record_cost(self, key: str, record: dict) -> None:
        """Merge one stage's cost record into RUN/report/costs.json (driver-only, so no races)."""
        rel = "report/costs.json"
        costs = self.read_json(rel) if self.exists(rel) else {}
        costs[key] = record
        self.write_json(rel, costs)


def _json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o)}")
