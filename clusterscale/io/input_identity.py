"""Which input files an ingest read, as a rerun can compare them: each file's path, size and modification time.

The done marker holds a digest of that listing; the listing itself is a Parquet file in the output folder, read only
when a rerun's listing has another digest, to name the first file changed, added or removed. Both come from the
one listing ingest does anyway (pyarrow's FileInfo: size and mtime; it exposes no ETag or object version, and a
store's modification time changes with every overwrite).
"""
from __future__ import annotations

import hashlib
import posixpath
import time

import pyarrow as pa
import pyarrow.parquet as pq

from clusterscale.config import DataConfig
from clusterscale.errors import UserError
from clusterscale.io.filesystems import filesystem_errors
from clusterscale.io.input_files import find_input_files
from clusterscale.io.input_walk import InputWalk
from clusterscale.io.rundir import ConfigMismatchError, RunDir
from clusterscale.redact import redact_uri

INPUT_LISTING = "_input_files.parquet"  # inside the output folder: `_` keeps it out of the data files
_SCHEMA = pa.schema([("path", pa.string()), ("size", pa.int64()), ("mtime_ns", pa.int64())])


def listing_table(walk: InputWalk) -> pa.Table:
    """The files in read order with their size and modification time (null where the store gives none)."""
    stamps = [walk.stamps.get(path, (None, None)) for path in walk.files]
    return pa.table([walk.files, [s[0] for s in stamps], [s[1] for s in stamps]], schema=_SCHEMA)


def listing_digest(listing: pa.Table) -> str:
    digest = hashlib.blake2b(digest_size=16, person=b"input-files")
    for path, size, mtime_ns in zip(*(listing.column(c).to_pylist() for c in _SCHEMA.names)):
        digest.update(f"{path}\0{size}\0{mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def record_inputs(run: RunDir, folder: str, walk: InputWalk) -> dict:
    """Write the listing into `folder`; what the done marker keeps of it (stats["inputs"])."""
    listing = listing_table(walk)
    run.write_parquet(posixpath.join(folder, INPUT_LISTING), listing)
    return {"files": listing.num_rows, "digest": listing_digest(listing), "listing": INPUT_LISTING}


def refuse_changed_input_files(run: RunDir, out: str, data: DataConfig) -> None:
    """Before `out` is reused: a ConfigMismatchError when an input file changed, was added or was removed since it
    was made (one listing, compared by its digest), naming the file. A marker from before inputs were recorded (or
    of the bundled dataset), and an input that can no longer be listed (`out` is then the only copy), leave the
    output reused."""
    recorded = run.done_stats(out).get("inputs")
    if not recorded:
        return
    try:
        with filesystem_errors(data.path):
            walk = find_input_files(data).walk
    except UserError as err:
        print(f"[ingest] the input files cannot be listed now ({str(err).splitlines()[0][:200].rstrip('.')}): "
              f"{out}/ is reused as made, unchecked", flush=True)
        return
    change = input_change(run, out, recorded, walk)
    if change:
        raise ConfigMismatchError(f"{run.path(out)} was made from the files of data.path {redact_uri(data.path)} "
                                  f"as they were then, and they have changed: {change}. Outputs are never mixed.", out)


def input_change(run: RunDir, folder: str, recorded: dict, walk: InputWalk) -> str | None:
    """None when the files listed now are those recorded (same digest); else the first change in path order,
    "<path> changed (<size> -> <size> bytes, modified <time> -> <time>)", "<path> was added" or "<path> was
    removed", and how many more there are."""
    now = listing_table(walk)
    if listing_digest(now) == recorded.get("digest"):
        return None
    stored = posixpath.join(folder, recorded.get("listing", INPUT_LISTING))
    if not run.exists(stored):
        return f"{now.num_rows} file(s) listed now, {recorded.get('files')} then, not the same"
    with run.fs.open_input_file(run.path(stored)) as f:
        before = {row["path"]: row for row in pq.read_table(f).to_pylist()}
    recorded_at = run.fs.get_file_info(run.path(stored)).mtime_ns  # when the listing was recorded (None: unknown)
    after = {row["path"]: row for row in now.to_pylist()}
    changes = []
    for path in sorted(before.keys() | after.keys()):
        old, new = before.get(path), after.get(path)
        if old is None and recorded_at and new["mtime_ns"] and new["mtime_ns"] < recorded_at:
            changes.append(f"{redact_uri(path)} is read now but was not then, though it was there (a compressed, "
                           f".feather or suffix-less file that an earlier clusterscale skipped without a word)")
        elif old is None:
            changes.append(f"{redact_uri(path)} was added")
        elif new is None:
            changes.append(f"{redact_uri(path)} was removed")
        elif old != new:
            changes.append(f"{redact_uri(path)} changed ({_size(old['size'])} -> {_size(new['size'])} bytes, "
                           f"modified {_time(old['mtime_ns'])} -> {_time(new['mtime_ns'])})")
    if not changes:
        return "the files are listed in another order"
    more = f" (and {len(changes) - 1} more file(s) changed, added or removed)" if len(changes) > 1 else ""
    return changes[0] + more


def _size(size: int | None) -> str:
    return "?" if size is None else f"{size:,}"


def _time(mtime_ns: int | None) -> str:
    if mtime_ns is None:
        return "?"
    seconds, ns = divmod(mtime_ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{ns // 1_000_000:03d}Z"
