"""The docs hold what the code says: README and docs/ stay short enough to read, the architecture diagram and the
configuration reference are the generated ones, and every command they show parses with the CLI (its --set keys
load) or names a file that exists (a doc check; the commands themselves run in the tests that name them)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from clusterscale import config as config_mod
from clusterscale import pipeline
from clusterscale.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
pytestmark = pytest.mark.unit


def test_readme_and_results_stay_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 300
    assert len((REPO / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 600


def test_the_stages_page_holds_the_generated_diagram():
    block = f"```text\n{pipeline.architecture_diagram()}\n```\n"
    text = (REPO / "docs" / "stages.md").read_text()
    assert block in text, "docs/stages.md's Architecture diagram is stale: paste pipeline.architecture_diagram() into it"
    for name in pipeline.STAGES:  # every stage of the list is in it, once
        assert sum(line.startswith(f"{name} ") for line in block.splitlines()) == 1, name


def test_the_configuration_page_is_the_generated_reference():
    text = (REPO / "docs" / "configuration.md").read_text()
    assert config_mod.describe_markdown() in text, \
        "docs/configuration.md is stale: `clusterscale config --markdown` prints what it must hold"


def commands(text: str) -> list[str]:
    """Shell commands of a page: the lines of its ```bash blocks (continuations joined) and `clusterscale ...` spans."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line:
                found += [part.strip() for part in re.split(r"&&|\|", line) if part.strip()]
    return found + [span for span in re.findall(r"`(clusterscale [^`]+)`", text) if "--run-dir" in span]


def test_every_page_links_to_pages_and_files_that_exist():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.name} links to {target}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_parses_or_names_a_file_that_exists(page):
    parser, checked = build_parser(), 0
    text = page.read_text()
    for rel in set(re.findall(r"((?:jobs|benchmarks|cluster_configs)/[\w./=-]+\.(?:py|sh|yaml|json|md))", text)):
        assert (REPO / rel).exists(), f"{page.name} names {rel}"
    for command in commands(text):
        words = shlex.split(command.replace("&", ""))
        words = [w for w in words if "=" not in w or w.startswith("-") or "." in w.split("=")[0]]  # VAR=x prefixes
        if not words:
            continue
        if words[0] == "clusterscale" and len(words) > 1 and words[1] not in ("VERB", "...") \
                and not any(w.isupper() and w.isalpha() and len(w) > 3 and w in ("VERB",) for w in words):
            try:
                args = parser.parse_args(words[1:])
            except SystemExit as exc:
                raise AssertionError(f"{page.name}: `{command}` does not parse") from exc
            for override in getattr(args, "overrides", None) or []:
                if "<" not in override and "YOUR-" not in override:
                    config_mod.load(None, [override])  # a key or value the config refuses fails here
            checked += 1
        elif words[0] in ("python", "bash") and len(words) > 1 and words[1].endswith((".py", ".sh")):
            assert (REPO / words[1]).exists(), f"{page.name}: `{command}`"
            checked += 1
    assert checked or not commands(text) or page.name not in ("README.md", "cli.md")
