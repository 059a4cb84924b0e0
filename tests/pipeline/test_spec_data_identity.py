"""docs/manifest.md, "Data identity": `calib_sha256` and `eval_sha256` recomputed by that section's words alone --
the text read from the files the run's `description` names, the run's tokenizer, the windows cut and the
calibration slots drawn as the section says, and hashlib + struct over the ids -- equal what a real run (model=tiny)
wrote into summary.json and into the artifact's manifest. Nothing here calls pipeline.data or exporters.checksums,
which wrote them; the same ids hashed any other way (another dtype, layout, shape string or window order) differ."""
import hashlib
import json
import re
import struct
from pathlib import Path

import pytest
import torch

from pipeline.app import run_pipeline
from pipeline.config import DataConfig, EvalConfig, ModelConfig, RunConfig, load_recipe

SPEC = Path(__file__).resolve().parents[2] / "docs" / "manifest.md"
SENTENCES = ["The cache holds every row the model has seen so far.", "Keys are rotated before they are stored.",
             "Naïve readers guess; this one reads the spec.", "A window is a run of consecutive token ids."]


def _text(n: int, start: int) -> str:
    """n lines of prose, Windows line ends (the spec reads them as \\n)."""
    return "\r\n".join(f"{i}: {SENTENCES[(start + i) % len(SENTENCES)]}" for i in range(n)) + "\r\n"


