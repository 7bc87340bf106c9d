"""MTEB retrieval (mteb 2.x) for the frozen encoder and the trained model of a run.

`clusterscale evaluate [CONFIG] --run-dir R --mteb TASK[,TASK...]` where TASK is an MTEB retrieval or STS task
name (e.g. SciFact, STSBenchmark; their data comes from the Hugging Face hub) or `local:FOLDER`, a task built from
local files: retrieval in BEIR layout, corpus.jsonl ({"_id"|"id", "text", "title"?}), queries.jsonl
({"_id"|"id", "text"}) and qrels/test.tsv or qrels.tsv (query-id, corpus-id, score; header line); or STS,
sts.tsv (sentence1, sentence2, score; header line) or sts.jsonl, scored by cosine Spearman. A folder of such
folders is one task with a subset each.
Results go to eval/mteb/<model>.json.
"""
from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from clusterscale.config import Config
from clusterscale.errors import UserError
from clusterscale.io.layout import local_model_dir, mteb_eval_path, train_dir
from clusterscale.modeling.model_card import write_model_card
from clusterscale.io.rundir import RunDir
from clusterscale.runtime.resources import Resources, plan_actors

LOCAL_PREFIX = "local:"
KEPT_SCORES = ("ndcg_at_10", "mrr_at_10", "recall_at_10", "recall_at_100", "map_at_10", "cosine_spearman",
               "main_score")  # retrieval's, STS's Spearman, and every task's main score


class MTEBError(UserError, RuntimeError):
    """An MTEB task cannot be built or run; the message says why and what to do."""


def _require_mteb():
    try:
        import mteb
    except ImportError as exc:
        raise MTEBError("MTEB evaluation needs the mteb package: `pip install \"mteb>=2\"`.") from exc
    return mteb


def make_encoder(model_path: str, name: str, pooling: str, query_max_length: int, passage_max_length: int,
                 batch_size: int):
    """An mteb encoder (mteb.models.abs_encoder.AbsEncoder) over clusterscale's Encoder, with ModelMeta.

    Queries are cut at query_max_length and passages at passage_max_length (the run's train.* lengths,
    which the model was trained with), each after the prompt the model folder names for its side (a trained model's
    train.query_prompt / train.passage_prompt, exported with it)."""
    _require_mteb()
    from mteb.models.abs_encoder import AbsEncoder
    from mteb.models.model_meta import ModelMeta
    from mteb.types import PromptType

    from clusterscale.stages.costs import param_count
    from clusterscale.modeling.encoder import Encoder, folder_prompts

    own = folder_prompts(model_path)
    prompts = {True: own.get("query", ""), False: own.get("passage", own.get("document", ""))}

    class ClusterscaleEncoder(AbsEncoder):
        def __init__(self) -> None:
            self.encoder = Encoder(model_path, pooling=pooling, max_length=passage_max_length)
            self.mteb_model_meta = ModelMeta(
                loader=None, name=f"clusterscale/{name}", revision="local", release_date=None, languages=None,
                n_parameters=param_count(model_path), memory_usage_mb=None, max_tokens=passage_max_length,
                embed_dim=self.encoder.dim, license=None, open_weights=True, public_training_code=None,
                public_training_data=None, framework=["PyTorch"], similarity_fn_name="cosine",
                use_instructions=False, training_datasets=None)

        def encode(self, inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kwargs: Any):
            texts = []
            for batch in inputs:
                titles = batch.get("title")
                for i, text in enumerate(batch["text"]):
                    title = titles[i] if titles is not None else ""
                    texts.append(f"{title} {text}".strip() if title else text)
            is_query = prompt_type == PromptType.query
            self.encoder.max_length = query_max_length if is_query else passage_max_length
            prompt = prompts[is_query]
            return self.encoder.encode([prompt + t for t in texts] if prompt else texts, batch_size)

    return ClusterscaleEncoder()


