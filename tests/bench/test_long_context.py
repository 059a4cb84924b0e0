"""bench.long_context end to end on the tiny model: long evaluation windows, windowed recipes, the per-layer policy
at a budget and passkey retrieval per length, written to the JSON the README's tables come from."""
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.long_context import passkey_by_length, target_report

ROOT = Path(__file__).resolve().parents[2]


def test_passkey_by_length_counts_depths_per_length():
    cells = {"1024@0.1": 1, "1024@0.5": 0, "8192@0.1": 1, "2048@0.9": 1}
    assert passkey_by_length(cells) == {"1024": 0.5, "2048": 1.0, "8192": 1.0}
    assert list(passkey_by_length(cells)) == ["1024", "2048", "8192"]  # by length, not as strings


def test_targets_pick_the_best_recipe_of_ours_at_no_more_bits():
    row = lambda bits, lo, hi: {"avg_bits": bits, "ppl_ratio": (lo + hi) / 2, "ppl_ratio_ci95": [lo, hi]}  # noqa: E731
    recipes = {"a": row(4.4, 1.001, 1.003), "b": row(2.9, 1.01, 1.05), "c": row(2.4, 1.05, 1.06), "peer": row(2.0, 1.0, 1.0)}
    recipes["d"] = row(3.4, 1.009, 1.0130)
    lines = target_report(recipes, ["a", "b", "c", "d"])
    assert lines[0].startswith("<= 4.5 bits: best a (4.400 bits)") and lines[0].endswith("met")
    assert lines[1].startswith("<= 3.5 bits: best d") and "midpoint 1.0110 vs target 1.01: NOT met" in lines[1]
    assert lines[2].startswith("<= 3.0 bits: best b") and "midpoint 1.0300 vs target 1.03: met" in lines[2]
    assert lines[3].startswith("<= 2.5 bits: best c") and "midpoint 1.0550 vs target 1.08: met" in lines[3]


def test_bench_long_context_on_the_tiny_model(tmp_path):
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    data = tmp_path / "wikitext"
    data.mkdir()
    (data / "valid.txt").write_text(text[: len(text) // 2])
    (data / "test.txt").write_text(text[len(text) // 2 :])
    out = tmp_path / "long.json"
    recipes = "kvquant-2b-1pct,kvquant-2b-1pct+sink16+recent128,kivi-2"
    cmd = [sys.executable, "-m", "bench.long_context", "--model", "tiny", "--seq-len", "512", "--calib-seq-len", "64",
           "--n-samples", "2", "--eval-n-samples", "2", "--recipes", recipes, "--budgets", "16",
           "--passkey-lengths", "256,512", "--passkey-depths", "0.5", "--cache-dir", str(tmp_path / "cache"),
           "--export-dir", str(tmp_path / "runs"), "--export-budgets", "16", "--json", str(out)]
    env = {**os.environ, "KVCALIB_WIKITEXT": str(data)}
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got["seq_len"], got["windows"], got["calib"]) == (512, 2, {"n_samples": 2, "seq_len": 64})
    rows = got["recipes"]
    assert {"fp16", "kvquant-2b-1pct", "kvquant-2b-1pct+sink16+recent128", "kivi-2", "mixed-16b"} <= set(rows)
    for name, r in rows.items():
        assert {"ppl_ratio", "ppl_ratio_ci95", "avg_bits", "passkey", "kl_buckets"} <= set(r), name
        assert set(r["passkey"]) == {"256", "512"}, name
        lo, hi = r["ppl_ratio_ci95"]
        assert lo <= r["ppl_ratio"] * (1 + 1e-12) and r["ppl_ratio"] <= hi * (1 + 1e-12)
    # the windows' fp16 rows are counted over the window: more bits than the same recipe without them
    assert rows["kvquant-2b-1pct+sink16+recent128"]["avg_bits"] > rows["kvquant-2b-1pct"]["avg_bits"] + 1.5
    # budget 16: every layer on the most precise option
    assert set(got["layer_policy"]["mixed-16b"]["choice"]) == {"kvquant-4b-1pct+sink16+recent128"}
    assert "KL per eighth of the window" in run.stdout and "passkey: fraction of depths retrieved" in run.stdout
    # the exported per-layer policy: the artifact a run writes, checked, with the figures the table printed
    manifest = json.loads((tmp_path / "runs" / "mixed-16b" / "artifact" / "manifest.json").read_text())
    assert manifest["runtime_check"]["status"] == "passed", manifest["runtime_check"]
    assert "runtime check passed" in run.stdout
    summary = json.loads((tmp_path / "runs" / "mixed-16b" / "summary.json").read_text())
    assert summary["mixed"]["recipe"]["ppl_ratio"] == rows["mixed-16b"]["ppl_ratio"]
    assert summary["mixed"]["layer_policy"]["seq_len"] == 512
