"""pipeline/plots.py's quality-per-bit frontier: which recipes are ours, the Pareto frontier on hand-checkable
points, and a crowded figure whose labels stay apart, each with its interval drawn, ours in their own colour."""
import itertools
import json

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.text import Text

from pipeline import plots


@pytest.mark.parametrize("name,group", [
    ("fp16", "reference"), ("kvquant-4b-1pct", "ours"), ("kvquant-3b-1pct+smooth+prefix", "ours"),
    ("mixed-3.5b", "ours"), ("int4-token+smooth", "ours"), ("nuq4-keys-only", "ours"),
    ("vllm-turboquant-k8v4", "peer"), ("hf-hqq-2", "peer"), ("kivi-2", "peer"), ("int4-token", "peer"),
    ("fp8-e4m3", "peer"),
])
def test_recipe_group(name, group):
    assert plots.recipe_group(name) == group


def test_pareto_front_keeps_the_lowest_ratio_at_equal_or_fewer_bits():
    points = {"a": (2.0, 1.5), "b": (3.0, 1.2), "c": (3.0, 1.3), "d": (4.0, 1.25), "e": (5.0, 1.0),
              "f": (6.0, 1.0)}
    # c: b has its bits and a lower ratio; d: b has fewer bits and a lower ratio; f: e, fewer bits, the same ratio
    assert plots.pareto_front(points) == ["a", "b", "e"]
    assert plots.pareto_front({"x": (4.0, 1.1)}) == ["x"]


def _row(bits, ratio, half=0.01):
    return {"ppl": 20 * ratio, "avg_bits": bits, "ppl_ratio": ratio, "ppl_ratio_ci95": [ratio - half, ratio + half]}


# eight recipes within 0.1 bit and 1% of each other, two far away: the labels must still stay apart
CROWDED = {"fp16": _row(16.0, 1.0, 0.0), "kvquant-2b-1pct": _row(2.75, 1.36, 0.1),
           "hf-hqq-2": _row(4.17, 38.4, 10.0),
           **{f"kvquant-4b-v{i}": _row(4.70 + 0.01 * i, 1.015 + 0.001 * i) for i in range(4)},
           **{f"vllm-int4-v{i}": _row(4.72 + 0.01 * i, 1.017 + 0.001 * i) for i in range(4)}}


def test_the_crowded_frontier_keeps_its_labels_apart():
    fig = plots.frontier_figure(CROWDED)
    ax = fig.axes[0]
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw_without_rendering()
    labels = {t.get_text(): t for t in ax.texts if t.get_text() in CROWDED}
    assert set(labels) == set(CROWDED) - {"fp16"}  # fp16 is the zero line, not a point
    boxes = {n: Text.get_window_extent(t, renderer) for n, t in labels.items()}  # the text, not its leader line
    frame = ax.get_window_extent(renderer)
    for (a, ba), (b, bb) in itertools.combinations(boxes.items(), 2):
        assert not ba.overlaps(bb), f"labels {a} and {b} overlap"
    assert all(frame.contains(bx.x0, bx.y0) and frame.contains(bx.x1, bx.y1) for bx in boxes.values())
    assert ax.get_yscale() == "symlog"
    # ours and the peers in their own colours; one interval per recipe, spanning [lo, hi] - 1
    colours = {to_hex(line.get_color()): line.get_label() for line in ax.lines if line.get_label().startswith(
        ("ours", "peers"))}
    assert len(colours) == 2
    bars = [seg for c in ax.containers for seg in c.lines[2][0].get_segments()]
    assert len(bars) == len(CROWDED) - 1
    hqq = next(seg for seg in bars if abs(seg[0][0] - 4.17) < 1e-9)
    assert hqq[:, 1].tolist() == pytest.approx([38.4 - 10 - 1, 38.4 + 10 - 1])
    # the frontier: kvquant-2b-1pct, then the lowest of the cluster, a step line out to the right edge
    (step,) = [line for line in ax.lines if line.get_label().startswith("Pareto")]
    assert list(step.get_xdata()[:2]) == [2.75, 4.70] and step.get_ydata()[1] == pytest.approx(0.015)


def test_ppl_vs_bits_writes_a_png_and_refuses_recipes_without_ratios(tmp_path):
    path = plots.ppl_vs_bits(CROWDED, tmp_path / "frontier.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    old = {"fp16": {"ppl": 10.0, "avg_bits": 16.0}, "kivi-2": {"ppl": 12.5, "avg_bits": 2.5}}  # no ppl_ratio yet
    assert plots.ppl_vs_bits(old, tmp_path / "old.png").is_file()
    with pytest.raises(ValueError, match=r"no recipe has avg_bits with ppl_ratio \(or ppl beside fp16's\); got "
                                         r"\['kivi-2'\]"):
        plots.ppl_vs_bits({"kivi-2": {"ppl": 12.5, "avg_bits": 2.5}}, tmp_path / "none.png")


def test_the_frontier_from_a_bench_quality_json(tmp_path, capsys):
    results = tmp_path / "quality.json"
    results.write_text(json.dumps({"recipes": CROWDED, "windows": 4, "seq_len": 1024, "perturb_seeds": [1, 2]}))
    assert plots.main([str(results), str(tmp_path / "q.png")]) == 0
    assert (tmp_path / "q.png").is_file() and capsys.readouterr().out.strip() == str(tmp_path / "q.png")
    results.write_text("{}")
    assert plots.main([str(results), str(tmp_path / "q.png")]) == 2


def _layer_ticks(fig) -> list[list[str]]:
    """The tick labels of every layer axis of `fig` (the y axes labelled "layer"), as drawn, within the axes' view."""
    fig.draw_without_rendering()
    out = []
    for ax in fig.axes:
        if ax.get_ylabel() != "layer":
            continue
        lo, hi = sorted(ax.get_ylim())
        out.append([t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi])
    return out


def test_a_three_layer_heatmap_is_ticked_on_whole_layers():
    """A 3-layer layer x position heatmap: its layer axis reads 0, 1, 2 (matplotlib's default ticks on a 3-row image
    are -0.5, 0.0, 0.5, ..., 2.5: half layers that do not exist)."""
    values = [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]
    fig = plots.heatmap_figure(values, [0, 128], "next-token KL, one layer quantized", "magma")
    assert _layer_ticks(fig) == [["0", "1", "2"]]


def test_every_layer_axis_of_the_channel_overview_is_ticked_on_whole_layers():
    """The kv_channels overview (a layer x channel image per K pre-RoPE, K post-RoPE, V) of a 3-layer model."""
    import numpy as np

    rng = np.random.default_rng(0)
    stats = {key: rng.random((3, 2, 16)) for key, _ in plots._PANELS}  # [n_layers, n_kv_heads, head_dim]
    assert _layer_ticks(plots.overview_figure(stats)) == [["0", "1", "2"]] * 3


def test_a_forty_layer_heatmap_keeps_whole_layer_ticks_and_few_of_them():
    values = [[float(i)] for i in range(40)]
    (ticks,) = _layer_ticks(plots.heatmap_figure(values, [0], "t", "viridis"))
    assert all(t.isdigit() for t in ticks) and 3 <= len(ticks) <= 12, ticks