def _read_jsonl(path: Path, kind: str) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        doc_id = obj.get("_id", obj.get("id"))
        if doc_id is None or not isinstance(obj.get("text"), str):
            raise MTEBError(f"{path}:{n}: each {kind} line needs an \"_id\" (or \"id\") and a \"text\" string.")
        rows.append({"id": str(doc_id), "text": obj["text"], **({"title": obj.get("title") or ""}
                                                              if kind == "corpus" else {})})
    return rows


def read_local_task(folder: str) -> dict:
    """corpus, queries and qrels ({query id: {doc id: score}}) of a BEIR-layout folder."""
    root = Path(folder)
    qrels_path = next((p for p in (root / "qrels" / "test.tsv", root / "qrels.tsv") if p.exists()), None)
    missing = [n for n, p in (("corpus.jsonl", root / "corpus.jsonl"), ("queries.jsonl", root / "queries.jsonl"),
                              ("qrels/test.tsv or qrels.tsv", qrels_path)) if p is None or not p.exists()]
    if missing:
        raise MTEBError(f"Local MTEB task {folder!r} lacks {', '.join(missing)} (BEIR layout: corpus.jsonl, "
                        f"queries.jsonl, qrels/test.tsv).")
    qrels: dict[str, dict[str, int]] = {}
    with qrels_path.open() as f:
        for row in csv.DictReader(f, delimiter="\t"):
            qrels.setdefault(str(row["query-id"]), {})[str(row["corpus-id"])] = int(float(row["score"]))
    queries = [q for q in _read_jsonl(root / "queries.jsonl", "queries") if q["id"] in qrels]
    return {"corpus": _read_jsonl(root / "corpus.jsonl", "corpus"), "queries": queries, "qrels": qrels}


STS_FILES = ("sts.tsv", "sts.jsonl")  # a local STS task: sentence1, sentence2, score per line


def _holds_task(path: Path) -> bool:
    return (path / "corpus.jsonl").exists() or any((path / name).exists() for name in STS_FILES)


def is_sts(folder: str) -> bool:
    return any((Path(folder) / name).exists() for name in STS_FILES)


def read_local_sts(folder: str) -> list[dict]:
    """The (sentence1, sentence2, score) rows of a local STS task: sts.tsv (tab-separated, a header line naming
    the three columns) or sts.jsonl (one object per line)."""
    root = Path(folder)
    path = next(root / name for name in STS_FILES if (root / name).exists())
    with path.open(encoding="utf-8") as f:
        if path.suffix == ".tsv":
            records = list(enumerate(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE), start=2))
        else:
            records = [(n, json.loads(line)) for n, line in enumerate(f, start=1) if line.strip()]
    rows = []
    for n, rec in records:
        try:
            rows.append({"sentence1": str(rec["sentence1"]), "sentence2": str(rec["sentence2"]),
                         "score": float(rec["score"])})
        except (KeyError, TypeError, ValueError):
            raise MTEBError(f"{path}:{n}: each line needs sentence1, sentence2 and a numeric score.") from None
    scores = [r["score"] for r in rows]
    if len(rows) < 2 or min(scores) == max(scores):
        raise MTEBError(f"{path}: an STS task needs at least two pairs with different scores (Spearman ranks them).")
    return rows


def local_subsets(folder: str) -> dict[str, str]:
    """{subset name: its folder}: the folder itself ('default') when it holds a task (BEIR retrieval, or STS), else
    each subfolder that does (a multi-subset task, e.g. one per language or domain)."""
    root = Path(folder)
    if _holds_task(root) or not root.is_dir():
        return {"default": folder}
    subsets = {p.name: str(p) for p in sorted(root.iterdir()) if p.is_dir() and _holds_task(p)}
    return subsets or {"default": folder}  # none: read_local_task names what the folder lacks


