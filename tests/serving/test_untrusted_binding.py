"""An artifact from a stranger meets the serving path (issue 51, items 1 and 2): load_artifact(DIR) without the
model check, then ArtifactCache / serving.generate. The artifact is bound to the model it is served with before any
kernel sees it (serving.cache.bind: the manifest's shapes and RoPE against stages.hooks.config_binding, every
calibrated tensor against the model's heads x head_dim); int16 outlier indices never wrap (exporters.layout
MAX_ROW_ENTRIES); and the C library is reached only through checks of every buffer it reads
(serving/cpu_attention.py), with guards of its own where an index comes from the data. Run under AddressSanitizer
too (`make test-asan`): without these checks the cases below read or write outside their buffers."""
import ctypes
from dataclasses import replace

import pytest
import torch

from exporters import manifest as mf
from exporters.codec import CachePolicy, TensorPolicy, encode
from exporters.errors import InputError
from exporters.layout import MAX_ROW_ENTRIES, PagedBlock, StoredBlock, store
from exporters.manifest import ModelMismatchError
from exporters.native import load_artifact, write_artifact
from pipeline.check import eval_ids
from pipeline.config import load_recipe
from serving import cpu_attention
from serving.blockwise import generate
from serving.cache import ArtifactCache
from stages import recipe as recipe_stage
from stages.hooks import config_binding

from tests.serving.test_cpu_attention import FORMATS, _synthetic

kernel = pytest.mark.skipif(not cpu_attention.available(),
                            reason=f"the CPU kernel is not built: {cpu_attention.status()['reason']}")
RECIPE = "kvquant-4b-1pct"   # nuq keys with static zero / range and bounds [H, D], per-token values, outliers


