import math
from dataclasses import replace

import pytest
import torch

from exporters.codec import TensorPolicy
from pipeline.config import load_recipe
from stages.traces import TracesConfig
from stages import evaluate
from exporters.codec import CachePolicy


def _policy(name, k, v, n_layers=2, **kw):
    return CachePolicy(name=name, layers=[(k, v)] * n_layers, **kw)


FP16 = TensorPolicy(format="fp16", bits=16)
INT2 = TensorPolicy(format="uniform", bits=2, axis="token")


def test_reference_and_fp16_cache_agree(tiny, tiny_windows):
    w = tiny_windows.eval
    ref = _policy("ref", FP16, FP16)
    # an fp16 cache through the codec path (sink flag forces the quantized attention): tiny rounding only
    via_codec = _policy("codec-fp16", FP16, FP16, n_sink=1, smooth=torch.ones(2, 2, 16))
    r = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, w, [ref, via_codec])).meta["recipes"]
    assert r["ref"]["kl"] == 0 and r["ref"]["top1"] == 1 and r["ref"]["avg_bits"] == 16
    assert r["codec-fp16"]["kl"] < 1e-5 and r["codec-fp16"]["top1"] > 0.98
    assert math.isclose(r["codec-fp16"]["ppl"], r["ref"]["ppl"], rel_tol=1e-3)


def test_residual_window_covering_the_sequence_is_exact(tiny, tiny_windows):
    w = tiny_windows.eval  # T = 48
    full = _policy("all-recent", INT2, INT2, residual=64)
    none = _policy("int2", INT2, INT2)
    half = _policy("int2-r16", INT2, INT2, residual=16)
    r = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, w, [_policy("ref", FP16, FP16), full, none, half])).meta["recipes"]
    assert r["all-recent"]["kl"] < 1e-6 and r["all-recent"]["avg_bits"] == pytest.approx(16.0)
    assert r["int2"]["kl"] > r["int2-r16"]["kl"] > r["all-recent"]["kl"]
    # ledger: int2 per token and head, D = 16: 2 + 2*16/16 = 4 bits per element
    assert r["int2"]["avg_bits"] == pytest.approx(4.0)
    # 16 of 48 rows full precision: (32 * 4 + 16 * 16) / 48
    assert r["int2-r16"]["avg_bits"] == pytest.approx((32 * 4 + 16 * 16) / 48)


def test_pre_rope_identity_path_matches_reference(tiny, tiny_windows):
    """Keys taken pre-RoPE from the k_proj hook and rotated by our RoPE must equal the model's own keys."""
    w = tiny_windows.eval[:1]
    pre = _policy("pre-fp16", FP16, FP16, key_rope="pre", n_sink=1)
    r = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, w, [_policy("ref", FP16, FP16), pre])).meta["recipes"]
    assert r["pre-fp16"]["kl"] < 1e-5


def test_table_lists_every_recipe():
    rows = {"fp16": {"ppl": 10.0, "kl": 0.0, "top1": 1.0, "avg_bits": 16.0, "outlier_fraction_k": 0, "outlier_fraction_v": 0},
            "x": {"ppl": 11.0, "kl": 0.1, "top1": 0.9, "avg_bits": 4.0, "outlier_fraction_k": 0.01, "outlier_fraction_v": 0.0}}
    text = evaluate.table(rows)
    assert "1.1000" in text and text.index("fp16") < text.index("\nx ")


def _served_policy(tiny, calib, name: str) -> CachePolicy:
    """A recipe's policy on the tiny model, shrunk to its 48-token windows: KIVI's group and residual; "value-groups"
    is int4-token with per-channel VALUE groups of 8 (validate_recipe takes them; a residual of 4 is no multiple
    of them); the prefix recipe gets a prefix of 3 tokens, longer than its one sink row; the long-context recipes
    2 sinks and 4 recent rows."""
    from stages import recipe

    q = load_recipe("int4-token" if name == "value-groups" else name)
    if q.key.format == "uniform" and q.key.axis == "channel":  # KIVI: a group and a residual that fit 48 tokens
        q.key.group_size, q.residual = 8, 16
    if q.n_sink + q.residual > 24:  # 16 sinks + 32 recent rows: most of 48 tokens encoded instead
        q.n_sink, q.residual = 2, 4
    if name == "value-groups":
        q.name, q.value.axis, q.value.group_size, q.residual, q.n_sink = name, "channel", 8, 4, 1
        recipe.validate_recipe(q)
    policy = recipe.build_policy(q, tiny.spec.n_layers, calib["smooth" if q.smooth else "plain"])
    if q.prefix:
        policy = replace(policy, prefix_ids=torch.tensor([tiny.spec.bos_token_id, 17, 23]), prefix_len=3)
    return policy