# -- the spec's words, one function each ------------------------------------------------------------------------
def read_file(path: Path, text_field: str = "text") -> str:
    """UTF-8, \\r\\n and \\r read as \\n; not .jsonl: the whole text, invalid bytes as U+FFFD; .jsonl: the text_field
    member (as a string) of each non-blank line's object that has one, joined by \\n\\n."""
    if path.suffix == ".jsonl":
        lines = path.read_bytes().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n").split("\n")
        rows = [json.loads(line) for line in lines if line.strip()]
        return "\n\n".join(str(r[text_field]) for r in rows if text_field in r)
    return path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def halves(text: str) -> tuple[str, str]:
    """Cut at the first \\n at or after character len // 2: calibration before it, evaluation from it."""
    cut = text.find("\n", len(text) // 2)
    cut = len(text) // 2 if cut < 0 else cut
    return text[:cut], text[cut:]


def texts(description: str, path: str) -> tuple[str, str]:
    """(calibration text, evaluation text) by the `description` forms of the spec."""
    description = description.split("; each window BOS")[0]
    if description == "embedded:pydoc_data.topics (first half calib, second half eval)":
        import pydoc_data.topics as topics
        return halves("\n\n".join(topics.topics[k] for k in sorted(topics.topics)))
    if m := re.fullmatch(r"local:(.+)\(calib\),(.+)\(eval\)", description):
        return read_file(Path(path) / m[1]), read_file(Path(path) / m[2])
    if m := re.fullmatch(r"local:(.+) \(first half calib, second half eval\)", description):
        assert Path(path).name == m[1]
        return halves(read_file(Path(path)))
    raise AssertionError(f"a description the spec does not list: {description!r}")


def spec_windows(tokenizer, description: str, text: str, n: int, length: int, seed: int | None) -> list[list[int]]:
    """n windows of `length` ids: BOS + length - 1 ids of text when the description says so; consecutive from the
    first id (seed None: evaluation) or the slots torch.randperm(slots, manual_seed(seed))[:n] in that order."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = re.search(r"; each window BOS \((\d+)\) \+ text$", description)
    head = [int(bos[1])] if bos else []
    per = length - len(head)
    if seed is None:
        slots = list(range(n))
    else:
        slots = torch.randperm(len(ids) // per, generator=torch.Generator().manual_seed(seed))[:n].tolist()
    return [head + ids[s * per : (s + 1) * per] for s in slots]


def spec_sha256(windows: list[list[int]], fmt: str = "q", dtype: str = "torch.int64") -> str:
    """sha256 of `torch.int64:(M, L):` + the ids as signed 64-bit little-endian integers, window by window."""
    m, length = len(windows), len(windows[0])
    body = b"".join(struct.pack(f"<{length}{fmt}", *w) for w in windows)
    return hashlib.sha256(f"{dtype}:({m}, {length}):".encode("ascii") + body).hexdigest()


# -- the run -----------------------------------------------------------------------------------------------------
def _source(kind: str, tmp_path: Path) -> DataConfig:
    windows = dict(n_samples=3, seq_len=16, seed=7, eval_n_samples=2, eval_seq_len=24)
    if kind == "embedded":
        return DataConfig(**windows)
    folder = tmp_path / "text"
    folder.mkdir()
    if kind == "folder":  # two whole .txt files, one with an invalid UTF-8 byte
        (folder / "valid.txt").write_bytes(_text(40, 0).encode("utf-8"))
        (folder / "test.txt").write_bytes(b"\xff " + _text(30, 1).encode("utf-8"))
        return DataConfig(name="local", source="local", path=str(folder), **windows)
    rows = [{"text": _text(4, i)} for i in range(20)] + [{"other": 1}]  # a .jsonl file cut in halves
    path = folder / "rows.jsonl"
    path.write_bytes(b"\r\n\r\n".join(json.dumps(r).encode() for r in rows))
    return DataConfig(name="local", source="local", path=str(path), **windows)


@pytest.mark.parametrize("kind", ["embedded", "folder", "jsonl"])
def test_the_window_hashes_are_what_the_spec_says(tmp_path, kind):
    data = _source(kind, tmp_path)
    cfg = RunConfig(model=ModelConfig(name="tiny", source="tiny"), data=data, quant=load_recipe("int4-token"),
                    eval=EvalConfig(recipes=["fp16"]), cache_dir=str(tmp_path / "cache"))
    cfg.traces.reservoir_size = 64
    cfg.check.enabled = cfg.tracking.enabled = cfg.export.vllm = False
    cfg.sensitivity.enabled = cfg.probes.enabled = cfg.gate.enabled = False
    out = run_pipeline(cfg, tmp_path / "run", log=lambda _m: None, show_progress=False)
    written = json.loads((tmp_path / "run" / "summary.json").read_text())["data"]
    manifest = json.loads((Path(out["summary"]["artifact_dir"]) / "manifest.json").read_text())
    assert manifest["calibration"]["data"] == written  # the manifest records the summary's object

    tokenizer, desc = out["model"].tokenizer, written["description"]
    calib_text, eval_text = texts(desc, data.path)
    calib = spec_windows(tokenizer, desc, calib_text, written["n_samples"], written["seq_len"], written["seed"])
    evaluation = spec_windows(tokenizer, desc, eval_text, written["eval_n_samples"], written["eval_seq_len"], None)
    assert (len(calib), len(calib[0]), len(evaluation), len(evaluation[0])) == (3, 16, 2, 24)
    assert spec_sha256(evaluation) == written["eval_sha256"]
    assert spec_sha256(calib) == written["calib_sha256"]

    # the test can fail: the same ids by any other reading of the spec give other hashes
    others = [spec_sha256(evaluation, "i", "torch.int32"), spec_sha256(evaluation, "i"),  # 32-bit ids
              spec_sha256([list(c) for c in zip(*evaluation)]),                            # column-major
              spec_sha256([sum(evaluation, [])]),                                          # one flat window
              hashlib.sha256(b"".join(struct.pack("<24q", *w) for w in evaluation)).hexdigest(),  # no shape string
              hashlib.sha256(json.dumps(evaluation).encode()).hexdigest()]
    assert written["eval_sha256"] not in others
    assert spec_sha256(calib[::-1]) != written["calib_sha256"]                         # windows in another order
    reseeded = spec_windows(tokenizer, desc, calib_text, 3, 16, 0)
    assert reseeded != calib and spec_sha256(reseeded) != written["calib_sha256"]


def test_the_specs_example_hash_is_its_words():
    """The example in the section: [[1, 2, 3], [4, 5, 6]] and the hex it names, computed here from the words."""
    section = SPEC.read_text().split("## Data identity", 1)[1]
    (named,) = re.findall(r"\[\[1, 2, 3\], \[4, 5, 6\]\] hash to\s+`([0-9a-f]{64})`", section)
    assert spec_sha256([[1, 2, 3], [4, 5, 6]]) == named
    assert hashlib.sha256(b"torch.int64:(2, 3):" + struct.pack("<6q", 1, 2, 3, 4, 5, 6)).hexdigest() == named
