"""The oracle for decode attention over an exported cache: plain torch, float32, one step at a time.

Decode every stored row through exporters.codec (exporters.layout.load unpacks the bytes), multiply smoothed
keys by lambda, rotate pre-RoPE keys at their positions with the model's own rotary module (so Llama-3 and other
scalings are honoured), then softmax(q K^T * scaling) V with GQA (query head j reads kv head j // (H_q / H_kv)).
"""
from __future__ import annotations

import torch

from exporters.codec import decode
from exporters.layout import join, load, pages_of
from exporters.rope import apply_rope, rotary_tables
from serving.inputs import DecodeInputs


def cached_kv(inp: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Every cached row decoded: post-RoPE keys and values [B, H_kv, T, D] float32, in position order."""
    ks, vs = [], []
    if inp.sink is not None:
        ks.append(inp.sink[0].float())
        vs.append(inp.sink[1].float())
    if inp.k_block is not None:  # the cache's pages joined into one block (a copy: the oracle's size does not matter)
        k = decode(load(join(pages_of(inp.k_block)), inp.key_policy), inp.key_policy)
        if inp.smooth is not None:
            k = k * inp.smooth.float()[None, :, None, :]
        if inp.key_rope == "pre":
            # float32 tables and rotation whatever the model's dtype (exporters/rope.py's convention)
            cos, sin = rotary_tables(inp.rotary, inp.k_block.start, k.shape[2])
            k = apply_rope(k, cos[0].to(k.device), sin[0].to(k.device))
        ks.append(k)
        vs.append(decode(load(join(pages_of(inp.v_block)), inp.value_policy), inp.value_policy))
    if inp.recent is not None:
        ks.append(inp.recent[0].float())
        vs.append(inp.recent[1].float())
    return torch.cat(ks, 2), torch.cat(vs, 2)


def decode_attention(inp: DecodeInputs) -> torch.Tensor:
    """-> [B, H_q, D] float32: the new token's attention output per query head."""
    k, v = cached_kv(inp)                                    # [B, H_kv, T, D]
    b, h_q, d = inp.q.shape
    group = h_q // k.shape[1]
    q = inp.q.float().view(b, k.shape[1], group, d)          # [B, H_kv, G, D]
    scores = torch.einsum("bhgd,bhtd->bhgt", q, k) * inp.scaling
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhgt,bhtd->bhgd", probs, v).reshape(b, h_q, d)