@pytest.mark.parametrize("recipe_name", ["kvquant-4b-1pct", "kivi-2", "int4-token", "fp8-e4m3",
                                         "kvquant-3b-1pct+smooth", "value-groups", "kvquant-3b-1pct+prefix",
                                         "kvquant-2b+sink16+recent32+rotclipv"])
def test_evaluation_is_what_the_serving_cache_computes(tiny, tiny_windows, calib, recipe_name):
    """The logits the evaluation computes for a window equal those of decoding the same tokens one at a time
    through serving/cache.py under the same policy (sink rows in fp16, every other row through the codec
    as stored, the residual buffer's flush rule in whole units of K's and V's groups, a prefix's rows first):
    max |log-prob difference| <= 2e-4 (float32 rounding of two attention implementations; a wrong row
    precision, flush or RoPE convention moves it by >= 1e-3)."""
    from serving.cache import ArtifactCache

    policy = _served_policy(tiny, calib, recipe_name)
    for w in range(2):
        ids = tiny_windows.eval[w : w + 1]
        with torch.no_grad():
            ours = evaluate.policy_logprobs(tiny.model, ids, policy)
            cache = ArtifactCache(policy, tiny.model)
            served = torch.cat([torch.log_softmax(tiny.model(ids[:, i : i + 1], cache=cache).logits[0].float(), -1)
                                for i in range(ids.shape[1])])
        assert (ours - served).abs().max() <= 2e-4, (recipe_name, float((ours - served).abs().max()))
    if policy.prefix_len:  # the prefix's rows stay in fp16: they are the layer's first sink rows
        assert cache.layers[0].sink[0].shape[2] == policy.prefix_len == 3


def test_evaluation_is_what_the_kernels_serve_for_rotated_values(tiny, tiny_windows, calib, monkeypatch):
    """Rotated, clipped values (the evaluation reads sink and residual rows un-rotated, encodes the rest rotated):
    decoding one token at a time through the block-wise cache, whose single-token steps go through the fused CPU
    kernel (the encoded rows' value sum un-rotated apart), gives the evaluation's log-probs within 2e-4."""
    from serving import blockwise, cpu_attention
    from serving.cache import ArtifactCache

    if not cpu_attention.available():
        pytest.skip(f"the CPU kernel is not built: {cpu_attention.status()['reason']}")
    policy = _served_policy(tiny, calib, "kvquant-2b+sink16+recent32+rotclipv")
    assert policy.layers[0][1].rotation == "hadamard" and policy.layers[0][1].rotation_signs is not None
    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda inp, **kw: calls.append(1) or real(inp, **kw))
    ids = tiny_windows.eval[:1]
    with torch.no_grad():
        ours = evaluate.policy_logprobs(tiny.model, ids, policy)
        cache = ArtifactCache(policy, tiny.model, attention="blockwise")
        with blockwise.serving(tiny.model, cache):
            served = torch.cat([torch.log_softmax(tiny.model(ids[:, i : i + 1], cache=cache).logits[0].float(), -1)
                                for i in range(ids.shape[1])])
    assert len(calls) == ids.shape[1] * tiny.spec.n_layers
    assert (ours - served).abs().max() <= 2e-4, float((ours - served).abs().max())


