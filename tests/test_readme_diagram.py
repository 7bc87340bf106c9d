"""README's Architecture diagram is the one pipeline.architecture_diagram() renders from the stage list."""
from __future__ import annotations

from pathlib import Path

from clusterscale import pipeline

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_holds_the_generated_diagram():
    text = README.read_text()
    block = f"```text\n{pipeline.architecture_diagram()}\n```\n"
    assert block in text, "README's Architecture diagram is stale: paste pipeline.architecture_diagram() into it"
    for name in pipeline.STAGES:  # every stage of the list is in it, once
        assert sum(line.startswith(f"{name} ") for line in block.splitlines()) == 1, name
