"""What one layer's decode attention reads: the new token's query and the cache as the runtime holds it.

The kernel (triton_attention.py) and the oracle (reference.py) take the same DecodeInputs, so a check compares
two readers of identical bytes. Positions: sink rows are 0..S-1, encoded block rows start..start+T_q-1 (the
block's `start`), residual rows follow; sink and residual keys are stored post-RoPE, block keys per `key_rope`.
A sliding-window layer forgets its oldest rows: then the rows held begin at `start` (sink rows, if any are left,
at start..S-1) and are contiguous from there.

Rotated values (value policy rotation "hadamard", exporters/codec.py): encoded value rows are stored in the
rotated basis, fp16 rows (sink, residual, prefix) never. A kernel sums the two parts apart under one softmax and
un-rotates the encoded part once per query head (`value_unrotation`, `finish`): out = A_fp / L + U(A_enc / L).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch

from exporters.codec import TensorPolicy
from exporters.layout import PagedBlock, StoredBlock
from exporters.rotation import unrotation_matrix

@dataclass
class DecodeInputs:
    q: torch.Tensor                                        # [B, H_q, D] float32, post-RoPE query of the new token
    scaling: float                                         # softmax scale (the model's attention.scaling)
    key_policy: TensorPolicy
    value_policy: TensorPolicy
    key_rope: str                                          # "pre": block keys are rotated at their positions
    rotary: torch.nn.Module                                # the model's rotary module (inv_freq, attention_scaling)
    sink: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, H_kv, S, D] fp16 post-RoPE K, V
    # encoded rows start..start+T_q-1: one block, or the cache's pages (PagedBlock, serving.cache.from_layer: views, no copy)
    k_block: StoredBlock | PagedBlock | None = None
    v_block: StoredBlock | PagedBlock | None = None
    recent: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, H_kv, R, D] fp16 post-RoPE K, V
    smooth: torch.Tensor | None = None                     # [H_kv, D] lambda: block keys hold K / lambda
    start: int = 0                                         # position of the first row held (a sliding layer's
                                                           # oldest rows leave its window: then > 0)

    def _row_keys(self) -> list[torch.Tensor]:
        return [pair[0] for pair in (self.sink, self.recent) if pair is not None]

    @property
    def n_kv_heads(self) -> int:
        rows = self._row_keys()
        return rows[0].shape[1] if rows else self.k_block.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def length(self) -> int:
        """Cached rows the query attends to."""
        encoded = self.k_block.shape[2] if self.k_block is not None else 0
        return sum(k.shape[2] for k in self._row_keys()) + encoded


def _to(x, device):
    return None if x is None else x.to(device)


def block_to(block: StoredBlock | PagedBlock | None, device) -> StoredBlock | PagedBlock | None:
    """The stored rows on `device`, page by page (a PagedBlock stays paged: its pages are never joined). A page
    already there is the same object, not a new one of the same tensors: the kernels keep a page's layout by the
    page object (serving/pages.py laid_out), so a copy of the inputs moving something else (a query, a lambda)
    never makes every page be laid out again."""
    if block is None:
        return None
    if isinstance(block, PagedBlock):
        pages = tuple(block_to(p, device) for p in block.pages)
        return block if all(a is b for a, b in zip(pages, block.pages)) else PagedBlock(pages)
    device = torch.device(device)
    if all(t.device == device for t in block.tensors.values()):
        return block
    return StoredBlock(block.start, block.shape, {k: v.to(device) for k, v in block.tensors.items()})


def inputs_to(inp: DecodeInputs, device) -> DecodeInputs:
    """The same cache on another device (a copy of the stored bytes, never a decoded copy)."""
    def pair(p):
        return None if p is None else (p[0].to(device), p[1].to(device))

    return replace(inp, q=inp.q.to(device), key_policy=inp.key_policy.to(device),
                   value_policy=inp.value_policy.to(device), sink=pair(inp.sink),
                   k_block=block_to(inp.k_block, device), v_block=block_to(inp.v_block, device),
                   recent=pair(inp.recent), smooth=_to(inp.smooth, device))


_UNROTATIONS: dict[tuple, tuple] = {}


def value_unrotation(p: TensorPolicy, d: int, device) -> torch.Tensor | None:
    """[d, d] float32 M on `device` with y @ M the un-rotation of a value row y stored by the rotated policy p
    (exporters.rotation.unrotation_matrix with p's rotation_signs; None: the seeded ones, as the codec), or None
    when p does not rotate. Made once per policy object, head_dim and device (a policy is an unhashable dataclass:
    kept by id, checked by a weak reference, as cpu_attention's _SIDES)."""
    if p.rotation == "none":
        return None
    key = (id(p), d, str(device))
    held = _UNROTATIONS.get(key)
    if held is not None and held[0]() is p:
        return held[1]
    signs = None if p.rotation_signs is None else p.rotation_signs.detach().cpu()
    m = unrotation_matrix(d, signs).to(device).contiguous()
    _UNROTATIONS[key] = (weakref.ref(p, lambda _, key=key: _UNROTATIONS.pop(key, None)), m)
    return m


def finish(out_fp: torch.Tensor, out_enc: torch.Tensor, unrotate: torch.Tensor) -> torch.Tensor:
    """A split value sum made whole: out_fp + out_enc @ unrotate, in place in out_fp [..., D] (both parts already
    divided by the softmax's sum; out_enc in the rotated basis) -> out_fp."""
    d = out_fp.shape[-1]
    out_fp.view(-1, d).addmm_(out_enc.reshape(-1, d), unrotate)
    return out_fp