def test_the_outlier_fraction_counts_only_the_layers_that_store_outliers(tiny, tiny_windows, calib, monkeypatch):
    """A mixed per-layer policy with an fp16 layer (layer_policy with an fp16 option): the measured fraction is
    the stored outliers over the elements of the tensors that store outliers -- what the manifest then writes as
    those layers' expected_fraction -- not diluted by the fp16 layer's elements."""
    from exporters import manifest as mf
    from stages import layer_policy, recipe

    q = load_recipe("kvquant-3b-1pct")
    kvq = recipe.build_policy(q, tiny.spec.n_layers, calib["plain"])
    fp16 = CachePolicy("fp16-pre", [(FP16, FP16)] * tiny.spec.n_layers, key_rope=kvq.key_rope, n_sink=kvq.n_sink,
                       residual=kvq.residual)
    mixed = layer_policy.assemble([fp16, kvq], [0, 1], "mixed")  # layer 0 fp16, layer 1 kvquant
    counted = {"k": [0, 0], "v": [0, 0]}
    real = evaluate.fake_quant

    def spy(x, p, where="tensor"):  # the codec's own output, counted here: outliers and elements encoded
        out, e = real(x, p, where)
        if p.outlier_fraction > 0:
            c = counted["k" if where.endswith("keys") else "v"]
            c[0], c[1] = c[0] + e.n_outliers, c[1] + x.numel()
        return out, e

    monkeypatch.setattr(evaluate, "fake_quant", spy)
    r = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, tiny_windows.eval, [mixed])).meta["recipes"]["mixed"]
    n_win, t = tiny_windows.eval.shape
    per_layer = n_win * (t - mixed.n_sink) * tiny.spec.n_kv_heads * tiny.spec.head_dim
    assert counted["k"][1] == counted["v"][1] == per_layer and counted["k"][0] > 0  # layer 1's rows only
    assert r["outlier_fraction_k"] == counted["k"][0] / per_layer
    assert r["outlier_fraction_v"] == counted["v"][0] / per_layer
    man, _ = mf.build_manifest(mixed, tiny.spec, {"data": {}}, {"mixed": r})
    assert "expected_fraction" not in man["layers"][0]["key"]["outliers"]  # fp16: stores none
    assert man["layers"][1]["key"]["outliers"]["expected_fraction"] == counted["k"][0] / per_layer
    assert man["layers"][1]["value"]["outliers"]["expected_fraction"] == counted["v"][0] / per_layer


def test_ppl_ratio_interval_covers_windows_and_seeds():
    ref = torch.tensor([100.0, 120.0, 80.0, 110.0])
    same = evaluate.ppl_ratio_interval(ref[None].clone(), ref, 10)
    assert same == (1.0, 1.0, 1.0)
    shifted = evaluate.ppl_ratio_interval(ref[None] + 1.0, ref, 10)  # +0.1 nats per token on every window
    assert shifted[0] == pytest.approx(math.exp(0.1)) and shifted[1] == pytest.approx(math.exp(0.1))
    noisy = torch.stack([ref + 1.0, ref + 3.0])                       # two seeds disagree: the interval opens
    r, lo, hi = evaluate.ppl_ratio_interval(noisy, ref, 10)
    assert r == pytest.approx(math.exp(0.2)) and lo < r < hi and lo >= math.exp(0.1) - 1e-12


def test_units_count_every_recipe_seed_and_window_and_kl_weighs_by_the_reference(tiny, tiny_windows):
    """meta["units"]: fp16 once per window (the reference's own forward), a quantized recipe once per seed and
    window; the KL of a recipe is sum p_ref (log p_ref - log p) over positions, with p_ref held across recipes."""
    ref, q = _policy("fp16", FP16, FP16), _policy("int2", INT2, INT2)
    w = tiny_windows.eval[:2]
    out = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, w, [ref, q]), evaluate.EvalConfig(perturb_seeds=[1, 2, 3]))
    assert out.meta["units"] == 2 * 1 + 2 * 3
    plain = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, w, [ref, q])).meta["recipes"]["int2"]
    with torch.no_grad():
        kl, per_position = 0.0, torch.zeros(w.shape[1], dtype=torch.float64)
        for i in range(w.shape[0]):
            p_ref = torch.log_softmax(tiny.model(w[i : i + 1]).logits[0].float(), -1)
            logp = evaluate.policy_logprobs(tiny.model, w[i : i + 1], q)
            kl += float((p_ref.exp() * (p_ref - logp)).sum())
            per_position += (p_ref.exp() * (p_ref - logp)).sum(-1).double()
    assert plain["kl"] == pytest.approx(kl / w.numel(), rel=1e-5)
    # KL per eighth of the window: the mean over windows of each span of positions, in order
    spans = torch.tensor_split(per_position / w.shape[0], evaluate.KL_BUCKETS)
    assert plain["kl_buckets"] == pytest.approx([float(x.mean()) for x in spans], rel=1e-4, abs=1e-9)
    assert len(plain["kl_buckets"]) == 8 and plain["kl_buckets"] != plain["kl_buckets"][::-1]


