"""PNG figures logged with each MLflow run.

- Perplexity against average bits per cached element, one point per recipe: the trade-off the recipes make.
- Per-layer channel magnitudes of K (pre- and post-RoPE) and V, after KIVI (Liu et al. 2024, fig. 2): keys have
  a few channels with large magnitude (so they are quantized per channel), values have none (per token).
  KIVI plots |K| and |V| over tokens x channels; the traces keep the per-channel abs-max over all tokens, which
  is the envelope of that surface along the token axis.

- Layer x position heatmaps for report.md (`heatmap`).

Figures are built with `matplotlib.figure.Figure` and written by the Agg renderer, never through pyplot, so
no GUI backend is touched and no global figure state is left behind. Each PNG is rendered in memory and written
atomically (exporters/files.py): a killed run leaves the old file or the new one, never a torn image.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from exporters.files import atomic_write_bytes

_PANELS = (("k_pre_absmax", "K pre-RoPE"), ("k_post_absmax", "K post-RoPE"), ("v_absmax", "V"))


def ppl_vs_bits(recipes: dict[str, dict], path: Path) -> Path:
    """recipes: {name: {"avg_bits", "ppl", ...}} -> a scatter of perplexity against average bits."""
    points = {n: (float(r["avg_bits"]), float(r["ppl"])) for n, r in recipes.items() if "avg_bits" in r and "ppl" in r}
    if not points:
        raise ValueError(f"ppl_vs_bits: no recipe has both avg_bits and ppl; got {sorted(recipes)}")
    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.add_subplot()
    for name, (bits, ppl) in points.items():
        ax.scatter(bits, ppl)
        ax.annotate(name, (bits, ppl), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.margins(0.15)
    ax.set_xlabel("average bits per K/V element")
    ax.set_ylabel("perplexity")
    ax.set_title("perplexity vs. cache size")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def kv_channel_magnitudes(tensors: dict[str, torch.Tensor], out_dir: Path) -> list[Path]:
    """Traces tensors -> out_dir/layer_XX.png per layer and out_dir/overview.png (layers x channels)."""
    stats = _stats(tensors)
    n_layers, n_kv_heads, head_dim = stats[_PANELS[0][0]].shape
    paths = [_layer_figure(stats, layer, n_kv_heads, head_dim, out_dir / f"layer_{layer:02d}.png")
             for layer in range(n_layers)]
    return [*paths, _overview(stats, n_kv_heads, head_dim, out_dir / "overview.png")]


def _stats(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    missing = [k for k, _ in _PANELS if k not in tensors]
    if missing:
        raise ValueError(f"kv_channel_magnitudes: traces tensors lack {missing}; have {sorted(tensors)}")
    stats = {k: tensors[k].detach().float().cpu().numpy() for k, _ in _PANELS}
    shapes = {k: v.shape for k, v in stats.items()}
    if len(set(shapes.values())) != 1 or len(shapes[_PANELS[0][0]]) != 3:
        raise ValueError(f"kv_channel_magnitudes: expected equal [n_layers, n_kv_heads, head_dim] shapes, got {shapes}")
    return stats


def _layer_figure(stats: dict[str, np.ndarray], layer: int, n_kv_heads: int, head_dim: int, path: Path) -> Path:
    fig = Figure(figsize=(10, 6.5), dpi=90, layout="constrained")
    axes = fig.subplots(len(_PANELS), 1, sharex=True)
    edges = np.arange(n_kv_heads * head_dim + 1)
    for ax, (key, title) in zip(axes, _PANELS):
        ax.stairs(stats[key][layer].reshape(-1), edges, fill=True)  # [H_kv * D]: head-major channels
        for h in range(1, n_kv_heads):
            ax.axvline(h * head_dim, color="0.6", lw=0.6, ls="--")
        ax.set_ylabel("abs-max")
        ax.set_title(f"{title}", fontsize=9, loc="left")
    axes[-1].set_xlabel(f"channel (kv head x {head_dim}; dashed lines separate heads)")
    fig.suptitle(f"layer {layer}: per-channel magnitude over calibration tokens")
    return _save(fig, path)


def _overview(stats: dict[str, np.ndarray], n_kv_heads: int, head_dim: int, path: Path) -> Path:
    fig = Figure(figsize=(10, 8), dpi=90, layout="constrained")
    axes = fig.subplots(len(_PANELS), 1, sharex=True)
    for ax, (key, title) in zip(axes, _PANELS):
        grid = stats[key].reshape(stats[key].shape[0], -1)  # [n_layers, H_kv * D]
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma")
        fig.colorbar(image, ax=ax, label="abs-max")
        ax.set_ylabel("layer")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1].set_xlabel(f"channel (kv head x {head_dim})")
    fig.suptitle("per-channel magnitude, all layers")
    return _save(fig, path)


def heatmap(values: list[list[float]], edges: list[int], title: str, path: Path, cmap: str) -> Path:
    """values [n_layers][n_buckets] -> a layer x position-bucket image (bucket j spans edges[j]..edges[j+1])."""
    fig = Figure(figsize=(4 + len(edges), 6), dpi=100, layout="tight")
    ax = fig.add_subplot()
    im = ax.imshow(values, aspect="auto", cmap=cmap)
    ax.set_xticks(range(len(edges)), [f"{a}-{b}" for a, b in zip(edges, edges[1:])] + [f"{edges[-1]}+"])
    ax.set_xlabel("position bucket")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def _save(fig: Figure, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write_bytes(path, buf.getvalue())


__all__ = ["ppl_vs_bits", "kv_channel_magnitudes", "heatmap"]
