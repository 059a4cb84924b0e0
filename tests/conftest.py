import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# at most 2 threads (CI's cores), or exactly OMP_NUM_THREADS where it is set: the suite's figures must not depend on
# the thread count (issue 66: run once with OMP_NUM_THREADS=1, once with 2)
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def embedded_wikitext(tmp_path_factory):
    """A folder shaped as the benchmarks' wikitext-2 (bench.common.wikitext_dir) holding the embedded text the
    pipeline ships (data.source=embedded: pydoc_data.topics): valid.txt its calibration half, test.txt its evaluation
    half. Tests give it to the benchmarks through KVCALIB_WIKITEXT, so none reads ../shared/data/wikitext-2 (absent
    from a clone; kept for benchmarks run by hand)."""
    from pipeline.config import DataConfig
    from pipeline.data import load_texts

    calib, evaluation, _ = load_texts(DataConfig(source="embedded"))
    folder = tmp_path_factory.mktemp("embedded-wikitext")
    (folder / "valid.txt").write_text(calib, encoding="utf-8")
    (folder / "test.txt").write_text(evaluation, encoding="utf-8")
    return folder


@pytest.fixture
def wikitext_env(embedded_wikitext, monkeypatch):
    """KVCALIB_WIKITEXT set to embedded_wikitext for this test (its own process and the ones it starts)."""
    monkeypatch.setenv("KVCALIB_WIKITEXT", str(embedded_wikitext))
    return embedded_wikitext


@pytest.fixture(scope="session")
def tiny():
    from pipeline.config import ModelConfig
    from pipeline.model import load_model
    return load_model(ModelConfig(name="tiny", source="tiny"))


@pytest.fixture(scope="session")
def smollm2():
    from pipeline.config import ModelConfig
    from pipeline.model import load_model
    return load_model(ModelConfig())


@pytest.fixture(scope="session")
def tiny_windows(tiny):
    from pipeline.config import DataConfig
    from pipeline.data import build_windows
    return build_windows(DataConfig(n_samples=3, seq_len=48, eval_n_samples=2, eval_seq_len=48), tiny.tokenizer)


@pytest.fixture(scope="session")
def calib(tiny, tiny_windows):
    """Calibration tensors every recipe may ask for, from the tiny model's own K / V on text."""
    from stages.hooks import attention_layers, forward_hooks

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


@pytest.fixture(scope="session")
def export_recipe(tiny, calib):
    """(recipe name, folder[, evaluation]) -> the tiny model's artifact for that recipe written to the folder (the
    prefix K/V included when the recipe has a prefix)."""
    from transformers import DynamicCache

    from exporters import manifest as mf
    from exporters.native import write_artifact
    from pipeline.config import load_recipe
    from stages import recipe as recipe_stage

    def export(recipe: str, directory: Path, evaluation: dict | None = None) -> Path:
        q = load_recipe(recipe)
        pol = recipe_stage.build_policy(q, tiny.spec.n_layers, calib["smooth" if q.smooth else "plain"])
        prefix = None
        if q.prefix:
            ids = pol.prefix_ids
            cache = DynamicCache()
            with torch.no_grad():
                tiny.model(ids[None], cache=cache)
            prefix = {"token_ids": ids.tolist(), "k": torch.stack([layer.keys[0] for layer in cache.layers]),
                      "v": torch.stack([layer.values[0] for layer in cache.layers])}
        man, tensors = mf.build_manifest(pol, tiny.spec, {"data": {}}, evaluation or {}, prefix=prefix)
        return write_artifact(directory, man, tensors)

    return export


@pytest.fixture
def make_artifact(tmp_path, export_recipe):
    """recipe name -> an exported tiny-model artifact folder under tmp_path."""
    return lambda recipe: export_recipe(recipe, tmp_path / recipe)


@pytest.fixture(scope="session")
def forge():
    """(folder, edit of the manifest dict, edit of the tensors dict, rebind) -> rewrites the artifact as a tool
    that keeps every checksum valid would: the edited tensors re-hashed, the tensor file's sha256 re-made, the
    manifest re-signed; with rebind the tensor file's header copy of the decoding fields follows the edit too.
    So exactly the check under test is left to refuse the edit."""
    import hashlib
    import json

    from safetensors.torch import load, save

    from exporters import manifest as mf
    from exporters.checksums import sha256_bytes
    from exporters.artifact import MANIFEST_FILE, tensor_file_metadata

    def rewrite(path, edit=None, edit_tensors=None, rebind=False):
        raw = (path / mf.TENSOR_FILE).read_bytes()
        man, tensors, metadata = json.loads((path / MANIFEST_FILE).read_text()), load(raw), tensor_file_metadata(raw)
        if edit:
            edit(man)
        if edit_tensors:
            edit_tensors(tensors)
            for name in set(tensors) & set(man["tensors"]):
                man["tensors"][name]["sha256"] = sha256_bytes(tensors[name])
        if rebind:
            metadata = mf.bound_metadata(man)
        raw = save(tensors, metadata=metadata)
        (path / mf.TENSOR_FILE).write_bytes(raw)
        man["tensor_file"]["sha256"] = hashlib.sha256(raw).hexdigest()
        (path / MANIFEST_FILE).write_bytes(mf.serialize_manifest(man))
        return path

    return rewrite


@pytest.fixture(scope="session")
def tiny_gemma3():
    """A random 4-layer Gemma 3 (conf/model/tiny-gemma3.yaml): q/k norms before RoPE, local layers 0 and 2 (sliding
    window 16, RoPE base 1000) and global layers 1 and 3 (base 10000), one KV head, head_dim 32."""
    from pipeline.config import ModelConfig, TinyModelConfig
    from pipeline.model import load_model
    return load_model(ModelConfig(name="tiny-gemma3", source="tiny", tiny=TinyModelConfig(
        arch="gemma3", n_layers=4, hidden_size=64, n_q_heads=2, n_kv_heads=1, head_dim=32, sliding_window=16,
        full_every=2)))


@pytest.fixture(scope="session")
def gemma3_270m_copy():
    """The converted copy of Gemma 3 270M (model=gemma3), converted on first use as a run would (about a minute,
    once per environment; scripts/install.sh installs the GGUF packages, so their absence fails here)."""
    from pipeline import convert
    return convert.ensure_converted(convert.GEMMA3_270M)
