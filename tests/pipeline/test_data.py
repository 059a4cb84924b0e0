import pytest
import torch

from pipeline.config import DataConfig
from pipeline.data import build_windows, consecutive_windows, load_texts, random_windows
from pipeline.errors import UserError


def test_random_windows_are_deterministic_and_disjoint():
    ids = torch.arange(100)
    a = random_windows(ids, 4, 10, seed=0)
    b = random_windows(ids, 4, 10, seed=0)
    c = random_windows(ids, 4, 10, seed=1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    starts = sorted(int(w[0]) for w in a)
    assert all(int(w[0]) % 10 == 0 for w in a) and len(set(starts)) == 4  # non-overlapping slots
    assert all(torch.equal(w, torch.arange(int(w[0]), int(w[0]) + 10)) for w in a)


def test_consecutive_windows():
    assert consecutive_windows(torch.arange(25), 2, 10).tolist() == [list(range(10)), list(range(10, 20))]


def test_too_many_windows_names_both_numbers():
    with pytest.raises(UserError, match=r"asked for 11 calibration windows of 10 tokens.*only 10"):
        random_windows(torch.arange(105), 11, 10, seed=0)


@pytest.mark.parametrize("field,value,pattern", [
    ("seq_len", 1, r"data.seq_len must be >= 2 tokens, got 1"),
    ("n_samples", 0, r"data.n_samples must be >= 1, got 0"),
    ("long_n_samples", -1, r"data.long_n_samples must be >= 0 \(0: no long-context evaluation\), got -1"),
    ("source", "s3", r"data.source must be one of \('embedded', 'local', 'hub'\), got 's3'"),
])
def test_bad_data_config(field, value, pattern):
    cfg = DataConfig(**{field: value})
    with pytest.raises(UserError, match=pattern):
        load_texts(cfg)


def test_missing_and_empty_paths(tmp_path):
    with pytest.raises(UserError, match="data.path: no such file or folder .*nope.txt"):
        load_texts(DataConfig(source="local", path=str(tmp_path / "nope.txt")))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(UserError, match="holds no text"):
        load_texts(DataConfig(source="local", path=str(empty)))


def test_embedded_text_halves_are_disjoint_real_english():
    calib, evaluation, desc = load_texts(DataConfig())
    assert len(calib) > 100_000 and len(evaluation) > 100_000 and "pydoc" in desc
    assert calib[-2000:] not in evaluation and " the " in calib


def test_local_folder_uses_the_two_files(tmp_path, tiny):
    (tmp_path / "valid.txt").write_text("alpha beta gamma " * 200)
    (tmp_path / "test.txt").write_text("one two three four " * 200)
    w = build_windows(DataConfig(source="local", path=str(tmp_path), n_samples=2, seq_len=16,
                                 eval_n_samples=2, eval_seq_len=16), tiny.tokenizer)
    calib_vocab, eval_vocab = set(w.calib.flatten().tolist()), set(w.eval.flatten().tolist())
    assert not calib_vocab & eval_vocab
    assert len(w.calib_sha256) == 64 and w.calib_sha256 != w.eval_sha256


def test_jsonl_source(tmp_path, tiny):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join('{"text": "sentence number %d is here."}' % i for i in range(400)))
    w = build_windows(DataConfig(source="local", path=str(f), n_samples=2, seq_len=32, eval_n_samples=1,
                                 eval_seq_len=32), tiny.tokenizer)
    assert w.calib.shape == (2, 32) and w.eval.shape == (1, 32)


def test_long_context_windows_come_from_the_evaluation_text(tmp_path, tiny):
    (tmp_path / "valid.txt").write_text("alpha beta gamma " * 200)
    (tmp_path / "test.txt").write_text("one two three four " * 200)
    base = dict(source="local", path=str(tmp_path), n_samples=2, seq_len=16, eval_n_samples=2, eval_seq_len=16)
    w = build_windows(DataConfig(**base), tiny.tokenizer)
    assert w.long is None and w.long_sha256 is None
    wl = build_windows(DataConfig(**base, long_n_samples=2, long_seq_len=64), tiny.tokenizer)
    assert wl.long.shape == (2, 64) and torch.equal(wl.long[0, :16], wl.eval[0])  # the same text, from its start
    assert torch.equal(wl.calib, w.calib) and torch.equal(wl.eval, w.eval)
    assert wl.data_id != w.data_id  # stage results computed with long windows are keyed apart
    with pytest.raises(UserError, match=r"asked for 99 long-context evaluation \(data.long_n_samples\) windows"):
        build_windows(DataConfig(**base, long_n_samples=99, long_seq_len=64), tiny.tokenizer)


def test_a_short_local_text_names_the_half_that_is_short(tmp_path, tiny):
    """data=local with one file cuts it in halves (calibration, evaluation): the refusal says which half is short,
    what it holds and needs, and that the text was cut in two."""
    f = tmp_path / "mine.txt"
    f.write_text("\n".join(f"line {i} of a short text about nothing much." for i in range(60)))
    base = dict(source="local", path=str(f), n_samples=1, seq_len=32, eval_n_samples=1, eval_seq_len=32)
    build_windows(DataConfig(**base), tiny.tokenizer)
    halves = r": data=local cuts its text in halves at the middle line, the first for calibration and the second for evaluation"
    with pytest.raises(UserError, match=r"asked for 90 calibration windows of 32 tokens \(2880 tokens\), but the "
                                        r"calibration half of '.*mine.txt' holds only \d+ \(\d+ tokens\)" + halves +
                                        r".*; lower data.n_samples or data.seq_len, or give more text"):
        build_windows(DataConfig(**{**base, "n_samples": 90}), tiny.tokenizer)
    with pytest.raises(UserError, match=r"asked for 90 evaluation windows of 32 tokens \(2880 tokens\), but the "
                                        r"evaluation half of '.*mine.txt' holds only \d+ \(\d+ tokens\)" + halves +
                                        r".*; lower data.eval_n_samples or data.eval_seq_len"):
        build_windows(DataConfig(**{**base, "eval_n_samples": 90}), tiny.tokenizer)


def test_a_short_file_of_a_folder_is_named_as_the_file(tmp_path, tiny):
    (tmp_path / "valid.txt").write_text("alpha beta gamma " * 200)
    (tmp_path / "test.txt").write_text("one two three four " * 10)
    with pytest.raises(UserError, match=r"but the evaluation file '.*test.txt' \(data.eval_file\) holds only \d+ "
                                        r"\(\d+ tokens\); lower data.eval_n_samples"):
        build_windows(DataConfig(source="local", path=str(tmp_path), n_samples=2, seq_len=16, eval_n_samples=2,
                                 eval_seq_len=32), tiny.tokenizer)
