"""bench/decode_profile.py on the tiny model: the profiled steps are the ones after the warm-up, and the kernel's
call (or the torch path where the kernel is not built) shows in the profile. Text: the embedded text
(conftest.wikitext_env), not ../shared/data/wikitext-2."""
from bench import decode_profile


def test_the_profile_counts_the_steps_after_warmup_and_sees_the_attention(capsys, wikitext_env):
    prefill_s, times, stats = decode_profile.profile(None, "int4-token", "tiny", 48, 5, 2, 32)
    assert prefill_s > 0 and len(times) == 3 and all(t > 0 for t in times)
    names = {f"{fn}:{name}" for fn, _, name in stats.stats}
    assert any(n.endswith(("cpu_attention.py:launch", "blockwise.py:attend")) for n in names)
    decode_profile.main(["--model", "tiny", "--recipe", "int4-token", "--context", "48", "--steps", "4", "--warmup",
                         "1", "--chunk", "32", "--top", "5"])
    assert "3 profiled steps" in capsys.readouterr().out