def test_bucket_means_split_positions_in_order():
    assert evaluate.bucket_means(torch.arange(8, dtype=torch.float64), 4) == [0.5, 2.5, 4.5, 6.5]
    assert evaluate.bucket_means(torch.arange(5, dtype=torch.float64), 2) == [1.0, 3.5]  # spans of 3 and 2


def test_query_chunks_read_only_the_rows_their_queries_see(tiny, tiny_windows, monkeypatch):
    """At long context the residual path runs in chunks of queries, each over the rows its queries can see
    (causal): the same log-probabilities as one chunk over every row."""
    w = tiny_windows.eval[:1]  # 48 tokens
    p = _policy("int2-recent8", INT2, INT2, n_sink=2, residual=8)
    whole = evaluate.policy_logprobs(tiny.model, w, p)
    monkeypatch.setattr(evaluate, "QUERY_CHUNK", 7)  # 7 chunks, the last one short
    chunked = evaluate.policy_logprobs(tiny.model, w, p)
    assert torch.allclose(whole, chunked, atol=1e-5, rtol=0)  # the fused path (chunks) vs the materialized one
    ref = evaluate.policy_logprobs(tiny.model, w, _policy("fp16", FP16, FP16))
    assert (whole - ref).abs().max() > 1e-3  # the encoded rows are read: the test can tell a wrong chunk


def test_chunked_attention_reads_only_its_band():
    """chunked_attention by hand: 12 positions, chunks of 4 queries, a sliding window of 3. A NaN in row 0 reaches
    only the chunk whose queries can see it (positions 0-3; row 0 is outside every later query's window), and
    every query's output is the full masked attention's."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=g) for _ in range(3))
    pos = torch.arange(12)
    band = (pos[:, None] >= pos[None]) & (pos[None] > pos[:, None] - 3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=0.5).transpose(1, 2)
    old = evaluate.QUERY_CHUNK
    evaluate.QUERY_CHUNK = 4
    try:
        got = evaluate.chunked_attention(q, k, v, None, 0.5, window=3)
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
        bad = k.clone()
        bad[:, :, 0] = float("nan")
        poisoned = evaluate.chunked_attention(q, bad, v, None, 0.5, window=3)
        causal = evaluate.chunked_attention(q, bad, v, None, 0.5)  # a global layer: every later query reads row 0
    finally:
        evaluate.QUERY_CHUNK = old
    assert poisoned[:, :3].isnan().all() and not poisoned[:, 4:].isnan().any()
    assert torch.equal(poisoned[:, 4:], got[:, 4:])
    assert causal.isnan().all()


def test_long_windows_without_a_residual_run_in_chunks(tiny, tiny_windows, monkeypatch):
    """A long forward (past QUERY_CHUNK positions) runs the recipe without a residual window, and the reference,
    in chunks of queries (chunked_attention, transformers' "serving" masks): the same log-probabilities and
    hidden states as one pass over every row."""
    w = tiny_windows.eval[:1]  # 48 tokens
    p = _policy("int2", INT2, INT2)
    whole = evaluate.policy_logprobs(tiny.model, w, p)
    with torch.no_grad():
        own = tiny.model.model(w, use_cache=False).last_hidden_state[0]
    monkeypatch.setattr(evaluate, "QUERY_CHUNK", 7)
    assert evaluate.long_forward(48) and evaluate.long_mask(48) == "serving"
    chunked = evaluate.policy_logprobs(tiny.model, w, p)
    assert torch.allclose(whole, chunked, atol=1e-5, rtol=0)
    ref = evaluate.policy_logprobs(tiny.model, w, _policy("fp16", FP16, FP16))
    assert (whole - ref).abs().max() > 1e-3  # the encoded rows are read
    with torch.no_grad():
        assert torch.allclose(evaluate.full_precision_hidden(tiny.model, w), own, atol=1e-5, rtol=0)


def test_recipes_evaluated_one_by_one_against_a_stored_reference_equal_the_evaluation_of_all_at_once(
        tiny, tiny_windows, calib):
    """The run's stages (evaluate-reference, evaluate-recipe-<name> each, evaluate putting them together) give the
    very figures and window NLLs fit gives for the recipes together -- ratios, intervals, KL, bits, per-seed
    perplexities -- with the reference's hidden states computed once and read by every recipe."""
    import json

    from stages.base import Context

    ctx = Context(tiny.model, tiny.spec, tiny.tokenizer, tiny_windows.calib, tiny_windows.eval)
    names = ["fp16", "int4-token", "kivi-2", "fp8-e4m3"]
    recipes = {n: _served_policy(tiny, calib, n) for n in names}
    cfg = evaluate.EvalConfig(recipes=names, perturb_seeds=[1, 2])
    together = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, tiny_windows.eval, list(recipes.values())), cfg)
    ref = evaluate.REFERENCE.fit(ctx, {}, evaluate.ReferenceJob(), lambda n=1: None)
    assert ref.tensors["hidden"].shape == (*tiny_windows.eval.shape, tiny.model.config.hidden_size)
    parts = [evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, tiny_windows.eval, [p]), cfg,
                          ref_hidden=ref.tensors["hidden"]) for p in recipes.values()]
    one_by_one = evaluate.combine(parts, cfg)
    assert json.dumps(one_by_one.meta) == json.dumps(together.meta)  # every figure, in the same order
    assert list(one_by_one.tensors) == list(together.tensors)
    assert all(torch.equal(one_by_one.tensors[k], together.tensors[k]) for k in together.tensors)
    assert together.meta["recipes"]["int4-token"]["ppl_ratio"] != 1.0  # a recipe the reference can tell apart
    with pytest.raises(ValueError, match=r"reference's hidden states are for \(1, 48\) windows x positions"):
        evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, tiny_windows.eval, [recipes["fp16"]]), cfg,
                     ref_hidden=ref.tensors["hidden"][:1])


