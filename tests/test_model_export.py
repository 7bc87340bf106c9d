"""The exported model folder (no Ray): sentence-transformers files, the model card, and the driver's warnings."""
from __future__ import annotations

import json
from pathlib import Path

from clusterscale import config
from clusterscale.modeling.model_card import write_model_card
from clusterscale.io.rundir import RunDir
from clusterscale.stages.train import training_warnings


def test_export_has_sentence_transformers_config_and_the_max_length_given(tiny_model):
    from sentence_transformers import SentenceTransformer

    folder = Path(tiny_model)
    st_config = json.loads((folder / "config_sentence_transformers.json").read_text())
    assert st_config["similarity_fn_name"] == "cosine" and "transformers" in st_config["__version__"]
    model = SentenceTransformer(str(folder), device="cpu")
    assert model.max_seq_length == 64 and model.similarity_fn_name == "cosine"  # conftest exports max_length=64


def _cfg(*overrides: str):
    return config.load(None, ["data.path=/data/pairs.parquet", "cluster.k=12", "train.sampler=random_clusters",
                              "train.passage_max_length=96", *overrides])


def test_model_card_names_base_data_k_sampler_steps_and_gains_metrics_after_evaluate(tmp_path):
    run, cfg = RunDir(str(tmp_path)), _cfg()
    name = cfg.train_name()
    write_model_card(cfg, run, name)
    assert not run.exists(f"train/{name}/model/README.md")  # nothing exported: no card
    run.write_json(f"train/{name}/model/config.json", {})
    run.write_json(f"train/{name}/model/1_Pooling/config.json", {"pooling_mode_cls_token": True})
    run.mark_done("pairs", "f", {"pairs": 3600})
    run.mark_done(f"train/{name}", "f", {"steps": 40})
    write_model_card(cfg, run, name)
    card = run.read_bytes(f"train/{name}/model/README.md").decode()
    assert "base_model: sentence-transformers/all-MiniLM-L6-v2" in card  # train.init=bundled
    for text in ("`/data/pairs.parquet`: 3600 training pairs", "k=12", "| sampler | random_clusters",
                 f"| steps | 40 x {cfg.train.schedule.global_batch_size} pairs", "| pooling, lengths | CLS, query",
                 "passage 96 tokens",
                 "Not evaluated yet"):
        assert text in card, text
    run.write_json(f"eval/{name}.json", {"metrics": {"ndcg_at_10": 0.71, "mrr_at_10": 0.6}, "num_queries": 300})
    run.write_json("eval/frozen.json", {"metrics": {"ndcg_at_10": 0.68, "mrr_at_10": 0.55}, "num_queries": 300})
    run.write_json(f"eval/mteb/{name}.json", {"tasks": {"SciFact": {"ndcg_at_10": 0.5, "split": "test"}}})
    write_model_card(cfg, run, name)  # what evaluate does after scoring the trained model
    card = run.read_bytes(f"train/{name}/model/README.md").decode()
    assert "| this model | 300 | 0.7100 | 0.6000 |" in card and "| frozen encoder (reference) | 300 | 0.6800 |" in card
    assert "SciFact 0.5000" in card and "Not evaluated yet" not in card


def test_model_card_of_a_local_or_scratch_init_has_no_hub_base_model(tmp_path):
    run = RunDir(str(tmp_path))
    for init in (str(tmp_path), "scratch"):
        cfg = _cfg(f"train.init={init}")
        run.write_json(f"train/{cfg.train_name()}/model/config.json", {})
        write_model_card(cfg, run, cfg.train_name())
        assert "base_model:" not in run.read_bytes(f"train/{cfg.train_name()}/model/README.md").decode()


def test_warnings_for_unused_pairs_and_a_warmup_longer_than_the_run():
    tc = _cfg("train.warmup_steps=50").train
    unused, warmup = training_warnings(tc, num_steps=40, unused_pairs=100, total_pairs=1000)
    assert unused.startswith("100 of 1000 pairs (10%) are unused per epoch")
    assert warmup.startswith("train.warmup_steps=50 >= the 40 steps of this run")
    assert training_warnings(_cfg("train.warmup_steps=4").train, 40, 99, 1000) == []
    restart, = training_warnings(_cfg("train.warmup_steps=4", "train.max_failures=2").train, 400, 0, 1000)
    assert "a restart begins again at step 0" in restart and "train.checkpoint_every_steps (e.g. 8)" in restart
    assert training_warnings(_cfg("train.warmup_steps=4", "train.max_failures=2",
                                  "train.checkpoint_every_steps=50").train, 400, 0, 1000) == []
