"""MTEB through the encoder wrapper on a local BEIR-layout task: same NDCG@10 as clusterscale's own scorer."""
from __future__ import annotations

import json
import os

import pytest

from clusterscale.stages.mteb_eval import MTEBError, read_local_task, run_mteb_model
from tests.conftest import make_pairs


@pytest.fixture(scope="module")
def local_task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("beir") / "toy"
    (folder / "qrels").mkdir(parents=True)
    table = make_pairs(40, seed=3).to_pylist()
    with open(folder / "corpus.jsonl", "w") as f:
        for i, row in enumerate(table):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": row["p"]}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        for i, row in enumerate(table[:20]):
            f.write(json.dumps({"_id": f"q{i}", "text": row["q"]}) + "\n")
    with open(folder / "qrels" / "test.tsv", "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for i in range(20):
            f.write(f"q{i}\td{i}\t1\n")
        f.write("q0\td21\t1\n")  # a second relevant passage for one query
    return folder


def _config_dict(query_len: int = 16, passage_len: int = 32) -> dict:
    return {"train": {"query_max_length": query_len, "passage_max_length": passage_len}, "eval": {"batch_size": 16}}


def test_local_task_matches_own_metrics(local_task_dir, tiny_model, tmp_path, monkeypatch):
    from clusterscale.modeling.encoder import Encoder
    from clusterscale.stages.evaluate import retrieval_metrics, search

    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb-cache"))
    scores = run_mteb_model(tiny_model, "tiny", "auto", _config_dict(), [f"local:{local_task_dir}"])
    (task, result), = scores.items()
    assert task == "LocalToy" and result["split"] == "test"
    assert 0.0 <= result["ndcg_at_10"] <= 1.0

    # The same retrieval computed by clusterscale: queries at 16 tokens, passages at 32.
    data = read_local_task(str(local_task_dir))
    enc = Encoder(tiny_model, max_length=16)
    q = enc.encode([x["text"] for x in data["queries"]])
    enc.max_length = 32
    p = enc.encode([x["text"] for x in data["corpus"]])
    ids = [d["id"] for d in data["corpus"]]
    qrels = [{ids.index(doc) for doc in data["qrels"][x["id"]]} for x in data["queries"]]
    ours = retrieval_metrics(search(q, p, 100), qrels, [10])
    assert result["ndcg_at_10"] == pytest.approx(ours["ndcg_at_10"], abs=1e-3)
    assert result["recall_at_10"] == pytest.approx(ours["recall_at_10"], abs=1e-3)

    # The wrapper really uses the configured lengths: other lengths give other vectors and scores.
    other = run_mteb_model(tiny_model, "tiny", "auto", _config_dict(4, 4), [f"local:{local_task_dir}"])
    assert other["LocalToy"]["ndcg_at_10"] != pytest.approx(result["ndcg_at_10"], abs=1e-6)


def test_local_task_missing_files_is_a_clear_error(tmp_path):
    with pytest.raises(MTEBError, match="corpus.jsonl"):
        read_local_task(str(tmp_path))


def test_unknown_task_name_is_a_clear_error(tiny_model):
    with pytest.raises(MTEBError, match="Unknown MTEB task"):
        run_mteb_model(tiny_model, "tiny", "auto", _config_dict(), ["NoSuchTaskXYZ"])


def test_hub_task_offline_says_it_needs_the_internet(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(MTEBError, match="internet"):
        run_mteb_model(tiny_model, "tiny", "auto", _config_dict(), ["SciFact"])


def test_a_multi_subset_task_reports_every_subset_and_their_mean(local_task_dir, tiny_model, tmp_path, monkeypatch):
    """A local folder of BEIR tasks is one task with a subset per subfolder (as MTEB's multilingual tasks): each
    subset's scores are kept and the task's are their mean (only the first subset's were kept before)."""
    import shutil

    from clusterscale.stages.mteb_eval import subset_scores

    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb-cache"))
    root = tmp_path / "multi"
    shutil.copytree(local_task_dir, root / "alpha")
    shutil.copytree(local_task_dir, root / "beta")
    (root / "beta" / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\td{(i + 7) % 40}\t1\n" for i in range(20)))  # other relevant passages: other scores
    result = run_mteb_model(tiny_model, "tiny", "auto", _config_dict(), [f"local:{root}"])["LocalMulti"]
    alpha, beta = result["subsets"]["alpha"], result["subsets"]["beta"]
    assert alpha["ndcg_at_10"] != pytest.approx(beta["ndcg_at_10"], abs=1e-6)
    assert result["ndcg_at_10"] == pytest.approx((alpha["ndcg_at_10"] + beta["ndcg_at_10"]) / 2)
    single = run_mteb_model(tiny_model, "tiny", "auto", _config_dict(), [f"local:{local_task_dir}"])["LocalToy"]
    assert alpha["ndcg_at_10"] == pytest.approx(single["ndcg_at_10"]) and "subsets" not in single
    sts = subset_scores([{"hf_subset": "en", "cosine_spearman": 0.5, "main_score": 0.5},
                         {"hf_subset": "de", "cosine_spearman": 0.7, "main_score": 0.7}])
    assert sts["cosine_spearman"] == pytest.approx(0.6) and set(sts["subsets"]) == {"en", "de"}


def test_the_scratch_cache_is_removed_and_a_users_cache_kept(tmp_path, monkeypatch):
    from clusterscale.stages.mteb_eval import scratch_cache

    monkeypatch.delenv("MTEB_CACHE", raising=False)
    with scratch_cache():
        made = os.environ["MTEB_CACHE"]
        assert os.path.isdir(made)
    assert not os.path.exists(made) and "MTEB_CACHE" not in os.environ  # every mteb run left an empty folder in /tmp
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path))
    with scratch_cache():
        assert os.environ["MTEB_CACHE"] == str(tmp_path)
    assert os.environ["MTEB_CACHE"] == str(tmp_path)


def test_a_local_sts_task_is_scored_by_the_spearman_of_the_models_cosines(tiny_model, tmp_path, monkeypatch):
    """local:FOLDER with sts.tsv: mteb's STS evaluation, whose cosine_spearman equals the Spearman correlation of
    the gold scores with the cosines clusterscale's own encoder gives (both sentences as passages, 32 tokens)."""
    import numpy as np
    from scipy.stats import spearmanr

    from clusterscale.modeling.encoder import Encoder

    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb-cache"))
    rows = make_pairs(24).to_pylist()
    pairs = [(r["p"], r["q"], 5.0) for r in rows[:8]] + [(r["p"], rows[(i + 3) % 24]["q"], 2.0)
                                                        for i, r in enumerate(rows[8:16], start=8)] + \
            [(r["p"], "an unrelated sentence about nothing", 0.0) for r in rows[16:]]
    folder = tmp_path / "toysts"
    folder.mkdir()
    (folder / "sts.tsv").write_text("sentence1\tsentence2\tscore\n" +
                                    "".join(f"{a}\t{b}\t{s}\n" for a, b, s in pairs))
    result = run_mteb_model(tiny_model, "tiny", "auto", _config_dict(), [f"local:{folder}"])["LocalToysts"]
    enc = Encoder(tiny_model, max_length=32)
    a, b = enc.encode([p[0] for p in pairs]), enc.encode([p[1] for p in pairs])
    ours = spearmanr([p[2] for p in pairs], np.einsum("ij,ij->i", a, b)).statistic
    assert result["cosine_spearman"] == pytest.approx(ours, abs=1e-3)
    (folder / "sts.tsv").write_text("sentence1\tsentence2\tscore\nx\ty\tnot-a-number\n")
    with pytest.raises(MTEBError, match="sts.tsv:2: each line needs sentence1, sentence2 and a numeric score"):
        run_mteb_model(tiny_model, "tiny", "auto", _config_dict(), [f"local:{folder}"])
