"""Text -> token windows. Calibration and evaluation windows always come from disjoint text: one text (data=embedded,
or data=local given one file) is cut in halves at its middle line, the first for calibration and the second for
evaluation; a folder gives a file for each, the hub a split for each. A split too short for its windows is refused
naming which split, the tokens it holds and needs, and (halves) that the text was cut in two (split_text).

Calibration: `n_samples` non-overlapping windows of `seq_len` tokens drawn at random slots (seeded).
Evaluation: the first `eval_n_samples` consecutive non-overlapping windows of the evaluation text.
Long-context evaluation (data.long_n_samples > 0): the first `long_n_samples` consecutive non-overlapping windows of
`long_seq_len` tokens of the same evaluation text (they may overlap the short windows' text: both are evaluation).
A tokenizer that starts every text with BOS (Gemma's: the model expects it at position 0) gets BOS as each window's
first token, followed by seq_len - 1 tokens of text; one that adds nothing (SmolLM2's) gets seq_len tokens of text.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import DataConfig, validate_data
from pipeline.errors import UserError
from exporters.checksums import sha256_tensor

@dataclass
class Windows:
    calib: torch.Tensor        # [N, L] int64
    eval: torch.Tensor         # [M, L_eval] int64
    description: str
    long: torch.Tensor | None = None  # [K, L_long] int64: the long-context evaluation windows (None: none)

    @property
    def calib_sha256(self) -> str:
        return sha256_tensor(self.calib)

    @property
    def eval_sha256(self) -> str:
        return sha256_tensor(self.eval)

    @property
    def long_sha256(self) -> str | None:
        return None if self.long is None else sha256_tensor(self.long)

    @property
    def data_id(self) -> str:
        """What of the data a stage result depends on: every window's token ids (the long ones when present)."""
        from exporters.checksums import sha256_json
        ids = [self.calib_sha256, self.eval_sha256] + ([self.long_sha256] if self.long is not None else [])
        return sha256_json(ids)


def text_file(cfg: DataConfig, calibration: bool) -> Path:
    """The file a local or embedded source's calibration (or evaluation) text is read from: a folder's calib_file
    / eval_file, the one file both halves come from, or the embedded pydoc_data.topics module."""
    if cfg.source == "embedded":
        return Path(importlib.util.find_spec("pydoc_data.topics").origin)
    path = Path(cfg.path).expanduser()
    return path / (cfg.calib_file if calibration else cfg.eval_file) if path.is_dir() else path


def split_text(cfg: DataConfig, calibration: bool) -> tuple[str, str]:
    """(the text the calibration (or evaluation) windows are cut from, how it came to be that text), as a refusal
    says them: the calibration or evaluation half of one text (data=embedded, and data=local given one file:
    load_texts cuts it in halves at its middle line), a folder's calib_file / eval_file, or a hub split."""
    what = "calibration" if calibration else "evaluation"
    if cfg.source == "hub":
        return f"the {what} split {cfg.calib_split if calibration else cfg.eval_split!r} of {cfg.hub_name}", ""
    path = text_file(cfg, calibration)
    if cfg.source == "local" and Path(cfg.path).expanduser().is_dir():
        return f"the {what} file {str(path)!r} (data.{'calib_file' if calibration else 'eval_file'})", ""
    return (f"the {what} half of {str(path)!r}", f"data={cfg.source} cuts its text in halves at the middle line, the "
            f"first for calibration and the second for evaluation, so each half must hold its own windows")


def load_texts(cfg: DataConfig) -> tuple[str, str, str]:
    """(calibration text, evaluation text, a description of where each came from)."""
    validate_data(cfg)
    if cfg.source == "embedded":
        import pydoc_data.topics as topics  # Python's bundled documentation: real English on every machine
        calib, evaluation = _halves("\n\n".join(topics.topics[k] for k in sorted(topics.topics)))
        return calib, evaluation, "embedded:pydoc_data.topics (first half calib, second half eval)"
    if cfg.source == "local":
        path = Path(cfg.path).expanduser()  # present: validate_data refused a missing one (preflight.check_data_path)
        if path.is_dir():
            calib_path, eval_path = text_file(cfg, True), text_file(cfg, False)
            for p in (calib_path, eval_path):
                if not p.is_file():
                    raise UserError(f"data.path={str(path)!r}: missing {p.name} (data.calib_file / data.eval_file)")
            return (read_text(calib_path, cfg.text_field), read_text(eval_path, cfg.text_field),
                    f"local:{calib_path.name}(calib),{eval_path.name}(eval)")
        calib, evaluation = _halves(read_text(path, cfg.text_field))
        return calib, evaluation, f"local:{path.name} (first half calib, second half eval)"
    return _load_hub(cfg)


