"""The pipeline's executor without Ray: markers of a stage and its extra outputs, reuse, clearing an interrupted
attempt, an early stop without a marker, cost records; and the rule that no stage module runs the marker sequence."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from clusterscale import cli, config as config_mod
from clusterscale import pipeline
from clusterscale.io import layout
from clusterscale.io.rundir import ConfigMismatchError, RunDir, StageMissingError, StageResult
from clusterscale.runtime.resources import Resources

ROOT = Path(__file__).resolve().parents[1]


def _stage(calls: list, complete: bool = True) -> pipeline.Stage:
    """An ingest-like stage: pairs/ plus heldout/ marked with it; reads nothing."""
    def write(call):
        assert not call.run.exists("pairs", "stale.json")  # an interrupted attempt's output was cleared
        call.run.write_json("pairs/rows.json", [1, 2, 3])
        calls.append(call.fingerprint)
        return StageResult({"rows": 3, "note": ["not a scalar"]}, outputs={"heldout": StageResult({"rows": 1})},
                           config={"data": {"limit": call.cfg.data.limit}}, complete=complete)
    return pipeline.Stage("toy", "A toy stage.", write, "pairs", sections=("data",),
                          extra_outputs=(pipeline.ExtraOutput("heldout", ("data",)),))


def test_marks_reuses_and_records_cost(tmp_path, capsys):
    run, cfg, calls = RunDir(str(tmp_path / "run")), config_mod.load(None, []), []
    run.write_json("pairs/stale.json", {})
    first = pipeline.execute(_stage(calls), cfg, run)
    assert first.stats["rows"] == 3 and len(calls) == 1
    assert run.done_stats("heldout") == {"rows": 1}
    assert run.read_json("pairs/_DONE.json")["config"] == {"data": {"limit": cfg.data.limit}}
    costs = run.read_json("report/costs.json")["toy"]
    assert costs["rows"] == 3 and "note" not in costs and costs["invocation_s"] >= 0
    capsys.readouterr()
    again = pipeline.execute(_stage(calls), cfg, run, cost_key="")
    assert len(calls) == 1 and again.stats["rows"] == 3
    assert capsys.readouterr().out.count("reused") == 1  # the extra output is said with its stage


def test_a_stage_refused_before_it_wrote_leaves_no_empty_folder(tmp_path):
    """A stage that fails before writing (a training refused by a check of its own) used to leave an empty
    train/<name>/ behind; one that wrote something keeps it (its units are the rerun's)."""
    run, cfg = RunDir(str(tmp_path / "run")), config_mod.load(None, [])

    def refuse(call):
        raise config_mod.ConfigError("refused by the stage")

    def half(call):
        call.run.write_json("out/b/unit-0.json", {})
        raise RuntimeError("stopped halfway")
    for run_fn, left in ((refuse, False), (half, True)):
        with pytest.raises(Exception, match="refused by the stage|stopped halfway"):
            pipeline.execute(pipeline.Stage("toy", "A toy stage.", run_fn, "out/b", sections=("data",)), cfg, run)
        assert run.exists("out/b") == left


def test_a_reuse_without_a_marker_keeps_the_cost_of_the_work(tmp_path):
    """evaluate has no marker: it runs every time and reuses its cached results; that reuse must not replace the
    cost record of the invocation that evaluated (a compare rerun once recorded 0.04 s for 50 s evaluations)."""
    run, cfg = RunDir(str(tmp_path / "run")), config_mod.load(None, [])
    stats = [{"wall_s": 50.0, "worker_s": 50.0}, {"wall_s": 0.04, "worker_s": 0.04, "reused": True}]
    stage = pipeline.Stage("toy", "A stage without a marker.", lambda call: StageResult(stats.pop(0)), "toy",
                           marks_done=False)
    pipeline.execute(stage, cfg, run)
    pipeline.execute(stage, cfg, run)
    assert run.read_json("report/costs.json")["toy"]["wall_s"] == 50.0 and not stats


def test_other_config_is_refused_then_replaced(tmp_path):
    run, calls, cfg = RunDir(str(tmp_path / "run")), [], config_mod.load(None, [])
    pipeline.execute(_stage(calls), cfg, run)
    other = config_mod.load(None, ["data.limit=5"])
    with pytest.raises(ConfigMismatchError, match=rf"data.limit {cfg.data.limit} -> 5.*--replace"):
        pipeline.execute(_stage(calls), other, run, command="clusterscale toy")
    pipeline.execute(_stage(calls), other, run, replace="changed")
    assert len(calls) == 2 and run.read_json("pairs/_DONE.json")["covers"]["data"]["limit"] == 5


def _per_clustering_stage(calls: list) -> pipeline.Stage:
    """A dedup-like stage: one output (toy/, with toy/kept/ marked with it) for one clustering at a time."""
    def write(call):
        calls.append(call.cfg.cluster.k)
        return StageResult({"k": call.cfg.cluster.k}, outputs={"toy/kept": StageResult({"k": call.cfg.cluster.k})})
    return pipeline.Stage("toy", "A toy stage.", write, "toy", sections=("data", "cluster"),
                          extra_outputs=(pipeline.ExtraOutput("toy/kept", ("data", "cluster")),), one_clustering=True)


def test_one_clustering_output_is_replaced_at_another_clustering_only(tmp_path, capsys):
    run, calls = RunDir(str(tmp_path / "run")), []
    pipeline.execute(_per_clustering_stage(calls), config_mod.load(None, ["cluster.k=4"]), run)
    pipeline.execute(_per_clustering_stage(calls), config_mod.load(None, ["cluster.k=8"]), run)
    assert calls == [4, 8] and run.done_stats("toy")["k"] == run.done_stats("toy/kept")["k"] == 8
    assert "another clustering (cluster.k 4 -> 8)" in capsys.readouterr().out
    with pytest.raises(ConfigMismatchError, match="data.limit"):  # not a clustering: refused as for any stage
        pipeline.execute(_per_clustering_stage(calls), config_mod.load(None, ["cluster.k=8", "data.limit=5"]), run)
    assert calls == [4, 8]


def test_input_made_with_another_config_is_refused_before_running(tmp_path):
    """A stage reading a one-clustering output refuses it when it holds another clustering's, unless its own
    output is reused."""
    run, calls = RunDir(str(tmp_path / "run")), []
    cfg4, cfg8 = config_mod.load(None, ["cluster.k=4"]), config_mod.load(None, ["cluster.k=8"])

    def read(call):
        calls.append(call.run.done_stats("toy/kept")["k"])
        return StageResult({"rows": 1})
    reader = pipeline.Stage("reader", "Reads toy/kept/.", read, lambda cfg: f"out/k={cfg.cluster.k}",
                            inputs=(pipeline.Input("toy/kept", "toy", "Toy rows", made_with=("data", "cluster")),),
                            sections=("data", "cluster"))
    pipeline.execute(_per_clustering_stage([]), cfg4, run)
    pipeline.execute(reader, cfg4, run)
    pipeline.execute(_per_clustering_stage([]), cfg8, run)
    pipeline.execute(reader, cfg4, run)  # out/k=4 stayed and is done: reused, toy/kept/ not read
    assert calls == [4]
    with pytest.raises(StageMissingError, match=r"toy/kept holds the output of another config \(changed: "
                                                r"cluster.k 8 -> 4\).*run `clusterscale toy`"):
        pipeline.execute(reader, cfg4, run, replace="always")
    pipeline.execute(reader, cfg8, run)
    assert calls == [4, 8]


def test_an_input_made_with_other_values_of_its_keys_is_refused_not_mixed(tmp_path):
    """A stage run alone with an upstream key changed (`train --set embed.max_length=16` on shards of embeddings made
    at 32) refuses its input, naming the key and the `run --replace` that redoes it: replacing only its own output (the
    --replace its own refusal advised) read the input made with the old value under a marker recording the new one.
    Keys the producer's fingerprint covers but its output does not depend on (Input.not_made_with: fit's centroids
    and assign's index keys) are not refused; a key absent from the input's marker (at its default then) counts."""
    run, calls = RunDir(str(tmp_path / "run")), []

    def read(call):
        calls.append(call.run.done_stats("pairs")["rows"])
        return StageResult({"rows": 1})
    toy_rows = pipeline.Input("pairs", "toy", "Toy rows")
    reader = pipeline.Stage("reader", "Reads pairs/.", read, "out", inputs=(toy_rows,), sections=("data", "train"))
    pipeline.execute(_stage([]), config_mod.load(None, []), run)
    pipeline.execute(reader, config_mod.load(None, ["train.steps=7"]), run)  # a key of the reader's own: fine
    command = "clusterscale reader --run-dir R --set data.limit=5 --replace"
    for replace in ("", "changed", "always"):
        with pytest.raises(StageMissingError, match=r"pairs, which reader reads, was made with other values of keys "
                                                    r"it depends on \(changed: data.limit 4000 -> 5\).*"
                                                    r"`clusterscale run --run-dir R --set data.limit=5 --replace`"):
            pipeline.execute(reader, config_mod.load(None, ["data.limit=5", "train.steps=7"]), run,
                             replace=replace, command=command)
    assert calls == [3] and run.exists("out", "_DONE.json")  # the reader's output stayed
    with pytest.raises(StageMissingError, match=r"changed: data.source_column None -> 'src'"):
        pipeline.execute(reader, config_mod.load(None, ["data.source_column=src", "train.steps=7"]), run)
    # A stage without a marker (evaluate: `evaluate --set train.lr=1e-2` scored the model trained at 1e-3 and wrote
    # 1e-2 into its model card) checks its inputs the same way.
    unmarked = dataclasses.replace(reader, marks_done=False)
    with pytest.raises(StageMissingError, match=r"pairs, which reader reads, .*changed: data.limit 4000 -> 5"):
        pipeline.execute(unmarked, config_mod.load(None, ["data.limit=5"]), run)
    pipeline.execute(unmarked, config_mod.load(None, ["train.steps=9"]), run)
    lenient = dataclasses.replace(reader, inputs=(dataclasses.replace(toy_rows, not_made_with=("data.limit",)),))
    pipeline.execute(lenient, config_mod.load(None, ["data.limit=5", "train.steps=8"]), run, replace="always")
    assert calls == [3, 3, 3]


def test_replace_checks_the_inputs_before_it_removes_anything(tmp_path):
    """--replace on a stage whose input marker does not parse names that input (and the command that rebuilds it)
    before anything is removed: the stage's output, and what was made from it, stay."""
    run, calls = RunDir(str(tmp_path / "run")), []

    def read(call):
        calls.append(call.run.done_stats("pairs")["rows"])
        return StageResult({"rows": 1})
    reader = pipeline.Stage("reader", "Reads pairs/.", read, "out", inputs=(pipeline.Input("pairs", "toy", "Toy rows"),),
                            sections=("data", "train"))
    pipeline.execute(_stage([]), config_mod.load(None, []), run)
    pipeline.execute(reader, config_mod.load(None, ["train.steps=7"]), run)
    run.write_bytes("pairs/_DONE.json", b'{"fingerprint": "ab')  # an unreadable input
    for replace, steps in (("always", 7), ("changed", 8)):
        with pytest.raises(Exception, match="pairs/_DONE.json"):
            pipeline.execute(reader, config_mod.load(None, [f"train.steps={steps}"]), run, replace=replace)
        assert calls == [3] and run.exists("out", "_DONE.json")


def test_incomplete_result_writes_no_marker(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    result = pipeline.execute(_stage([], complete=False), config_mod.load(None, []), run)
    assert result.stats["rows"] == 3 and not run.exists("pairs", "_DONE.json") and not run.exists("heldout", "_DONE.json")


def test_missing_input_names_the_verb(tmp_path):
    with pytest.raises(StageMissingError, match="Centroids for k=4 not found.*run `clusterscale fit`"):
        pipeline.run_stage("assign", config_mod.load(None, ["cluster.k=4"]), RunDir(str(tmp_path / "run")))


def test_one_stage_list():
    """pipeline.STAGES is the only list of stage names: layout has none; the CLI and costs derive theirs."""
    assert not hasattr(layout, "STAGES") and not hasattr(layout, "PREPROCESS")
    assert pipeline.PREPROCESS == ("ingest", "embed", "embed_heldout", "fit", "assign", "dedup", "shard")
    assert pipeline.PER_K_STAGES == ("fit", "assign", "dedup", "shard")
    verbs = set(pipeline.STAGE_VERBS)
    assert verbs <= set(cli.VERBS) and verbs - set(cli.REPLACEABLE) == {"evaluate", "report"}
    # Stages no `run` step and no verb of their own: training builds the shard sets, dedup embeds the held-out pairs,
    # `synth` has its options.
    assert set(pipeline.STAGES) - verbs == {"synth", "embed_heldout", "shard_set", "dedup_shards"}
    assert "synth" in cli.VERBS
    cfg = config_mod.load(None, ["cluster.k=7", "train.name=x", "train.sampler=random"])
    assert [s.output_of(cfg) for s in pipeline.STAGES.values()] == [
        "pairs", "pairs", "embeddings", "embeddings_heldout", "kmeans/k=7", "assign/k=7", "dedup", "shards/k=7", "shards/k=7/random",
        "shards/k=7/dedup", "negatives", "train/x", "eval", "report"]


def test_stages_are_declared_by_named_functions():
    """What the executor calls of a stage has a name (a traceback or a reader finds it); no lambda."""
    for stage in pipeline.STAGES.values():
        called = [stage.run, stage.output, stage.extra, stage.cost_key, stage.after_done, stage.in_run,
                  *(need.folder for need in stage.inputs), *(need.made_with for need in stage.inputs)]
        assert not [c for c in called if getattr(c, "__name__", "") == "<lambda>"], stage.name


def test_the_stage_gets_its_declared_resources(tmp_path):
    """The resources a stage declares are what its run function sizes its pool from (ctx.resources)."""
    seen = []
    need = Resources(cpus=0.5, gpus=1)
    stage = pipeline.Stage("toy", "A toy stage.", lambda ctx: seen.append(ctx.resources) or StageResult({}), "toy",
                           resources=need)
    pipeline.execute(stage, config_mod.load(None, []), RunDir(str(tmp_path / "run")))
    assert seen == [need]
    assert pipeline.STAGES["embed"].resources.gpus == 1 and pipeline.STAGES["ingest"].resources is None


# Calls that would mean a stage module runs the marker protocol itself, with the ones allowed and why.
MARKER_CALLS = {"is_done", "mark_done"}
ALLOWED = {("clusterscale/stages/synthetic.py", "mark_done"),  # write_embeddings_stage: the tests' in-process shortcut
           ("clusterscale/stages/train.py", "is_done")}  # _check_negatives: an input check of mined negatives


def test_no_stage_module_runs_the_marker_sequence():
    found = set()
    for path in [*(ROOT / "clusterscale" / "stages").glob("*.py"), *(ROOT / "clusterscale" / "train").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in MARKER_CALLS:
                found.add((str(path.relative_to(ROOT)), node.attr))
    assert found <= ALLOWED, sorted(found - ALLOWED)


def test_a_failure_after_a_lost_node_is_one_paragraph_naming_it_and_the_rerun(tmp_path, monkeypatch):
    """Ray's own error after a node left (here a stand-in RuntimeError) becomes NodeLostError (a user fault: one
    paragraph, exit 2) naming the node and the rerun; with every node still there the error stays a bug."""
    from clusterscale import executor
    from clusterscale.errors import user_message
    from clusterscale.runtime import nodes

    def fail(call):
        raise RuntimeError("ray.exceptions.ActorDiedError: The actor died because its node has died.\nmore lines")

    run, cfg = RunDir(str(tmp_path / "run")), config_mod.load(None, [])
    stage = pipeline.Stage("toy", "A stage whose node goes.", fail, "toy", sections=("data",))
    monkeypatch.setattr(nodes, "alive_nodes", lambda: {"n1": "10.0.0.1", "n2": "10.0.0.2"})
    monkeypatch.setattr(nodes, "lost_nodes", lambda before: ["n2 (10.0.0.2)"])
    with pytest.raises(executor.NodeLostError) as lost:
        pipeline.execute(stage, cfg, run, command="clusterscale run --run-dir R")
    message = user_message(lost.value)
    assert message.startswith("toy: Ray node n2 (10.0.0.2) left the cluster while the stage ran")
    assert "(ray.exceptions.ActorDiedError: The actor died because its node has died.)" in message
    assert message.endswith("`clusterscale run --run-dir R`.") and "more lines" not in message
    train = pipeline.Stage("train", "Training.", fail, "toy2", sections=("data",))
    with pytest.raises(executor.NodeLostError, match=r"`clusterscale train --run-dir R --resume`: training continues"):
        pipeline.execute(train, cfg, run, command="clusterscale train --run-dir R")
    monkeypatch.setattr(nodes, "lost_nodes", lambda before: [])
    with pytest.raises(RuntimeError, match="ActorDiedError") as bug:
        pipeline.execute(stage, cfg, run)
    assert not isinstance(bug.value, executor.NodeLostError)


def test_a_report_at_a_k_the_run_was_not_clustered_at_is_refused(tmp_path):
    """`report --set cluster.k=7` on a run clustered at k=4 only would credit k=7 with k=4's costs and overwrite the
    right report: refused, naming the k the run holds; the report as it was stays."""
    run = RunDir(str(tmp_path / "run"))
    run.makedirs("kmeans/k=4")
    run.write_text("report/report.md", "the k=4 report")
    with pytest.raises(config_mod.ConfigError, match=r"no clustering at k=7, only k=4: report on one of them"):
        pipeline.run_stage("report", config_mod.load(None, ["cluster.k=7"]), run)
    assert run.read_bytes("report/report.md") == b"the k=4 report"
    run.remove("kmeans")
    run.remove("report")
    with pytest.raises(StageMissingError, match=r"holds no finished stage: nothing to report"):
        pipeline.run_stage("report", config_mod.load(None, []), run)  # a mistyped --run-dir
    assert not run.exists("report")
