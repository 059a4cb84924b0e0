"""pipeline/llamacpp.py on hand-made worker output: bits per cache type, ratios to llama.cpp's own f16 with their
intervals, and the run's refusals before anything loads (the worker itself against real llama.cpp:
tests/pipeline/test_llamacpp_worker.py)."""
import math

import pytest

from pipeline.config import ModelConfig
from pipeline.errors import UserError
from pipeline.llamacpp import rows_from
from pipeline.llamacpp_config import LlamaCppConfig, llamacpp_bits, validate, with_reference


def test_bits_are_the_block_formats_averaged_over_k_and_v():
    assert llamacpp_bits("q4_0") == 4.5 and llamacpp_bits("q4_1") == 5.0 and llamacpp_bits("f16") == 16.0
    assert llamacpp_bits("q8_0/q4_0") == (8.5 + 4.5) / 2
    with pytest.raises(UserError, match=r"llamacpp.types: unknown cache type 'q3_k'; allowed: f16, q8_0"):
        llamacpp_bits("q3_k")
    with pytest.raises(UserError, match="llamacpp.types"):
        llamacpp_bits("q8_0/q4_0/f16")
    assert with_reference(["q4_0"]) == ["f16", "q4_0"] and with_reference(["q4_0", "f16"]) == ["q4_0", "f16"]


def test_rows_are_ratios_to_its_own_f16_cache():
    n = 100  # predicted tokens per window
    f16 = [200.0, 300.0, 250.0]
    q4 = [x + n * math.log(1.1) for x in f16]  # exactly log(1.1) more NLL per token: ratio 1.1, interval width 0
    res = {"attn_rot": True, "results": {
        "f16": {"type_k": "f16", "type_v": "f16", "sum_nll": f16, "n_tokens": [n] * 3, "argmax": [[1, 2, 3, 4]] * 3},
        "q8_0/q4_0": {"type_k": "q8_0", "type_v": "q4_0", "sum_nll": q4, "n_tokens": [n] * 3,
                      "argmax": [[1, 2, 0, 0]] * 3}}}
    rows = rows_from(res)
    assert rows["f16"]["ppl_ratio"] == pytest.approx(1.0) and rows["f16"]["ppl_ratio_ci95"] == pytest.approx([1, 1])
    q = rows["q8_0/q4_0"]
    assert q["ppl_ratio"] == pytest.approx(1.1) and q["ppl_ratio_ci95"] == pytest.approx([1.1, 1.1])
    assert q["ppl"] == pytest.approx(math.exp(750.0 / 300) * 1.1) and q["top1"] == pytest.approx(0.5)
    assert (q["type_k"], q["type_v"], q["avg_bits"]) == ("q8_0", "q4_0", 6.5)


def test_the_run_refuses_what_it_cannot_run_before_anything_loads(tmp_path):
    python = tmp_path / "python"
    python.write_text("")
    embedded = ModelConfig()
    validate(LlamaCppConfig(types=["q4_0"], python=str(python)), embedded)  # the embedded GGUF: fine
    with pytest.raises(UserError, match=r"llamacpp.python: no llama.cpp environment at /nowhere/python"):
        validate(LlamaCppConfig(types=["q4_0"], python="/nowhere/python"), embedded)
    with pytest.raises(UserError, match=r"llamacpp.types: unknown cache type 'q2_k'"):
        validate(LlamaCppConfig(types=["q2_k"], python=str(python)), embedded)
    hf = ModelConfig(name="llama3", source="local", path=str(tmp_path))
    with pytest.raises(UserError, match=r"llamacpp.gguf: model.source='local' has no GGUF file of its own"):
        validate(LlamaCppConfig(types=["q4_0"], python=str(python)), hf)
    with pytest.raises(UserError, match=r"llamacpp.gguf: no file at /nowhere/m.gguf"):
        validate(LlamaCppConfig(types=["q4_0"], python=str(python), gguf="/nowhere/m.gguf"), hf)
    with pytest.raises(UserError, match=r"llamacpp.threads must be >= 0"):
        validate(LlamaCppConfig(types=["q4_0"], python=str(python), threads=-1), embedded)
