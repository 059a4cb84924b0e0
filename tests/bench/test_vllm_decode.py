"""bench/vllm_decode.py against real vLLM (.venv-vllm): on a tiny packed checkpoint with a recent window, `auto`
and the plugin each decode one request and a batch of distinct requests; the figures come out of the engine (the
plugin's launches served several sequences at once) and the JSON holds what was printed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.vllm_runs import DEFAULT_VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not Path(DEFAULT_VLLM_PYTHON).is_file(),
                                reason=f"no vLLM environment at {DEFAULT_VLLM_PYTHON} (bash scripts/install-vllm.sh)")


def test_decode_speed_of_auto_and_the_plugin_on_distinct_requests(tmp_path):
    from tests.serving.test_vllm_plugin import WINDOW_RECIPES, tiny_packed

    ckpt, _, _, _ = tiny_packed(tmp_path, WINDOW_RECIPES)
    text = tmp_path / "wikitext"   # the bench's text: test.txt of a wikitext folder ($KVCALIB_WIKITEXT)
    text.mkdir()
    words = " ".join(f"word{i % 97} of line {i}" for i in range(3000))
    (text / "test.txt").write_text(words)
    (text / "valid.txt").write_text(words)
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, "-m", "bench.vllm_decode", "--checkpoint", str(ckpt), "--context", "300",
                           "--tokens", "4", "--batch", "3", "--kv-bytes", str(64 << 20), "--json", str(out),
                           "--profile", str(tmp_path / "prof")],
                          capture_output=True, text=True, cwd=str(ROOT), timeout=900,
                          env={**os.environ, "KVCALIB_WIKITEXT": str(text), "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        assert r["auto"]["tokens_per_s"] > 0 and r["packed"]["tokens_per_s"] > 0
        assert r["ratio"] == pytest.approx(r["packed"]["tokens_per_s"] / r["auto"]["tokens_per_s"])
        assert f"{r['ratio']:.3f}" in proc.stdout
    assert 0 < res["rows"][1]["packed"]["new_tokens"] <= 3 * 4   # the steps once every request has its first
    stats = res["plugin_stats"]
    assert stats["kernel_rows"] > stats["kernel_calls"] and stats["window_misses"] == 0
    for kind in ("auto", "packed"):   # --profile: the decode steps of each run, by function
        for b in (1, 3):
            assert (tmp_path / f"prof.{kind}.b{b}").is_file()
            assert f"-- profile of {kind}, batch {b}" in proc.stdout
    packed = proc.stdout.split("-- profile of packed, batch 1")[1]
    assert "vllm_backend.py" in packed and "cpu_attention.py" in packed   # the plugin and its kernel's call
