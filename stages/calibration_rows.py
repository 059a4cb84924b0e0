"""The calibration rows a recipe's key scales, outlier thresholds and codebooks are fitted on.

The traces stage keeps a reservoir of pre-RoPE K and V rows with their (sample, position); the Fisher stage
keeps the squared gradients of exactly those elements. A recipe quantizes keys in one space, so the rows are
brought there first:
- post-RoPE recipes: each key row is rotated at its own position with the model's rotary module;
- SmoothAttention recipes store K / lambda: keys are divided by lambda, and since dL/d(k / lambda) =
  lambda dL/dk, the Fisher of the stored element is F_k lambda^2 (RoPE pairs share lambda, so the order of
  rotation and division is free);
- rotated tensors (`rotation: hadamard`, evaluation-only) are fitted on the rotated rows
  (exporters.rotation.rotate_orthonormal, after smoothing and RoPE as the codec sees them); the Fisher of a
  rotated element is taken as the mean Fisher of its row's Hadamard block: with random signs,
  E[(R g)_c^2] = |g_block|^2 / b exactly, and the Fisher stage keeps squared gradients, not the gradients;
- the first `n_sink` positions of every sample (sinks, or the whole full-precision prefix) are never
  quantized and are left out of every fit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exporters.rope import apply_rope, rotary_tables
from exporters.rotation import largest_power_of_two_divisor, rotate_orthonormal
from stages.base import InputError
from stages.hooks import model_rotaries


@dataclass
class CalibrationRows:
    keys: torch.Tensor                    # [S, L, H_kv, D] in the space the recipe quantizes
    values: torch.Tensor                  # [S, L, H_kv, D]
    res_pos: torch.Tensor                 # [S] position of each row in its window
    n_sink: int                           # rows at positions < n_sink are excluded from every fit
    fisher_k: torch.Tensor | None = None  # [S, L, H_kv, D] Fisher of the stored key element
    fisher_v: torch.Tensor | None = None

    def kept(self) -> torch.Tensor:
        """Indices of the rows that enter the fits (positions >= n_sink)."""
        keep = (self.res_pos >= self.n_sink).nonzero().flatten()
        if keep.numel() == 0:
            raise InputError(f"no reservoir rows left after excluding the first n_sink={self.n_sink} positions")
        return keep


def rotate_rows(k: torch.Tensor, res_pos: torch.Tensor, rotary, dtype: torch.dtype) -> torch.Tensor:
    """Pre-RoPE reservoir rows [S, L, H, D] -> post-RoPE, each row rotated at its own position. rotary: the model's
    rotary module, or one per layer (stages.hooks.model_rotaries: local and global layers with their own RoPE),
    each layer then rotated with its own."""
    if isinstance(rotary, (list, tuple)):
        if len(rotary) != k.shape[1]:
            raise ValueError(f"rotate_rows: {len(rotary)} rotary modules for {k.shape[1]} layers")
        if any(r is not rotary[0] for r in rotary):
            return torch.cat([rotate_rows(k[:, i : i + 1], res_pos, r, dtype) for i, r in enumerate(rotary)], 1)
        rotary = rotary[0]
    cos, sin = rotary_tables(rotary, 0, int(res_pos.max()) + 1, dtype)  # on the rotary module's device
    cos, sin = cos[0, res_pos.to(cos.device)].to(k.device), sin[0, res_pos.to(sin.device)].to(k.device)  # [S, D]
    s, n_layers, h, d = k.shape
    rows = k.permute(1, 2, 0, 3).reshape(1, n_layers * h, s, d)  # rows as a [1, L*H, S, D] "sequence"
    rot = apply_rope(rows, cos, sin)
    return rot.view(n_layers, h, s, d).permute(2, 0, 1, 3).contiguous()


def block_mean(f: torch.Tensor) -> torch.Tensor:
    """[..., D] -> each element replaced by the mean over its Hadamard block (rotate_orthonormal's blocks)."""
    d = f.shape[-1]
    b = largest_power_of_two_divisor(d)
    blocks = f.reshape(*f.shape[:-1], d // b, b)
    return blocks.mean(-1, keepdim=True).expand_as(blocks).reshape(f.shape)


def rows_for(traces: dict[str, torch.Tensor], key_rope: str, rotary, dtype: torch.dtype, n_sink: int,
             smooth: torch.Tensor | None = None, fisher: dict[str, torch.Tensor] | None = None,
             rotate_k: bool = False, rotate_v: bool = False) -> CalibrationRows:
    """traces: the traces stage's tensors (res_k, res_v, res_pos); fisher: the Fisher stage's (fisher_k,
    fisher_v) or None when the stage needs no weights; smooth: lambda [L, H, D] or None; rotary/dtype: the
    model's rotary module (or one per layer: rotate_rows) and dtype (post-RoPE recipes); rotate_k / rotate_v: the
    recipe rotates that tensor's rows before quantizing (codec rotation "hadamard")."""
    k, v = traces["res_k"], traces["res_v"]
    if smooth is not None:
        k = k / smooth[None]
    if key_rope == "post":
        k = rotate_rows(k, traces["res_pos"], rotary, dtype)
    if rotate_k:
        k = rotate_orthonormal(k)
    if rotate_v:
        v = rotate_orthonormal(v)
    rows = CalibrationRows(k, v, traces["res_pos"], n_sink)
    if fisher is not None:
        rows.fisher_k, rows.fisher_v = fisher["fisher_k"], fisher["fisher_v"]
        if smooth is not None:
            rows.fisher_k = rows.fisher_k * smooth[None].square()
        if rotate_k:
            rows.fisher_k = block_mean(rows.fisher_k)
        if rotate_v:
            rows.fisher_v = block_mean(rows.fisher_v)
    return rows


@dataclass(frozen=True)
class CalibGroup:
    """Recipes that share key scales, outlier thresholds and codebooks (stages.recipe.group_of): the config of the
    key_scales and outliers stages and part of the codebooks stage's. Smoothed recipes fit K / lambda; prefix
    recipes fit rows of the traces taken with the prefix prepended, the prefix rows excluded; rotated recipes
    (codec rotation "hadamard"; evaluation only) fit rotated rows."""
    fraction: float
    n_sink: int
    key_rope: str
    smooth: bool = False
    prefix: bool = False
    rotate_k: bool = False
    rotate_v: bool = False

    @property
    def suffix(self) -> str:
        flags = ("-smooth" if self.smooth else "") + ("-prefix" if self.prefix else "")
        flags += ("-rotk" if self.rotate_k else "") + ("-rotv" if self.rotate_v else "")
        return f"f{self.fraction:g}-s{self.n_sink}-{self.key_rope}{flags}"

    @property
    def traces(self) -> str:
        return "traces-prefix" if self.prefix else "traces"

    @property
    def fisher(self) -> str:
        return "fisher-prefix" if self.prefix else "fisher"

    @property
    def extra(self) -> list[str]:
        """The stages besides the traces whose results shape the group's rows."""
        return (["smooth"] if self.smooth else []) + (["prefix_tokens"] if self.prefix else [])


def group_rows(model, inputs: dict, g: CalibGroup, with_fisher: bool = False) -> CalibrationRows:
    """The calibration rows of group g from the stage results `inputs` (traces or traces-prefix, smooth,
    prefix_tokens, fisher or fisher-prefix): the whole prefix is kept in full precision, like sink rows."""
    n_sink = g.n_sink
    if g.prefix:
        n_sink = max(n_sink, int(inputs["prefix_tokens"].tensors["ids"].numel()))
    dtype = next(model.parameters()).dtype
    return rows_for(inputs[g.traces].tensors, g.key_rope, model_rotaries(model), dtype, n_sink,
                    smooth=inputs["smooth"].tensors["smooth"] if g.smooth else None,
                    fisher=inputs[g.fisher].tensors if with_fisher else None,
                    rotate_k=g.rotate_k, rotate_v=g.rotate_v)
