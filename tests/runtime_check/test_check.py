"""Kernel vs oracle on tiny-model artifacts (runtime_check/check.py): the bound, the recorded decode inputs, and a
case that passes with the kernel and fails for each planted fault. The check as the pipeline runs it (model,
text, manifest, exit codes) is tests/pipeline/test_check.py."""
from dataclasses import replace

import pytest
import torch

from exporters.layout import StoredBlock
from exporters.native import load_artifact
from pipeline.check import eval_ids
from runtime_check.check import (ATOL, RTOL, KernelFailed, artifact_prefix, check_case, compare, non_finite, record,
                                 tolerance)
from serving import triton_attention


def _timing():
    return {"kernel_s": 0.0, "oracle_s": 0.0}


def _case(tiny, path, context: int, batch: int):
    """(policy, ids [batch, context + 1], prefix) of an artifact, as the check feeds check_case."""
    artifact = load_artifact(path, tiny.spec)
    prefix = artifact_prefix(artifact)
    return artifact.policy, eval_ids(tiny.tokenizer, batch, context + 1), prefix


def test_compare_applies_the_bound():
    oracle = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    assert compare(oracle.clone(), oracle) == {"max_abs_err": 0.0, "max_rel_err": 0.0, "scale": 4.0, "ok": True}
    inside = compare(oracle + 0.9 * RTOL * 4.0, oracle)
    assert inside["ok"] and inside["max_rel_err"] == pytest.approx(0.9 * RTOL, rel=1e-2)  # float32 rounding
    outside = compare(oracle + 1.1 * RTOL * 4.0, oracle)
    assert not outside["ok"] and outside["max_rel_err"] == pytest.approx(1.1 * RTOL, rel=1e-2)
    zeros = torch.zeros(2, 2)
    assert compare(zeros + 0.5 * ATOL, zeros)["ok"] and not compare(zeros + 2 * ATOL, zeros)["ok"]
    for bad in ("nan", "inf"):  # no figure that JSON cannot hold: None, and non_finite says why
        out = torch.tensor([[float(bad), 0.0], [0.0, 0.0]])
        for res in (compare(out, oracle), compare(oracle, out)):
            assert res == {"max_abs_err": None, "max_rel_err": None, "scale": None, "ok": False}
        assert non_finite(out, "kernel") == "the kernel's output holds 1 non-finite values (NaN or inf) of 4"
    assert non_finite(oracle, "oracle") is None


def test_tolerance_states_each_term():
    def manifest(key_format, key_rope, smoothing):
        layer = {"key": {"format": key_format}, "value": {"format": "uniform"}}
        return {"layers": [layer, layer], "cache": {"key_rope": key_rope, "smoothing": smoothing}}

    tol, reason = tolerance(manifest("nuq", "pre", True))
    assert tol["atol"] == ATOL and tol["rtol"] == RTOL and "max|kernel - oracle|" in tol["criterion"]
    assert "formats nuq/uniform" in reason and "in-kernel cos/sin" in reason
    assert "lambda" not in reason  # kernel and oracle both multiply lambda into the decoded keys: no term
    _, plain = tolerance(manifest("fp16", "pre", False))  # fp16 keys are stored post-RoPE whatever key_rope says
    assert "cos/sin" not in plain and "lambda" not in plain and f"rtol={RTOL:g}" in plain
    assert "un-rotated" not in reason and "un-rotated" not in plain
    rotated = manifest("nuq", "pre", False)
    rotated["layers"][1] = {"key": {"format": "nuq"}, "value": {"format": "uniform", "rotation": "hadamard"}}
    assert "rotated values un-rotated once" in tolerance(rotated)[1]


def test_tolerance_reason_states_the_rule_not_a_measurement():
    """The reason goes into every manifest whatever was measured: rule and rationale only, no figures observed
    on some model; measurements live in max_abs_err / max_rel_err / cases."""
    layer = {"key": {"format": "nuq"}, "value": {"format": "nuq"}}
    _, reason = tolerance({"layers": [layer], "cache": {"key_rope": "pre", "smoothing": False}})
    for claim in ("observed", "measured on", "SmolLM2", "tiny", "<="):
        assert claim not in reason, claim
    assert "max_abs_err, max_rel_err and cases" in reason  # where the measured values are