def local_metadata(folder: str, subsets: list[str], kind: str, main_score: str):
    """mteb TaskMetadata of a local task (dataset path local/<name>, per ENVIRONMENT.md): Local<Folder name>, one
    English subset or several."""
    from mteb.abstasks.task_metadata import TaskMetadata

    name = "Local" + re.sub(r"[^0-9A-Za-z]+", "", Path(folder).resolve().name.title()) or "LocalTask"
    langs = ["eng-Latn"] if subsets == ["default"] else {sub: ["eng-Latn"] for sub in subsets}
    return TaskMetadata(
        name=name, type=kind, main_score=main_score, description=f"Local {kind} task from {folder}",
        reference=None, dataset={"path": f"local/{name}", "revision": "local"}, category="t2t",
        eval_splits=["test"], eval_langs=langs, date=None, dialect=None, domains=None, task_subtypes=None,
        license=None, annotations_creators=None, modalities=["text"], sample_creation=None, bibtex_citation=None)


def local_sts_task(folder: str, subsets: dict[str, str]):
    """An mteb AbsTaskSTS over local files (cosine Spearman; scores normalised by the data's own range), both
    sentences encoded as passages (the model folder's passage prompt)."""
    from datasets import Dataset
    from mteb.abstasks.sts import AbsTaskSTS

    data = {name: read_local_sts(path) for name, path in subsets.items()}
    scores = [r["score"] for rows in data.values() for r in rows]

    class LocalSTS(AbsTaskSTS):
        min_score, max_score = min(scores), max(scores)
        metadata = local_metadata(folder, list(data), "STS", "cosine_spearman")

        def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
            self.dataset = {sub: {"test": Dataset.from_list(rows)} for sub, rows in data.items()}
            self.data_loaded = True

    return LocalSTS()


def local_task(folder: str):
    """An mteb task over local files: STS (local_sts_task) or an AbsTaskRetrieval over BEIR files, with one subset
    per subfolder when the folder holds several tasks."""
    _require_mteb()
    from datasets import Dataset
    from mteb.abstasks.retrieval import AbsTaskRetrieval

    paths = local_subsets(folder)
    sts = [is_sts(path) for path in paths.values()]
    if any(sts):
        if not all(sts):
            raise MTEBError(f"Local MTEB task {folder!r} mixes STS subsets ({', '.join(STS_FILES)}) with retrieval "
                            f"ones (corpus.jsonl): give each kind its own folder.")
        return local_sts_task(folder, paths)
    subsets = {name: read_local_task(path) for name, path in paths.items()}

    class LocalRetrieval(AbsTaskRetrieval):
        metadata = local_metadata(folder, list(subsets), "Retrieval", "ndcg_at_10")

        def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
            self.dataset = {sub: {"test": {"corpus": Dataset.from_list(data["corpus"]),
                                           "queries": Dataset.from_list(data["queries"]),
                                           "relevant_docs": data["qrels"], "top_ranked": None}}
                            for sub, data in subsets.items()}
            self.data_loaded = True

    return LocalRetrieval()


def resolve_tasks(specs: list[str]) -> list:
    mteb = _require_mteb()
    tasks = []
    for spec in specs:
        if spec.startswith(LOCAL_PREFIX):
            tasks.append(local_task(spec[len(LOCAL_PREFIX):]))
            continue
        try:
            task = mteb.get_task(spec)
        except Exception as exc:
            raise MTEBError(f"Unknown MTEB task {spec!r} ({exc}); list retrieval tasks with "
                            f"`python -c \"import mteb; print([t.metadata.name for t in mteb.get_tasks(task_types=['Retrieval'])])\"`"
                            f", or use local:FOLDER.") from exc
        if task.metadata.type not in ("Retrieval", "STS"):
            raise MTEBError(f"MTEB task {spec!r} is a {task.metadata.type} task; --mteb runs Retrieval and STS "
                            f"tasks.")
        tasks.append(task)
    return tasks


def run_mteb_model(model_path: str, name: str, pooling: str, cfg_dict: dict, specs: list[str]) -> dict:
    """Run the tasks on one model in this process; {task name: kept scores of its first test split}."""
    mteb = _require_mteb()
    with scratch_cache():
        return _run_tasks(mteb, model_path, name, pooling, cfg_dict, specs)


