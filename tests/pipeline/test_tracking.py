"""MLflow provenance against a real tracking server (one `mlflow server` subprocess for the module).

Pipeline runs are subprocesses on the tiny model, each in its own tmp_path working directory, exactly as a user
runs `python -m pipeline run ... tracking.uri=http://HOST:PORT`; what they recorded is read back with
MlflowClient. The subprocesses are started together by one fixture and each test waits for its own. A few
cases call `tracked_run` in-process with a hand-made summary, to cover every optional section (artifact
folder, manifest, runtime check) whatever the pipeline produces today, and to fail the store on purpose.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from pipeline.errors import EXIT_UNREACHABLE, EXIT_USER

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["data.n_samples=2", "data.seq_len=32", "data.eval_n_samples=1", "data.eval_seq_len=32",
         "traces.reservoir_size=16"]
TINY = ["model=tiny", *SMALL]
# the recorded run keeps every section tracking logs (evaluation, export, runtime check) and skips the rest; it is
# a user's own run (`kvcalib run model=llama3 model.path=DIR preset=quick`, a Llama folder saved by save_pretrained,
# the default recipe, the default store ./mlruns.db); runs that test only the tracking mechanics skip the runtime
# check too, on the fp16 recipe
SKIPPED = ["sensitivity.enabled=false", "probes.enabled=false"]
RECORDED = ["model=llama3", "model.dtype=float32", "model.device=cpu", "preset=quick", *SMALL, *SKIPPED]
LEAN = ["quant=fp16", *SKIPPED, "check.enabled=false"]
PLUS = "kvquant-4b+sink16+recent128"  # a recipe whose name MLflow's keys cannot hold (`+`)
# the run folder's report as pipeline/analysis.py writes it, and a file beside it that is not the report's
REPORT = {"report.md": b"# kvcalib report\n\n![frontier](frontier.png) ![kl](heatmap_kl.png)\n",
          "frontier.png": b"\x89PNG\r\n\x1a\nfrontier", "heatmap_kl.png": b"\x89PNG\r\n\x1a\nheatmap",
          "layer_position_map.csv": b"layer,bucket,kl,cos\r\n0,0,0.5,0.9\r\n"}
mlflow = pytest.importorskip("mlflow")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KVCALIB_"))}
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _run_ids(stdout: str) -> list[str]:
    return [line.split()[2] for line in stdout.splitlines() if line.startswith("mlflow: run ")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(root: Path) -> tuple[subprocess.Popen, str]:
    """`mlflow server` on a free loopback port: sqlite backend, artifacts served over HTTP."""
    port = _free_port()
    with open(root / "server.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/db.sqlite",
             "--serve-artifacts", "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(port), "--workers", "1"], cwd=root, stdout=log, stderr=subprocess.STDOUT,
            env={**_env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no GenAI job workers: lighter
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"mlflow server did not start: {log.read_text()[-3000:]}")
        time.sleep(0.5)


class Launched:
    """Pipeline subprocesses started together (each spends most of its time loading the model, so they
    overlap well on two cores); `result(name)` waits for one and keeps its output."""

    def __init__(self, tmp_root: Path):
        self.tmp_root, self.procs, self.cwds, self.results = tmp_root, {}, {}, {}

    def start(self, name: str, args: list[str]) -> None:
        cwd = self.tmp_root / name
        cwd.mkdir()
        self.cwds[name] = cwd
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=_env(),
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self, name: str, timeout_s: float = 400) -> subprocess.CompletedProcess:
        if name not in self.results:
            proc = self.procs[name]
            out, err = proc.communicate(timeout=timeout_s)
            self.results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return self.results[name]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def own_llama(tiny, tmp_path_factory):
    """A user's Llama folder, my-llama/: the session's tiny random LlamaForCausalLM and its tokenizer, saved with
    save_pretrained (config.json, model.safetensors, tokenizer files)."""
    folder = tmp_path_factory.mktemp("user") / "my-llama"
    assert type(tiny.model).__name__ == "LlamaForCausalLM"
    tiny.model.save_pretrained(str(folder))
    tiny.tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def launched(tmp_path_factory, own_llama):
    """The module's one tracking server and every pipeline subprocess its tests read back."""
    root = tmp_path_factory.mktemp("tracking")
    (root / "server").mkdir()
    server, url = _start_server(root / "server")
    runs = Launched(root)
    nowhere = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    try:
        for required in ("true", "false"):  # these need no server: start them while it boots
            runs.start(f"unreachable-{required}", ["run", *TINY, *LEAN, f"tracking.uri={nowhere}",
                                                   f"tracking.required={required}"])
        # the default store, ./mlruns.db in its working directory: no server either
        runs.start("recorded", ["run", *RECORDED, f"model.path={own_llama}", "tracking.experiment=recorded"])
        _wait_healthy(server, url, root / "server" / "server.log")
        runs.start("failing", ["run", *TINY, "traces.reservoir_size=0", f"tracking.uri={url}",
                               "tracking.experiment=failing"])
        runs.start("sweep", ["run", "-m", *TINY, *LEAN, "traces.seed=0,1", "hydra/launcher=joblib",
                             "hydra.launcher.n_jobs=2", f"tracking.uri={url}", "tracking.experiment=sweep"])
        runs.url, runs.nowhere = url, nowhere
        yield runs
    finally:
        runs.stop()
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="module")
def server(launched):
    return launched.url


@pytest.fixture(scope="module")
def client(server):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=server)


@pytest.fixture(scope="module")
def recorded(launched):
    """The user's run recorded in its default store: (completed process, run id, working directory)."""
    out = launched.result("recorded")
    assert out.returncode == 0, out.stderr[-3000:]
    (run_id,) = _run_ids(out.stdout)
    return out, run_id, launched.cwds["recorded"]


@pytest.fixture(scope="module")
def recorded_store(recorded):
    """The URI of the recorded run's store: ./mlruns.db of its working directory, as an absolute sqlite URI."""
    return f"sqlite:///{recorded[2]}/mlruns.db"


@pytest.fixture(scope="module")
def recorded_client(recorded_store):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=recorded_store)


