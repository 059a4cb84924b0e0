"""bench/vllm_formats_check.py: run inside .venv-vllm on small sizes, every vLLM format our codec models is bit-exact
with vLLM's own code (or has no reference, with the reason); its policies are the recipes'; its comparison reports the
first mismatch it is shown; bad arguments exit 2 naming the field. The vLLM run is skipped, with the reason, where the
vLLM environment does not exist (bash scripts/install-vllm.sh)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import vllm_formats_check as vfc
from bench.vllm_serve import DEFAULT_VLLM_PYTHON
from pipeline.config import load_recipe

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "vllm_formats_check.py"
needs_vllm = pytest.mark.skipif(not Path(DEFAULT_VLLM_PYTHON).is_file(),
                                reason=f"no vLLM environment at {DEFAULT_VLLM_PYTHON} (bash scripts/install-vllm.sh)")


def run(python: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(SCRIPT), *args], capture_output=True, text=True, cwd=str(ROOT),
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=timeout)


@needs_vllm
def test_every_modelled_format_is_bit_exact_with_vllm(tmp_path):
    out = tmp_path / "check.json"
    proc = run(DEFAULT_VLLM_PYTHON, "--json", str(out), "--seeds", "1", "--tokens", "8", "--heads", "2",
               "--head-dims", "64", "128")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    by_name = {r["format"]: r for r in res["results"]}
    assert set(by_name) == {*vfc.POLICIES, *vfc.NOT_MODELLED, vfc.LLOYD_MAX}
    for name, r in by_name.items():
        assert r["verified"] is True or (r["verified"] == "no reference" and len(r["reason"]) > 40), (name, r)
    for name in vfc.POLICIES:             # every format the codec models has a reference, and it was compared
        assert by_name[name]["verified"] is True and sum(by_name[name]["compared"].values()) > 0, name
        assert all(":" in f for f in by_name[name]["reference"])
    for name in vfc.NOT_MODELLED:
        assert by_name[name]["verified"] == "no reference" and "CUDA" in by_name[name]["reason"]
    assert by_name[vfc.LLOYD_MAX]["compared"] == {"levels": 48, "midpoints": 44}
    assert "| ultraquant_4bit |" in res["table"] and "| nvfp4 |" in res["table"]


def test_the_checked_policies_are_the_recipes():
    for name, (recipe_name, key, value) in vfc.POLICIES.items():
        q = load_recipe(recipe_name)
        assert (q.key.to_policy(), q.value.to_policy()) == (key, value), name


def test_a_mismatch_names_the_field_the_index_and_both_values():
    tally = vfc.Tally()
    theirs = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    ours = theirs.clone()
    tally.check("key scale", ours, theirs, {"seed": 0})
    assert tally.mismatch is None and tally.compared == {"key scale": 24}
    ours[1, 2, 3] = torch.nextafter(theirs[1, 2, 3], torch.tensor(100.0))    # one ulp off
    tally.check("key decoded", ours, theirs, {"seed": 1})
    m = tally.mismatch
    assert m["field"] == "key decoded" and m["index"] == [1, 2, 3] and m["case"] == {"seed": 1, "row": "constant"}
    assert m["ours"].startswith("23.0000019 (0x41b80001") and m["theirs"].startswith("23 (0x41b80000")
    assert (m["mismatches"], m["of"]) == (1, 24)
    tally.check("value codes", ours, ours, {"seed": 2})   # the first mismatch is kept
    assert tally.mismatch["field"] == "key decoded"
    signed_zero = vfc.Tally()
    signed_zero.check("x", torch.tensor([-0.0]), torch.tensor([0.0]), {})
    assert signed_zero.mismatch is not None           # bits, not ==


@pytest.mark.parametrize("args,message", [
    (["--head-dims", "48"], r"--head-dims must be powers of two >= 32 .* got \[48\]"),
    (["--tokens", "3"], r"--tokens must be >= 8 .* got 3"),
    (["--dtypes", "float32"], r"--dtypes must be among \('float16', 'bfloat16'\), got \['float32'\]"),
    (["--formats", "int2_per_token_head"], r"--formats must be among \('int8_per_token_head', .* got "
                                           r"\['int2_per_token_head'\]"),
])
def test_bad_arguments_exit_2_naming_the_field(tmp_path, args, message):
    proc = run(sys.executable, "--json", str(tmp_path / "x.json"), *args, timeout=120)
    assert proc.returncode == 2
    assert re.search(message, proc.stderr), proc.stderr
    assert not (tmp_path / "x.json").exists()
