"""The runtime check on tiny-model artifacts: passes for every recipe, fails for each planted fault."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from exporters import manifest as mf
from exporters.native import load_artifact, write_artifact
from pipeline.config import CheckConfig, load_recipe, recipe_names
from pipeline.errors import UserError
from pipeline.hashing import sha256_file, sha256_tensor
from runtime_check import triton_attention
from runtime_check.cache import StoredBlock
from runtime_check.check import RuntimeCheckError, run_check
from stages import policy as policy_stage
from stages.hooks import attention_layers, forward_hooks

ROOT = Path(__file__).resolve().parents[2]
FAST = CheckConfig(contexts=[170], batches=[2])  # > KIVI's 128 residual + one 32-token group: every path runs


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def calib(tiny, tiny_windows):
    """Calibration tensors every recipe may ask for, from the tiny model's own K / V on text."""
    spec = tiny.spec
    pre_k, vals = {}, {}

    def grab(store, i):
        def hook(_m, _inp, out):
            store[i] = out.view(out.shape[0], out.shape[1], spec.n_kv_heads, spec.head_dim).transpose(1, 2)
        return hook

    hooks = [(a.k_proj, grab(pre_k, i), False) for i, a in enumerate(attention_layers(tiny.model))]
    hooks += [(a.v_proj, grab(vals, i), False) for i, a in enumerate(attention_layers(tiny.model))]
    with torch.no_grad(), forward_hooks(hooks):
        tiny.model(tiny_windows.calib)
    k = torch.stack([pre_k[i] for i in range(spec.n_layers)])              # [L, N, H, T, D]
    v = torch.stack([vals[i] for i in range(spec.n_layers)])
    g = torch.Generator().manual_seed(0)
    half = spec.head_dim // 2
    smooth = (k.abs().amax((1, 3)) ** 0.5).view(spec.n_layers, spec.n_kv_heads, 2, half).amax(2).repeat(1, 1, 2)

    def channel_stats(keys, f=0.01):
        flat = keys.transpose(1, 2).reshape(spec.n_layers, spec.n_kv_heads, -1, spec.head_dim)
        lo, hi = flat.quantile(f / 2, dim=2), flat.quantile(1 - f / 2, dim=2)
        return {"zero": (hi + lo) / 2, "range": (hi - lo) / 2, "lower": lo, "upper": hi}

    out = {"k_absmax": k.abs().amax((1, 3)), "v_absmax": v.abs().amax((1, 3)), "smooth": smooth,
           "prefix_ids": torch.tensor([tiny.spec.bos_token_id])}
    for bits in (2, 3, 4):
        levels = torch.sort(torch.rand(spec.n_layers, 2 ** bits - 2, generator=g) * 1.9 - 0.95).values
        edges = torch.ones(spec.n_layers, 1)
        out[f"k_codebook_{bits}"] = torch.cat([-edges, levels, edges], 1)
        out[f"v_codebook_{bits}"] = out[f"k_codebook_{bits}"].clone()  # separate tensors, as calibration gives
    return {"plain": out | channel_stats(k), "smooth": out | channel_stats(k / smooth[:, None, :, None, :])}


def make_artifact(tmp_path: Path, tiny, calib, recipe: str) -> Path:
    q = load_recipe(recipe)
    pol = policy_stage.build(q, tiny.spec.n_layers, calib["smooth" if q.smooth else "plain"])
    prefix = None
    if q.prefix:
        ids = pol.prefix_ids
        cache = DynamicCache()
        with torch.no_grad():
            tiny.model(ids[None], cache=cache)
        prefix = {"token_ids": ids.tolist(), "k": torch.stack([layer.keys[0] for layer in cache.layers]),
                  "v": torch.stack([layer.values[0] for layer in cache.layers])}
    man, tensors = mf.build_manifest(pol, tiny.spec, {"data": {}}, {}, prefix=prefix)
    return write_artifact(tmp_path / recipe, man, tensors)


