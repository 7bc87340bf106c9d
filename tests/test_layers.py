"""The import layers: every project import (those inside functions too) points down or sideways, never up,
and the import graph has no cycle. Read with `ast`, so nothing is imported."""
from __future__ import annotations

import pytest

import ast
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMPONENT_CONFIGS = [f"clusterscale.train.{name}_config" for name in
                     ("schedule", "optim", "loss", "data", "trainer", "metrics", "checkpoint")] + \
                    [f"clusterscale.modeling.{name}_config" for name in ("student", "moe")]

# Top to bottom; a module may import its own layer and the layers below. Every package sits in one layer.
LAYERS: list[tuple[str, list[str]]] = [
    ("entry points", ["clusterscale.cli", "jobs.*"]),
    # plan estimates a run from the stages' own rules (and plan.calibrate runs stages through the pipeline).
    ("orchestration", ["clusterscale.pipeline", "clusterscale.executor", "clusterscale.run_protocol",
                       "clusterscale.experiments", "clusterscale.arm_costs", "clusterscale.plan", "clusterscale.plan.*"]),
    ("stages", ["clusterscale.stages", "clusterscale.stages.*"]),
    ("trainer components", ["clusterscale.train", "clusterscale.train.*"]),
    ("modeling", ["clusterscale.modeling", "clusterscale.modeling.*"]),
    ("runtime", ["clusterscale.runtime", "clusterscale.runtime.*"]),
    ("io", ["clusterscale.io", "clusterscale.io.*"]),
    # Each training component's config sits next to its code but is torch-free and imports only the schema
    # (clusterscale.knobs): it belongs to the config layer, which the config package composes from it.
    ("config", ["clusterscale.config", "clusterscale.config.*", *COMPONENT_CONFIGS, "clusterscale.knobs"]),
    ("base", ["clusterscale.errors", "clusterscale.redact", "clusterscale"]),
]


def module_files() -> dict[str, Path]:
    files = {}
    for path in [*(ROOT / "clusterscale").rglob("*.py"), *(ROOT / "jobs").glob("*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules that `name` imports anywhere in its file (`from pkg import mod` counts as pkg.mod)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            elif name.startswith("jobs.") and f"jobs.{base}" in known:  # jobs import their siblings (`_job`)
                base = f"jobs.{base}"
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def layer_of(module: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):  # a module named outright wins over a pattern
        if module in patterns:
            return index
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch(module, p) for p in patterns):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [node, nxt] if nxt in stack else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, stack + [node])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_module_imports_from_a_layer_above_it():
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
              for a, targets in sorted(import_graph().items()) for b in sorted(targets) if layer_of(b) < layer_of(a)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def package_of(module: str) -> str:
    """The package a module belongs to (clusterscale.<package>); a component config counts as the config's."""
    if module in COMPONENT_CONFIGS or module == "clusterscale.knobs":
        return "config"
    parts = module.split(".")
    return parts[0] if parts[0] == "jobs" else (parts[1] if len(parts) > 1 else "clusterscale")


def two_way_packages(graph: dict[str, set[str]]) -> list[str]:
    edges: dict[tuple[str, str], list[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            if package_of(a) != package_of(b):
                edges.setdefault((package_of(a), package_of(b)), []).append(f"{a} -> {b}")
    return [f"{a} <-> {b}: {sorted(found)[:3]} and {sorted(edges[(b, a)])[:3]}"
            for (a, b), found in sorted(edges.items()) if a < b and (b, a) in edges]


def test_no_two_packages_import_each_other():
    both = two_way_packages(import_graph())
    assert not both, "packages that import each other:\n" + "\n".join(both)


def test_every_package_sits_in_one_layer():
    layers: dict[str, set[str]] = {}
    for module in import_graph():
        if module not in COMPONENT_CONFIGS:
            layers.setdefault(package_of(module), set()).add(LAYERS[layer_of(module)][0])
    split = {package: found for package, found in layers.items() if len(found) > 1}
    assert not split, f"packages split across layers: {split}"


def test_the_checks_see_imports_inside_functions_and_cycles():
    graph = import_graph()
    assert "clusterscale.pipeline" in graph["clusterscale.cli"]  # imported inside main()
    assert "clusterscale.modeling.moe" in graph["clusterscale.modeling.moe_hf"]  # a relative import
    assert "jobs._job" in graph["jobs.sweep"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert two_way_packages({"clusterscale.plan.x": {"clusterscale.stages.y"}, "clusterscale.stages.y":
                             {"clusterscale.plan.z"}, "clusterscale.plan.z": set()})


@pytest.mark.integration
def test_config_loading_imports_neither_torch_nor_ray():
    """The component configs live beside torch code but in torch-free modules: reading and describing a config
    (`clusterscale config`, every verb's start) imports neither torch nor Ray."""
    import subprocess
    import sys

    code = ("import sys; from clusterscale import config; config.load(); config.describe(); "
            "print(sorted(m for m in ('torch', 'ray', 'transformers', 'faiss') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)


@pytest.mark.integration
def test_the_command_starts_without_torch():
    """`clusterscale` imports its verbs without torch or transformers (~1.2 s of every start here): `--help`,
    `config`, `plan` and `inspect` never load them, the other verbs where a stage needs them."""
    import subprocess
    import sys

    code = ("import sys; import clusterscale.cli; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
    assert out.stdout.strip() == "[]"


def test_every_component_config_module_is_in_the_config_layer():
    found = sorted(m for m in import_graph() if m.endswith("_config") and m.startswith("clusterscale."))
    assert found == sorted(COMPONENT_CONFIGS)


def test_package_docstrings_name_their_modules():
    """stages/ and train/ list their modules in their docstrings: a module added or removed is said there."""
    for package in ("stages", "train"):
        folder = ROOT / "clusterscale" / package
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
        names |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        missing = sorted(n for n in names if n not in doc)
        assert not missing, f"clusterscale/{package}/__init__.py does not name {missing}"
