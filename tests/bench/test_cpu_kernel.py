"""bench/cpu_kernel.py at a small context: every format and thread count is timed (the library's call alone and
the whole decode_attention), the kernel's output is the oracle's, and the JSON holds what was printed."""
import json

import pytest

from bench import cpu_kernel
from serving import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the CPU kernel is not built")


def test_the_kernel_is_timed_per_format_and_equals_the_oracle(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert cpu_kernel.main(["--context", "300", "--formats", "nuq4,nuq3-1pct", "--threads", "1,2", "--reps", "3",
                            "--json", str(out)]) == 0
    res, printed = json.loads(out.read_text()), capsys.readouterr().out
    rows = res["rows"]
    assert res["path"] == "fused" and "fused path" in printed
    assert [(r["format"], r["threads"]) for r in rows] == [("nuq4", 1), ("nuq4", 2), ("nuq3-1pct", 1),
                                                          ("nuq3-1pct", 2)]
    for r in rows:
        assert r["kernel_ms"] > 0 and r["call_ms"] >= r["kernel_ms"] and r["max_rel_err"] < 1e-4
        assert f"kernel {r['kernel_ms']:7.3f} ms" in printed


def test_the_general_path_is_timed_apart(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert cpu_kernel.main(["--context", "100", "--formats", "nuq2", "--threads", "1", "--reps", "2", "--general",
                            "--json", str(out)]) == 0
    assert json.loads(out.read_text())["path"] == "general" and "general path" in capsys.readouterr().out


def test_an_unknown_format_is_refused_naming_the_allowed(capsys):
    with pytest.raises(SystemExit):
        cpu_kernel.main(["--formats", "nuq5"])
    assert "allowed nuq2, nuq3, nuq4" in capsys.readouterr().err
