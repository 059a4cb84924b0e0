"""MLflow provenance: one MLflow run per pipeline run, one parent run per Hydra sweep.

A run records what produced it and what it measured:
- params: the resolved config, flattened to dotted keys (`traces.reservoir_size`), its model.* the model that was
  loaded (`run_params`: model.source local for a folder, model.name the folder's name, model.dtype);
- metrics: stage wall times and peak RSS, the evaluation table (`eval.<recipe>.ppl`, the recipe's name written
  with `metric_name`: MLflow keys allow no `+`), the runtime check errors;
- tags: git sha, package version, model / tokenizer / data sha256, manifest sha256 and format version,
  runtime check status, the Hydra overrides, the run's recipe (`quant_name`) and every evaluated recipe by its
  exact name (`recipes`, searchable: `recipe_filter`) and, when a stage fails, the error;
- artifacts: the exported artifact folder, the resolved config, summary.json, the run's report (report.md with
  every PNG and CSV of the run folder, under `report/`), the evaluation table (CSV and markdown, and
  `evaluation/table.json` logged with `log_table`, which the UI shows "as table") and PNG plots
  (pipeline/plots.py); each file once (the frontier is the report's frontier.png, plots/ppl_vs_bits.png only for a
  run without a report; Hydra's config.yaml only where it differs from the resolved config/config.yaml);
- inputs: the calibration and evaluation token windows as MLflow datasets (context `calibration` /
  `evaluation`, digest = the windows' sha256 cut to MLflow's 36 characters, schema and shape of the windows,
  source = the text file or hub split they came from), listed in the run's Datasets.

The run is opened before the stages and closed after everything is logged, so a failed stage leaves a FAILED
run with its error and nothing half-recorded is FINISHED. A process killed outright (SIGKILL, OOM killer, node
lost) cannot close its run, which stays RUNNING: every run records the host and pid that own it (tags
`kvcalib_host`, `kvcalib_host_id`, `kvcalib_pid`, `kvcalib_pid_started`), and a new run of the same experiment
marks a RUNNING run whose process is gone from this host KILLED, with the tag `error` saying so.

A sqlite store keeps its artifacts in `mlartifacts/<experiment>/` beside the database file
(`artifact_location`), as `mlflow server` keeps them in `./mlartifacts`; an experiment made before keeps its own.

The store is checked once, with retries off and a short timeout, so an unreachable server costs seconds: the
pipeline still runs and writes its results, then the process exits with `EXIT_UNREACHABLE` (pipeline/errors.py)
naming the URI (`tracking.required=false`: a warning instead).

mlflow is imported inside the functions: `tracking.enabled=false` runs never pay for it. MlflowClient is used
rather than the fluent API, whose exit hook would end an interrupted run as FINISHED.
"""
from __future__ import annotations

import contextlib
import csv
import datetime as dt
import getpass
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

import pipeline
from pipeline import faults
from pipeline.config import DataConfig, RunConfig, TrackingConfig
from pipeline.data import text_file
from pipeline.errors import UserError, shown
from exporters.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from pipeline.locks import HOST, HOST_ID, pid_alive

ENV_PARENT_RUN = "KVCALIB_MLFLOW_PARENT_RUN_ID"   # set by SweepCallback for the jobs of a sweep
ENV_RUN_NAME = "KVCALIB_MLFLOW_RUN_NAME"          # a sweep job's name: the swept overrides it got
PROJECT_ROOT = Path(pipeline.__file__).resolve().parent.parent
# once the store answered, a request may be retried (backoff 2 s, 4 s, 8 s) before the run gives up
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}
_MAX_TAG_CHARS = 5000
_FOLDER_KEYS = ("artifact_dir",)  # exported folders, logged whole under their names
# the vLLM checkpoint is logged without its weight shards (a model's worth of bytes per run): config, index,
# scales, tokenizer and the kvcalib/ record, under vllm-checkpoint/
_CHECKPOINT_KEY = "vllm_checkpoint_dir"
TABLE_FILE = "evaluation/table.json"  # the evaluation table, logged with MlflowClient.log_table
REPORT_DIR = "report"  # report.md and the PNG / CSV files beside it in the run folder (its links stay valid)
# the report's quality-per-bit frontier (pipeline/analysis.py write_report): plots.ppl_vs_bits of the evaluation, the
# figure plots/ppl_vs_bits.png would repeat
REPORT_FRONTIER = "frontier.png"
SHOWN_LINE_CHARS = 10_000   # one line of `show RUN_ID` printed whole up to here (a tag is cut at _MAX_TAG_CHARS)
_REPORT_SUFFIXES = (".md", ".png", ".csv")
ARTIFACTS_FOLDER = "mlartifacts"  # a sqlite store's artifacts, beside its database file
RECIPES_TAG = "recipes"  # every evaluated recipe's exact name, each between commas: ",fp16,kivi-2,"
# two jobs of a parallel sweep inserting one dataset at once: the later insert fails, the row exists
_DATASET_RACE = re.compile(r"UNIQUE constraint failed: datasets\.|duplicate key value.*datasets", re.S)
_MAX_DIGEST_CHARS = 36  # MLflow's limit on a dataset digest: the windows' sha256 is cut to it (full: input tag sha256)
_MAX_INPUT_TAG_CHARS = 500

Warn = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _stdout(message: str) -> None:
    print(message, flush=True)  # sweep workers may be ended before their buffers are


def _checkpoint_files(folder: Path) -> list[Path]:
    """A vLLM checkpoint's files but its weight shards (every *.safetensors except the KV scales)."""
    from exporters.compressed_tensors import SCALES_FILE

    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and not (p.parent == folder and p.suffix == ".safetensors" and p.name != SCALES_FILE))


class TrackingError(Exception):
    """The MLflow store could not be reached or written; the message names the URI."""


# ---------------------------------------------------------------------------------------------- the store

