"""The kvcalib vLLM plugin (serving/vllm_plugin.py, serving/vllm_backend.py) in real vLLM (the CPU build in
.venv-vllm, scripts/install-vllm.sh, which installs the plugin): a packed checkpoint of a tiny random Llama is served
from its slots -- the slots and both attention paths equal the codec's rows, vLLM reports the capacity the page
predicts, the plugin holds every layer's tensors of the artifact, a plain model is served exactly as without the
plugin -- and a damaged artifact or an unservable setting is refused at load, naming it. Skipped, with the reason,
where the vLLM environment does not exist."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.vllm_runs import DEFAULT_VLLM_PYTHON
from exporters import compressed_tensors as ct

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path(DEFAULT_VLLM_PYTHON).is_file(),
                                reason=f"no vLLM environment at {DEFAULT_VLLM_PYTHON} (bash scripts/install-vllm.sh)")
KV_BYTES = 64 << 20


def tiny_packed(tmp, recipes: tuple[str, ...]):
    """A tiny random Llama whose head_dim (32) vLLM's CPU attention takes, an artifact calibrated on its own keys
    and values (codebooks, channel ranges and outlier bounds per layer) whose layer i takes recipes[i % len] (one
    recipe: the recipe itself; several: per-layer bits, as a layer_policy run exports), and its packed checkpoint.
    -> (checkpoint, policy, lm, ids [2, 96])."""
    from dataclasses import replace

    from transformers import DynamicCache

    from exporters.manifest import build_manifest
    from exporters.native import write_artifact
    from exporters.rope import invert_rope, rotary_tables
    from pipeline.config import ModelConfig, TinyModelConfig, load_recipe
    from pipeline.export import write_vllm_checkpoint
    from pipeline.model import load_model
    from stages import recipe as recipe_stage

    lm = load_model(ModelConfig(name="tiny", source="tiny", tiny=TinyModelConfig(hidden_size=128, n_q_heads=4)))
    spec = lm.spec
    assert spec.head_dim == 32
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (2, 96), generator=g)
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(ids, past_key_values=cache, use_cache=True)
    rotary = lm.model.model.rotary_emb
    cos, sin = rotary_tables(rotary, 0, ids.shape[1])
    k = torch.stack([invert_rope(layer.keys.float(), cos, sin) for layer in cache.layers])   # [L, B, H, T, D] pre
    flat = k.transpose(1, 2).reshape(spec.n_layers, spec.n_kv_heads, -1, spec.head_dim)
    lo, hi = flat.quantile(0.005, dim=2), flat.quantile(0.995, dim=2)
    calib = {"zero": (hi + lo) / 2, "range": (hi - lo) / 2, "lower": lo, "upper": hi,
             "k_absmax": k.abs().amax((1, 3)), "v_absmax": torch.stack([x.values for x in cache.layers]).abs().amax((1, 3))}
    for bits in (2, 3, 4):
        levels = torch.sort(torch.rand(spec.n_layers, 2 ** bits - 2, generator=g) * 1.9 - 0.95).values
        edges = torch.ones(spec.n_layers, 1)
        calib[f"k_codebook_{bits}"] = torch.cat([-edges, levels, edges], 1)
        calib[f"v_codebook_{bits}"] = calib[f"k_codebook_{bits}"].flip(1).neg().contiguous() * 0.99
    built = [recipe_stage.build_policy(load_recipe(r), spec.n_layers, calib) for r in recipes]
    policy = built[0]
    if len(built) > 1:
        policy = replace(policy, name="per-layer-test", layers=[built[i % len(built)].layers[i]
                                                                for i in range(spec.n_layers)])
    manifest, tensors = build_manifest(policy, spec, {"data": {}}, {})
    art = write_artifact(tmp / "artifact", manifest, tensors)
    ckpt = write_vllm_checkpoint(tmp / "ckpt", art, lm)
    assert ct.checkpoint_kind(policy) == "packed"
    return ckpt, policy, lm, ids


PACKED_MODEL: list = []   # the packed fixture's model (its weights are the checkpoint's)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-plugin")
    ckpt, policy, lm, ids = tiny_packed(tmp, ("kvquant-4b-1pct",))
    PACKED_MODEL[:] = [lm]
    return ckpt, tmp, policy, ids[0].tolist()


def vllm_worker(folder: Path, job: dict, out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    job_path = out.with_suffix(".job.json")
    job_path.write_text(json.dumps(job))
    return subprocess.run([DEFAULT_VLLM_PYTHON, "-m", "bench.vllm_worker", "--checkpoint", str(folder), "--job",
                           str(job_path), "--out", str(out)], capture_output=True, text=True, cwd=str(ROOT),
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=900)


def run_job(name: str, prompt: list[int], kv: str = "auto") -> dict:
    return {"runs": [{"name": name, "kv_cache_dtype": kv, "dtype": "float32", "kv_cache_memory_bytes": KV_BYTES}],
            "windows": [prompt], "prompts": [prompt[:40]], "max_new_tokens": 8, "scales_only": False}


def test_the_slots_and_both_attention_paths_equal_the_codec(packed):
    ckpt, tmp, _, _ = packed
    out = tmp / "probe.json"
    proc = subprocess.run([DEFAULT_VLLM_PYTHON, str(Path(__file__).with_name("vllm_probe.py")), str(ckpt), str(out)],
                          capture_output=True, text=True, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["overflow"] == {}
    names = [c["name"] for c in res["checks"]]
    assert any(n.startswith("kernel attention over 70") for n in names), names
    for c in res["checks"]:
        assert c["max_abs"] <= 1e-5 * max(1.0, c["scale"]), c


def test_vllm_serves_the_packed_cache_from_its_slots(packed):
    """vLLM with the plugin: every layer bound to its own tensors of the artifact, the capacity the page predicts at
    the same memory as `auto`, its single-token steps through the fused kernel and its prompt through the rows path,
    and a perplexity close to `auto`'s (a 4-bit cache of a random model) -- while `auto` on the same weights without
    the artifact is vLLM's own attention, equal with the plugin installed or not."""
    from bench.vllm_packed import check_held
    from bench.vllm_runs import reference_view
    from exporters import vllm_slots

    ckpt, tmp, policy, prompt = packed
    res = {}
    view = reference_view(ckpt, tmp / "view")
    for name, folder, env in (("packed", ckpt, {}), ("auto", view, {}), ("auto-off", view, {"KVCALIB_VLLM_PLUGIN": "0"})):
        out = tmp / f"{name}.json"
        proc = vllm_worker(folder, run_job(name, prompt), out, env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        res[name] = json.loads(out.read_text())["runs"][0]
    p, a = res["packed"], res["auto"]
    assert check_held(p["held"], policy) == []
    assert all(not h["packed"] for h in a["held"])
    stats = p["plugin_stats"]
    assert stats["kernel_calls"] >= 7 * len(policy.layers) and stats["rows_calls"] >= 2 * len(policy.layers)
    # capacity: vLLM's blocks at the same memory, in the ratio of the pages' bytes (auto: float32 K and V)
    lay = vllm_slots.layout(policy, 2, 32)
    bs = p["block_size"]
    auto_page = bs * 2 * 2 * 32 * 4
    predicted = auto_page / lay.page_bytes(bs)
    assert p["capacity_tokens"] / a["capacity_tokens"] == pytest.approx(predicted, rel=0.02)
    assert predicted > 4
    # the plain model: the plugin changes nothing
    assert a["window_nll"] == res["auto-off"]["window_nll"] and a["greedy"] == res["auto-off"]["greedy"]
    n = len(prompt) - 1
    assert abs(p["window_nll"][0] - a["window_nll"][0]) / n < 0.1, (p["window_nll"], a["window_nll"])


def test_prefix_caching_serves_the_same_tokens(packed):
    """Without a window a slot depends only on its own token's rows and position: a 1,500-token prompt whose full
    blocks come from vLLM's prefix cache on three more requests continues exactly as when it was computed, in one
    chunk and in chunks of 256 tokens, and as our own cache fed the prompt one token at a time (float32)."""
    from serving.blockwise import greedy_stepwise

    ckpt, tmp, policy, _ = packed
    prompt = torch.randint(100, 20000, (1500,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {}
    for name, extra in (("prefix", {}), ("prefix-chunks", {"max_num_batched_tokens": 256, "max_num_seqs": 4})):
        job = run_job(name, prompt) | {"windows": [], "prompts": [prompt], "prefix_caching": True, "again": 3}
        job["runs"][0] |= extra
        proc = vllm_worker(ckpt, job, tmp / f"{name}.json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads((tmp / f"{name}.json").read_text())["runs"][0]
    want = greedy_stepwise(PACKED_MODEL[0].model, policy, prompt, 8)
    for run in runs.values():
        assert run["prefix_caching"] and run["greedy"] == [want] and run["greedy_again"] == [[want]] * 3, run["name"]
        # rows the plugin wrote (2 layers): 1499 + 7 per layer for the first request (the sink row apart, 7 decode
        # steps); each of the three again only what follows the 11 cached blocks of 128: 1500 - 1408 + 7
        assert run["plugin_stats"]["rows_written"] <= 2 * (1506 + 3 * (1507 - 11 * 128)), run["plugin_stats"]


WINDOW_RECIPES = ("kvquant-4b-1pct+sink16+recent32", "kvquant-2b-1pct+sink16+recent32+rotclipv")


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A recipe that carries the quality at long context: fp16 sink and recent rows, a different slot per layer (4 and
    2 bits), the 2-bit layer's values rotated and clipped."""
    tmp = tmp_path_factory.mktemp("vllm-window")
    ckpt, policy, lm, ids = tiny_packed(tmp, WINDOW_RECIPES)
    return ckpt, tmp, policy, lm, ids


def test_the_window_per_layer_slots_and_rotated_values_are_read_as_the_evaluation_reads(windowed):
    """No engine: each layer's rows written by the plugin's forward in vLLM's steps (prefill chunks of 50 and 40 rows,
    decode steps, a chunk of 70 after them) and every query's output against the evaluation's reading -- the sink
    rows and the R most recent rows in fp16, the rest as the codec decodes them -- while reading the rows all decoded
    (a cache without the window) would be far off."""
    ckpt, tmp, policy, _, _ = windowed
    out = tmp / "probe.json"
    proc = subprocess.run([DEFAULT_VLLM_PYTHON, str(Path(__file__).with_name("vllm_probe.py")), str(ckpt), str(out)],
                          capture_output=True, text=True, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["overflow"] == {} and res["window_misses"] == 0
    assert len(res["checks"]) == 2 * len(policy.layers)
    assert any("rotation hadamard" in c["name"] for c in res["checks"])
    for c in res["checks"]:
        assert c["max_abs"] <= 1e-5 and c["contrast"] > 1e-2, c


def test_vllm_serves_the_window_as_the_evaluation_however_the_prompt_is_cut(windowed):
    """vLLM with the plugin serves the windowed, per-layer, rotated recipe: a 200-token window's prompt log-probs
    (vLLM's prefill) sum to the evaluation's NLL of the same artifact on the same window (stages/evaluate.py
    policy_logprobs); the prompt in one chunk and in chunks of 32 tokens gives the same NLL and the same greedy
    tokens, equal to the project's own cache fed the prompt one token at a time (serving.blockwise.greedy_stepwise);
    prefix caching asked for is turned off by the plugin (a cached block holds no fp16 window) and the prompt
    served three more times continues alike; no window row is lost. The prompt: 1,500 tokens, 12 blocks of vLLM's
    128 (the chunks: 47 of 32 tokens), served together with two more (300 and 700 tokens): steps where several
    sequences decode, all of them in one kernel launch per layer, each continuing as when served alone."""
    from serving.blockwise import greedy_stepwise
    from stages.evaluate import policy_logprobs

    ckpt, tmp, policy, lm, _ = windowed
    g = torch.Generator().manual_seed(5)
    window = torch.randint(100, 20000, (200,), generator=g).tolist()
    prompt = torch.randint(100, 20000, (1500,), generator=g).tolist()
    others = [torch.randint(100, 20000, (n,), generator=g).tolist() for n in (300, 700)]
    runs = {}
    for name, extra in (("whole", {}), ("chunks", {"max_num_batched_tokens": 32, "max_num_seqs": 4})):
        job = run_job(name, window) | {"prompts": [prompt, *others], "max_new_tokens": 12}
        job["runs"][0] |= extra
        if name == "whole":   # the prompts four times: once, then three more with prefix caching asked for
            job |= {"prefix_caching": True, "again": 3}
        proc = vllm_worker(ckpt, job, tmp / f"{name}.json")
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        runs[name] = json.loads((tmp / f"{name}.json").read_text())["runs"][0]
    whole, chunks = runs["whole"], runs["chunks"]
    assert whole["prefix_caching"] is False and whole["plugin_stats"]["window_misses"] == 0
    assert chunks["plugin_stats"]["window_misses"] == 0 and chunks["plugin_stats"]["rows_calls"] >= 2 * 5
    ids = torch.tensor([window])
    with torch.no_grad():
        lp = policy_logprobs(lm.model, ids, policy)
    ours = float(-lp[:-1].gather(1, ids[0, 1:, None]).sum())
    for run in (whole, chunks):
        assert run["window_nll"][0] == pytest.approx(ours, rel=2e-5), (run["name"], run["window_nll"], ours)
    want = [greedy_stepwise(lm.model, policy, p, 12) for p in (prompt, *others)]
    assert whole["greedy"] == want and chunks["greedy"] == want and whole["greedy_again"] == [want] * 3
    for run in (whole, chunks):   # some launch served several decoding sequences at once
        assert run["plugin_stats"]["kernel_rows"] > run["plugin_stats"]["kernel_calls"], run["plugin_stats"]
    assert {h["layout"]["value"]["bits"] for h in whole["held"]} == {4, 2}
    # per-layer bits without padding: each layer's page is its own slots' and key outlier pool's size, and vLLM's
    # capacity is the memory (less the window's rings) over the sum of the layers' pages
    from exporters import vllm_slots
    sizes = [vllm_slots.layout(policy, 2, 32, i).slot_bytes for i in range(len(policy.layers))]
    assert len(set(sizes)) == 2 and [h["layout"]["slot_bytes"] for h in whole["held"]] == sizes
    stats = whole["plugin_stats"]
    assert stats["padding_loss"] == 0.0 and [stats["slot_bytes"][str(i)] for i in range(len(sizes))] == sizes
    bs = whole["block_size"]
    pages = [vllm_slots.layout(policy, 2, 32, i).page_bytes(bs) for i in range(len(policy.layers))]
    assert all(p > bs * s for p, s in zip(pages, sizes))   # the keys' static-bound outliers: a pool per page
    fits = (KV_BYTES - stats["window_ring_bytes"]) / sum(pages) * bs
    assert whole["capacity_tokens"] == pytest.approx(fits, rel=0.02)


def test_a_damaged_artifact_is_refused_at_load_naming_the_file(packed):
    import shutil

    ckpt, tmp, _, prompt = packed
    bad = tmp / "damaged"
    shutil.copytree(ckpt, bad)
    tensors = bad / ct.ARTIFACT_DIR / "tensors.safetensors"
    raw = bytearray(tensors.read_bytes())
    raw[-5] ^= 0x40
    tensors.write_bytes(bytes(raw))
    proc = vllm_worker(bad, run_job("damaged", prompt), tmp / "damaged.json")
    assert proc.returncode != 0
    assert ("the checkpoint does not verify: ChecksumError: tensors.safetensors sha256 does not match the manifest"
            in proc.stdout + proc.stderr), proc.stderr[-2000:]


def test_a_mismatched_model_or_setting_is_refused_naming_it(packed):
    import shutil

    ckpt, tmp, _, prompt = packed
    proc = vllm_worker(ckpt, run_job("fp8", prompt, kv="fp8"), tmp / "fp8.json")
    assert proc.returncode != 0
    assert "kv_cache_dtype: the plugin stores the artifact's own packed cache; allowed 'auto', got 'fp8'" in (
        proc.stdout + proc.stderr)
    other = tmp / "one-layer"
    shutil.copytree(ckpt, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (other / "config.json").write_text(json.dumps(config))
    (other / ct.ARTIFACT_DIR / ct.RECORD_FILE).write_text(json.dumps(ct.file_record(other)))   # re-signed
    proc = vllm_worker(other, run_job("one-layer", prompt), tmp / "one-layer.json")
    assert proc.returncode != 0
    assert "model.n_layers: the artifact was calibrated for 2, vLLM's model has 1" in proc.stdout + proc.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
