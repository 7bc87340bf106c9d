"""Lost or cut-short inputs (issue 55, round 3): every done marker lists the files its folder held (one listing),
and a stage checks each input folder against it before it starts (one listing per folder): a deleted or truncated
file is refused by name with the command that rebuilds the folder. Readers of run files that do not parse (a
manifest, a done marker, a Parquet footer) name the file too; markers without a file list (older runs) still work.
User faults exit 2 with one paragraph and no traceback."""
from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from clusterscale import cli, pipeline, run_protocol
from clusterscale.io.layout import manifest_path, read_manifest, shards_dir
from clusterscale.io.rundir import RunDir, StageInputChangedError, UnreadableFileError
from conftest import make_pairs, tiny_overrides

VERBS = ("ingest", "embed")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_model, ray_local) -> Path:
    """A tiny run up to its embeddings (pairs/ in several parts, and so embeddings/): copied by each test. The
    shards' test copies the session's finished run (conftest.shared_run) instead."""
    base = tmp_path_factory.mktemp("lost")
    pq.write_table(make_pairs(180), base / "pairs.parquet")
    cfg, run = pipeline.open_run(str(base / "run"), None, tiny_overrides(tiny_model, str(base / "pairs.parquet"))
                                 + ["data.rows_per_part=60"])
    pipeline.run_stages(cfg, run, VERBS)
    return base / "run"


def _copy(sharded: Path, tmp_path: Path, *drop: str) -> Path:
    """The run, without the folders in `drop` (so that the stage reading the damaged input is not reused)."""
    target = tmp_path / "run"
    shutil.copytree(sharded, target, ignore=lambda folder, names: [n for n in names if Path(folder, n) in
                                                                   {sharded / d for d in drop}])
    return target


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def _user_fault(code: int, err: str) -> None:
    """Exit 2 with one `error:` paragraph and no traceback."""
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err


def _drop_file_list(run: Path, folder: str) -> None:
    """Make the marker of `folder` look like one written before markers listed their files."""
    marker = run / folder / "_DONE.json"
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "files"}))


def _parts(run: Path, folder: str) -> list[Path]:
    return sorted((run / folder).glob("*.parquet"))


def test_fit_refuses_embeddings_that_lost_a_part(sharded, tmp_path, capsys):
    run = _copy(sharded, tmp_path)
    parts = _parts(run, "embeddings")
    assert len(parts) > 2
    parts[1].unlink()
    code, err = _cli(capsys, "fit", "--run-dir", str(run))
    _user_fault(code, err)
    marker = json.loads((run / "embeddings" / "_DONE.json").read_text())
    assert f"{parts[1]} is missing: Embeddings in {run / 'embeddings'} changed after `embed` finished " \
           f"({len(marker['files'])} files, {marker['stats']['rows']} rows then)" in err
    assert f"`clusterscale embed --run-dir {run} --replace`" in err and not (run / "kmeans").exists()
    # A marker from before the file list: the footers fit reads anyway do not add up to the marker's rows.
    _drop_file_list(run, "embeddings")
    code, err = _cli(capsys, "fit", "--run-dir", str(run))
    _user_fault(code, err)
    assert "rows, but its done marker counts" in err and f"`clusterscale embed --run-dir {run} --replace`" in err


def test_fit_refuses_a_truncated_embeddings_part(sharded, tmp_path, capsys):
    run = _copy(sharded, tmp_path)
    part = _parts(run, "embeddings")[0]
    size = part.stat().st_size
    part.write_bytes(part.read_bytes()[:100])
    code, err = _cli(capsys, "fit", "--run-dir", str(run))
    _user_fault(code, err)
    assert f"{part} holds 100 bytes, not the {size:,} it was written with" in err
    assert f"`clusterscale embed --run-dir {run} --replace`" in err
    _drop_file_list(run, "embeddings")  # without the list, the footer read names the file (was: ArrowInvalid)
    code, err = _cli(capsys, "fit", "--run-dir", str(run))
    _user_fault(code, err)
    assert f"{part}: not a readable Parquet file" in err and f"`clusterscale embed --run-dir {run} --replace`" in err