def _windows():
    """Token-id windows as pipeline.data.build_windows makes them: 2 x 8 calibration, 1 x 12 evaluation."""
    from pipeline.data import Windows

    return Windows(calib=torch.arange(16).reshape(2, 8), eval=torch.arange(100, 112).reshape(1, 12),
                   description="hand-made")


def _summary(artifact_dir: Path) -> dict:
    """What run_pipeline returns once export and runtime check exist: every optional section filled."""
    windows = _windows()
    return {
        "model": {"name": "tiny", "model_sha256": "a" * 64, "tokenizer_sha256": "b" * 64},
        "data": {"description": "hand-made", "calib_sha256": windows.calib_sha256,
                 "eval_sha256": windows.eval_sha256},
        "stages": [{"name": "traces", "key": "e" * 32, "status": "computed", "wall_s": 1.5, "peak_rss_mb": 100.0}],
        "wall_s": 3.0, "peak_rss_mb": 120.0,
        "evaluation": {"recipes": {
            "fp16": {"ppl": 10.0, "kl": 0.0, "top1": 1.0, "avg_bits": 16.0, "ppl_ratio": 1.0,
                     "ppl_ratio_ci95": [1.0, 1.0], "ppl_seeds": [10.0, 10.0]},
            "kivi-2": {"ppl": 12.5, "kl": 0.25, "top1": 0.75, "avg_bits": 2.5, "ppl_ratio": 1.25,
                       "ppl_ratio_ci95": [1.1234567890123, 1.3765432109876], "ppl_seeds": [12.25, 12.75]},
            PLUS: {"ppl": 11.0, "kl": 0.125, "top1": 0.875, "avg_bits": 6.0625, "ppl_ratio": 1.1,
                   "ppl_ratio_ci95": [1.05, 1.15]}}},
        "runtime_check": {"status": "pass", "max_abs_err": 0.001, "max_rel_err": 0.002},
        "manifest": {"sha256": "f" * 64, "format_version": "1.0"},
        "artifact_dir": str(artifact_dir),
    }


def _run_dir(tmp: Path) -> Path:
    """A run folder as the pipeline leaves it: the report, its plots and CSV, and cli.log (not logged)."""
    run_dir = tmp / "run"
    run_dir.mkdir()
    for name, data in {**REPORT, "cli.log": b"log"}.items():
        (run_dir / name).write_bytes(data)
    return run_dir


def _out(tmp: Path) -> dict:
    from stages.base import StageResult

    folder = tmp / "kvcache-export-tiny"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    ckpt = tmp / "vllm-checkpoint"  # a vLLM checkpoint: logged without its weight shards
    (ckpt / "kvcalib").mkdir(parents=True)
    for name in ("config.json", "model.safetensors.index.json", "kv_cache_scales.safetensors",
                 "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json",
                 "kvcalib/checkpoint.json"):
        (ckpt / name).write_text("{}")
    g = torch.Generator().manual_seed(0)
    k = torch.rand(2, 2, 16, generator=g)  # [n_layers, n_kv_heads, head_dim]
    traces = StageResult(tensors={"k_pre_absmax": k, "k_post_absmax": 2 * k, "v_absmax": k / 2})
    return {"summary": _summary(folder) | {"vllm_checkpoint_dir": str(ckpt)}, "results": {"traces": traces},
            "windows": _windows()}


def _config(uri: str | None, **tracking):
    """A default RunConfig with tracking settings changed (uri None: the default store)."""
    from pipeline.config import RunConfig

    cfg = RunConfig()
    cfg.tracking.uri = uri or cfg.tracking.uri
    for key, value in tracking.items():
        setattr(cfg.tracking, key, value)
    return cfg


@pytest.fixture(scope="module")
def synthetic(server, tmp_path_factory):
    """A run recorded in-process from a hand-made summary with every optional section."""
    from pipeline.tracking import tracked_run

    tmp = tmp_path_factory.mktemp("synthetic")
    cfg = _config(server, experiment="synthetic", run_name="synthetic-provenance-run")
    with tracked_run(cfg, _run_dir(tmp), log=lambda s: None) as rec:
        rec.record(_out(tmp))
    return rec.run_id


def _artifacts(client, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= _artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def _check_table(client, run_id: str, recipes: dict, tmp: Path) -> None:
    """evaluation/table.json, read back as a JSON file and as MLflow reads a table (pandas, orient split): one
    row per recipe, every column of its flat row (both interval ends) with the summary's numbers (to log_table's
    10 decimals; a NaN is null)."""
    import pandas as pd

    from pipeline.tracking import TABLE_FILE, recipe_columns

    path = Path(client.download_artifacts(run_id, TABLE_FILE, str(tmp)))
    table = json.loads(path.read_text())
    assert table["columns"][0] == "recipe"
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["data"]}
    assert len(table["data"]) == len(recipes) and set(rows) == set(recipes)
    for name, summary_row in recipes.items():
        expected = recipe_columns(summary_row)
        assert {"ppl", "kl", "top1", "avg_bits", "ppl_ratio_ci95_lo", "ppl_ratio_ci95_hi"} <= set(expected)
        for column, value in expected.items():
            if isinstance(value, float) and value != value:
                assert rows[name][column] is None, (name, column)
            else:
                assert rows[name][column] == pytest.approx(value, abs=1e-10, rel=0), (name, column)
    logged = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": TABLE_FILE, "type": "table"} in logged  # what makes the UI show it as a table
    frame = pd.read_json(path, orient="split")  # MlflowClient.load_table's reader (it searches the global store)
    assert list(frame["recipe"]) == list(rows) and len(frame.columns) == len(table["columns"])


def _check_datasets(run, data: dict, shapes: dict[str, list[int]]) -> None:
    """The run's inputs: the calibration and evaluation windows, each once, with the summary's sha256."""
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = {}
    for item in run.inputs.dataset_inputs:
        tags = {t.key: t.value for t in item.tags}
        inputs[tags[MLFLOW_DATASET_CONTEXT]] = (item.dataset, tags)
    assert len(run.inputs.dataset_inputs) == 2 and set(inputs) == {"calibration", "evaluation"}
    for context, key in (("calibration", "calib_sha256"), ("evaluation", "eval_sha256")):
        dataset, tags = inputs[context]
        assert dataset.digest == data[key][:36] and tags["sha256"] == data[key]
        assert dataset.name == f"embedded-{context}" and tags["description"] == data["description"]
        assert dataset.source_type == "local"
        assert json.loads(dataset.source)["uri"].endswith(os.path.join("pydoc_data", "topics.py"))
        assert json.loads(dataset.profile)["features_shape"] == shapes[context]
        assert "int64" in dataset.schema


