"""The bundled real dataset: (summary line, body) pairs from the docstrings of installed Python packages.

Docstrings are read with `ast` from the source files, so nothing is imported or executed. The pairs
carry the package as `source`, which gives the data topical structure (numpy vs torch vs ray ...).
The harvest is cached as Parquet under ~/.cache/clusterscale (or $CLUSTERSCALE_CACHE).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BUILTIN_DOCSTRINGS = "builtin:docstrings"
# Packages the install always brings (direct or transitive dependencies) plus the stdlib.
PACKAGES = ("stdlib", "numpy", "torch", "pyarrow", "ray", "transformers", "pandas", "scipy", "sklearn",
            "yaml", "matplotlib")
MAX_FILES_PER_PACKAGE = 1500
MAX_PASSAGE_CHARS = 1200
_SECTION = re.compile(r"\n\s*(Parameters|Args|Arguments|Returns|Examples?|Raises|Notes|See Also|Attributes|"
                      r"Yields|References|Keyword Args|Example usage)\s*[:\n-]", re.I)


def _package_root(name: str) -> Path | None:
    if name == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _version(name: str) -> str:
    if name == "stdlib":
        return sys.version.split()[0]
    dist = {"sklearn": "scikit-learn", "yaml": "PyYAML"}.get(name, name)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _pair_from_docstring(doc: str) -> tuple[str, str] | None:
    doc = doc.strip()
    if "\n\n" not in doc:
        return None
    summary, body = doc.split("\n\n", 1)
    body = _SECTION.split("\n" + body)[0]  # keep the prose, drop parameter tables and examples
    summary, body = _clean(summary), _clean(body)
    if not (4 <= len(summary.split()) <= 40) or len(body.split()) < 12 or ">>>" in body:
        return None
    return summary, body[:MAX_PASSAGE_CHARS]


def _harvest_package(name: str, root: Path) -> list[tuple[str, str]]:
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.as_posix().lower()
                   and "site-packages" not in p.relative_to(root).as_posix())[:MAX_FILES_PER_PACKAGE]
    pairs = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError, OSError, RecursionError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node, clean=True)
                if doc and (pair := _pair_from_docstring(doc)):
                    pairs.append(pair)
    return pairs


def harvest_docstrings(out_path: Path, packages: tuple[str, ...] = PACKAGES, seed: int = 0) -> Path:
    """Write the deduplicated, seeded-shuffled docstring pairs to `out_path` (Parquet)."""
    queries, passages, sources, seen = [], [], [], set()
    for name in packages:
        root = _package_root(name)
        if root is None:
            continue
        for summary, body in _harvest_package(name, root):
            key = body.lower()
            if key in seen:  # inherited / copied docstrings would be false negatives of each other
                continue
            seen.add(key)
            queries.append(summary)
            passages.append(body)
            sources.append(name)
    order = np.random.default_rng(seed).permutation(len(queries))  # interleave packages for data.limit
    table = pa.table({"query": [queries[i] for i in order], "passage": [passages[i] for i in order],
                      "source": [sources[i] for i in order]})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".tmp-{os.getpid()}-{out_path.name}")
    pq.write_table(table, tmp)
    tmp.replace(out_path)
    return out_path


def builtin_docstrings_path() -> str:
    """Path of the cached harvest for the installed package versions (harvested on first use)."""
    cache = Path(os.environ.get("CLUSTERSCALE_CACHE", Path.home() / ".cache" / "clusterscale"))
    versions = ",".join(f"{p}={_version(p)}" for p in PACKAGES)
    digest = hashlib.sha256(versions.encode()).hexdigest()[:12]
    path = cache / f"docstrings-{digest}.parquet"
    if not path.exists():
        print(f"[ingest] harvesting the bundled docstring dataset into {path} (once, ~1 min) ...", flush=True)
        harvest_docstrings(path)
    return str(path)