def manifest_of(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


@pytest.mark.parametrize("recipe", recipe_names())
def test_check_passes_for_every_recipe(tmp_path, tiny, calib, recipe):
    path = make_artifact(tmp_path, tiny, calib, recipe)
    result = run_check(path, tiny, FAST, log=quiet)
    assert result["status"] == "passed", result
    assert result["max_rel_err"] < 1e-5 and result["interpreter"] == (not torch.cuda.is_available())
    written = manifest_of(path)["runtime_check"]
    assert written["status"] == "passed" and written["tolerance"]["rtol"] == result["tolerance"]["rtol"]
    assert {"max_abs_err", "max_rel_err", "reason", "device", "triton", "contexts", "batches"} <= set(written)
    load_artifact(path, tiny.spec)  # the updated manifest still loads strictly


def _permuted_codebook(inp):
    """The kernel reads a key codebook with its levels reversed; the oracle reads the true one."""
    return triton_attention.decode_attention(replace(inp, key_policy=replace(
        inp.key_policy, codebook=inp.key_policy.codebook.flip(0))))


def _shifted_positions(inp):
    """Encoded keys rotated one position too far."""
    blk = inp.k_block
    return triton_attention.decode_attention(replace(inp, k_block=StoredBlock(blk.start + 1, blk.shape, blk.tensors)))


def _token_major(inp):
    """Cache tensors laid out [B, T, H, ...] in memory but read as the manifest's [B, H_kv, T, ...]."""
    def swap(t):
        return t.transpose(1, 2).contiguous().view(t.shape) if t.dim() == 4 else t

    def block(b):
        return StoredBlock(b.start, b.shape, {n: swap(x) for n, x in b.tensors.items()})

    return triton_attention.decode_attention(replace(
        inp, k_block=block(inp.k_block), v_block=block(inp.v_block), sink=tuple(map(swap, inp.sink))))


@pytest.mark.parametrize("fault", [_permuted_codebook, _shifted_positions, _token_major],
                         ids=["corrupted-codebook", "wrong-rope-positions", "swapped-kv-axes"])
def test_check_fails_on_each_fault(tmp_path, tiny, calib, fault):
    path = make_artifact(tmp_path, tiny, calib, "kvquant-3b-1pct")
    result = run_check(path, tiny, CheckConfig(contexts=[64], batches=[2]), kernel=fault, log=quiet)
    assert result["status"] == "failed" and "error" not in result
    assert result["max_rel_err"] > 10 * result["tolerance"]["rtol"], result["max_rel_err"]  # far outside, not marginal
    assert manifest_of(path)["runtime_check"]["status"] == "failed"


def test_a_kernel_that_raises_is_a_recorded_failure(tmp_path, tiny, calib):
    path = make_artifact(tmp_path, tiny, calib, "int4-token")

    def broken(inp):
        raise ValueError("no such format")

    result = run_check(path, tiny, CheckConfig(contexts=[16], batches=[1]), kernel=broken, log=quiet)
    assert result["status"] == "failed" and "ValueError: no such format" in result["error"]
    with pytest.raises(RuntimeCheckError, match="no such format; see runtime_check"):
        raise RuntimeCheckError(path, result)


def _cli(args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pipeline", "check", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_cli_check_passes_and_refuses_a_tampered_codebook(tmp_path, tiny, calib):
    """`python -m pipeline check DIR [contexts=..] [batches=..]`: 0 when it passes; a codebook whose levels were
    permuted in the file (checksums re-made so only the content is wrong) is refused by the strict loader (2)."""
    path = make_artifact(tmp_path, tiny, calib, "kvquant-4b-1pct")
    out = _cli([str(path), "contexts=[40,170]", "check.batches=[2]"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "runtime check passed" in out.stdout and "context    170 batch 2" in out.stdout
    written = manifest_of(path)["runtime_check"]
    assert written["contexts"] == [40, 170] and written["batches"] == [2] and written["status"] == "passed"
    with pytest.raises(UserError, match=r"each context must be in \[1, 4095\]"):
        run_check(path, tiny, CheckConfig(contexts=[4096]), log=quiet)

    tensors = load_file(str(path / "tensors.safetensors"))
    tensors["layers.0.key.codebook"] = tensors["layers.0.key.codebook"].flip(0).contiguous()
    save_file(tensors, str(path / "tensors.safetensors"))
    man = manifest_of(path)
    man["tensors"]["layers.0.key.codebook"]["sha256"] = sha256_tensor(tensors["layers.0.key.codebook"])
    man["tensor_file"]["sha256"] = sha256_file(path / "tensors.safetensors")
    (path / "manifest.json").write_text(json.dumps(man))
    out = _cli([str(path), "contexts=[32]", "batches=[1]"], tmp_path)
    assert out.returncode == 2 and "codebook must be finite and strictly increasing" in out.stderr


def test_a_failed_check_fails_the_run(tmp_path, monkeypatch):
    """run_pipeline runs the check after export; a disagreement is written to the manifest, then raised."""
    from omegaconf import OmegaConf

    from pipeline.app import run_pipeline
    from pipeline.config import RunConfig, to_typed

    cfg = to_typed(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist([
        "model.name=tiny", "model.source=tiny", "data.n_samples=1", "data.seq_len=16", "data.eval_n_samples=1",
        "data.eval_seq_len=16", "traces.reservoir_size=16", "eval.enabled=false", "tracking.enabled=false",
        "sensitivity.enabled=false", "probes.enabled=false", "gate.enabled=false", "check.contexts=[16]",
        "check.batches=[1]", f"cache_dir={tmp_path / 'cache'}", "quant.name=int4-token", "quant.key.format=uniform",
        "quant.key.bits=4", "quant.key.axis=token", "quant.value.format=uniform", "quant.value.bits=4",
        "quant.value.axis=token"])))
    real = triton_attention.decode_attention
    monkeypatch.setattr(triton_attention, "decode_attention", lambda inp, **kw: real(inp, **kw) * 1.01)
    with pytest.raises(RuntimeCheckError, match="runtime check failed"):
        run_pipeline(cfg, tmp_path / "run", log=quiet, show_progress=False)
    assert manifest_of(tmp_path / "run" / "artifact")["runtime_check"]["status"] == "failed"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["runtime_check"]["status"] == "failed"
