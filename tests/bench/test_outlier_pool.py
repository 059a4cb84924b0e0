"""bench.outlier_pool: what a fixed per-token slot and a page's pool leave clamped, on hand-checkable counts, and the
command as docs/vllm.md prints it (a tiny model's artifact, the embedded text as the dev split, passkey prompts)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench.outlier_pool import clamped_pool, clamped_slot

ROOT = Path(__file__).resolve().parents[2]


def test_a_slot_clamps_each_token_a_pool_each_page():
    counts = torch.tensor([[0, 9, 1, 0, 5, 5, 0, 0]])   # two pages of 4 tokens: 10 and 10 outliers
    assert clamped_slot(counts, 4) == 5 + 1 + 1                 # tokens over 4: 9 -> 5, 5 -> 1, 5 -> 1
    assert clamped_pool(counts, 4, 12, 0) == 0                  # each page's 10 fit in 12
    assert clamped_pool(counts, 4, 8, 0) == 2 + 2
    assert clamped_pool(torch.tensor([[3, 3, 3]]), 2, 4, 0) == 2 + 0   # a last page of fewer tokens: padded with 0


def test_the_command_counts_the_dev_split_and_the_passkey_prompts(make_artifact, wikitext_env, tmp_path):
    art = make_artifact("kvquant-4b-1pct")
    out = tmp_path / "pool.json"
    proc = subprocess.run([sys.executable, "-m", "bench.outlier_pool", "--artifact", str(art), "--windows", "2",
                           "--seq-len", "64", "--block", "16", "--passkey-lengths", "96", "--json", str(out)],
                          capture_output=True, text=True, cwd=str(ROOT), timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["texts"]) == {"valid.txt", "passkey prompts"}
    dev = res["texts"]["valid.txt"]
    assert dev["layers"] and all(r["fraction"] == 0.01 for r in dev["layers"])
    assert dev["total"]["outliers"] == sum(r["outliers"] for r in dev["layers"]) > 0
    for r in dev["layers"]:   # a larger pool never clamps more
        clamped = [r["clamped_pool"][k] for k in sorted(r["clamped_pool"], key=float)]
        assert clamped == sorted(clamped, reverse=True)
    assert "clamped by a slot of 16" in proc.stdout and "passkey prompts" in proc.stdout