def test_a_recipes_key_holds_its_recipe_and_the_evaluation_knobs_not_the_other_recipes():
    """recipe_job: the comparison list narrowed to the recipe itself, every other knob as configured."""
    from pipeline.config import load_recipe

    q = load_recipe("kivi-2")
    a = evaluate.recipe_job(evaluate.EvalConfig(recipes=["fp16", "kivi-2"], perturb_seeds=[3]), q)
    b = evaluate.recipe_job(evaluate.EvalConfig(recipes=["kivi-2", "fp8-e4m3", "kivi-4"], perturb_seeds=[3]), q)
    assert a == b and a.eval.recipes == ["kivi-2"] and a.eval.perturb_seeds == [3]
    assert evaluate.RECIPE(a).name == evaluate.recipe_stage(q) == "evaluate-recipe-kivi-2"
    assert evaluate.RECIPE(a).deps == ("evaluate-reference", "traces")


def test_combine_takes_a_cached_part_whose_reference_differs_in_the_last_bits_only():
    # a part computed in another process: the same reference hidden states through the float32 head, summed in
    # another order (measured at 8192 tokens: 24439.303579330444 vs 24439.30357837677); another reference is refused
    def part(name, ref):
        meta = evaluate._meta({name: {"ppl": 1.0}}, 2, 8, 2, evaluate.EvalConfig())
        return evaluate.StageResult({"window_nll.reference": torch.tensor(ref, dtype=torch.float64),
                                     f"window_nll.{name}": torch.ones(1, 2, dtype=torch.float64)}, meta)

    ref = [24140.436606407166, 24439.303579330444]
    both = evaluate.combine([part("a", ref), part("b", [24140.436606407166, 24439.30357837677])],
                            evaluate.EvalConfig())
    assert set(both.meta["recipes"]) == {"a", "b"} and both.tensors["window_nll.reference"].tolist() == ref
    with pytest.raises(AssertionError, match="other references"):
        evaluate.combine([part("a", ref), part("b", [24140.436606407166, 24439.31])], evaluate.EvalConfig())


