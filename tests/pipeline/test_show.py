"""pipeline/show.py: a layer's policy described in one line, the rotated and clipped values included."""
from pipeline.show import _describe, show_artifact


def test_a_rotated_clipped_value_policy_says_so():
    p = {"format": "uniform", "bits": 2, "axis": "token", "group_size": 0, "zero_point": "min",
         "outliers": {"fraction": 0.0, "rule": "none"}, "rotation": "hadamard", "clip": "mse", "tensors": {}}
    assert _describe(p) == "uniform2 per-token rotated clip mse"
    plain = {k: v for k, v in p.items() if k not in ("rotation", "clip")}
    assert _describe(plain) == "uniform2 per-token"


def test_show_prints_the_rotation_of_an_artifact(make_artifact):
    out = show_artifact(make_artifact("kvquant-2b+sink16+recent32+rotclipv"))
    assert "uniform2 per-token rotated clip mse" in out and "nuq2 per-channel rotated" not in out


HOSTILE = "x\x1b[2J\x1b[31mPASSED\nfake line\r\u2028"


def test_every_string_of_the_artifact_is_printed_escaped(make_artifact, forge):
    """Issue 68, item 4: a re-signed manifest (tensor file's binding following: forge rebind) whose recipe, model
    name, stage names and source path hold a terminal escape and a newline is printed with them escaped; no line of
    the output comes from the newline."""
    def hostile(m):
        m["recipe"] = m["model"]["name"] = m["model"]["architecture"] = HOSTILE
        m["model"]["source"] = {"kind": "local", "path": HOSTILE, "revision": HOSTILE, "config": HOSTILE,
                                "settings": {}}
        m["calibration"] = {"data": {"description": HOSTILE},
                            "stages": {HOSTILE: {"cache_key": HOSTILE, "config_sha256": HOSTILE}}}
        m["evaluation"] = {HOSTILE: {"ppl": 2.0}}

    path = forge(make_artifact("kvquant-4b-1pct"), hostile, rebind=True)
    plain = show_artifact(make_artifact("fp8-e4m3"))
    out = show_artifact(path)
    assert "\x1b" not in out and "\r" not in out and "\u2028" not in out
    assert out.count("\n") == plain.count("\n") + 2   # the source line and the evaluation line: no more
    escaped = "x\\x1b[2J\\x1b[31mPASSED\\nfake line\\r\\u2028"
    assert f"recipe     {escaped}: keys" in out and f"model      {escaped} {escaped}: 2 layers" in out
    assert f"source     local {escaped}, revision {escaped} (config {escaped})" in out
    assert f"stage      {escaped}" in out and f"data       {escaped}: None x None" in out


def test_the_recorded_check_is_shown_as_the_artifacts_claim(make_artifact, forge):
    """A runtime_check record is the artifact's own (re-signable) text: `show` says so and names the command that
    measures it, whether the record says passed or nothing ran (issue 68: `show` printed "check passed / canary ok"
    as if it were a result)."""
    path = make_artifact("kvquant-4b-1pct")
    assert "check      not run (claimed by the artifact; `kvcalib check ARTIFACT` measures it)" in show_artifact(path)
    record = {"status": "passed", "max_abs_err": 1e-7, "max_rel_err": 1e-6, "tolerance": {"atol": 1e-6, "rtol": 2e-4, "criterion": "c"},
              "reason": "r", "device": "cpu", "triton": "3", "interpreter": True, "contexts": [16], "batches": [1],
              "cases": [{"context": 16, "batch": 1, "max_abs_err": 1e-7, "max_rel_err": 1e-6, "worst_layer": 0,
                         "ok": True}],
              "canary": {"tokens": 128, "warmup": 400, "kl": 0.001, "agreement": 0.99, "baseline": "b",
                         "baseline_kl": 0.5, "baseline_agreement": 0.6, "limit": 0.25, "recorded_kl": None, "ok": True,
                         "reason": "passed"}}

    def checked(m):
        m["runtime_check"] = record

    out = show_artifact(forge(path, checked))
    assert "claimed by the artifact, not a result: `kvcalib check ARTIFACT` measures it" in out
    assert "canary     claimed ok: KL 0.001" in out and "(re-measured by `kvcalib check`)" in out


def test_show_says_when_the_recorded_model_predicts_at_chance(export_recipe, forge, tmp_path):
    """From the manifest alone: its fp16 row's perplexity against its model's vocab_size (pipeline.sanity); an artifact
    made before vocab_size was recorded is judged on nothing and says nothing."""
    row = {"ppl": 50701.0, "ppl_ratio": 1.0, "avg_bits": 16.0}
    random_model = export_recipe("kvquant-4b-1pct", tmp_path / "random",
                                 {"fp16": row, "kvquant-4b-1pct": {**row, "ppl": 50705.0, "avg_bits": 4.7}})
    lines = show_artifact(random_model).splitlines()
    warning = next(i for i, line in enumerate(lines) if line.startswith("warning    "))
    assert lines[warning].startswith("warning    the model predicts at chance: fp16 perplexity 50,701 on a "
                                     "49,152-token vocabulary")
    assert lines[warning + 1].startswith("evaluation ppl 50705.000")   # right above the figures it puts in doubt
    sane = export_recipe("kvquant-4b-1pct", tmp_path / "sane", {"fp16": {**row, "ppl": 25.0}})
    assert "warning" not in show_artifact(sane)

    def made_before(m):
        del m["model"]["vocab_size"]

    assert "warning" not in show_artifact(forge(random_model, made_before, rebind=True))