@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def connect(uri: str, timeout_s: int = 5):
    """An MlflowClient for `uri`, after one request made with retries off and a `timeout_s` timeout."""
    import logging

    from mlflow.tracking import MlflowClient

    for name in ("alembic", "mlflow.store.db.utils"):  # schema migrations of a new sqlite store: not news
        logging.getLogger(name).setLevel(logging.WARNING)
    client = MlflowClient(tracking_uri=uri)
    try:
        with _environ(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT=str(timeout_s)):
            client.search_experiments(max_results=1)
    except Exception as exc:  # connection refused, timeout, HTTP error, bad sqlite path: all say the same
        raise TrackingError(f"MLflow tracking store {uri} is unreachable ({_reason(exc)})") from exc
    for key, value in _HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return client


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(exc: BaseException) -> str:
    """The root cause inside MLflow's wrapped HTTP errors ("[Errno 111] Connection refused", "timed out")."""
    text = str(exc)
    errno = re.search(r"\[Errno -?\d+\][^\"')]*", text)
    if errno:
        return errno.group(0).strip()
    if "timed out" in text.lower():
        return "no answer: the request timed out"
    return _short(exc)


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment of store `uri` keeps its runs' artifacts: for a sqlite store, the folder
    `mlartifacts/<experiment>` beside the database file (a name's characters other than letters, digits and
    `- _ .` written `_`), as a file URI; None for any other store (a server decides: `--artifacts-destination`).

    >>> artifact_location("sqlite:////data/mlruns.db", "kvcalib")
    'file:///data/mlartifacts/kvcalib'
    """
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri[len("sqlite:///"):].split("?", 1)[0])
    folder = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment).strip(".") or "_"
    return (database.resolve().parent / ARTIFACTS_FOLDER / folder).as_uri()


def experiment_id(client, name: str) -> str:
    """The id of experiment `name`, created when missing (sqlite store: with `artifact_location`)."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:  # the kind makes MLflow 3's UI list the runs as model development, not GenAI evaluations
            return client.create_experiment(name, artifact_location=artifact_location(client.tracking_uri, name),
                                             tags={"mlflow.experimentKind": "custom_model_development"})
        except MlflowException:  # created by a concurrent job of the same sweep
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage != "active":
        raise TrackingError(f"MLflow experiment {name!r} is deleted in {client.tracking_uri}; restore it "
                            f"(mlflow experiments restore) or choose another tracking.experiment")
    return exp.experiment_id


# ---------------------------------------------------------------------------------------------- what is logged