# ------------------------------------------------------------------------------------------------- unit

def test_flatten_and_metrics_are_hand_checkable():
    from pipeline.tracking import flatten, summary_metrics

    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": "x", "e": {}}) == {"a.b": "1", "a.c": "[1, 2]", "d": "x",
                                                                      "e": "{}"}
    metrics = summary_metrics(_summary(Path("x")))
    assert metrics["stage.traces.wall_s"] == 1.5 and metrics["stage.traces.peak_rss_mb"] == 100.0
    assert metrics["eval.kivi-2.ppl"] == 12.5 and metrics["eval.kivi-2.avg_bits"] == 2.5
    assert metrics["eval.kvquant-4b_sink16_recent128.ppl"] == 11.0  # `+` is written `_` (metric_name)
    assert metrics["runtime_check.max_rel_err"] == 0.002 and "runtime_check.status" not in metrics


def test_evaluation_table_csv_and_markdown():
    from pipeline.tracking import evaluation_table

    csv_text, md = evaluation_table(_summary(Path("x"))["evaluation"]["recipes"])
    assert csv_text.splitlines() == [
        "recipe,avg_bits,ppl,kl,top1,ppl_ratio,ppl_ratio_ci95_lo,ppl_ratio_ci95_hi,ppl_seeds",
        'fp16,16,10,0,1,1,1,1,"[10.0, 10.0]"', 'kivi-2,2.5,12.5,0.25,0.75,1.25,1.12346,1.37654,"[12.25, 12.75]"',
        f"{PLUS},6.0625,11,0.125,0.875,1.1,1.05,1.15,"]
    assert md.splitlines()[2] == "| fp16 | 16 | 10 | 0 | 1 | 1 | 1 | 1 | [10.0, 10.0] |"


def test_table_frame_has_a_row_per_recipe_and_both_interval_ends():
    from pipeline.tracking import recipe_columns, summary_metrics, table_frame

    assert recipe_columns({"ppl": 2.0, "ppl_ratio_ci95": [0.5, 1.5], "ppl_seeds": [1.0, 3.0]}) == {
        "ppl": 2.0, "ppl_ratio_ci95_lo": 0.5, "ppl_ratio_ci95_hi": 1.5, "ppl_seeds": [1.0, 3.0]}
    frame = table_frame({"a": {"ppl": 2.0, "ppl_ratio_ci95": [0.5, 1.5]}, "b": {"ppl": 3.0, "top1": 0.5}})
    assert list(frame.columns) == ["recipe", "avg_bits", "ppl", "kl", "top1", "ppl_ratio_ci95_lo",
                                   "ppl_ratio_ci95_hi"]
    assert list(frame["recipe"]) == ["a", "b"] and list(frame["ppl"]) == [2.0, 3.0]
    assert frame["ppl_ratio_ci95_hi"][0] == 1.5 and frame["ppl_ratio_ci95_hi"].isna()[1]
    metrics = summary_metrics(_summary(Path("x")))  # the metrics are the table's numeric columns
    assert metrics["eval.kivi-2.ppl_ratio_ci95_lo"] == 1.1234567890123
    assert metrics["eval.kivi-2.ppl_ratio_ci95_hi"] == 1.3765432109876
    assert not any(k.startswith("eval.kivi-2.ppl_seeds") for k in metrics)


def test_dataset_inputs_name_their_source(tmp_path):
    """Local folder: the calib / eval files; local file: the file for both halves; hub: the splits."""
    from pipeline.config import DataConfig
    from pipeline.tracking import dataset_inputs

    windows, data = _windows(), _summary(Path("x"))["data"]
    (tmp_path / "valid.txt").write_text("calibration text")
    (tmp_path / "test.txt").write_text("evaluation text")

    def sources(cfg):
        return {next(t.value for t in i.tags if t.key == "mlflow.data.context"): (i.dataset.source_type,
                                                                                  json.loads(i.dataset.source))
                for i in dataset_inputs(cfg, data, windows)}

    assert sources(DataConfig(name="local", source="local", path=str(tmp_path))) == {
        "calibration": ("local", {"uri": str(tmp_path / "valid.txt")}),
        "evaluation": ("local", {"uri": str(tmp_path / "test.txt")})}
    one = str(tmp_path / "valid.txt")
    assert {v[1]["uri"] for v in sources(DataConfig(source="local", path=one)).values()} == {one}
    hub = sources(DataConfig(name="hub", source="hub"))
    assert hub["calibration"][0] == "hugging_face" and hub["calibration"][1]["path"] == "wikitext"
    assert (hub["calibration"][1]["split"], hub["evaluation"][1]["split"]) == ("validation", "test")
    (calib, evaluation) = dataset_inputs(DataConfig(), data, windows)
    assert calib.dataset.digest == windows.calib_sha256[:36] and evaluation.dataset.digest == windows.eval_sha256[:36]
    assert json.loads(calib.dataset.profile)["features_shape"] == [2, 8]
    assert json.loads(evaluation.dataset.profile)["features_shape"] == [1, 12]


def test_disabled_tracking_touches_no_store(tmp_path, monkeypatch):
    from pipeline.tracking import tracked_run

    monkeypatch.chdir(tmp_path)
    with tracked_run(_config(None, enabled=False), tmp_path / "run") as rec:
        rec.record(_out(tmp_path))
    assert rec.run_id is None and not (tmp_path / "mlruns.db").exists() and not (tmp_path / "mlruns").exists()