@pytest.mark.parametrize("recipe", ["int4-token", "kvquant-3b-1pct+prefix"])
def test_record_gives_the_decode_step_of_every_layer(tiny, make_artifact, recipe):
    policy, ids, prefix = _case(tiny, make_artifact(recipe), 40, 2)
    inputs = record(tiny, policy, ids, prefix)
    n_prefix = 0 if prefix is None else prefix["ids"].numel()
    assert len(inputs) == tiny.spec.n_layers
    for inp in inputs:
        assert inp.q.shape == (2, tiny.spec.n_q_heads, tiny.spec.head_dim) and inp.q.dtype == torch.float32
        assert inp.length == n_prefix + 41  # the prefix, the 40 prompt rows and the decoded token's own row
    if prefix is not None:  # the prefix rows are served from the artifact, as stored
        sink_k = inputs[0].sink[0][:, :, :n_prefix]
        assert torch.equal(sink_k, prefix["k"][0].to(torch.float16)[None].expand_as(sink_k))


def test_check_case_passes_with_the_kernel(tiny, make_artifact):
    policy, ids, prefix = _case(tiny, make_artifact("kvquant-3b-1pct+smooth+prefix"), 64, 2)
    timing = _timing()
    case = check_case(tiny, policy, ids, prefix, triton_attention.decode_attention, timing)
    assert case["ok"] and case["max_rel_err"] < 1e-5 and 0 <= case["worst_layer"] < tiny.spec.n_layers
    assert set(case) == {"max_abs_err", "max_rel_err", "worst_layer", "ok"}
    assert timing["kernel_s"] > 0 and timing["oracle_s"] > 0


def test_per_channel_value_groups_pass_the_check_end_to_end(tiny, calib, tmp_path):
    """A recipe with per-channel VALUE groups (validate_recipe takes it) is exported, loaded and checked like any
    other: the serving cache flushes whole value groups (and whole key groups), and the kernel decodes the
    values' group scales as the oracle does."""
    from exporters import manifest as mf
    from exporters.native import write_artifact
    from pipeline.config import load_recipe
    from stages import recipe

    q = load_recipe("kivi-4")
    q.name, q.value.axis, q.value.group_size, q.residual, q.n_sink = "kivi-value-groups", "channel", 6, 8, 1
    q.key.group_size = 4  # flush unit lcm(4, 6) = 12
    recipe.validate_recipe(q)
    policy = recipe.build_policy(q, tiny.spec.n_layers, calib["plain"])
    man, tensors = mf.build_manifest(policy, tiny.spec, {"data": {}}, {})
    artifact = load_artifact(write_artifact(tmp_path / "artifact", man, tensors), tiny.spec)
    assert [artifact.manifest["layers"][0]["value"][k] for k in ("axis", "group_size")] == ["channel", 6]
    ids = eval_ids(tiny.tokenizer, 2, 50)
    inputs = record(tiny, artifact.policy, ids, None)
    # the prompt's 49 rows: 1 sink, 48 past it of which 36 (3 units, 6 value groups) flushed and 12 recent; the
    # decoded token's row joins the 12 (flushing in key groups alone would encode 40 rows, a partial value group)
    assert inputs[0].v_block.shape[2] == inputs[0].k_block.shape[2] == 36 and inputs[0].recent[0].shape[2] == 13
    case = check_case(tiny, artifact.policy, ids, None, triton_attention.decode_attention, _timing())
    assert case["ok"] and case["max_rel_err"] < 1e-5, case


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
def test_check_case_fails_on_each_fault(tiny, make_artifact, fault):
    policy, ids, prefix = _case(tiny, make_artifact("kvquant-3b-1pct"), 64, 2)
    case = check_case(tiny, policy, ids, prefix, fault, _timing())
    assert not case["ok"]
    assert case["max_rel_err"] > 10 * RTOL, case["max_rel_err"]  # far outside the bound, not marginal


def test_a_kernel_that_raises_is_kernel_failed(tiny, make_artifact):
    policy, ids, prefix = _case(tiny, make_artifact("int4-token"), 16, 1)

    def broken(inp):
        raise ValueError("no such format")

    with pytest.raises(KernelFailed, match="layer 0: ValueError: no such format"):
        check_case(tiny, policy, ids, prefix, broken, _timing())