@pytest.fixture
def kernel_calls(monkeypatch):
    """Calls into the C library's two entries through their wrappers, counted (the real functions run)."""
    calls = []
    for name in ("encode_rows", "decode_attention"):
        real = getattr(cpu_attention, name)
        monkeypatch.setattr(cpu_attention, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    return calls


def _lying_artifact(tiny, calib, directory, field: str, value: int):
    """The tiny model's artifact written for a model whose n_kv_heads or head_dim is `value`: its tensors of that
    shape, its manifest consistent with them and re-signed (what anyone can make: checksums are no signature)."""
    cut = {"n_kv_heads": (slice(None), slice(0, value)), "head_dim": (slice(None), slice(None), slice(0, value))}
    tensors = {k: (v[cut[field]] if k in ("zero", "range", "lower", "upper", "smooth") else v)
               for k, v in calib["plain"].items()}
    pol = recipe_stage.build_policy(load_recipe(RECIPE), tiny.spec.n_layers, tensors)
    man, out = mf.build_manifest(pol, replace(tiny.spec, **{field: value}), {"data": {}})
    return write_artifact(directory, man, out)


def test_config_binding_is_what_a_manifest_for_the_model_binds(tiny, tiny_gemma3):
    """One definition: the binding of a manifest written for the model (model_json of its spec, through JSON)."""
    import json

    for lm in (tiny, tiny_gemma3):
        written = json.loads(json.dumps(mf.model_json(lm.spec)))
        assert config_binding(lm.model.config) == mf.model_binding(written)
    assert config_binding(tiny_gemma3.model.config)["attention"] == {
        "layer_types": ["sliding", "full", "sliding", "full"], "sliding_window": 16}


@pytest.mark.parametrize("field, value", [("n_kv_heads", 1), ("head_dim", 8)])
def test_an_artifact_for_other_shapes_is_refused_before_any_kernel(tiny, calib, tmp_path, kernel_calls, field,
                                                                   value):
    """Shorter tensors than the model's heads x head_dim would be read past their end by the encoder (zero /
    range) and the decode (static scales): refused, naming the field, the artifact's value and the model's."""
    art = load_artifact(_lying_artifact(tiny, calib, tmp_path / "lie", field, value))   # no model given: loads
    real = getattr(tiny.spec, field)
    with pytest.raises(ModelMismatchError, match=rf"model/{field}={value}; the model given has {field}={real}"):
        ArtifactCache(art.policy, tiny.model)
    with pytest.raises(ModelMismatchError, match=rf"model/{field}={value}"):
        generate(tiny.model, art.policy, eval_ids(tiny.tokenizer, 1, 12), max_new_tokens=3, do_sample=False)
    assert kernel_calls == []
    # the same tensors with the binding taken away (a policy built in memory): refused by their shapes
    h, d = tiny.spec.n_kv_heads, tiny.spec.head_dim
    with pytest.raises(InputError, match=r"layer 0 keys: (zero|range|lower|upper) has shape \[\d+, \d+\]; the model "
                                         rf"given \(n_kv_heads={h}, head_dim={d}\) needs \[{h}, {d}\]"):
        ArtifactCache(replace(art.policy, model=None), tiny.model)


@pytest.mark.parametrize("path, value", [(("rope", "theta"), 5000.0), (("max_positions",), 8192), (("n_q_heads",), 2),
                                         (("rope", "scaling"), {"rope_type": "linear", "factor": 2.0})])
def test_a_re_signed_rope_or_shape_edit_is_refused(tiny, export_recipe, forge, tmp_path, path, value):
    """A forged manifest (edited, re-hashed, re-signed, the tensor file's header rebound) loads without the model
    check; the cache refuses it, naming the field and both values. The truthful artifact is served, and a number
    written as an integer (theta 10000 for 10000.0) is the same number."""
    directory = export_recipe(RECIPE, tmp_path / "a")
    ArtifactCache(load_artifact(directory).policy, tiny.model)

    def edit(man, v=value):
        node = man["model"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = v

    real = config_binding(tiny.model.config)
    for key in path:
        real = real[key]
    forge(directory, edit, rebind=True)
    field = "/".join(path)
    with pytest.raises(ModelMismatchError, match=rf"model/{field}.*; the model given has {field}"):
        ArtifactCache(load_artifact(directory).policy, tiny.model)
    forge(directory, lambda man: edit(man, real), rebind=True)
    ArtifactCache(load_artifact(directory).policy, tiny.model)
    if path == ("rope", "theta"):
        forge(directory, lambda man: edit(man, 10000), rebind=True)
        assert type(load_artifact(directory).policy.model["rope"]["theta"]) is int
        ArtifactCache(load_artifact(directory).policy, tiny.model)


def _kvquant(h: int, d: int, n_layers: int = 2) -> CachePolicy:
    lower, upper = -torch.ones(h, d), torch.ones(h, d)
    k = TensorPolicy(format="nuq", bits=4, axis="channel", outlier_fraction=0.01, codebook=torch.linspace(-1, 1, 16),
                     zero=torch.zeros(h, d), range=torch.ones(h, d), lower=lower, upper=upper)
    return CachePolicy("kvq", [(k, TensorPolicy())] * n_layers, key_rope="pre")


@pytest.mark.parametrize("what", ["zero", "range", "lower", "upper", "codebook", "fp8_scale", "smooth"])
def test_a_policy_shorter_than_the_model_is_refused(tiny, what):
    """A policy built in memory (no binding) whose tensors do not cover the model's 2 kv heads x 16 channels."""
    h, d = tiny.spec.n_kv_heads, tiny.spec.head_dim
    pol = _kvquant(h, d)
    k, v = pol.layers[0]
    if what in ("zero", "range", "lower", "upper"):
        pol = replace(pol, layers=[(replace(k, **{what: torch.zeros(h, d - 1)}), v)] * 2)
        msg = rf"layer 0 keys: {what} has shape \[2, 15\]; the model given \(n_kv_heads=2, head_dim=16\) needs \[2, 16"
    elif what == "codebook":
        pol = replace(pol, layers=[(replace(k, codebook=torch.linspace(-1, 1, 8)), v)] * 2)
        msg = r"layer 0 keys.codebook must hold 2\^bits = 16 levels, got 8"
    elif what == "fp8_scale":
        fp8 = TensorPolicy(format="fp8", bits=8, axis="head", fp8_scale=torch.full((h - 1,), 0.01))
        pol = replace(pol, layers=[(k, fp8)] * 2)
        msg = r"layer 0 values: fp8_scale has shape \[1\]; the model given \(n_kv_heads=2, head_dim=16\) needs \[2\]"
    else:
        pol = replace(pol, smooth=torch.ones(2, 1, d))
        msg = r"smooth has shape \[2, 1, 16\]; the model given needs \[n_layers=2, n_kv_heads=2, head_dim=16\]"
    with pytest.raises(InputError, match=msg):
        ArtifactCache(pol, tiny.model)


def test_prefix_ids_outside_the_vocabulary_are_refused(tiny):
    """A prefix the model would look up past its embedding table (an IndexError deep in the forward before)."""
    vocab = tiny.spec.vocab_size
    pol = replace(_kvquant(tiny.spec.n_kv_heads, tiny.spec.head_dim), prefix_ids=torch.tensor([1, vocab]), prefix_len=2)
    with pytest.raises(InputError, match=rf"prefix token ids must be in \[0, {vocab}\) \(the model's vocabulary\), "
                                         rf"got ids from 1 to {vocab}"):
        ArtifactCache(pol, tiny.model)


# ---- int16 outlier indices ------------------------------------------------------------------------------------

def test_rows_wider_than_int16_indices_are_refused():
    """h * D + d is stored as int16: 128 heads x 256 channels (32768 entries) would wrap to negative indices, which
    the decode writes before its row. store, the cache's pages and the encoder's wrapper refuse it; 32512 entries
    (127 x 256) store every index as it is."""
    assert MAX_ROW_ENTRIES == 32767
    from exporters.vllm_slots import SENTINEL
    assert SENTINEL == MAX_ROW_ENTRIES
    p = TensorPolicy(format="nuq", bits=4, axis="token", outlier_fraction=0.01, codebook=torch.linspace(-1, 1, 16))
    gen = torch.Generator().manual_seed(0)
    msg = (r"n_kv_heads \* head_dim must be at most 32767; got n_kv_heads=128 \* head_dim=256 = 32768")
    wide = torch.randn(1, 128, 1, 256, generator=gen)
    with pytest.raises(InputError, match=msg):
        store(encode(wide, p), p, 0)
    with pytest.raises(InputError, match=msg):
        ArtifactCache(CachePolicy("wide", [(p, p)]), _config_only(128, 256))
    if cpu_attention.available():
        assert cpu_attention._LIB["lib"].kvcalib_max_row_entries() == MAX_ROW_ENTRIES   # the C library's own limit
        with pytest.raises(InputError, match=msg):
            cpu_attention.encode_rows(wide.half(), p, 0)
        with pytest.raises(InputError, match=msg):
            _encode_into(wide, p, 0, None)
    ok = torch.randn(1, 127, 1, 256, generator=gen)
    blk = store(encode(ok, p), p, 0)
    index = blk.tensors["outlier_index"].long()
    assert index.numel() > 0 and int(index.min()) >= 0 and int(index.max()) > 2 ** 14   # late heads, unwrapped


def _config_only(h: int, d: int):
    """A model object with just a Llama config of h kv heads of d channels (bind reads the config, refusing before
    anything else of the model is touched)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    return SimpleNamespace(config=LlamaConfig(num_hidden_layers=1, num_attention_heads=h, num_key_value_heads=h,
                                              head_dim=d, hidden_size=2 * h))


# ---- the C library's wrapper and guards -------------------------------------------------------------------------

SPEC = FORMATS["nuq3-channel+outliers/uniform8-token"] | {"smooth": True}


@kernel
@pytest.mark.parametrize("what", ["range", "zero", "codebook", "lambda", "sink", "recent", "page"])
def test_the_decode_wrapper_refuses_mismatched_buffers(what):
    """Every buffer kvcalib_decode reads is checked against B, H_kv, D and the rows before the call (the kernel
    would read past the end of each one shorter than that: each is its own allocation here, as an artifact's
    tensors are, so AddressSanitizer sees such a read)."""
    inp = _synthetic(SPEC)
    assert cpu_attention.decode_attention(inp).shape == (2, 6, 16)
    k = inp.key_policy
    if what in ("range", "zero"):   # a fresh policy object: the library's view of a policy is made once
        bad = replace(inp, key_policy=replace(k, **{what: getattr(k, what)[:1].clone()}))
        msg = rf"{what}: the CPU kernel reads shape \[2, 16\] for n_kv_heads=2, head_dim=16; got \[1, 16\]"
    elif what == "codebook":
        bad = replace(inp, key_policy=replace(k, codebook=k.codebook[:4].clone()))
        msg = r"codebook: the CPU kernel reads shape \[8\]"
    elif what == "lambda":
        bad = replace(inp, smooth=inp.smooth[:1].clone())
        msg = r"smooth \(lambda\): the CPU kernel reads a contiguous CPU torch.float32 tensor of shape \[2, 16\]"
    elif what in ("sink", "recent"):
        rows = getattr(inp, what)
        bad = replace(inp, **{what: (rows[0][:, :1].clone(), rows[1][:, :1].clone())})
        msg = (r"key page at 1: shape \[2, 2, 8, 16\]; the inputs ask for \[B=2, n_kv_heads=1" if what == "sink"
               else r"recent keys: .*float16 tensor of shape \[2, 2, 2, 16\]; got torch.float16 \[2, 1, 2, 16\]")
    else:   # a page whose outlier lists are shorter than its counts say
        first = inp.k_block.pages[0]
        t = dict(first.tensors)
        t["outlier_index"], t["outlier_value"] = t["outlier_index"][:1].clone(), t["outlier_value"][:1].clone()
        bad = replace(inp, k_block=PagedBlock((StoredBlock(first.start, first.shape, t), *inp.k_block.pages[1:])))
        msg = r"key page at 1 outlier_index: the counts list \d+ outliers.*got torch.int16 of 1"
    with pytest.raises(ValueError, match=msg):   # InputError (a ValueError) from the wrapper
        cpu_attention.decode_attention(bad)


@kernel
def test_the_library_refuses_a_negative_outlier_index_and_a_short_rope_table(monkeypatch):
    """Indices read from the data: a negative stored outlier index (e / D would pick this head, e % D a channel
    before the row: a stack write) and page positions past the RoPE table (a fault planted in the table the
    wrapper hands over: 3 positions short) are refused by the library itself."""
    inp = _synthetic(SPEC)
    first = inp.k_block.pages[0]
    t = dict(first.tensors)
    t["outlier_index"] = torch.full_like(t["outlier_index"], -3)
    bad = replace(inp, k_block=PagedBlock((StoredBlock(first.start, first.shape, t), *inp.k_block.pages[1:])))
    with pytest.raises(InputError, match=r"negative outlier count, offset or index"):
        cpu_attention.decode_attention(bad)
    real = cpu_attention._rope_table
    monkeypatch.setattr(cpu_attention, "_rope_table", lambda rotary, end: real(rotary, end)[:end - 3])
    end = inp.k_block.start + inp.k_block.shape[2]
    with pytest.raises(InputError, match=rf"positions run past the RoPE table's {end - 3} positions"):
        cpu_attention.decode_attention(inp)


@kernel
@pytest.mark.parametrize("what", ["zero", "range", "lower", "lambda", "dtype", "rope"])
def test_the_encode_wrappers_refuse_mismatched_buffers(what):
    """kvcalib_encode reads zero / range / bounds and lambda [H, D] and a RoPE table covering the rows: each checked
    against the rows given (2 heads x 16 channels)."""
    h, d = 2, 16
    p = TensorPolicy(format="nuq", bits=4, axis="channel", outlier_fraction=0.05, codebook=torch.linspace(-1, 1, 16),
                     zero=torch.zeros(h, d), range=torch.ones(h, d), lower=-torch.ones(h, d), upper=torch.ones(h, d))
    x = torch.randn(1, h, 3, d).half()
    lam = None
    assert cpu_attention.encode_rows(x, p, 0) is not None
    if what in ("zero", "range", "lower"):
        p = replace(p, **{what: getattr(p, what)[:1].clone()})
        msg = rf"policy.{what}: the CPU kernel reads a contiguous CPU torch.float32 tensor of shape \[2, 16\]"
    elif what == "lambda":
        lam = torch.ones(1, d)
        msg = r"smooth \(lambda\): the CPU kernel reads .* shape \[2, 16\]; got torch.float32 \[1, 16\]"
    elif what == "dtype":
        with pytest.raises(InputError, match=r"encode_into: one token's rows \[1, H, 1, D\] in float16 or float32, "
                                             r"got torch.bfloat16"):
            _encode_into(x[:, :, :1].bfloat16(), p, 0, None)
        return
    else:
        with pytest.raises(InputError, match=r"encode_into: RoPE table: .* shape \[8, 2, 8\]; got torch.float32 "
                                             r"\[4, 2, 8\]"):
            _encode_into(x[:, :, :1], p, 7, torch.zeros(4, 2, 8))
        return
    with pytest.raises(InputError, match=msg):
        cpu_attention.encode_rows(x, p, 0, lam=lam)


def _encode_into(x, p, start, rope):
    """encode_into one token x [1, H, 1, D] into buffers of its own (codes, fp16 scale / zero, H * D outliers)."""
    h, d = x.shape[1], x.shape[3]
    bufs = [torch.zeros(h, d, dtype=torch.uint8), torch.zeros(h, dtype=torch.float16),
            torch.zeros(h, dtype=torch.float16), torch.zeros(h * d, dtype=torch.int16),
            torch.zeros(h * d, dtype=torch.float16)]
    return cpu_attention.encode_into(x, p, start, rope, *(b.data_ptr() for b in bufs), h * d,
                                     torch.zeros(1, dtype=torch.int16))


@kernel
def test_the_library_refuses_an_encoder_call_beyond_its_limits():
    """kvcalib_encode itself, called without the wrapper (a struct made by hand): rows of 128 x 256 entries with
    per-token outliers return -4 -- nothing encoded, nothing written (the int16 indices and counts would wrap)."""
    lib = cpu_attention._LIB["lib"]
    for h, d, outliers in ((128, 256, 3),):
        x = torch.zeros(1, h, 1, d)
        codes = torch.zeros(h, d, dtype=torch.uint8)
        scale, zero = torch.zeros(h, dtype=torch.float16), torch.zeros(h, dtype=torch.float16)
        count, index, value = (torch.zeros(1, dtype=torch.int16), torch.zeros(h * d, dtype=torch.int16),
                               torch.zeros(h * d, dtype=torch.float16))
        mids = torch.linspace(-1, 1, 15)
        enc = cpu_attention._Enc(x.data_ptr(), 0, (ctypes.c_int64 * 4)(*x.stride()), 1, h, 1, d, 0, None, None,
                                 cpu_attention.FMT_NUQ, 4, 1, 0, mids.data_ptr(), None, None, outliers, 0.01, 0.99,
                                 None, None, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), count.data_ptr(),
                                 index.data_ptr(), value.data_ptr(), h * d, 1)
        assert lib.kvcalib_encode(ctypes.byref(enc)) == -4, (h, d)
        assert int(codes.sum()) == 0 and int(count[0]) == 0
