"""PNG figures logged with each MLflow run.

- The quality-per-bit frontier (`ppl_vs_bits`, report.md's frontier.png): the perplexity increase over fp16 on a
  log axis against average bits per cached element, one point per recipe with its 95% interval, ours apart from
  the peers (`recipe_group`), the Pareto frontier drawn. `python -m pipeline.plots RESULTS.json OUT.png` draws it
  from bench.quality's JSON or a run's summary.json.
- Per-layer channel magnitudes of K (pre- and post-RoPE) and V, after KIVI (Liu et al. 2024, fig. 2): keys have
  a few channels with large magnitude (so they are quantized per channel), values have none (per token).
  KIVI plots |K| and |V| over tokens x channels; the traces keep the per-channel abs-max over all tokens, which
  is the envelope of that surface along the token axis.

- Layer x position heatmaps for report.md (`heatmap`).

Every axis that counts layers has its ticks on whole layers (`_layer_axis`).

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


# Names of formats that are not ours: serving engines' caches and the uncalibrated baselines (bench/quality.py PEERS,
# docs/peer-formats.md). Everything else but the reference is ours: kvquant-*, mixed-*, any recipe with a calibrated
# part (+smooth, +prefix, +rot) and a user's own.
PEER_PREFIXES = ("vllm-", "hf-", "kivi-", "int", "fp8")
REFERENCE = "fp16"
_LINTHRESH = 1e-3   # the y axis is linear within +-0.1% of fp16 (where intervals cross it), logarithmic beyond
_STYLE = {"ours": {"color": "#1f5fbf", "marker": "o", "mfc": "#1f5fbf", "text": "#12407f", "weight": "bold", "z": 4},
          "peer": {"color": "#8a8a8a", "marker": "s", "mfc": "white", "text": "#5a5a5a", "weight": "normal", "z": 3},
          "reference": {"color": "0.1", "marker": "D", "mfc": "0.1", "text": "0.1", "weight": "normal", "z": 3}}


def recipe_group(name: str) -> str:
    """"reference" (fp16), "peer" (a serving engine's format or an uncalibrated baseline) or "ours"."""
    if name == REFERENCE:
        return "reference"
    if "+" not in name and name.startswith(PEER_PREFIXES):
        return "peer"
    return "ours"


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """{name: (bits, ratio)} -> the names no other point beats, by bits ascending: a point is on the frontier when
    every point at equal or fewer bits has a higher ratio (the lowest ratio at its bits or fewer)."""
    front, best = [], float("inf")
    for name, (_bits, ratio) in sorted(points.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if ratio < best:
            front.append(name)
            best = ratio
    return front


def _ratios(recipes: dict[str, dict]) -> dict[str, tuple[float, float, float, float]]:
    """-> {name: (avg_bits, ratio, lo, hi)}: the ratio to fp16 on the same windows with its 95% interval (the ratio
    itself where the evaluation computed none; ppl / fp16's ppl for a summary older than ppl_ratio)."""
    ref_ppl = recipes.get(REFERENCE, {}).get("ppl")
    out = {}
    for name, r in recipes.items():
        if "avg_bits" not in r or not ("ppl_ratio" in r or (ref_ppl and "ppl" in r)):
            continue
        ratio = float(r["ppl_ratio"]) if "ppl_ratio" in r else float(r["ppl"]) / float(ref_ppl)
        lo, hi = r.get("ppl_ratio_ci95") or (ratio, ratio)
        out[name] = (float(r["avg_bits"]), ratio, float(lo), float(hi))
    return out


def ppl_vs_bits(recipes: dict[str, dict], path: Path, title: str | None = None) -> Path:
    """recipes: {name: {"avg_bits", "ppl_ratio", "ppl_ratio_ci95", ...}} -> path, a PNG of `frontier_figure`."""
    return _save(frontier_figure(recipes, title), path)


def frontier_figure(recipes: dict[str, dict], title: str | None = None) -> Figure:
    """The quality-per-bit frontier: the perplexity increase over fp16 (ratio - 1; a log axis beyond +-0.1%, where
    the ratios of a few-bit cache spread over decades) against average bits per cached element, each recipe's 95%
    interval as an error bar, ours apart from the peers, the Pareto frontier drawn, the labels kept apart. fp16 is
    the dashed zero line (a point only when nothing else was evaluated)."""
    rows = _ratios(recipes)
    shown = {n: v for n, v in rows.items() if recipe_group(n) != "reference"} or rows
    if not shown:
        raise ValueError(f"ppl_vs_bits: no recipe has avg_bits with ppl_ratio (or ppl beside fp16's); got "
                         f"{sorted(recipes)}")
    fig = Figure(figsize=(10, 6), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ax.set_yscale("symlog", linthresh=_LINTHRESH, linscale=0.6)
    front = pareto_front({n: (b, r) for n, (b, r, _, _) in shown.items()})
    bits = [b for b, *_ in shown.values()]
    span = max(max(bits) - min(bits), 1.0)
    x_lo, x_hi = min(bits) - 0.08 * span, max(bits) + 0.12 * span
    for group, label in (("ours", "ours: calibrated (kvquant-*, mixed-*)"),
                         ("peer", "peers: serving engines' formats, uncalibrated baselines"),
                         ("reference", REFERENCE)):
        names = [n for n in shown if recipe_group(n) == group]
        if not names:
            continue
        st = _STYLE[group]
        b, r, lo, hi = (np.array([shown[n][i] for n in names]) for i in range(4))
        # the bar spans the interval itself (a bootstrap interval need not hold the point estimate)
        ax.errorbar(b, (lo + hi) / 2 - 1, yerr=(hi - lo) / 2, fmt="none", ecolor=st["color"], elinewidth=1.1,
                    capsize=2.5, zorder=st["z"])
        ax.plot(b, r - 1, ls="none", marker=st["marker"], color=st["color"], mfc=st["mfc"], ms=6, mew=1.4,
                zorder=st["z"], label=label)
    fx = [shown[n][0] for n in front] + [x_hi]
    fy = [shown[n][1] - 1 for n in front]
    ax.step(fx, fy + fy[-1:], where="post", color="#d9822b", lw=1.6, alpha=0.8, zorder=2,
            label="Pareto frontier (lowest ratio at equal or fewer bits)")
    ax.axhline(0, color="0.2", lw=0.9, ls="--", zorder=1)
    ref_bits = f" ({rows[REFERENCE][0]:g} bits)" if REFERENCE in rows else ""
    ax.annotate(f"{REFERENCE}{ref_bits}: the reference", (x_lo, 0), xytext=(4, 3), textcoords="offset pixels",
                va="bottom", fontsize=8, color="0.2")
    top = max(hi for _, _, _, hi in shown.values()) - 1
    bottom = min(lo for _, _, lo, _ in shown.values()) - 1
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(min(bottom * 1.3, -_LINTHRESH * 0.5), max(top * 2.5, 10 * _LINTHRESH))
    _percent_ticks(ax)
    ax.set_xlabel("average bits per cached K/V element (scales and sparse outliers included)")
    ax.set_ylabel("perplexity increase over fp16 = ppl/fp16 - 1 (log scale)")
    ax.set_title(title or "Quality per bit (lower left is better)", fontsize=11)
    ax.grid(alpha=0.25, which="major")
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("Pareto"))  # ours, peers, then the line
    legend = ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="best", fontsize=8,
                       framealpha=0.95)
    _place_labels(fig, ax, {n: (b, r - 1) for n, (b, r, _, _) in shown.items()},
                  {n: (lo - 1, hi - 1) for n, (_, _, lo, hi) in shown.items()}, list(zip(fx, fx[1:], fy)), legend)
    return fig


def _percent_ticks(ax) -> None:
    """Ticks at 0 and each decade of the increase, written as percentages (+1%, +10%, ...)."""
    y0, y1 = ax.get_ylim()
    ticks = [0.0] + [10.0 ** k for k in range(-3, 5) if 10.0 ** k <= y1] + [-(10.0 ** k) for k in range(-3, 5)
                                                                        if -(10.0 ** k) >= y0]
    ax.set_yticks(sorted(ticks), [_percent(t) for t in sorted(ticks)])
    ax.minorticks_off()


def _percent(v: float) -> str:
    if v == 0:
        return "0 (= fp16)"
    return f"{'+' if v > 0 else '-'}{100 * abs(v):g}%"


def _place_labels(fig: Figure, ax, anchors: dict[str, tuple[float, float]], bars: dict[str, tuple[float, float]],
                  steps: list[tuple[float, float, float]], legend, pad_px: float = 7.0) -> None:
    """One label per point, at the free spot nearest to it (`_free_spot`): clear of the labels placed before it,
    of every marker and the legend and, where it can be, of every error bar and frontier step (x0, x1, y); a
    leader line joins a label that had to move away to its point. Ours are placed first."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw_without_rendering()  # the constrained layout settles the axes before positions are measured
    frame = ax.get_window_extent(renderer)
    px = {n: ax.transData.transform(xy) for n, xy in anchors.items()}
    box = legend.get_window_extent(renderer)
    markers = [(x - 5, y - 5, x + 5, y + 5) for x, y in px.values()] + [(box.x0, box.y0, box.x1, box.y1)]
    whiskers = []
    for n, (lo, hi) in bars.items():
        x = px[n][0]
        (_, y0), (_, y1) = ax.transData.transform([(anchors[n][0], lo), (anchors[n][0], hi)])
        whiskers.append((x - 4, y0, x + 4, y1))
    for x0, x1, y in steps:
        (a, b), (c, _) = ax.transData.transform([(x0, y), (x1, y)])
        whiskers.append((a, b - 2, c, b + 2))
    labels: list[tuple] = []
    for name in sorted(anchors, key=lambda n: (recipe_group(n) != "ours", px[n][1])):
        st = _STYLE[recipe_group(name)]
        probe = ax.text(0, 0, name, fontsize=8, fontweight=st["weight"])
        box = probe.get_window_extent(renderer)
        probe.remove()
        x, y = px[name]
        dx, dy, moved = _free_spot(x, y, box.width, box.height, pad_px, [*labels, *markers], whiskers, frame)
        labels.append((x + dx, y + dy - box.height / 2, x + dx + box.width, y + dy + box.height / 2))
        ax.annotate(name, anchors[name], xytext=(dx, dy), textcoords="offset pixels", ha="left", va="center",
                    fontsize=8, color=st["text"], fontweight=st["weight"], zorder=5,
                    bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8},
                    arrowprops={"arrowstyle": "-", "color": st["color"], "lw": 0.6, "shrinkA": 1, "shrinkB": 4}
                    if moved else None)


def _free_spot(x: float, y: float, w: float, h: float, pad: float, hard: list, soft: list,
               frame) -> tuple[float, float, bool]:
    """(dx, dy, moved) of a w x h label box for the point at pixel (x, y), its left edge at x + dx: of the spots
    beside the point (right, left) or over and under it, each shifted up or down by whole label heights, the
    nearest one inside the axes clear of every `hard` box, preferring one clear of the `soft` boxes too; the plain
    right-hand spot when none is free."""
    spots = []
    for k in range(-12, 13):
        dy = k * (h + 1)
        spots += [(abs(dy), pad, dy), (abs(dy) + 0.3 * w, -pad - w, dy)]      # right of the point, left of it
        if k:
            spots.append((abs(dy) + 0.3 * w + h, -w / 2, dy + (h / 2 + 3) * (1 if k > 0 else -1)))  # over / under
    spots.sort(key=lambda spot: spot[0])
    fallback = None
    for _, dx, dy in spots:
        box = (x + dx, y + dy - h / 2, x + dx + w, y + dy + h / 2)
        if not (frame.x0 <= box[0] and box[2] <= frame.x1 and frame.y0 <= box[1] and box[3] <= frame.y1):
            continue
        if any(_overlap(box, b) for b in hard):
            continue
        if not any(_overlap(box, b) for b in soft):
            return dx, dy, abs(dy) > 0.5 or dx != pad
        fallback = fallback or (dx, dy, abs(dy) > 0.5 or dx != pad)
    return fallback or (pad, 0.0, False)


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def kv_channel_magnitudes(tensors: dict[str, torch.Tensor], out_dir: Path) -> list[Path]:
    """Traces tensors -> out_dir/layer_XX.png per layer and out_dir/overview.png (layers x channels)."""
    stats = _stats(tensors)
    n_layers, n_kv_heads, head_dim = stats[_PANELS[0][0]].shape
    paths = [_layer_figure(stats, layer, n_kv_heads, head_dim, out_dir / f"layer_{layer:02d}.png")
             for layer in range(n_layers)]
    return [*paths, _save(overview_figure(stats), out_dir / "overview.png")]


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


def overview_figure(stats: dict[str, np.ndarray]) -> Figure:
    """All layers' per-channel abs-max (`_stats`: [n_layers, n_kv_heads, head_dim] per tensor of _PANELS) as
    layer x channel images, a panel per tensor."""
    head_dim = stats[_PANELS[0][0]].shape[-1]
    fig = Figure(figsize=(10, 8), dpi=90, layout="constrained")
    axes = fig.subplots(len(_PANELS), 1, sharex=True)
    for ax, (key, title) in zip(axes, _PANELS):
        grid = stats[key].reshape(stats[key].shape[0], -1)  # [n_layers, H_kv * D]
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma")
        fig.colorbar(image, ax=ax, label="abs-max")
        _layer_axis(ax.yaxis)
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1].set_xlabel(f"channel (kv head x {head_dim})")
    fig.suptitle("per-channel magnitude, all layers")
    return fig


def _layer_axis(axis) -> None:
    """An axis that counts layers (one image row per layer): labelled "layer", its ticks on whole layers only
    (matplotlib's default locator puts them at -0.5, 0.0, 0.5, ... on a few-layer image)."""
    axis.set_label_text("layer")
    axis.set_major_locator(MaxNLocator(integer=True))


def heatmap(values: list[list[float]], edges: list[int], title: str, path: Path, cmap: str) -> Path:
    """values [n_layers][n_buckets] -> path, a PNG of `heatmap_figure`."""
    return _save(heatmap_figure(values, edges, title, cmap), path)


def heatmap_figure(values: list[list[float]], edges: list[int], title: str, cmap: str) -> Figure:
    """values [n_layers][n_buckets] -> a layer x position-bucket image (bucket j spans edges[j]..edges[j+1]), its
    layer ticks on whole layers."""
    fig = Figure(figsize=(4 + len(edges), 6), dpi=100, layout="tight")
    ax = fig.add_subplot()
    im = ax.imshow(values, aspect="auto", cmap=cmap)
    ax.set_xticks(range(len(edges)), [f"{a}-{b}" for a, b in zip(edges, edges[1:])] + [f"{edges[-1]}+"])
    ax.set_xlabel("position bucket")
    _layer_axis(ax.yaxis)
    ax.set_title(title)
    fig.colorbar(im, ax=ax)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write_bytes(path, buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m pipeline.plots", description="The quality-per-bit frontier PNG from "
                                 "bench.quality's JSON ({'recipes': ...}) or a run's summary.json.")
    ap.add_argument("results", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    data = json.loads(args.results.read_text())
    recipes = data.get("recipes") or (data.get("evaluation") or {}).get("recipes")
    if not recipes:
        print(f"error: {args.results}: no 'recipes' (bench.quality) nor 'evaluation.recipes' (summary.json)")
        return 2
    seeds = data.get("perturb_seeds") or (data.get("evaluation") or {}).get("perturb_seeds")
    windows = data.get("windows") or (data.get("evaluation") or {}).get("windows")
    seq_len = data.get("seq_len") or (data.get("evaluation") or {}).get("seq_len")
    title = args.title or ("Quality per bit (lower left is better): " + ", ".join(
        [f"{windows} windows x {seq_len} tokens"] * bool(windows and seq_len) + [f"{len(seeds)} seeds"] * bool(seeds)))
    print(ppl_vs_bits(recipes, args.out, title))
    return 0


__all__ = ["ppl_vs_bits", "frontier_figure", "pareto_front", "recipe_group", "kv_channel_magnitudes", "heatmap",
           "heatmap_figure", "overview_figure", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