@pytest.fixture(scope="module")
def sqlite_run(tmp_path_factory):
    """A run recorded in the default store (./mlruns.db, no server), from a working directory holding a run folder
    with its report, of recipe PLUS on a model given as a local folder (`model.source=local model.path=.../my-llama`):
    (working directory, run id, the lines it logged). The only in-process use of the default URI: MLflow keeps one
    store per URI, and this one is relative to the working directory."""
    from pipeline.tracking import tracked_run

    cwd = tmp_path_factory.mktemp("sqlite")
    (cwd / "my-llama").mkdir()
    cfg = _config(None)
    cfg.model.source, cfg.model.path, cfg.quant.name = "local", str(cwd / "my-llama"), PLUS
    logged, before = [], os.getcwd()
    os.chdir(cwd)
    try:
        with tracked_run(cfg, _run_dir(cwd), log=logged.append) as rec:
            rec.record(_out(cwd))
    finally:
        os.chdir(before)
    return cwd, rec.run_id, logged


def test_default_store_keeps_artifacts_in_mlartifacts_beside_it(sqlite_run):
    """sqlite:///mlruns.db: the run's artifacts in ./mlartifacts/<experiment>/<run id>/artifacts (no ./mlruns), the
    report with its plots and CSV under report/ byte for byte, the run named after the model's folder and the recipe."""
    from mlflow.tracking import MlflowClient

    cwd, run_id, logged = sqlite_run
    run = MlflowClient(f"sqlite:///{cwd}/mlruns.db").get_run(run_id)  # the default: ./mlruns.db
    assert run.info.status == "FINISHED"
    artifacts = cwd / "mlartifacts" / "kvcalib" / run_id / "artifacts"
    assert run.info.artifact_uri == artifacts.as_uri()
    assert f"artifacts in {artifacts.as_uri()}" in logged[0]
    assert (artifacts / "kvcache-export-tiny" / "manifest.json").is_file() and not (cwd / "mlruns").exists()
    assert {p.name: p.read_bytes() for p in (artifacts / "report").iterdir()} == REPORT  # cli.log is not the report
    assert json.loads((artifacts / "summary.json").read_text())["evaluation"]["recipes"][PLUS]["ppl"] == 11.0
    assert re.fullmatch(rf"my-llama-{re.escape(PLUS)}-\d{{8}}-\d{{6}}", run.info.run_name), run.info.run_name


