"""The files under an input folder: each file once however symlinks reach it, no loop, no run directory.

pyarrow's recursive listing follows symlinks blindly: a link to its own folder is walked ~40 levels deep and
every file under it listed again at each level (one 100-row file became 4,100 rows). On a local filesystem
the folder is walked here instead, by (st_dev, st_ino): a folder or file already reached is skipped and
counted. Object stores have no symlinks, so their listing is pyarrow's. A clusterscale run directory found
under the folder (its outputs, locks and quarantine are not input pairs) is skipped whole and named.
"""
from __future__ import annotations

import heapq
import os
import posixpath
import stat
from dataclasses import dataclass, field

import pyarrow.fs as pafs

# A run directory holds its config and, once any stage started, locks/ or a stage's done marker (io/rundir.py).
RUN_CONFIG, RUN_LOCKS, RUN_DONE = "config.yaml", "locks", "_DONE.json"


@dataclass
class InputWalk:
    """What walking an input folder found."""

    files: list[str] = field(default_factory=list)  # not hidden, not inside a run directory; sorted
    stamps: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    """(size in bytes, modification time in ns) of each file listed, as the listing gave them (no extra request):
    what ingest records so that a rerun can tell an input file changed."""
    links_skipped: int = 0  # folders and files reached a second time (a symlink loop or two names of one thing)
    run_dirs_skipped: list[str] = field(default_factory=list)
    docs_skipped: list[str] = field(default_factory=list)  # a data folder's README.md, LICENSE (input_files)


def is_hidden(path: str, root: str) -> bool:
    """Files and folders named `_*` or `.*` (Spark/Hive markers, temp files, .git) are not data."""
    return any(part.startswith((".", "_")) for part in posixpath.relpath(path, root).split("/"))


def walk_files(fs: pafs.FileSystem, root: str) -> InputWalk:
    """Every non-hidden file under the folder `root` (none when it does not exist)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return _walk_local(root)
    return _walk_listing(fs, root)


def _walk_local(root: str) -> InputWalk:
    """Walked in order of (symlinks followed, path): every real path comes before any path through a link,
    so of two names of one file or folder the one without a link is kept (then the first in sorted order)."""
    walk, seen = InputWalk(), set()
    queue: list[tuple[int, str]] = [(0, root)]
    while queue:
        links, path = heapq.heappop(queue)
        try:
            info = os.stat(path)  # follows symlinks; a dangling one is no file
        except (FileNotFoundError, NotADirectoryError):
            continue
        if (info.st_dev, info.st_ino) in seen:
            walk.links_skipped += 1
            continue
        seen.add((info.st_dev, info.st_ino))
        if stat.S_ISREG(info.st_mode):
            walk.files.append(path)
            walk.stamps[path] = (info.st_size, info.st_mtime_ns)
        elif stat.S_ISDIR(info.st_mode):
            with os.scandir(path) as it:
                entries = [e for e in it if not e.name.startswith((".", "_"))]
            if path != root and _is_local_run_dir(path, entries):
                walk.run_dirs_skipped.append(path)
                continue
            for entry in entries:
                heapq.heappush(queue, (links + entry.is_symlink(), entry.path))
    walk.files.sort()
    walk.run_dirs_skipped.sort()
    return walk


def _is_local_run_dir(path: str, entries: list[os.DirEntry]) -> bool:
    names = {e.name for e in entries}
    if RUN_CONFIG not in names:
        return False
    return RUN_LOCKS in names or any(e.is_dir() and os.path.exists(os.path.join(e.path, RUN_DONE)) for e in entries)


def file_stamp(info: pafs.FileInfo) -> tuple[int | None, int | None]:
    """(size, mtime in ns) of a listed file; None where the store does not say."""
    return info.size, info.mtime_ns


def _walk_listing(fs: pafs.FileSystem, root: str) -> InputWalk:
    """pyarrow's recursive listing (object stores: no links), without hidden files and run directories."""
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    files = [i for i in infos if i.type == pafs.FileType.File]
    paths = [i.path for i in files]
    configs = {posixpath.dirname(p) for p in paths if posixpath.basename(p) == RUN_CONFIG}
    marked = {posixpath.dirname(posixpath.dirname(p)) for p in paths
              if posixpath.basename(p) == RUN_DONE or posixpath.basename(posixpath.dirname(p)) == RUN_LOCKS}
    run_dirs = sorted(d for d in configs & marked if d != root and not is_hidden(d, root))
    walk = InputWalk(run_dirs_skipped=run_dirs, stamps={i.path: file_stamp(i) for i in files})
    walk.files = sorted(p for p in paths if not is_hidden(p, root)
                        and not any(p.startswith(d + "/") for d in run_dirs))
    return walk
