"""What every stage's run function gets from the executor: `run(ctx: StageContext) -> StageResult`, the one
signature of the stages listed in clusterscale.pipeline."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from clusterscale.config import Config, Fingerprint
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.runtime.resources import Resources

RunStage = Callable[..., StageResult]  # run_stage(name, cfg, run, **options of pipeline.execute)


@dataclass(frozen=True)
class StageContext:
    cfg: Config
    run: RunDir
    source: RunDir | None = None
    """The run directory the stage's inputs are read from (a re-clustering segment's child run re-embeds its
    parent's pairs); None: `run` itself."""
    fingerprint: Fingerprint | None = None
    """The fingerprint the output's done marker will record (the shard stages copy it into their manifest)."""
    resources: Resources | None = None
    """What each actor of the stage's pool asks for: the stage's declaration (executor.Stage.resources), which
    its call to runtime.resources.plan_actors sizes the pool from."""
    run_stage: RunStage | None = None
    """Runs another stage of the list through the executor (its lock, reuse, marker and cost record): training
    builds its shard set and re-clusters with it, mine re-embeds with it, without importing the pipeline."""
    resume: bool = False
    """train: continue from the latest checkpoint."""
    fail_at_step: int | None = None
    """train: fail on purpose at this step (tests of --resume)."""
    max_tasks_in_flight: int | None = None
    """synth: parts generated at once (default: the cluster's CPUs); it changes nothing in the output."""
    inputs: dict[str, str] = field(default_factory=dict)
    """The folder each input is read from, by the name the stage declares it under (pipeline.wire): a stage
    registered to stand in for a folder (Stage.replaces) sends the stages after it to its own output."""

    def input(self, name: str) -> str:
        """The folder to read the input declared as `name` from (the name itself unless the wiring says otherwise)."""
        return self.inputs.get(name, name)

    def __post_init__(self) -> None:
        if self.source is None:
            object.__setattr__(self, "source", self.run)

    def stage(self, name: str, cfg: Config, run: RunDir, **options: Any) -> StageResult:
        """Run the stage `name` of the pipeline's list (see run_stage)."""
        if self.run_stage is None:
            raise RuntimeError(f"{name}: this stage was called outside the executor, which runs the stages it needs")
        return self.run_stage(name, cfg, run, **options)