@contextlib.contextmanager
def scratch_cache():
    """MTEB_CACHE in a temporary folder removed afterwards (never the home folder), unless the user set one."""
    if "MTEB_CACHE" in os.environ:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="clusterscale-mteb-") as cache:
        os.environ["MTEB_CACHE"] = cache
        try:
            yield
        finally:
            os.environ.pop("MTEB_CACHE", None)


def _run_tasks(mteb, model_path: str, name: str, pooling: str, cfg_dict: dict, specs: list[str]) -> dict:
    cfg_train, cfg_eval = cfg_dict["train"], cfg_dict["eval"]
    encoder = make_encoder(model_path, name, pooling, cfg_train["query_max_length"], cfg_train["passage_max_length"],
                           cfg_eval["batch_size"])
    out = {}
    for task in resolve_tasks(specs):
        try:
            result = mteb.evaluate(encoder, task, cache=None, show_progress_bar=False)
        except Exception as exc:
            if task.metadata.dataset["path"].startswith("local/"):
                raise
            raise MTEBError(f"MTEB task {task.metadata.name} failed ({type(exc).__name__}: {exc}). Hub tasks download "
                            f"their data from the Hugging Face hub: run where the internet is reachable (unset "
                            f"HF_HUB_OFFLINE), or evaluate on local files with --mteb local:FOLDER.") from exc
        task_result = result.task_results[0]
        split = "test" if "test" in task_result.scores else next(iter(task_result.scores))
        out[task.metadata.name] = subset_scores(task_result.scores[split]) | {"split": split}
    return out


def subset_scores(per_subset: list[dict]) -> dict:
    """The kept scores of a split: their mean over the task's subsets (languages, domains), and with several
    subsets each one's under "subsets" ({name: scores})."""
    subsets = {str(s.get("hf_subset", i)): {k: float(s[k]) for k in KEPT_SCORES if k in s}
               for i, s in enumerate(per_subset)}
    keys = [k for k in KEPT_SCORES if all(k in s for s in subsets.values())]
    mean = {k: sum(s[k] for s in subsets.values()) / len(subsets) for k in keys}
    return mean | ({"subsets": subsets} if len(subsets) > 1 else {})


def run_mteb(cfg: Config, run: RunDir, specs: list[str]) -> dict:
    """MTEB for the frozen encoder and, when trained, the run's model; one Ray task per model."""
    resolve_tasks(specs)  # fail on a bad task name before any model is loaded
    name = cfg.train_name()
    results = mteb_models(cfg, run, ["frozen"] + ([name] if run.exists(train_dir(name), "_DONE.json") else []),
                          specs)
    if name in results:
        write_model_card(cfg, run, name)
    return results


def mteb_models(cfg: Config, run: RunDir, names: list[str], specs: list[str]) -> dict:
    """{model name: its eval/mteb/<name>.json} for "frozen" (embed.model) and trained models of the run, one Ray
    task each (on a GPU when there is one); the same config's training for every model (its lengths)."""
    import ray

    models = {n: (cfg.embed.model, cfg.embed.pooling) if n == "frozen" else (local_model_dir(run, n), "auto")
              for n in names}
    plan = plan_actors(Resources(cpus=1, gpus=1), max_actors=1)
    remote = ray.remote(max_retries=0)(run_mteb_model).options(**plan.options)
    mteb = _require_mteb()
    results = {}
    for model_name, (path, pooling) in models.items():
        tasks = ray.get(remote.remote(path, model_name, pooling, cfg.to_dict(), specs))
        results[model_name] = {"model_name": model_name, "model": path, "mteb_version": mteb.__version__,
                               "tasks": tasks}
        run.write_json(mteb_eval_path(model_name), results[model_name])
        for task, scores in tasks.items():
            subsets = f" (mean of {len(scores['subsets'])} subsets)" if "subsets" in scores else ""
            print(f"[mteb] {model_name} {task}: main score {scores.get('main_score', float('nan')):.4f}{subsets}",
                  flush=True)
    return results