def read_text(path: Path, text_field: str) -> str:
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        text = "\n\n".join(str(r[text_field]) for r in rows if text_field in r)
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UserError(f"data file {str(path)!r} holds no text")
    return text


def _halves(text: str) -> tuple[str, str]:
    cut = text.find("\n", len(text) // 2)
    cut = len(text) // 2 if cut < 0 else cut
    return text[:cut], text[cut:]


def _load_hub(cfg: DataConfig) -> tuple[str, str, str]:
    try:
        import datasets
        parts = [datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=s) for s in (cfg.calib_split, cfg.eval_split)]
    except Exception as exc:
        raise UserError(f"data.source=hub: could not load {cfg.hub_name}/{cfg.hub_config} "
                        f"({type(exc).__name__}: {str(exc)[:200]}); offline machines use data.source=local "
                        f"data.path=/path/to/wikitext-2") from None
    calib, evaluation = ("\n".join(str(t) for t in p[cfg.text_field]) for p in parts)
    return calib, evaluation, f"hub:{cfg.hub_name}/{cfg.hub_config}:{cfg.calib_split}(calib),{cfg.eval_split}(eval)"


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """The whole text as one id stream, no special tokens added. [n_tokens] int64"""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def _too_short(ids: torch.Tensor, n: int, seq_len: int, what: str, text: tuple[str, str], fields: str) -> UserError:
    """The refusal of a text too short for n windows of seq_len tokens: which text and why it is that text
    (split_text), the tokens it has and needs, and the fields that ask for them."""
    name, why = text
    return UserError(f"asked for {n} {what} windows of {seq_len} tokens ({n * seq_len} tokens), but {name} holds only "
                     f"{ids.numel() // seq_len} ({ids.numel()} tokens){f': {why}' if why else ''}; lower {fields}, "
                     f"or give more text")


def random_windows(ids: torch.Tensor, n: int, seq_len: int, seed: int, what: str = "calibration",
                   text: tuple[str, str] = ("the text", ""), fields: str = "n_samples or seq_len") -> torch.Tensor:
    """n non-overlapping windows at seeded random slots. [n, seq_len]"""
    slots = ids.numel() // seq_len
    if n > slots:
        raise _too_short(ids, n, seq_len, what, text, fields)
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:n]
    return ids[: slots * seq_len].view(slots, seq_len)[order].clone()


def consecutive_windows(ids: torch.Tensor, n: int, seq_len: int, what: str = "evaluation",
                        text: tuple[str, str] = ("the text", ""),
                        fields: str = "the number of windows or seq_len") -> torch.Tensor:
    """The first n consecutive non-overlapping windows. [n, seq_len]"""
    if n > ids.numel() // seq_len:
        raise _too_short(ids, n, seq_len, what, text, fields)
    return ids[: n * seq_len].view(n, seq_len).clone()


def leading_bos(tokenizer) -> int | None:
    """The BOS id when the tokenizer starts every text it encodes with it (add_special_tokens=True), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True, return_attention_mask=False)["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def with_bos(windows: torch.Tensor, bos: int | None) -> torch.Tensor:
    """[N, L] -> [N, L + 1] with BOS first (unchanged when bos is None)."""
    if bos is None:
        return windows
    return torch.cat([torch.full((windows.shape[0], 1), bos, dtype=windows.dtype), windows], dim=1)


def build_windows(cfg: DataConfig, tokenizer) -> Windows:
    calib_text, eval_text, description = load_texts(cfg)
    bos = leading_bos(tokenizer)
    text = 0 if bos is None else 1  # BOS takes a window's first position where the tokenizer wants it
    calib = with_bos(random_windows(tokenize(tokenizer, calib_text), cfg.n_samples, cfg.seq_len - text, cfg.seed,
                                    text=split_text(cfg, True), fields="data.n_samples or data.seq_len"), bos)
    eval_ids = tokenize(tokenizer, eval_text)
    evaluation = with_bos(consecutive_windows(eval_ids, cfg.eval_n_samples, cfg.eval_seq_len - text,
                                              text=split_text(cfg, False),
                                              fields="data.eval_n_samples or data.eval_seq_len"), bos)
    long = None
    if cfg.long_n_samples:
        long = with_bos(consecutive_windows(eval_ids, cfg.long_n_samples, cfg.long_seq_len - text,
                                           "long-context evaluation (data.long_n_samples)", split_text(cfg, False),
                                           "data.long_n_samples or data.long_seq_len"), bos)
    if bos is not None:
        description += f"; each window BOS ({bos}) + text"
    return Windows(calib=calib, eval=evaluation, description=description, long=long)