def test_ledger_counts_a_sliding_layer_by_the_rows_it_serves(tiny_gemma3):
    """A sliding layer holds its window's rows when served, not the whole evaluation window: the evaluation's
    ledger agrees with exporters.ledger.predict_bytes over the same windows. Tiny Gemma 3: layers 0 and 2 slide
    over 16 rows, head_dim 32. INT2 per token: 2 + (16 + 16) / 32 = 3 bits; residual 4 rows at 16 bits. At t = 48 a
    sliding layer holds 12 encoded + 4 fp16 rows (100 bits per row-element), a global one 44 + 4 (196)."""
    from exporters.ledger import Ledger, predict_bytes
    from stages.hooks import layer_windows
    m = tiny_gemma3
    policy = _policy("int2-r4", INT2, INT2, n_layers=4, residual=4)
    ids = torch.randint(0, m.model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    ledger = Ledger()
    with torch.no_grad():
        evaluate.policy_hidden(m.model, ids, policy, ledger)
    assert ledger.avg_bits == pytest.approx((2 * 100 + 2 * 196) / (2 * 16 + 2 * 48))
    windows = layer_windows(m.model.config)
    assert windows == [16, None, 16, None]
    h, d = m.spec.n_kv_heads, m.spec.head_dim
    assert ledger.bits / 8 == pytest.approx(predict_bytes(policy, 48, h, d, windows=windows))


def test_the_model_spec_and_the_config_agree_on_windows(tiny_gemma3):
    """Two readings of one fact: the allocation (stages.layer_policy) reads the windows from the ModelSpec the
    manifest is written from, the evaluation's ledger from the model's config; they must give the same list."""
    from stages.hooks import layer_windows
    assert tiny_gemma3.spec.layer_windows() == layer_windows(tiny_gemma3.model.config) == [16, None, 16, None]


def test_an_interval_of_fewer_than_four_windows_is_said_to_be_none():
    """The percentile bootstrap over 2 or 3 windows gives the extreme windows' own ratios as its ends (MIN_INTERVAL_
    WINDOWS): the table says so on every interval it prints, and widens its column for it."""
    assert evaluate.MIN_INTERVAL_WINDOWS == 4
    assert evaluate.interval_text([1.00061, 1.00062], 2) == "[1.0006, 1.0006] (2 windows: not an interval)"
    assert evaluate.interval_text([1.0, 1.1], 1) == "[1.0000, 1.1000] (1 window: not an interval)"
    assert evaluate.interval_text([1.0, 1.1], 4) == evaluate.interval_text([1.0, 1.1]) == "[1.0000, 1.1000]"
    assert evaluate.interval_text(None, 2) == "-"
    fig = {"kl": 0.0, "top1": 1.0, "outlier_fraction_k": 0, "outlier_fraction_v": 0}
    rows = {"fp16": {**fig, "ppl": 10.0, "avg_bits": 16.0, "ppl_ratio": 1.0, "ppl_ratio_ci95": [1.0, 1.0]},
            "x": {**fig, "ppl": 10.006, "avg_bits": 4.0, "ppl_ratio": 1.0006, "ppl_ratio_ci95": [1.00061, 1.00062]}}
    lines = evaluate.table(rows, n_windows=2).splitlines()
    assert "[1.0006, 1.0006] (2 windows: not an interval)" in lines[3]
    assert lines[0].index("KL") + 2 == lines[3].index("0.0000") + 6   # KL still under its header
    assert "not an interval" not in evaluate.table(rows, n_windows=4)


def test_greedy_tokens_take_the_head_chunk_by_chunk(tiny, tiny_windows, monkeypatch):
    """greedy_tokens (the report's changed-token examples): the argmax of the model's own logits, with the head
    applied to 5 positions at a time."""
    w = tiny_windows.eval[:1]
    with torch.no_grad():
        want = tiny.model(w, use_cache=False).logits[0].argmax(-1)
        monkeypatch.setattr(evaluate, "logit_rows", lambda vocab: 5)
        got = evaluate.greedy_tokens(tiny.model, evaluate.full_precision_hidden(tiny.model, w))
    assert got.shape == want.shape and torch.equal(got, want)
