"""Property: every mutation of a real artifact is refused with a ManifestError subclass, or provably harmless --
the loaded policy decodes a fixed K/V tensor bit-identically under every layer's key and value policy, and the
sequence-level fields (sinks, residual, RoPE stage and parameters, smoothing, prefix) are unchanged. Any other
exception fails the test, and so does a single silent acceptance.

The mutations are a fixed list (bench.manifest_mutations.enumerated): every JSON path of each artifact edited
with each kind of edit and re-signed, unsigned edits, and byte edits of both files at fixed positions, so the
suite passes or fails the same way on every run. The long random campaign is a benchmark:
`python -m bench.manifest_mutations --examples N --seed S`. Run with `pytest -s` to see the counts."""
from collections import Counter

import pytest

from bench.manifest_mutations import EDITS, MODES, Original, Tally, enumerated, walk
from exporters import manifest as mf
from exporters.native import update_manifest

RECIPES = ["kvquant-3b-1pct+smooth+prefix", "kivi-2", "fp8-e4m3"]


@pytest.fixture(scope="module")
def originals(tmp_path_factory, export_recipe, records, tiny):
    """Per recipe: the artifact with the informative fields filled as a pipeline run fills them."""
    out = []
    for recipe in RECIPES:
        evaluation = {**records["evaluation"], recipe: {**records["evaluation"]["int4-token"],
                                                        "outlier_fraction_k": 0.011, "outlier_fraction_v": 0.009}}
        path = export_recipe(recipe, tmp_path_factory.mktemp("mut") / recipe, evaluation)
        update_manifest(path, runtime_check=records["runtime_check"], gate=records["gate"])
        out.append(Original.of(recipe, (path / "manifest.json").read_bytes(), (path / mf.TENSOR_FILE).read_bytes(),
                               tiny.spec))
    return out


def test_the_mutations_edit_every_field_with_every_kind_of_edit(originals):
    """Every path deleted, retyped and (null, {} and [] aside) given another value of its type; every object and
    array given a member."""
    for o in originals:
        edits = Counter(m.what for m in enumerated(o) if m.mode == "json_resigned")
        for path, value in walk(o.manifest):
            where = "/".join(map(str, path))
            kinds = {kind for kind in EDITS if edits[f"{kind} {where}"]}
            want = {"delete", "other_type"} | ({"same_type"} if value not in (None, {}, []) else set()) | \
                ({"add"} if isinstance(value, (dict, list)) else set())
            assert kinds >= want, (o.name, where, kinds)
        modes = Counter(m.mode for m in enumerated(o))
        assert set(modes) == set(MODES)
        assert [m.what for m in enumerated(o)] == [m.what for m in enumerated(o)]   # the same list every time


def test_mutations_are_refused_or_harmless(originals):
    tally = Tally()
    for o in originals:
        for m in enumerated(o):
            tally.judge(o, m)
    print("\n" + "\n".join(tally.lines()))
    assert not tally.silent, tally.silent[:10]
    total = tally.total
    assert sum(total.values()) >= 2000 and total["refused"] > total["harmless"] > 0