def test_mlflow_ui_on_the_default_store_serves_the_report(sqlite_run):
    """The README's `mlflow ui --backend-store-uri sqlite:///mlruns.db`, in the run's working directory: the report
    and a plot come back over HTTP from mlartifacts/ as the UI's artifact viewer asks for them."""
    cwd, run_id, _ = sqlite_run
    port = _free_port()
    with open(cwd / "ui.log", "w") as log:
        ui = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", "sqlite:///mlruns.db",
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], cwd=cwd, stdout=log,
                              stderr=subprocess.STDOUT, env={**_env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(ui, url, cwd / "ui.log")
        for name in ("report.md", "heatmap_kl.png"):
            with urllib.request.urlopen(f"{url}/get-artifact?path=report/{name}&run_uuid={run_id}", timeout=30) as r:
                assert r.read() == REPORT[name], name
    finally:
        ui.terminate()
        try:
            ui.wait(timeout=20)
        except subprocess.TimeoutExpired:
            ui.kill()
            ui.wait()


def test_artifact_location_is_beside_a_sqlite_database_only():
    from pipeline.tracking import artifact_location

    assert artifact_location("sqlite:////data/runs/mlruns.db", "kvcalib") == "file:///data/runs/mlartifacts/kvcalib"
    assert artifact_location("sqlite:////data/mlruns.db?timeout=5", "team a/b") == "file:///data/mlartifacts/team_a_b"
    assert artifact_location("http://127.0.0.1:5000", "kvcalib") is None  # the server decides
    assert artifact_location("sqlite:///mlruns.db", "x") == (Path.cwd() / "mlartifacts" / "x").as_uri()


def test_unresponsive_store_fails_in_seconds():
    """A port that accepts connections but never answers: the probe gives up after its timeout, no retries."""
    from pipeline.tracking import TrackingError, connect

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(TrackingError, match=uri):
            connect(uri, timeout_s=1)
        assert time.monotonic() - start < 10


# ------------------------------------------------------------------------------------------------- server

def test_pipeline_run_is_recorded(recorded, recorded_client):
    proc, run_id, cwd = recorded
    client = recorded_client
    run = client.get_run(run_id)
    params, metrics, tags = run.data.params, run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED" and run.info.run_name.startswith(f"my-llama-{params['quant.name']}-")
    assert params["traces.reservoir_size"] == "16"
    assert params["data.seq_len"] == "32" and params["tracking.experiment"] == "recorded"
    summary = json.loads(Path(tags["run_dir"], "summary.json").read_text())
    from pipeline.tracking import metric_name  # the default recipe's `+` is written `_` in keys
    for stage in summary["stages"]:
        name = metric_name(stage["name"])
        assert metrics[f"stage.{name}.wall_s"] == pytest.approx(stage["wall_s"])
        assert metrics[f"stage.{name}.peak_rss_mb"] == pytest.approx(stage["peak_rss_mb"])
        assert tags[f"stage.{name}.key"] == stage["key"]
    for recipe, row in summary.get("evaluation", {}).get("recipes", {}).items():
        assert metrics[f"eval.{metric_name(recipe)}.ppl"] == pytest.approx(row["ppl"])
    assert tags["model_sha256"] == summary["model"]["model_sha256"]
    assert tags["tokenizer_sha256"] == summary["model"]["tokenizer_sha256"]
    assert tags["calib_sha256"] == summary["data"]["calib_sha256"]
    assert tags["eval_sha256"] == summary["data"]["eval_sha256"]
    import pipeline
    assert tags["kvcalib_version"] == pipeline.__version__
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert tags["git_sha"] == (git.stdout.strip() if git.returncode == 0 else "unknown")
    assert "traces.reservoir_size=16" in tags["overrides"]
    files = _artifacts(client, run_id)
    assert {"config/config.yaml", "config/hydra/overrides.yaml", "summary.json",
            "plots/kv_channels/layer_00.png", "plots/kv_channels/layer_01.png"} <= files
    from pipeline.tracking import recipes_tag, report_files
    run_dir = Path(tags["run_dir"])  # the report, its plots and CSV as the run folder holds them
    assert {f for f in files if f.startswith("report/")} == {f"report/{p.name}" for p in report_files(run_dir)}
    assert {"report/report.md", "report/frontier.png"} <= files
    assert tags["recipes"] == recipes_tag(summary["evaluation"]["recipes"])
    assert tags["model_name"] == summary["model"]["name"]  # the model's own name and where it came from
    assert (tags["model_source"], tags["model_config"]) == (summary["model"]["source"]["kind"], "llama3")
    if "evaluation" in summary:
        assert {"evaluation/table.csv", "evaluation/table.md"} <= files
    if "runtime_check" in summary:
        assert tags["runtime_check_status"] == str(summary["runtime_check"]["status"])
        assert metrics["runtime_check.max_abs_err"] == pytest.approx(summary["runtime_check"]["max_abs_err"])
    if "artifact_dir" in summary:  # the exported artifact, whole, under its folder name
        folder = Path(summary["artifact_dir"])
        assert {f"{folder.name}/{p.relative_to(folder)}" for p in folder.rglob("*") if p.is_file()} <= files
        assert tags["manifest_sha256"] == summary["manifest"]["sha256"]
        assert tags["manifest_format_version"] == str(summary["manifest"]["format_version"])
    config = client.download_artifacts(run_id, "config/config.yaml", str(cwd))
    assert "reservoir_size: 16" in Path(config).read_text()
    assert (cwd / "mlartifacts" / "recorded" / run_id / "artifacts" / "summary.json").is_file()  # the default store


def test_params_record_the_model_that_was_loaded(recorded, recorded_client, own_llama):
    """`kvcalib run model=llama3 model.path=DIR`: conf/model/llama3.yaml says `name: llama3`, `source: hub`, but the
    model loaded is the folder. The params say what was used -- the folder's own name, source local, its absolute
    path, the config it came through, the dtype its weights were loaded in -- as the tags do (one definition,
    pipeline.tracking.used_model), and no setting of a source it did not come from (model.tiny.*, model.shape.*)."""
    _, run_id, _ = recorded
    run = recorded_client.get_run(run_id)
    params, tags = run.data.params, run.data.tags
    model = {k: v for k, v in params.items() if k.startswith("model.")}
    assert model == {"model.name": "my-llama", "model.source": "local", "model.path": str(own_llama.resolve()),
                     "model.config": "llama3", "model.dtype": "float32", "model.device": "cpu"}
    assert {k[len("model_"):]: v for k, v in tags.items() if k.startswith("model_") and k != "model_sha256"} == {
        k[len("model."):]: v for k, v in model.items() if k != "model.device"}
    summary = json.loads(Path(tags["run_dir"], "summary.json").read_text())
    assert (summary["model"]["name"], summary["model"]["source"]["kind"]) == ("my-llama", "local")


def test_run_params_keep_the_settings_of_the_models_source_only():
    """A tiny model's params keep model.tiny.* (its shape and seed are the model), an embedded one model.embedded,
    a hub id its id as path and name; none keeps another source's settings."""
    from pipeline.config import ModelConfig, RunConfig, load_model_config
    from pipeline.tracking import run_params

    cfg = RunConfig()
    cfg.model = load_model_config("tiny")
    params = run_params(cfg)
    assert (params["model.name"], params["model.source"], params["model.tiny.n_layers"]) == ("tiny", "tiny", "2")
    assert not any(k.startswith(("model.shape.", "model.embedded", "model.gguf_file")) for k in params)
    params = run_params(RunConfig())  # the embedded SmolLM2
    assert (params["model.source"], params["model.embedded"], params["model.dtype"]) == (
        "embedded", "smollm2", "float32")
    assert "model.path" not in params and not any(k.startswith("model.tiny.") for k in params)
    cfg.model = ModelConfig(name="llama3", source="hub", path="meta-llama/Meta-Llama-3-8B", dtype="bfloat16")
    params = run_params(cfg)  # HF_HUB_OFFLINE and not cached: no revision
    assert {k: v for k, v in params.items() if k.startswith("model.")} == {
        "model.name": "meta-llama/Meta-Llama-3-8B", "model.source": "hub", "model.path": "meta-llama/Meta-Llama-3-8B",
        "model.config": "llama3", "model.dtype": "bfloat16", "model.device": "cpu"}


def test_each_file_is_logged_once(recorded, recorded_client, tmp_path):
    """Every artifact of the user's run, downloaded: no two paths hold the same bytes. The quality-per-bit frontier
    is the report's frontier.png (report.md links it), not again plots/ppl_vs_bits.png; Hydra's composed config is
    the resolved config/config.yaml byte for byte (no interpolation), so it is not logged again under
    config/hydra/."""
    import hashlib

    _, run_id, _ = recorded
    files = _artifacts(recorded_client, run_id)
    assert files == {  # sensitivity and probes are off: the report has no heatmaps
        "artifact/manifest.json", "artifact/tensors.safetensors", "config/config.yaml", "config/hydra/hydra.yaml",
        "config/hydra/overrides.yaml", "summary.json", "evaluation/table.csv", "evaluation/table.md",
        "evaluation/table.json", "plots/kv_channels/layer_00.png", "plots/kv_channels/layer_01.png",
        "plots/kv_channels/overview.png", "report/frontier.png", "report/report.md"}
    local = Path(recorded_client.download_artifacts(run_id, "", str(tmp_path)))
    paths = {}
    for name in sorted(files):
        paths.setdefault(hashlib.sha256((local / name).read_bytes()).hexdigest(), []).append(name)
    assert [names for names in paths.values() if len(names) > 1] == []


def test_pipeline_run_logs_its_datasets_and_evaluation_table(recorded, recorded_client, tmp_path):
    _, run_id, _ = recorded
    client = recorded_client
    run = client.get_run(run_id)
    summary = json.loads(Path(run.data.tags["run_dir"], "summary.json").read_text())
    _check_datasets(run, summary["data"], {"calibration": [2, 32], "evaluation": [1, 32]})  # TINY's windows
    _check_table(client, run_id, summary["evaluation"]["recipes"], tmp_path)


def test_every_optional_section_is_recorded(synthetic, client, tmp_path):
    run = client.get_run(synthetic)
    metrics, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED"
    assert metrics["eval.kivi-2.kl"] == 0.25 and metrics["runtime_check.max_abs_err"] == 0.001
    assert tags["manifest_sha256"] == "f" * 64 and tags["manifest_format_version"] == "1.0"
    assert tags["runtime_check_status"] == "pass"
    files = _artifacts(client, synthetic)
    assert {"kvcache-export-tiny/manifest.json", "evaluation/table.csv", "evaluation/table.md",
            "plots/kv_channels/overview.png"} <= files
    assert "plots/ppl_vs_bits.png" not in files  # the report's frontier.png is the frontier
    assert {f for f in files if f.startswith("report/")} == {f"report/{name}" for name in REPORT}
    report = Path(client.download_artifacts(synthetic, "report/report.md", str(tmp_path)))
    assert report.read_bytes() == REPORT["report.md"]
    assert {f for f in files if f.startswith("vllm-checkpoint/")} == {
        f"vllm-checkpoint/{n}" for n in ("config.json", "model.safetensors.index.json", "kv_cache_scales.safetensors",
                                         "tokenizer.json", "kvcalib/checkpoint.json")}  # no weight shard
    summary = _summary(Path("x"))
    _check_datasets(run, summary["data"], {"calibration": [2, 8], "evaluation": [1, 12]})
    _check_table(client, synthetic, summary["evaluation"]["recipes"], tmp_path)


def test_a_run_without_a_report_logs_its_frontier_under_plots(server, client, tmp_path):
    """No report.md in the run folder (no report/ logged): the frontier is drawn as plots/ppl_vs_bits.png, once."""
    from pipeline.tracking import tracked_run

    (tmp_path / "run").mkdir()
    with tracked_run(_config(server, experiment="no-report"), tmp_path / "run", log=lambda s: None) as rec:
        rec.record(_out(tmp_path))
    files = _artifacts(client, rec.run_id)
    assert "plots/ppl_vs_bits.png" in files and not any(f.startswith("report/") for f in files)
    png = Path(client.download_artifacts(rec.run_id, "plots/ppl_vs_bits.png", str(tmp_path)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_recipe_is_found_by_its_exact_name(sqlite_run, synthetic, server, client):
    """The tag `recipes` holds every evaluated recipe's exact name: recipe_filter finds the run by PLUS, `+` and
    all, in a sqlite store and on a server, and never by a shorter name PLUS begins with; `quant_name` is the
    run's own recipe."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import recipe_filter

    cwd, run_id, _ = sqlite_run
    local = MlflowClient(f"sqlite:///{cwd}/mlruns.db")
    (exp,) = [e.experiment_id for e in local.search_experiments() if e.name == "kvcalib"]
    run = local.get_run(run_id)
    assert run.data.tags["recipes"] == f",fp16,kivi-2,{PLUS},"
    assert recipe_filter(PLUS) == f"tags.recipes LIKE '%,{PLUS},%'"
    assert [r.info.run_id for r in local.search_runs([exp], recipe_filter(PLUS))] == [run_id]
    assert [r.info.run_id for r in local.search_runs([exp], f"tags.quant_name = '{PLUS}'")] == [run_id]
    assert local.search_runs([exp], recipe_filter("kvquant-4b")) == []
    remote = client.get_run(synthetic)
    assert [r.info.run_id for r in client.search_runs([remote.info.experiment_id], recipe_filter(PLUS))] == [synthetic]
    assert remote.data.metrics["eval.kvquant-4b_sink16_recent128.ppl"] == 11.0
    with pytest.raises(ValueError, match="a,b"):
        recipe_filter("a,b")


def test_docs_search_snippet_runs_as_written(sqlite_run):
    """docs/mlflow.md's search example, run as written in the working directory of a recorded run: it prints the
    run found by the recipe's exact name and its metric under the documented spelling."""
    cwd, run_id, _ = sqlite_run
    text = (ROOT / "docs" / "mlflow.md").read_text()
    (snippet,) = re.findall(r"<!-- search example -->\n```python\n(.*?)```", text, re.S)
    assert PLUS in snippet
    out = subprocess.run([sys.executable, "-c", snippet], cwd=cwd, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert run_id in out.stdout and "11.0" in out.stdout, out.stdout


def test_show_prints_lineage(recorded, recorded_store, recorded_client, server):
    from pipeline.errors import UserError
    from pipeline.tracking import show_run

    _, run_id, _ = recorded
    text = show_run(run_id, recorded_store)
    tags = recorded_client.get_run(run_id).data.tags
    for expected in (run_id, "FINISHED", tags["git_sha"], tags["model_sha256"], tags["calib_sha256"],
                     "traces.reservoir_size=16", "traces", "config/config.yaml"):
        assert expected in text
    with pytest.raises(UserError, match="0" * 32):
        show_run("0" * 32, server)


def test_show_lists_the_model_loaded_and_only_the_fields_the_recipe_uses(recorded, recorded_store, own_llama):
    """`show RUN_ID` of the user's run (the default recipe, kvquant-4b+sink16+recent128): the model as loaded (the
    folder's name, source local, dtype), and of the recipe's fields those it uses -- no engine.* (a serving
    library's cache), no fp8, rotation, clip or outlier setting it does not have, no smooth / prefix."""
    from pipeline.tracking import show_run

    _, run_id, _ = recorded
    lines = show_run(run_id, recorded_store).splitlines()
    model = lines[lines.index("model") + 1:lines.index("model") + 4]
    assert model == ["  name              my-llama (config llama3)", f"  source            local {own_llama.resolve()}",
                     "  dtype             float32"]
    start = lines.index("  recipe            kvquant-4b+sink16+recent128") + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("  params "))
    assert lines[start].startswith("  quant             ")
    assert " ".join(line[20:] for line in lines[start:end]).split() == [
        "key.format=nuq", "key.bits=4", "key.axis=channel", "value.format=nuq", "value.bits=4", "value.axis=token",
        "key_rope=pre", "n_sink=16", "residual=128"]
    assert not any("engine." in line for line in lines)


def test_show_lists_smoothing_and_prefix_settings_only_when_the_recipe_has_them():
    """The `quant` line and what follows it, from a run's params (run_params): a smoothed recipe with a prefix lists
    the smooth.* and prefix.* settings; a serving library's recipe its engine.* fields alone; params of an older
    schema (a field today's recipe lacks) every quant.* param, as recorded."""
    from pipeline.config import RunConfig, load_recipe
    from pipeline.tracking import _show_recipe, run_params

    cfg = RunConfig()
    cfg.quant = load_recipe("kvquant-3b-1pct+smooth+prefix")
    lines = _show_recipe(run_params(cfg))
    assert lines[-2:] == ["  smooth            alpha=0.5 beta=0.0",
                          "  prefix            eta=64.0 max_tokens=4 n_tokens=-1"]
    assert " ".join(line[20:] for line in lines[:-2]).split() == [
        "key.format=nuq", "key.bits=3", "key.axis=channel", "key.outlier_fraction=0.01", "value.format=nuq",
        "value.bits=3", "value.axis=token", "value.outlier_fraction=0.01", "key_rope=pre", "n_sink=1", "smooth=True",
        "prefix=True"]
    cfg.quant = load_recipe("hf-hqq-2")
    words = " ".join(line[20:] for line in _show_recipe(run_params(cfg))).split()
    assert words == ["engine.library=transformers", "engine.backend=hqq", "engine.nbits=2", "engine.axis_key=0",
                     "engine.axis_value=0", "engine.q_group_size=64", "engine.residual_length=128"]
    cfg.quant = load_recipe(PLUS)
    assert not any(line.startswith(("  smooth", "  prefix")) for line in _show_recipe(run_params(cfg)))
    old = {"quant.name": "x", "quant.key.format": "nuq", "quant.key.codebook_iters": "9"}  # not a field today
    assert _show_recipe(old) == ["  quant             key.codebook_iters=9 key.format=nuq name=x"]


def test_show_lays_out_results_in_aligned_columns(synthetic, server, client):
    """`show <run id>` on the synthetic run, from its stages on, exactly: a header row per table, one row per
    stage and per recipe (exact names, highest bits first), columns two spaces apart, the report's files."""
    from pipeline.tracking import show_run
    from stages.evaluate import BITS_NOTE

    text = show_run(synthetic, server)
    artifact_dir = client.get_run(synthetic).data.tags["artifact_dir"]
    assert text[text.index("\nstages\n") + 1:].splitlines() == [
        "stages",
        "  stage   status    key           wall s  peak MB",
        "  traces  computed  eeeeeeeeeeee     1.5      100",
        "evaluation",
        "  recipe                       avg bits     ppl  ppl/fp16  95% interval          KL   top-1",
        "  fp16                           16.000  10.000    1.0000  [1.0000, 1.0000]  0.0000  1.0000",
        "  kvquant-4b+sink16+recent128     6.062  11.000    1.1000  [1.0500, 1.1500]  0.1250  0.8750",
        "  kivi-2                          2.500  12.500    1.2500  [1.1235, 1.3765]  0.2500  0.7500",
        f"  windows of 1024 tokens; {BITS_NOTE}",
        "  metrics eval.<recipe>.<column>, `+` written `_`: docs/mlflow.md",
        "runtime check",
        "  status  max_abs_err  max_rel_err",
        "  pass          0.001        0.002",
        "artifact",
        f"  folder            {artifact_dir} (the run's artifact kvcache-export-tiny/)",
        f"  manifest sha256   {'f' * 64}",
        "  format version    1.0",
        "report",
        "  files             report/frontier.png",
        "                    report/heatmap_kl.png",
        "                    report/layer_position_map.csv",
        "                    report/report.md"]
    header = text[:text.index("\nstages\n")].splitlines()
    assert header[0] == "MLflow run " + synthetic + " 'synthetic-provenance-run': FINISHED"
    assert {"code", "model", "data", "config"} <= set(header)
    for line in header[1:]:  # a section title, or `  label  value` with every value from column 20
        assert line[0] != " " or (line[18:20] == "  " and line[20] != " "), line


def test_store_failure_while_recording_marks_run_failed(server, client, tmp_path, monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import TrackingError, tracked_run

    def broken(self, *args, **kwargs):
        raise MlflowException("connection reset by peer")

    ids = []
    with pytest.raises(TrackingError, match=re.escape(server)):
        with tracked_run(_config(server, experiment="broken"), tmp_path / "run", log=ids.append) as rec:
            monkeypatch.setattr(MlflowClient, "log_artifacts", broken)
            rec.record(_out(tmp_path))
    monkeypatch.undo()
    (run_id,) = _run_ids("\n".join(ids))
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and "connection reset by peer" in run.data.tags["error"]


def test_a_dataset_inserted_by_a_concurrent_sweep_job_is_linked_not_fatal(server, client, tmp_path, monkeypatch):
    """Two jobs of a parallel sweep log the same windows at once: the server's SQL store looks the dataset up, the
    other job inserts it, and this insert fails on the UNIQUE constraint (seen in CI). The race is in the server
    and cannot be timed from here; its answer is replayed once before the real call, which must then link the
    row the other job made. Any other store error still fails the run."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import TrackingError, tracked_run

    real, calls = MlflowClient.log_inputs, []
    race = ("BAD_REQUEST: (sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
            "datasets.name, datasets.digest [SQL: INSERT INTO datasets (dataset_uuid, experiment_id, ...)]")

    def racing(self, run_id, datasets=None, **kwargs):
        calls.append(run_id)
        if len(calls) == 1:
            real(self, other_id, datasets=datasets)  # the other job's insert, first
            raise MlflowException(race)
        return real(self, run_id, datasets=datasets, **kwargs)

    with tracked_run(_config(server, experiment="dataset-race"), tmp_path / "other", log=lambda s: None) as other:
        other_id = other.run_id
    monkeypatch.setattr(MlflowClient, "log_inputs", racing)
    with tracked_run(_config(server, experiment="dataset-race"), tmp_path / "run", log=lambda s: None) as rec:
        rec.record(_out(tmp_path))
    run = client.get_run(rec.run_id)
    assert len(calls) == 2 and run.info.status == "FINISHED"
    _check_datasets(run, _summary(tmp_path)["data"], {"calibration": [2, 8], "evaluation": [1, 12]})

    def broken(self, run_id, datasets=None, **kwargs):
        raise MlflowException("BAD_REQUEST: UNIQUE constraint failed: runs.run_uuid")

    monkeypatch.setattr(MlflowClient, "log_inputs", broken)
    ids = []
    with pytest.raises(TrackingError):
        with tracked_run(_config(server, experiment="dataset-race"), tmp_path / "failing", log=ids.append) as rec:
            (tmp_path / "failing").mkdir(exist_ok=True)
            rec.record(_out(tmp_path / "failing"))
    (run_id,) = _run_ids("\n".join(ids))
    assert client.get_run(run_id).info.status == "FAILED"


def test_failed_stage_marks_run_failed(launched, client):
    out = launched.result("failing")  # traces.reservoir_size=0: the traces stage raises ValueError
    assert out.returncode == EXIT_USER and "traces.reservoir_size must be >= 1" in out.stderr, out.stderr[-2000:]
    (run_id,) = _run_ids(out.stdout)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert re.match(r"\w*Error: traces.reservoir_size must be >= 1, got 0", run.data.tags["error"]), run.data.tags["error"]
    assert "error/traceback.txt" in _artifacts(client, run_id)
    assert not any(k.startswith("stage.") for k in run.data.metrics)


def test_sweep_has_a_parent_run_with_a_child_per_job(launched, client):
    out = launched.result("sweep")  # -m traces.seed=0,1 hydra/launcher=joblib hydra.launcher.n_jobs=2
    log = out.stdout[-2000:] + out.stderr[-3000:]
    assert out.returncode == 0, log
    assert "Joblib.Parallel(n_jobs=2" in out.stdout + out.stderr, log  # the parallel local launcher ran it
    (parent_id,) = [line.split()[4] for line in out.stdout.splitlines() if line.startswith("mlflow: sweep parent")]
    parent = client.get_run(parent_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert len(children) == 2, log
    assert parent.info.status == "FINISHED" and parent.data.metrics["sweep.n_jobs"] == 2, (parent, log)
    assert "traces.seed=0,1" in parent.data.tags["sweep_overrides"]
    assert sorted(c.data.params["traces.seed"] for c in children) == ["0", "1"]
    assert sorted(c.info.run_name for c in children) == ["traces.seed=0", "traces.seed=1"]
    assert [c.info.status for c in children] == ["FINISHED", "FINISHED"], log


def test_unreachable_store_still_writes_results(launched):
    uri = launched.nowhere
    required, optional = launched.result("unreachable-true"), launched.result("unreachable-false")
    assert required.returncode == EXIT_UNREACHABLE, required.stderr[-2000:]
    assert uri in required.stderr and "error:" in required.stderr, required.stderr[-2000:]
    assert "Traceback" not in required.stderr
    assert optional.returncode == 0, optional.stderr[-2000:]
    assert "warning:" in optional.stderr and uri in optional.stderr, optional.stderr[-2000:]
    for name, says_where in (("unreachable-true", required.stderr), ("unreachable-false", optional.stdout)):
        cwd = launched.cwds[name]
        (summary_path,) = cwd.glob("outputs/*/*/summary.json")
        summary = json.loads(summary_path.read_text())
        assert summary["stages"][0]["status"] == "computed" and summary["model"]["model_sha256"]
        assert str(summary_path.parent) in says_where
        assert not (cwd / "mlruns.db").exists() and not (cwd / "mlruns").exists()


def test_mlflow_ui_shows_the_run_in_headless_chromium(synthetic, server, client, tmp_path):
    """The run's page in the MLflow UI (a React app: the DOM is dumped after virtual time has let it render)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium); the UI check needs it")
    run = client.get_run(synthetic)
    url = f"{server}/#/experiments/{run.info.experiment_id}/runs/{synthetic}/artifacts"
    for budget_ms in (15000, 45000):  # a loaded machine may need longer to fetch the run before rendering
        dom = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
            capture_output=True, text=True, timeout=180).stdout
        if "synthetic-provenance-run" in dom and "kvcache-export-tiny" in dom:
            break
    assert "synthetic-provenance-run" in dom, dom[-2000:]  # the run name, in the page header
    assert "kvcache-export-tiny" in dom, dom[-2000:]  # the exported artifact folder, in the artifact tree


def test_llamacpp_rows_become_metrics_with_their_interval():
    from pipeline.tracking import summary_metrics

    row = {"type_k": "q8_0", "type_v": "q4_0", "avg_bits": 6.5, "ppl": 20.4, "ppl_ratio": 1.02,
           "ppl_ratio_ci95": [1.01, 1.03], "top1": 0.9, "seconds": 3.0}
    got = summary_metrics({"evaluation_llamacpp": {"types": {"q8_0/q4_0": row}}})
    assert got == {"llamacpp.q8_0/q4_0.avg_bits": 6.5, "llamacpp.q8_0/q4_0.ppl": 20.4,
                   "llamacpp.q8_0/q4_0.ppl_ratio": 1.02, "llamacpp.q8_0/q4_0.ppl_ratio_lo": 1.01,
                   "llamacpp.q8_0/q4_0.ppl_ratio_hi": 1.03, "llamacpp.q8_0/q4_0.top1": 0.9}


def test_show_of_a_run_of_two_evaluation_windows_says_its_intervals_are_none():
    """`show <run id>`'s evaluation table prints each interval as stages.evaluate.interval_text does: from the run's
    data.eval_n_samples windows, fewer than 4 said not to be one (issue 69)."""
    from pipeline.tracking import _show_evaluation

    m = {"eval.fp16.avg_bits": 16.0, "eval.fp16.ppl": 10.0, "eval.fp16.ppl_ratio": 1.0, "eval.fp16.kl": 0.0,
         "eval.fp16.top1": 1.0, "eval.fp16.ppl_ratio_ci95_lo": 1.0, "eval.fp16.ppl_ratio_ci95_hi": 1.0}
    two = "\n".join(_show_evaluation({"recipes": ",fp16,"}, m, "128", "2"))
    assert "[1.0000, 1.0000] (2 windows: not an interval)" in two
    assert "not an interval" not in "\n".join(_show_evaluation({"recipes": ",fp16,"}, m, "128", "4"))