def test_train_refuses_a_truncated_manifest(shared_run, tmp_path, capsys):
    run = tmp_path / "run"  # what training reads of the finished run, without its models (nothing is reused)
    shutil.copytree(shared_run.run.path(""), run, ignore=lambda folder, names: [
        n for n in names if Path(folder) == Path(shared_run.run.path("")) and n not in
        ("config.yaml", "pairs", "heldout", "embeddings", "kmeans", "assign", "shards")])
    manifest = run / manifest_path(4)
    size = manifest.stat().st_size
    manifest.write_bytes(manifest.read_bytes()[:size // 2])
    code, err = _cli(capsys, "train", "--run-dir", str(run))
    _user_fault(code, err)
    assert f"{manifest} holds {size // 2:,} bytes, not the {size:,} it was written with: Shards for k=4" in err
    assert f"`clusterscale shard --run-dir {run} --replace`" in err and not (run / "train").exists()
    _drop_file_list(run, shards_dir(4))  # without the list, the manifest reader names it (was: JSONDecodeError)
    code, err = _cli(capsys, "train", "--run-dir", str(run))
    _user_fault(code, err)
    assert f"{manifest}: not valid JSON" in err and f"`clusterscale shard --run-dir {run} --replace`" in err


def test_embed_refuses_pairs_that_lost_a_part_and_the_advice_rebuilds_them(sharded, tmp_path, capsys):
    run = _copy(sharded, tmp_path, "embeddings")
    parts = _parts(run, "pairs")
    assert len(parts) > 1
    parts[-1].unlink()
    code, err = _cli(capsys, "embed", "--run-dir", str(run))
    _user_fault(code, err)
    assert f"{parts[-1]} is missing: Ingested pairs in {run / 'pairs'} changed after `ingest` finished" in err
    assert not (run / "embeddings").exists()
    advice = re.search(r"`(clusterscale ingest [^`]+)`", err).group(1)
    assert advice == f"clusterscale ingest --run-dir {run} --replace"
    assert cli.main(shlex.split(advice)[1:]) == 0
    assert parts[-1].exists()
    RunDir(str(run)).check_complete("pairs", "Ingested pairs", "ingest")  # whole again


# --- the marker's file list and the check, without Ray -----------------------------------------------------------
def _marked(tmp_path: Path) -> RunDir:
    run = RunDir(str(tmp_path / "run"))
    for i in range(3):
        run.write_parquet(f"embeddings/part-{i}.parquet", pa.table({"pair_id": list(range(i + 1))}))
    run.write_json("embeddings/_units.json", {"units": 3})
    run.write_bytes("embeddings/.tmp-x-part-9.parquet", b"half")  # an interrupted write: not listed
    run.write_json("embeddings/inner/_DONE.json", {})  # another output inside: not listed
    run.write_parquet("embeddings/inner/part-0.parquet", pa.table({"pair_id": [1]}))
    run.mark_done("embeddings", "fp", {"rows": 6})
    return run


def test_the_marker_lists_the_folder_and_the_check_is_one_listing(tmp_path, monkeypatch):
    run = _marked(tmp_path)
    files = run.done_marker("embeddings").files
    assert sorted(files) == ["_units.json", "part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert files["part-1.parquet"] == (tmp_path / "run/embeddings/part-1.parquet").stat().st_size
    listings = []

    class CountingFileSystem:
        def __getattr__(self, name):
            return getattr(pafs.LocalFileSystem(), name)

        def get_file_info(self, what):
            listings.append(what) if isinstance(what, pafs.FileSelector) else None
            return pafs.LocalFileSystem().get_file_info(what)

    monkeypatch.setattr(run, "fs", CountingFileSystem())
    run.write_bytes("embeddings/notes.txt", b"a user's stray file, not read by any stage")
    run.check_complete("embeddings", "Embeddings", "embed")
    assert len(listings) == 1  # one listing of the folder, never a request per file


def test_the_check_refuses_a_stray_parquet_file_and_skips_old_markers(tmp_path):
    run = _marked(tmp_path)
    run.write_parquet("embeddings/part-3.parquet", pa.table({"pair_id": [7]}))
    with pytest.raises(StageInputChangedError, match=r"part-3.parquet is not one of the files `embed` wrote, and "
                                                     r"would be read with them.*Move it out of embeddings/"):
        run.check_complete("embeddings", "Embeddings", "embed")
    run.check_complete("embeddings", "Embeddings", "embed", strays=False)  # read through a manifest: not an error
    run.remove("embeddings/part-0.parquet")
    _drop_file_list(Path(run.root), "embeddings")
    run.check_complete("embeddings", "Embeddings", "embed")  # a marker without a file list is not checked


def test_unreadable_run_files_are_named_and_replace_still_works(tmp_path):
    run = _marked(tmp_path)
    run.write_bytes("embeddings/_DONE.json", b'{"fingerprint": "fp", "sta')
    with pytest.raises(UnreadableFileError) as said:
        run.check_complete("embeddings", "Embeddings", "embed")
    assert str(said.value).startswith(f"{run.path('embeddings/_DONE.json')}: not valid JSON (") and \
        f"Rebuild embeddings/ with `clusterscale embed --run-dir {run.uri} --replace`" in str(said.value)
    assert run_protocol.replace(run, "embeddings") == ["embeddings"] and not run.exists("embeddings")
    run.write_bytes("report/costs.json", b"{")
    with pytest.raises(UnreadableFileError, match=r"costs.json: not valid JSON.*Move it aside"):
        run_protocol.record_cost(run, "fit", {"wall_s": 1.0})
    run.write_bytes("shards/k=4/manifest.json", b'{"k": 4}')
    with pytest.raises(UnreadableFileError, match=r"manifest.json: not a shard manifest .*`clusterscale shard --run"):
        read_manifest(run, manifest_path(4))
