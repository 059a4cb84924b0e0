"""Property: every mutation of a real artifact is refused with a ManifestError subclass, or provably harmless --
the loaded policy decodes a fixed K/V tensor bit-identically under every layer's key and value policy, and the
sequence-level fields (sinks, residual, RoPE stage and parameters, smoothing, prefix) are unchanged. A poisoned
tensor, an artifact for another model (refused by the serving cache without the model check, and by the strict
loader with it) and a replaced file are always refused. Nothing crashes or hangs, and `pipeline show` of every
mutated folder exits 0 or 2.

The mutations are a fixed list (bench.manifest_mutations.enumerated): every JSON path of each artifact edited
with each kind of edit and re-signed, unsigned edits, byte edits of both files at fixed positions, poisons, shape
lies and file replacements, so the suite passes or fails the same way on every run. The long random campaign is a
benchmark: `python -m bench.manifest_mutations --examples N --seed S`. Run with `pytest -s` to see the counts."""
import copy
from collections import Counter

import pytest
from safetensors.torch import load

from bench.manifest_mutations import (EDITS, FILE_KINDS, MODES, NATIVE_FILES, NONFINITE, RECORD, RECORD_KINDS,
                                      ROLE_POISONS, SHAPE_FIELDS, Mutation, Original, Tally, enumerated, judge_all,
                                      link_tree, resign, tensor_role, vllm_checkpoint, walk,
                                      write_folder)
from exporters import manifest as mf
from exporters.artifact import parse_artifact, tensor_file_metadata
from exporters.native import load_artifact, update_manifest
from serving.cache import ArtifactCache

RECIPES = ["kvquant-3b-1pct+smooth+prefix", "kivi-2", "fp8-e4m3", "kvquant-2b+sink16+recent32+rotclipv"]


@pytest.fixture(scope="module")
def originals(tmp_path_factory, export_recipe, records, tiny):
    """Per recipe: the artifact with the informative fields filled as a pipeline run fills it, the tiny model it
    was calibrated on, and its vLLM checkpoint where vLLM serves the recipe (fp8-e4m3: vLLM's fp8 cache; the rotated
    windowed recipe: the kvcalib plugin's packed folder)."""
    out = []
    for recipe in RECIPES:
        evaluation = {**records["evaluation"], recipe: {**records["evaluation"]["int4-token"],
                                                        "outlier_fraction_k": 0.011, "outlier_fraction_v": 0.009}}
        here = tmp_path_factory.mktemp("mut")
        path = export_recipe(recipe, here / recipe, evaluation)
        update_manifest(path, runtime_check=records["runtime_check"], gate=records["gate"])
        out.append(Original.of(recipe, (path / "manifest.json").read_bytes(), (path / mf.TENSOR_FILE).read_bytes(),
                               tiny.spec, tiny.model, vllm_checkpoint(path, tiny, here / "vllm")))
    assert [o.checkpoint is not None for o in out] == [False, False, True, True]   # fp8, and the plugin's packed
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
        assert set(modes) == set(MODES) - (set() if o.float_tensors else {"tensor_values_resigned"})   # kivi-2: none
        assert [m.what for m in enumerated(o)] == [m.what for m in enumerated(o)]   # the same list every time


def test_the_new_kinds_cover_every_tensor_field_and_file(originals):
    """NaN in every float tensor, +inf / -inf, each tensor role's own poisons; every shape field; each file of the
    folder (and of the checkpoint) replaced by each kind, and each record entry leaving the folder."""
    for o in originals:
        whats = {m.what for m in enumerated(o)}
        assert all(any(w.startswith(f"nan in {name}[") for w in whats) for name in o.float_tensors), o.name
        roles = {tensor_role(name) for name in o.float_tensors}
        poisons = {w.split(" in ")[0] for w in whats if " in " in w}
        assert poisons == (set(NONFINITE) | {p for r in roles for p in ROLE_POISONS.get(r, ())} if roles else set())
        assert {w.split()[1] for w in whats if w.startswith("model ")} == set(SHAPE_FIELDS)
        assert {f"native {t}: {k}" for t in NATIVE_FILES for k in FILE_KINDS} <= whats
        if o.checkpoint is not None:
            assert {f"checkpoint {t}: {k}" for t in o.checkpoint_files for k in FILE_KINDS} <= whats
            assert {f"checkpoint {RECORD}: {k}" for k in RECORD_KINDS} <= whats
            assert {"model.safetensors", "config.json", "kvcalib/manifest.json", RECORD} <= set(o.checkpoint_files)
    fp8, kvq, rot = originals[2], originals[0], originals[3]
    assert {"fp8_scale"} == {tensor_role(n) for n in fp8.float_tensors}
    assert {"codebook", "zero", "range", "rotation_signs"} == {tensor_role(n) for n in rot.float_tensors}
    assert {"codebook", "zero", "range", "lower", "upper", "smooth", "prefix.k", "prefix.v"} == \
        {tensor_role(n) for n in kvq.float_tensors}


def test_the_forgeries_are_well_formed_so_only_the_check_under_test_refuses(originals, tiny, tmp_path):
    """The re-signing is a tool's: the original tensors re-signed load with the model. Every shape lie loads without
    the model (load_artifact(DIR)): the serving cache's binding is what must refuse it; the truthful artifact is
    served. The unedited folders (the artifact's two files; the checkpoint linked as a file edit links it) load."""
    for o in originals:
        again = resign(copy.deepcopy(o.manifest), load(o.raw_tensors), tensor_file_metadata(o.raw_tensors))
        parse_artifact(*again, o.spec)
        ArtifactCache(parse_artifact(o.raw_manifest, o.raw_tensors).policy, tiny.model)
        lies = [m for m in enumerated(o) if m.mode == "shape_lies_resigned"]
        assert len(lies) == 15
        for m in lies:
            parse_artifact(m.raw_manifest, m.raw_tensors)
        folder = tmp_path / o.name / "native"
        folder.parent.mkdir()
        write_folder(o, Mutation("files", "none", o.raw_manifest, o.raw_tensors), folder)
        load_artifact(folder, o.spec)
        if o.checkpoint is not None:
            copied = tmp_path / o.name / "checkpoint"
            link_tree(o.checkpoint, copied)
            load_artifact(copied, o.spec)


def test_mutations_are_refused_or_harmless(originals, tmp_path):
    tally = Tally()
    judge_all(tally, ((o, m) for o in originals for m in enumerated(o)), tmp_path)
    print("\n" + "\n".join(tally.lines()))
    assert tally.failures == 0, {k: v[:10] for k, v in tally.findings.items()}
    total = tally.total
    assert sum(total[k] for k in ("refused", "harmless")) >= 3000 and total["refused"] > total["harmless"] > 0
    for mode in ("tensor_values_resigned", "shape_lies_resigned", "files"):
        c = tally.counts[mode]
        assert c["refused"] == sum(c.values()) > 30, (mode, c)
    by = tally.refused_by
    assert by["TensorValueError"] == tally.counts["tensor_values_resigned"]["refused"]
    assert by["ArtifactCache: ModelMismatchError"] == by["strict: ModelMismatchError"] == 15 * len(RECIPES)
    assert by["FileKindError"] > 0 and by["FileSizeError"] > 0