def git_state(root: Path = PROJECT_ROOT) -> tuple[str, bool | None]:
    """(commit sha or "unknown", whether tracked files differ from it; None when unknown)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    return sha, dirty


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name in a bare container
        return "unknown"


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"data": {"seq_len": 32}} -> {"data.seq_len": "32"}; lists are JSON."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return flat


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_name(name: str) -> str:
    """A recipe's name as it is written in metric keys (`eval.<this>.ppl`): MLflow keys allow letters, digits and
    `_ - . / ` only, so every other character (the `+` of `kvquant-4b+sink16+recent128`) is written `_`. The exact
    name is in the tag `recipes` and in the rows of `evaluation/table.json`.

    >>> metric_name("kvquant-4b+sink16+recent128")
    'kvquant-4b_sink16_recent128'
    """
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in str(name))


def recipes_tag(names) -> str:
    """The tag `recipes`: every evaluated recipe's exact name, each between commas (",fp16,kivi-2,"), so that one
    LIKE pattern (`recipe_filter`) finds a recipe whole and never a longer name that begins with it."""
    return "," + ",".join(names) + ","


def recipe_filter(name: str) -> str:
    """The `search_runs` filter string for the runs that evaluated recipe `name` (its exact name, `+` and all).

    >>> recipe_filter("kvquant-4b+sink16+recent128")
    "tags.recipes LIKE '%,kvquant-4b+sink16+recent128,%'"
    """
    if "'" in name or "," in name:
        raise ValueError(f"a recipe name cannot hold ' or , (the tag's separator), got {name!r}")
    return f"tags.{RECIPES_TAG} LIKE '%,{name},%'"


def summary_metrics(summary: dict) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for stage in summary.get("stages", []):
        # a stage's name holds its recipe's (evaluate-recipe-kvquant-4b+sink16+recent128): written as metric_name
        metrics[f"stage.{metric_name(stage['name'])}.wall_s"] = float(stage["wall_s"])
        metrics[f"stage.{metric_name(stage['name'])}.peak_rss_mb"] = float(stage["peak_rss_mb"])
    for step in summary.get("steps", []):  # the timed parts that are not cached stages (load, export, check, ...)
        metrics[f"step.{metric_name(step['name'])}.wall_s"] = float(step["wall_s"])
        metrics[f"step.{metric_name(step['name'])}.others_cpu"] = float(step["others_cpu"])
    for key in ("wall_s", "calib_wall_s", "peak_rss_mb"):
        if _number(summary.get(key)):
            metrics[f"run.{key}"] = float(summary[key])
    for recipe, row in (summary.get("evaluation") or {}).get("recipes", {}).items():
        metrics.update({f"eval.{metric_name(recipe)}.{k}": float(v) for k, v in recipe_columns(row).items()
                        if _number(v)})
    for cache_type, row in (summary.get("evaluation_llamacpp") or {}).get("types", {}).items():
        lo, hi = row.get("ppl_ratio_ci95") or (None, None)
        metrics.update({f"llamacpp.{metric_name(cache_type)}.{k}": float(v) for k, v in
                        (("avg_bits", row.get("avg_bits")), ("ppl", row.get("ppl")), ("ppl_ratio", row.get("ppl_ratio")),
                         ("ppl_ratio_lo", lo), ("ppl_ratio_hi", hi), ("top1", row.get("top1"))) if _number(v)})
    check = summary.get("runtime_check") or {}
    metrics.update({f"runtime_check.{k}": float(v) for k, v in check.items() if _number(v)})
    return metrics


def used_model(name: str | None, source: dict) -> dict[str, str]:
    """The model a run loaded, as both its params (`model.<key>`) and its tags (`model_<key>`) record it, from its
    own name and its source (pipeline.model.own_name and model_source, summary["model"]): name (the folder's name
    for model.path=DIR, the hub id), source (the kind it was loaded as: "local" for a folder, whatever the config
    said), path (the absolute folder, the hub id), revision (a hub snapshot's commit), config (the conf/model name)
    and dtype (the weights were loaded in). Absent values are left out."""
    used = {"name": name, "source": source.get("kind"), "path": source.get("path") or None,
            "revision": source.get("revision"), "config": source.get("config"),
            "dtype": (source.get("settings") or {}).get("dtype")}
    return {k: str(v) for k, v in used.items() if v is not None}


# the model.* settings a source reads beside used_model's (and model.device): none for a local folder or a hub id
_SOURCE_SETTINGS = {"embedded": ("embedded",), "gguf": ("gguf_file",), "tiny": ("tiny",), "shape": ("shape",)}


def run_params(cfg: RunConfig) -> dict[str, str]:
    """The run's MLflow params: the resolved config flattened to dotted keys (`data.seq_len`), its model.* being
    what was used (`used_model`: model.name my-llama, model.source local, model.path /abs/my-llama, model.config
    llama3, model.dtype, rather than the config's `name: llama3`, `source: hub`), model.device, and the settings
    of the model's source only (model.tiny.* for a tiny model, none for a folder)."""
    from pipeline.model import model_source, own_name

    source = model_source(cfg.model)
    model = {f"model.{k}": v for k, v in used_model(own_name(cfg.model), source).items()}
    model["model.device"] = cfg.model.device
    settings = asdict(cfg.model)
    for name in _SOURCE_SETTINGS.get(source["kind"], ()):
        model.update(flatten({name: settings[name]}, "model."))
    return {**{k: v for k, v in flatten(asdict(cfg)).items() if not k.startswith("model.")}, **model}


def summary_tags(summary: dict) -> dict[str, str]:
    model, data = summary.get("model") or {}, summary.get("data") or {}
    manifest, check = summary.get("manifest") or {}, summary.get("runtime_check") or {}
    tags = {"model_sha256": model.get("model_sha256"),
            "tokenizer_sha256": model.get("tokenizer_sha256"), "data_description": data.get("description"),
            "calib_sha256": data.get("calib_sha256"), "eval_sha256": data.get("eval_sha256"),
            "manifest_sha256": manifest.get("sha256"), "manifest_format_version": manifest.get("format_version"),
            "runtime_check_status": check.get("status"), "artifact_dir": summary.get("artifact_dir"),
            "stages": ",".join(stage["name"] for stage in summary.get("stages", [])) or None}
    # the model the run loaded: model_name, model_source, model_path, ... as the params model.name, model.source, ...
    tags.update({f"model_{k}": v for k, v in used_model(model.get("name"), model.get("source") or {}).items()})
    recipes = (summary.get("evaluation") or {}).get("recipes")
    if recipes:
        tags[RECIPES_TAG] = recipes_tag(recipes)
    for stage in summary.get("stages", []):
        tags[f"stage.{metric_name(stage['name'])}.status"] = stage["status"]
        tags[f"stage.{metric_name(stage['name'])}.key"] = stage["key"]
    return {k: str(v) for k, v in tags.items() if v is not None}


def recipe_columns(row: dict) -> dict[str, Any]:
    """One recipe's evaluation as flat columns: a 95% interval `x_ci95: [lo, hi]` becomes `x_ci95_lo` and
    `x_ci95_hi`; everything else is kept as it is (the numbers are the run's metrics `eval.<recipe>.<column>`)."""
    flat: dict[str, Any] = {}
    for key, value in row.items():
        if key.endswith("_ci95") and isinstance(value, (list, tuple)) and len(value) == 2:
            flat[f"{key}_lo"], flat[f"{key}_hi"] = value
        else:
            flat[key] = value
    return flat


def table_rows(recipes: dict[str, dict]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """(columns in first-seen order after avg_bits, ppl, kl, top1; {recipe: its flat columns})."""
    rows = {name: recipe_columns(row) for name, row in recipes.items()}
    columns = list(dict.fromkeys(["avg_bits", "ppl", "kl", "top1", *(k for row in rows.values() for k in row)]))
    return columns, rows


def table_frame(recipes: dict[str, dict]):
    """The evaluation table as a pandas DataFrame for `log_table`: one row per recipe, a `recipe` column first;
    a column a recipe lacks is null there. log_table writes it as JSON with numbers to 10 decimal places (pandas
    `to_json`); the metrics `eval.<recipe>.<column>` and summary.json keep every digit."""
    import pandas as pd

    columns, rows = table_rows(recipes)
    frame = pd.DataFrame([{"recipe": name, **row} for name, row in rows.items()], columns=["recipe", *columns])
    return frame.astype({"recipe": object})  # not pandas 3's str: log_table's select_dtypes("object") warns on it


def evaluation_table(recipes: dict[str, dict]) -> tuple[str, str]:
    """The evaluation table as (CSV, markdown): one row per recipe, the columns of `table_rows`."""
    columns, rows = table_rows(recipes)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["recipe", *columns])
    cells = {name: [_cell(row.get(c)) for c in columns] for name, row in rows.items()}
    writer.writerows([name, *row] for name, row in cells.items())
    md = ["| recipe | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    md += [f"| {name} | " + " | ".join(row) + " |" for name, row in cells.items()]
    return out.getvalue(), "\n".join(md) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _dataset_source(data: DataConfig, context: str):
    """Where the text of `context` ("calibration" / "evaluation") came from, as an MLflow dataset source: the
    hub split, or the file its text is read from (pipeline.data.text_file)."""
    from mlflow.data.dataset_source_registry import get_dataset_source_from_json
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    calibration = context == "calibration"
    if data.source == "hub":
        return HuggingFaceDatasetSource(data.hub_name, config_name=data.hub_config,
                                        split=data.calib_split if calibration else data.eval_split)
    return get_dataset_source_from_json(json.dumps({"uri": str(text_file(data, calibration).resolve())}), "local")


def dataset_inputs(data: DataConfig, described: dict, windows) -> list:
    """The calibration and evaluation windows (pipeline.data.Windows) as MLflow DatasetInputs for `log_inputs`:
    the token ids' schema and shape, digest = the summary's sha256 of the windows (cut to MLflow's limit; whole in
    the input tag `sha256`), input tags `mlflow.data.context` and `description` (summary["data"])."""
    import mlflow.data
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = []
    for context, ids, sha in (("calibration", windows.calib, described["calib_sha256"]),
                              ("evaluation", windows.eval, described["eval_sha256"])):
        ds = mlflow.data.from_numpy(ids.cpu().numpy(), source=_dataset_source(data, context),
                                    name=f"{data.name}-{context}", digest=sha[:_MAX_DIGEST_CHARS])
        tags = {MLFLOW_DATASET_CONTEXT: context, "sha256": sha, "description": described.get("description", "")}
        inputs.append(DatasetInput(Dataset(**ds.to_dict()),
                                   tags=[InputTag(k, str(v)[:_MAX_INPUT_TAG_CHARS]) for k, v in tags.items()]))
    return inputs


def _hydra_files(run_dir: Path) -> dict[str, Path]:
    hydra_dir = run_dir / ".hydra"
    return {p.name: p for p in sorted(hydra_dir.glob("*.yaml"))} if hydra_dir.is_dir() else {}


def _overrides(run_dir: Path) -> list[str]:
    path = _hydra_files(run_dir).get("overrides.yaml")
    return [str(o) for o in OmegaConf.load(path)] if path else []


def report_files(run_dir: Path) -> list[Path]:
    """The run's report as the run folder holds it: report.md and every PNG and CSV beside it (frontier.png, the
    layer x position heatmaps and their CSV, pipeline/analysis.py); none when the run wrote no report."""
    run_dir = Path(run_dir)
    if not (run_dir / "report.md").is_file():
        return []
    return sorted(p for p in run_dir.iterdir() if p.is_file() and p.suffix in _REPORT_SUFFIXES)


def _write_artifacts(out: dict, cfg: RunConfig, run_dir: Path, dest: Path) -> None:
    """Everything but the artifact folder, laid out under `dest` as it will appear in the MLflow run."""
    from pipeline import plots

    (dest / "config" / "hydra").mkdir(parents=True)
    resolved = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    atomic_write_text(dest / "config" / "config.yaml", resolved)
    for name, path in _hydra_files(run_dir).items():
        # Hydra's composed config is the resolved one byte for byte unless it holds an interpolation (${...}) the
        # resolved one resolved: logged once, as config/config.yaml, and under config/hydra/ only when it differs
        if name == "config.yaml" and path.read_bytes() == resolved.encode():
            continue
        atomic_write_bytes(dest / "config" / "hydra" / name, path.read_bytes())
    summary = out["summary"]
    atomic_write_json(dest / "summary.json", summary)
    report = report_files(run_dir)
    recipes = (summary.get("evaluation") or {}).get("recipes")
    if recipes:
        table_csv, table_md = evaluation_table(recipes)
        atomic_write_text(dest / "evaluation" / "table.csv", table_csv)
        atomic_write_text(dest / "evaluation" / "table.md", table_md)
        if REPORT_FRONTIER not in {p.name for p in report}:  # else the same figure: logged once, under report/
            plots.ppl_vs_bits(recipes, dest / "plots" / "ppl_vs_bits.png")
    traces = (out.get("results") or {}).get("traces")
    if traces is not None and "k_pre_absmax" in traces.tensors:
        plots.kv_channel_magnitudes(traces.tensors, dest / "plots" / "kv_channels")
    for path in report:  # together, so report.md's relative image links resolve in the UI
        atomic_write_bytes(dest / REPORT_DIR / path.name, path.read_bytes())


# ---------------------------------------------------------------------------------------------- one run

class RunRecorder:
    """The MLflow run of one pipeline run. `tracked_run` drives it; the pipeline calls `record(out)`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, warn: Warn = _stderr, log: Callable[[str], None] = _stdout):
        self.cfg, self.tcfg, self.run_dir = cfg, cfg.tracking, Path(run_dir)
        self.warn, self.log = warn, log
        self.client = None
        self.run_id: str | None = None
        self.problem: str | None = None  # why the store could not open or close the run

    def start(self) -> None:
        params = run_params(self.cfg)  # outside the try: a failure here is not the store's
        try:
            self.client = connect(self.tcfg.uri, self.tcfg.probe_timeout_s)
            exp_id = experiment_id(self.client, self.tcfg.experiment)
            reap_dead_runs(self.client, exp_id, self.log, self.warn)
            run = self.client.create_run(exp_id, run_name=self._run_name(), tags=self._start_tags())
            self.run_id = run.info.run_id
            faults.point("mlflow.started")
            self._log_batch(params=params)
            faults.point("mlflow.params_logged")
        except Exception as exc:
            self.problem = str(exc) if isinstance(exc, TrackingError) else \
                f"MLflow tracking store {self.tcfg.uri} failed ({_short(exc)})"
            if self.run_id is not None:
                self._terminate("FAILED", f"tracking: {self.problem}")
                self.run_id = None
            then = "exits non-zero afterwards" if self.tcfg.required else "goes on without tracking"
            self.warn(f"warning: {self.problem}; the pipeline still runs and {then} "
                      f"(tracking.required={str(self.tcfg.required).lower()})")
            return
        self.log(f"mlflow: run {self.run_id} in experiment {self.tcfg.experiment!r} at {self.tcfg.uri}, "
                 f"artifacts in {run.info.artifact_uri}")

    def _run_name(self) -> str:
        """tracking.run_name; a sweep job's swept overrides; else `<the model's own name>-<recipe>-<time>`
        (pipeline.model.own_name: the folder's name for model.path=DIR, the hub id, not the config's name)."""
        from pipeline.model import own_name

        if self.tcfg.run_name:
            return self.tcfg.run_name
        if os.environ.get(ENV_RUN_NAME):
            return os.environ[ENV_RUN_NAME]
        return f"{own_name(self.cfg.model)}-{self.cfg.quant.name}-{time.strftime('%Y%m%d-%H%M%S')}"

    def _start_tags(self) -> dict[str, str]:
        sha, dirty = git_state()
        tags = {"git_sha": sha, "git_dirty": str(dirty).lower() if dirty is not None else "unknown",
                "kvcalib_version": pipeline.__version__, "run_dir": str(self.run_dir.resolve()),
                **owner_tags(),
                "overrides": " ".join(_overrides(self.run_dir)), "quant_name": self.cfg.quant.name,
                "mlflow.source.name": "python -m pipeline run", "mlflow.source.type": "LOCAL",
                "mlflow.user": _user()}
        if sha != "unknown":
            tags["mlflow.source.git.commit"] = sha
        if os.environ.get(ENV_PARENT_RUN):
            tags["mlflow.parentRunId"] = os.environ[ENV_PARENT_RUN]
        return tags

    def record(self, out: dict) -> None:
        """Metrics, tags and artifacts of a finished pipeline run (`run_pipeline`'s return value).

        Files and plots are made first, so a bug there is raised as itself (and the run marked FAILED by
        `tracked_run`); only the calls to the store are reported as a tracking failure."""
        if self.run_id is None:
            return
        summary = out["summary"]
        metrics, tags = summary_metrics(summary), summary_tags(summary)
        folders = [Path(summary[k]) for k in (*_FOLDER_KEYS, _CHECKPOINT_KEY) if summary.get(k)]
        missing = [str(f) for f in folders if not f.is_dir()]
        if missing:
            raise ValueError(f"summary names exported folders that do not exist: {missing}")
        recipes = (summary.get("evaluation") or {}).get("recipes")
        table = table_frame(recipes) if recipes else None
        datasets = dataset_inputs(self.cfg.data, summary["data"], out["windows"]) \
            if summary.get("data") and out.get("windows") is not None else []
        with tempfile.TemporaryDirectory(prefix="kvcalib-mlflow-") as tmp:
            _write_artifacts(out, self.cfg, self.run_dir, Path(tmp))
            try:
                self._log_batch(metrics=metrics, tags=tags)
                faults.point("mlflow.metrics_logged")
                if datasets:
                    self._log_inputs(datasets)
                self.client.log_artifacts(self.run_id, tmp)
                if table is not None:  # a new file (log_table would append to a table.json already logged)
                    self.client.log_table(self.run_id, data=table, artifact_file=TABLE_FILE)
                for folder in folders:
                    if summary.get(_CHECKPOINT_KEY) and folder == Path(summary[_CHECKPOINT_KEY]):
                        for path in _checkpoint_files(folder):
                            parent = Path(folder.name, path.relative_to(folder)).parent.as_posix()
                            self.client.log_artifact(self.run_id, str(path), artifact_path=parent)
                    else:
                        self.client.log_artifacts(self.run_id, str(folder), artifact_path=folder.name)
                faults.point("mlflow.artifacts_logged")
            except Exception as exc:
                self._store_failed(exc)

    def _store_failed(self, exc: Exception) -> None:
        message = f"could not record the run in MLflow tracking store {self.tcfg.uri} ({_reason(exc)})"
        self._terminate("FAILED", f"tracking: {message}")
        self.run_id = None
        where = f"results are complete in {self.run_dir.resolve()}"
        if self.tcfg.required:
            raise TrackingError(f"{message}; {where}") from exc
        self.warn(f"warning: {message}; {where}")

    def _log_inputs(self, datasets: list, attempts: int = 3) -> None:
        """log_inputs, again when a concurrent job of the same sweep inserted the same dataset between the store's
        lookup and its insert (the server's SQL store answers with a UNIQUE constraint on datasets; the retry finds
        the row and links it). Any other failure is raised at once."""
        for attempt in range(attempts):
            try:
                self.client.log_inputs(self.run_id, datasets=datasets)
                return
            except Exception as exc:
                if attempt == attempts - 1 or not _DATASET_RACE.search(str(exc)):
                    raise
                time.sleep(0.2 * (attempt + 1))

    def _log_batch(self, metrics: dict[str, float] | None = None, params: dict[str, str] | None = None,
                   tags: dict[str, str] | None = None) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, 0) for k, v in (metrics or {}).items()],
                              params=[Param(k, v) for k, v in (params or {}).items()],
                              tags=[RunTag(k, v) for k, v in (tags or {}).items()])

    def fail(self, exc: BaseException) -> None:
        if self.run_id is None:
            return
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        self._terminate(status, _short(exc, _MAX_TAG_CHARS), "".join(traceback.format_exception(exc)))
        self.run_id = None

    def _terminate(self, status: str, error: str, trace: str = "") -> None:
        """Best effort: the store may be the thing that failed; the caller reports the original error."""
        try:
            self.client.set_tag(self.run_id, "error", error[:_MAX_TAG_CHARS])
            if trace:
                self.client.log_text(self.run_id, trace, "error/traceback.txt")
        except Exception as exc:
            self.warn(f"warning: could not record the error in MLflow run {self.run_id}: {_short(exc)}")
        try:
            self.client.set_terminated(self.run_id, status)
        except Exception as exc:
            self.warn(f"warning: MLflow run {self.run_id} could not be marked {status}: {_short(exc)}")

    def finish(self) -> None:
        if self.run_id is not None:
            faults.point("mlflow.before_end")
            try:
                self.client.set_terminated(self.run_id, "FINISHED")
            except Exception as exc:
                self.problem = f"MLflow run {self.run_id} could not be closed in {self.tcfg.uri} ({_reason(exc)})"
                self.warn(f"warning: {self.problem}")
        if self.problem and self.tcfg.required:
            raise TrackingError(f"{self.problem}; the results are complete in {self.run_dir.resolve()} but "
                                f"were not recorded (tracking.required=false goes on without MLflow)")


def owner_tags() -> dict[str, str]:
    """Which process owns a run: read back by `reap_dead_runs`."""
    import psutil

    return {"kvcalib_host": HOST, "kvcalib_host_id": HOST_ID, "kvcalib_pid": str(os.getpid()),
            "kvcalib_pid_started": repr(psutil.Process().create_time())}


def reap_dead_runs(client, exp_id: str, log: Callable[[str], None] = _stdout, warn: Warn = _stderr) -> list[str]:
    """Mark KILLED the runs of experiment `exp_id` still RUNNING whose process on this host is gone (killed
    before it could end its run). Runs of other hosts are left alone: their processes cannot be asked. Best
    effort: a store that refuses is warned about, never fatal."""
    reaped = []
    try:
        running = client.search_runs([exp_id], filter_string=f"attributes.status = 'RUNNING' and "
                                                             f"tags.kvcalib_host_id = '{HOST_ID}'", max_results=200)
        for run in running:
            tags = run.data.tags
            try:
                pid, started = int(tags["kvcalib_pid"]), float(tags["kvcalib_pid_started"])
            except (KeyError, ValueError):
                continue
            if pid_alive(pid, started):
                continue
            client.set_tag(run.info.run_id, "error", f"process {pid} on {tags.get('kvcalib_host', HOST)} ended "
                                                     f"without closing this run (killed); marked by a later run")
            client.set_terminated(run.info.run_id, "KILLED")
            reaped.append(run.info.run_id)
    except Exception as exc:
        warn(f"warning: could not look for runs left RUNNING by dead processes: {_short(exc)}")
    if reaped:
        log(f"mlflow: marked {len(reaped)} run(s) left RUNNING by a dead process KILLED: {', '.join(reaped)}")
    return reaped


class _NoRecorder:
    run_id = None

    def record(self, out: dict) -> None:
        pass


@contextlib.contextmanager
def tracked_run(cfg: RunConfig, run_dir: Path, warn: Warn = _stderr, log: Callable[[str], None] = _stdout):
    """`with tracked_run(cfg, run_dir) as rec: out = run_pipeline(cfg, run_dir); rec.record(out)`.

    An exception inside the block marks the run FAILED (KILLED for Ctrl-C) with the error and re-raises it;
    a normal exit marks it FINISHED, or raises TrackingError when the store failed and tracking.required.
    """
    if not cfg.tracking.enabled:
        yield _NoRecorder()
        return
    recorder = RunRecorder(cfg, run_dir, warn=warn, log=log)
    recorder.start()
    try:
        yield recorder
    except BaseException as exc:
        recorder.fail(exc)
        raise
    recorder.finish()


# ---------------------------------------------------------------------------------------------- sweeps

class SweepCallback(Callback):
    """Hydra callback (conf/config.yaml `hydra.callbacks`): a parent MLflow run around a multirun.

    The parent is opened at `on_multirun_start`, its id reaches every job through `ENV_PARENT_RUN` (set here for
    launchers that inherit the environment, and again in `on_job_start`, which runs inside the job's process on
    joblib, submitit and Ray workers, where this object arrives pickled), and it is closed at `on_multirun_end`:
    FINISHED when every child finished, FAILED otherwise, or at interpreter exit when a job aborted the sweep.
    """

    def __init__(self) -> None:
        self.uri: str | None = None
        self.parent_run_id: str | None = None
        self.swept: list[str] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        tcfg = OmegaConf.merge(OmegaConf.structured(TrackingConfig), OmegaConf.select(config, "tracking") or {})
        if not tcfg.enabled:
            return
        overrides = list(OmegaConf.select(config, "hydra.overrides.task") or [])
        self.swept = _swept_keys(overrides)
        try:
            client = connect(tcfg.uri, tcfg.probe_timeout_s)
            sha, _ = git_state()
            tags = {"git_sha": sha, "kvcalib_version": pipeline.__version__, "sweep_overrides": " ".join(overrides),
                    "sweep_dir": str(Path(str(config.hydra.sweep.dir)).resolve()),
                    "mlflow.source.name": "python -m pipeline run -m", "mlflow.source.type": "LOCAL"}
            run = client.create_run(experiment_id(client, tcfg.experiment), tags=tags,
                                    run_name=f"sweep-{time.strftime('%Y%m%d-%H%M%S')}")
        except Exception as exc:
            _stderr(f"warning: no parent MLflow run for this sweep: {_short(exc)}; each job reports its own run")
            return
        self.uri, self.parent_run_id = tcfg.uri, run.info.run_id
        os.environ[ENV_PARENT_RUN] = self.parent_run_id
        import atexit
        atexit.register(self._close, aborted=True)
        _stdout(f"mlflow: sweep parent run {self.parent_run_id} at {self.uri}")

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.parent_run_id is None:
            return
        os.environ[ENV_PARENT_RUN] = self.parent_run_id
        job = OmegaConf.select(config, "hydra.job")
        picked = [o for o in OmegaConf.select(config, "hydra.overrides.task") or [] if _key(o) in self.swept]
        os.environ[ENV_RUN_NAME] = ",".join(picked) if picked else f"job{job.num if job else ''}"

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._close(aborted=False)

    def _close(self, aborted: bool) -> None:
        """Every job is over: a child still RUNNING lost its process (KILLED); the parent is FINISHED only
        when the sweep ran to its end and every child finished."""
        if self.parent_run_id is None:
            return
        run_id, self.parent_run_id = self.parent_run_id, None
        try:
            client = connect(self.uri)
            parent = client.get_run(run_id)
            children = client.search_runs([parent.info.experiment_id],
                                          filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
            for child in children:
                if child.info.status == "RUNNING":
                    client.set_tag(child.info.run_id, "error", "the sweep ended before this job finished")
                    client.set_terminated(child.info.run_id, "KILLED")
            n_done = sum(c.info.status == "FINISHED" for c in children)
            ok = not aborted and children and n_done == len(children)
            client.log_metric(run_id, "sweep.n_jobs", len(children))
            client.log_metric(run_id, "sweep.n_finished", n_done)
            if not ok:
                client.set_tag(run_id, "error", "a job aborted the sweep" if aborted else
                               f"{len(children) - n_done} of {len(children)} jobs did not finish")
            client.set_terminated(run_id, "FINISHED" if ok else "FAILED")
        except Exception as exc:
            _stderr(f"warning: the sweep's parent MLflow run {run_id} could not be closed: {_short(exc)}")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _swept_keys(overrides: list[str]) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [_key(o.input_line) for o in parsed if o.is_sweep_override()]


# ---------------------------------------------------------------------------------------------- show

_LABEL_WIDTH = 18  # the label column of show's `label  value` lines ("tokenizer sha256" and two spaces)
# show's evaluation table: (header, the metric column, its format); a metric the run lacks is shown "-"
_EVAL_COLUMNS = (("avg bits", "avg_bits", "{:.3f}"), ("ppl", "ppl", "{:.3f}"), ("ppl/fp16", "ppl_ratio", "{:.4f}"),
                 ("KL", "kl", "{:.4f}"), ("top-1", "top1", "{:.4f}"))


def show_run(run_id: str, tracking_uri: str) -> str:
    """The lineage of a recorded run, read back from MLflow: code, model, data, config, stages, results; every
    table with a header row and its columns aligned, one row per stage, per recipe."""
    from mlflow.exceptions import MlflowException

    client = connect(tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise UserError(f"no MLflow run {run_id} in {tracking_uri} ({_short(exc, 120)}); "
                        f"pass tracking.uri=... for another store") from exc
    experiment = client.get_experiment(run.info.experiment_id).name
    p, t, m = run.data.params, run.data.tags, run.data.metrics
    report = sorted(f.path for f in client.list_artifacts(run_id, REPORT_DIR) if not f.is_dir)
    lines = [*_show_header(run.info, t, experiment, tracking_uri), *_show_inputs(p, t), *_show_results(p, t, m, report)]
    # each line through pipeline.errors.shown: the store's params and tags hold names and paths from configs and
    # artifacts, whose control characters and terminal escapes are printed escaped (a line holds no newline of ours)
    return "\n".join(shown(line, SHOWN_LINE_CHARS) for line in lines)


def _field(label: str, value: Any) -> str:
    return f"  {label:<{_LABEL_WIDTH - 2}}  {value}".rstrip()


def _wrapped(label: str, words: list[str], width: int = 110) -> list[str]:
    """A field whose value is many `key=value` words: wrapped at `width`, the lines after the first indented to
    the value column."""
    import textwrap

    lines = textwrap.wrap(" ".join(words), width - _LABEL_WIDTH, break_long_words=False, break_on_hyphens=False)
    return [_field("" if i else label, line) for i, line in enumerate(lines or [""])]


def aligned(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    """A table as text lines: the header, then one line per row, every column as wide as its widest cell and two
    spaces apart, columns numbered in `right` right-aligned (numbers), the others left-aligned; lines indented by
    two spaces, without trailing spaces.

    >>> aligned(["recipe", "ppl"], [["fp16", "10.0"], ["kivi-2", "12.5"]], right={1})
    ['  recipe   ppl', '  fp16    10.0', '  kivi-2  12.5']
    """
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return ["  " + "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                             for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
            for line in (header, *rows)]


def _show_header(info, t: dict, experiment: str, uri: str) -> list[str]:
    took = f", took {(info.end_time - info.start_time) / 1000:.1f} s" if info.end_time else ""
    lines = [f"MLflow run {info.run_id} {info.run_name!r}: {info.status}",
             _field("store", f"{uri}, experiment {experiment!r} ({info.experiment_id})"),
             _field("started", f"{_when(info.start_time)}{took}"),
             _field("artifacts", info.artifact_uri)]
    if "mlflow.parentRunId" in t:
        lines.append(_field("sweep", f"child of run {t['mlflow.parentRunId']}"))
    if "error" in t:
        lines.append(_field("error", t["error"]))
    return lines


def _recorded_recipe(p: dict):
    """The run's recipe (a QuantConfig) rebuilt from its quant.* params, whose values are strings that OmegaConf
    converts to the schema's types; None where they make no recipe of today's schema (a run recorded before it)."""
    from omegaconf.errors import OmegaConfBaseException

    from stages.recipe import QuantConfig

    tree: dict = {}
    try:
        for key, value in p.items():
            if key.startswith("quant."):
                *parents, leaf = key[len("quant."):].split(".")
                node = tree
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = value
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig), tree))
    except (OmegaConfBaseException, AttributeError, TypeError, ValueError):
        return None


def _show_recipe(p: dict) -> list[str]:
    """The `quant` line: the fields the run's recipe uses (stages.recipe.recipe_fields: no engine.* for kvcalib's
    own recipes, no key.* for a serving library's, no setting that is off), `field=value` as the params hold them;
    then the smooth.* and prefix.* settings when the recipe smooths or has a prefix. Every quant.* param for a run
    whose params make no recipe of today's schema."""
    from stages.recipe import recipe_fields

    q = _recorded_recipe(p)
    if q is None:
        return _wrapped("quant", [f"{k[len('quant.'):]}={v}" for k, v in sorted(p.items()) if k.startswith("quant.")])
    lines = _wrapped("quant", [f"{name}={p.get('quant.' + name, '?')}" for name in recipe_fields(q)])
    for section in ("smooth", "prefix"):
        if getattr(q, section):
            lines += _wrapped(section, [f"{k[len(section) + 1:]}={v}" for k, v in sorted(p.items())
                                        if k.startswith(f"{section}.")])
    return lines


def _show_inputs(p: dict, t: dict) -> list[str]:
    """What produced the run: code, model, data, config."""
    dirty = {"true": " (with uncommitted changes)", "false": ""}.get(t.get("git_dirty", ""), "")
    # the model the run loaded (used_model): its tags, or its params where it failed before the tags were logged; a
    # run recorded before the params held what was used named its conf/model config in model.name
    used = {k: t.get(f"model_{k}", p.get(f"model.{k}")) for k in ("name", "source", "path", "revision", "config",
                                                                  "dtype")}
    revision = f", revision {used['revision']}" if used["revision"] else ""
    return ["code", _field("kvcalib", f"{t.get('kvcalib_version', '?')}, git {t.get('git_sha', 'unknown')}{dirty}"),
            _field("command", f"{t.get('mlflow.source.name', '?')} {t.get('overrides', '')}"),
            _field("run dir", t.get("run_dir", "?")),
            "model", _field("name", f"{used['name'] or '?'} (config {used['config'] or p.get('model.name', '?')})"),
            _field("source", f"{used['source'] or '?'} {used['path'] or ''}{revision}"),
            _field("dtype", used["dtype"] or "?"),
            _field("model sha256", t.get("model_sha256", "-")),
            _field("tokenizer sha256", t.get("tokenizer_sha256", "-")),
            "data", _field("description", t.get("data_description", p.get("data.source", "?"))),
            _field("calibration", f"{p.get('data.n_samples', '?')} x {p.get('data.seq_len', '?')} tokens, "
                                  f"seed {p.get('data.seed', '?')}, sha256 {t.get('calib_sha256', '-')}"),
            _field("evaluation", f"{p.get('data.eval_n_samples', '?')} x {p.get('data.eval_seq_len', '?')} tokens, "
                                 f"sha256 {t.get('eval_sha256', '-')}"),
            "config", _field("recipe", p.get("quant.name", t.get("quant_name", "?"))),
            *_show_recipe(p),
            _field("params", f"{len(p)}; the resolved config is the run's artifact config/config.yaml")]


def _number_cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _run_recipes(t: dict, m: dict) -> list[str]:
    """The evaluated recipes' exact names: the tag `recipes`; for a run recorded before it existed, the names
    in the metric keys (`metric_name`'s spelling)."""
    if t.get(RECIPES_TAG):
        return [r for r in t[RECIPES_TAG].split(",") if r]
    return sorted({k[len("eval."):k.rindex(".")] for k in m if k.startswith("eval.")})


def _show_evaluation(t: dict, m: dict, seq_len: str, n_windows: str = "?") -> list[str]:
    """The evaluation table, one row per recipe by its exact name, sorted by average bits (highest first), and
    what its bits column counts (exporters/ledger.py: the bits the evaluated cache held per element); each interval
    as stages.evaluate.interval_text prints it (n_windows: the param data.eval_n_samples)."""
    from stages.evaluate import BITS_NOTE, interval_text  # the one explanation of the bits column; of an interval

    windows = int(n_windows) if str(n_windows).isdigit() else None

    rows = []
    for recipe in _run_recipes(t, m):
        key = f"eval.{metric_name(recipe)}."
        lo, hi = m.get(f"{key}ppl_ratio_ci95_lo"), m.get(f"{key}ppl_ratio_ci95_hi")
        interval = interval_text([lo, hi], windows) if lo is not None and hi is not None else "-"
        cells = [_number_cell(m.get(key + column), fmt) for _, column, fmt in _EVAL_COLUMNS]
        rows.append((-m.get(f"{key}avg_bits", float("inf")), recipe, [recipe, *cells[:3], interval, *cells[3:]]))
    if not rows:
        return []
    header = ["recipe", *(h for h, _, _ in _EVAL_COLUMNS[:3]), "95% interval", *(h for h, _, _ in _EVAL_COLUMNS[3:])]
    body = [cells for _, _, cells in sorted(rows, key=lambda row: row[:2])]
    return ["evaluation", *aligned(header, body, right={1, 2, 3, 5, 6}),
            f"  windows of {seq_len} tokens; {BITS_NOTE}",
            "  metrics eval.<recipe>.<column>, `+` written `_`: docs/mlflow.md"]


def _show_results(p: dict, t: dict, m: dict, report: list[str]) -> list[str]:
    """What the run computed: stages, evaluation, runtime check, exported artifact, report."""
    lines = []
    stages = [(s, metric_name(s)) for s in t.get("stages", "").split(",") if f"stage.{metric_name(s)}.key" in t]
    if stages:
        rows = [[s, t.get(f"stage.{k}.status", "?"), t[f"stage.{k}.key"][:12],
                 _number_cell(m.get(f"stage.{k}.wall_s"), "{:.1f}"),
                 _number_cell(m.get(f"stage.{k}.peak_rss_mb"), "{:.0f}")] for s, k in stages]
        lines += ["stages", *aligned(["stage", "status", "key", "wall s", "peak MB"], rows, right={3, 4})]
    lines += _show_evaluation(t, m, p.get("data.eval_seq_len", "?"), p.get("data.eval_n_samples", "?"))
    if "runtime_check_status" in t:
        errors = sorted((k[len("runtime_check."):], v) for k, v in m.items() if k.startswith("runtime_check."))
        lines += ["runtime check", *aligned(["status", *(k for k, _ in errors)],
                                            [[t["runtime_check_status"], *(f"{v:.3g}" for _, v in errors)]],
                                            right=set(range(1, len(errors) + 1)))]
    if "artifact_dir" in t or "manifest_sha256" in t:
        name = Path(t["artifact_dir"]).name if "artifact_dir" in t else "-"
        lines += ["artifact", _field("folder", f"{t.get('artifact_dir', '-')} (the run's artifact {name}/)"),
                  _field("manifest sha256", t.get("manifest_sha256", "-")),
                  _field("format version", t.get("manifest_format_version", "-"))]
    if report:
        lines += ["report", *(_field("" if i else "files", path) for i, path in enumerate(report))]
    return lines


def _when(ms: int | None) -> str:
    if not ms:
        return "?"
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


__all__ = ["TrackingError", "RunRecorder", "SweepCallback", "tracked_run", "connect", "show_run", "flatten",
           "reap_dead_runs", "owner_tags", "artifact_location", "metric_name", "recipes_tag", "recipe_filter",
           "report_files", "aligned", "REPORT_DIR", "RECIPES_TAG",
           "summary_metrics", "summary_tags", "evaluation_table", "recipe_columns", "table_rows", "table_frame",
           "dataset_inputs", "TABLE_FILE", "git_state", "ENV_PARENT_RUN"]
