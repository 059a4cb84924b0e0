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
