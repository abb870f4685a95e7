"""The comparison of model variants as charts (matplotlib, Agg): mAP bars per variant, the forest plot of the
paired differences and accuracy against latency, with labels placed clear of one another."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from qatpipe.metrics.comparison_report import VARIANT_COLUMNS
from qatpipe.metrics.comparisons import ci_side, split_pair, verdict


def plot_variants(variants: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """Grouped bars: mAP@0.5 and mAP@[.5:.95] per variant (the accuracy side of the FP32/PTQ/QAT trade), with
    their 95% CIs where known."""
    import numpy as np

    plt = _pyplot()
    names = list(variants)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(names), 3.6))
    for offset, key in ((-0.2, "map50"), (0.2, "map")):
        values = [variants[n].get(key) or 0.0 for n in names]
        bars = ax.bar(x + offset, values, width=0.4, label=VARIANT_COLUMNS[key][0],
                      yerr=_error_bars([variants[n] for n in names], key), capsize=3)
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("mAP (val)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Variants")
    return _save(fig, path)


# forest plot: summary key -> (marker, filled, what its rows measured); colours by where the 95% CI lies
DIFFERENCE_SETS = {"comparisons": ("o", True, "engines as validated"),
                   "comparisons_tensorrt_emulated": ("D", False, "TensorRT's numbers")}
SIGNIFICANCE_COLOURS = {"above": ("tab:blue", "CI above 0: a better"),
                        "below": ("tab:red", "CI below 0: b better"),
                        "holds": ("0.45", "CI holds 0: no significant difference")}
BUDGET_COLOUR = "tab:orange"


def plot_differences(summary: dict[str, Any], path: str | Path, metric: str = "map50") -> Path | None:
    """The forest plot of the paired differences (differences_figure) as a PNG; None when the summary has none."""
    fig = differences_figure(summary, metric)
    return None if fig is None else _save(fig, path)


def differences_figure(summary: dict[str, Any], metric: str = "map50"):
    """A forest plot of summary.json's paired differences in `metric`: one row per pair a-b the summary holds
    (`comparisons`, then any only in `comparisons_tensorrt_emulated`; none named in code), top to bottom in its
    order. Each difference is a point in mAP points (x100) with its 95% CI as a horizontal bar, filled circles for
    the engines as validated and open diamonds beside them for TensorRT's numbers; coloured by where the CI lies
    (blue above 0: a better, red below: b better, grey holding 0: no significant difference) and printed right of
    its row with the verdict. A solid line marks 0; on the rows a-fp32 a dashed line marks the drop a's
    validation gate allowed (-validate.max_map_drop, summary `max_map_drop`), the line an interval must stay
    right of for the gate to pass with room. None when the summary holds no difference in `metric`."""
    from matplotlib.lines import Line2D
    from matplotlib.transforms import blended_transform_factory

    sets = [(key, summary.get(key) or {}) for key in DIFFERENCE_SETS]
    sets = [(key, comparisons) for key, comparisons in sets
            if any(metric in metrics for metrics in comparisons.values())]
    pairs = list(dict.fromkeys(pair for _, comparisons in sets for pair, metrics in comparisons.items()
                               if metric in metrics))
    if not pairs:
        return None
    names = list(summary.get("variants", {}))
    budgets = summary.get("max_map_drop") or {}
    plt = _pyplot()
    row_height = 0.3 + 0.22 * len(sets)  # inches
    fig, (ax, key) = plt.subplots(2, 1, figsize=(9, 1.9 + row_height * len(pairs)),
                                  gridspec_kw={"height_ratios": [row_height * len(pairs) + 0.4, 0.5]})
    spacing = 0.36 / len(sets)
    offsets = [spacing * ((len(sets) - 1) / 2 - i) for i in range(len(sets))]  # the sets, top to bottom in a row
    xs, colours, budget_values = [0.0], set(), set()
    for row, pair in enumerate(pairs):
        y = len(pairs) - 1 - row
        a, b = split_pair(pair, names)
        budget = budgets.get(a) if b == "fp32" else None
        if budget is not None:
            ax.vlines(-100 * budget, y - 0.45, y + 0.45, colors=BUDGET_COLOUR, linestyles="--", lw=1.3, zorder=1)
            xs.append(-100 * budget)
            budget_values.add(budget)
        for (set_key, comparisons), dy in zip(sets, offsets):
            estimate = comparisons.get(pair, {}).get(metric)
            if estimate is None:
                continue
            marker, filled, what = DIFFERENCE_SETS[set_key]
            diff, low, high = (100 * value for value in (estimate["diff"], *estimate["ci95"]))
            where = ci_side(estimate["ci95"])
            colour = SIGNIFICANCE_COLOURS[where][0]
            colours.add(where)
            finite = all(math.isfinite(value) for value in (diff, low, high))
            if finite:
                ax.errorbar(diff, y + dy, xerr=[[max(diff - low, 0.0)], [max(high - diff, 0.0)]], fmt=marker,
                            color=colour, mfc=colour if filled else "white", mec=colour, ms=6, capsize=3, lw=1.5,
                            zorder=3)
                xs += [low, high, diff]
            figures = (f"{diff:+6.2f} [{low:+6.2f}, {high:+6.2f}]  {verdict(pair, estimate['ci95'], names)}"
                       if finite else "n/a")
            label = f"{'TensorRT' if set_key != 'comparisons' else 'engine':<8} " if len(sets) > 1 else ""
            ax.annotate(label + figures, xy=(1.02, y + dy), xycoords=("axes fraction", "data"), ha="left",
                        va="center", fontsize=8, family="monospace", color=colour)
    ax.axvline(0, color="0.15", lw=0.9, zorder=2)
    low, high = min(xs), max(xs)
    pad = max(high - low, 1.0) * 0.08
    ax.set_xlim(low - pad, high + pad)
    ax.set_ylim(-0.6, len(pairs) - 0.4)
    ax.set_yticks(range(len(pairs) - 1, -1, -1), pairs)
    ax.grid(axis="x", alpha=0.3)
    bootstrap = summary.get("bootstrap")
    how = (f"; {bootstrap['images']} val images, {bootstrap['resamples']} paired bootstrap resamples"
           if bootstrap else "")
    header = VARIANT_COLUMNS.get(metric, (metric,))[0]
    ax.set_xlabel(f"a − b in {header} (points), 95% CI")
    ax.set_title(f"Paired differences a − b in {header}{how}", loc="left", fontsize=10)  # over the figures too
    handles = [Line2D([], [], color=colour, marker="s", ls="", label=label)
               for where, (colour, label) in SIGNIFICANCE_COLOURS.items() if where in colours]
    if len(sets) > 1:
        handles += [Line2D([], [], color="0.15", marker=DIFFERENCE_SETS[set_key][0], ls="",
                           mfc="0.15" if DIFFERENCE_SETS[set_key][1] else "white", label=DIFFERENCE_SETS[set_key][2])
                    for set_key, _ in sets]
    if budget_values:
        value = (f" −{100 * next(iter(budget_values)):.2f} points" if len(budget_values) == 1 else "")
        handles.append(Line2D([], [], color=BUDGET_COLOUR, ls="--",
                              label=f"validation gate's budget{value} (a − fp32 rows; validate.max_map_drop)"))
    key.axis("off")  # the legend's row, centred on the figure (the plot's axes leave the figures room)
    key.legend(handles=handles, loc="center", ncol=min(len(handles), 3), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.5), bbox_transform=blended_transform_factory(fig.transFigure, key.transAxes))
    return fig


def plot_tradeoff(variants: dict[str, dict[str, Any]], path: str | Path) -> Path | None:
    """Accuracy against latency (tradeoff_figure) as a PNG; None when no variant was benchmarked."""
    fig = tradeoff_figure(variants)
    return None if fig is None else _save(fig, path)


def tradeoff_figure(variants: dict[str, dict[str, Any]]):
    """mAP@0.5 (95% CI bars where known) over p50 latency at batch 1, a labelled point per benchmarked variant,
    the labels placed so that none overlaps another (place_labels); None when no variant was benchmarked."""
    timed = {name: row for name, row in variants.items() if row.get("latency_ms_p50") is not None}
    if not timed:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, row in timed.items():
        ax.errorbar(row["latency_ms_p50"], row["map50"], yerr=_error_bars([row], "map50"), fmt="o", capsize=4)
    with_ci = any(row.get("map50_ci95_lo") is not None for row in timed.values())
    ax.set(xlabel=VARIANT_COLUMNS["latency_ms_p50"][0] + ", batch 1",
           ylabel="mAP@0.5 (val)" + (", 95% CI" if with_ci else ""), title="Accuracy vs latency")
    ax.set_xlim(0, 1.6 * max(row["latency_ms_p50"] for row in timed.values()))  # room for the labels
    ax.grid(alpha=0.3)
    fig.tight_layout()  # the axes' final place first: the labels are placed in display space
    place_labels(ax, [(f"{name} ({row['engine']})" if row.get("engine") else name, row["latency_ms_p50"],
                       row["map50"]) for name, row in timed.items()])
    return fig


LABEL_GAP = 6  # points between a point and its label, and between stacked labels


def place_labels(ax, points: list[tuple[str, float, float]], fontsize: float = 8) -> list:
    """Annotate each (label, x, y) beside its point where it overlaps no label placed before it: the corners
    around the point first, then ever farther above or below it with a leader line. Among those, one clear of
    every marker, inside the axes and nearest its point wins, crossing the fewest error bars. Measured in display
    space (the renderer's extents), so the axes must have their final size and limits; the labels take no part
    in the layout, so a later tight_layout keeps them apart. Returns the annotations, top to bottom."""
    renderer = ax.figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    markers, bars = _obstacles(ax)
    corners = [(LABEL_GAP, LABEL_GAP, "left", "bottom"), (LABEL_GAP, -LABEL_GAP, "left", "top"),
               (-LABEL_GAP, LABEL_GAP, "right", "bottom"), (-LABEL_GAP, -LABEL_GAP, "right", "top")]
    step = fontsize + LABEL_GAP  # one stacked line, in points
    placed, boxes = [], []
    for label, x, y in sorted(points, key=lambda point: -point[2]):  # top to bottom: stacks keep the order
        best = None  # (score, annotation, box)
        for ring in range(len(points) + 2):
            for dx, dy, ha, va in corners:
                offset = (dx, dy + ring * step * (1 if dy > 0 else -1))
                text = ax.annotate(label, (x, y), textcoords="offset points", xytext=offset, fontsize=fontsize,
                                   ha=ha, va=va, annotation_clip=False,
                                   arrowprops=dict(arrowstyle="-", lw=0.6, color="0.5") if ring else None)
                text.set_in_layout(False)
                box = label_extent(text, renderer)
                clear = box.padded(1)
                outside = not (inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1))
                score = (sum(clear.overlaps(other) for other in boxes), sum(clear.overlaps(m) for m in markers),
                         outside, ring, sum(clear.overlaps(bar) for bar in bars))
                if best is None or score < best[0]:
                    if best is not None:
                        best[1].remove()
                    best = (score, text, box)
                else:
                    text.remove()
            if best[0][:3] == (0, 0, False):
                break
        placed.append(best[1])
        boxes.append(best[2])
    return placed


def _obstacles(ax) -> tuple[list, list]:
    """Display boxes a label should not cover: (every marker, error bar caps included; every error bar)."""
    from matplotlib.transforms import Bbox

    scale = ax.figure.dpi / 72  # points to pixels
    markers = []
    for line in ax.lines:
        if line.get_marker() in (None, "", " ", "None", "none"):
            continue
        half = line.get_markersize() * scale / 2
        markers += [Bbox.from_extents(x - half, y - half, x + half, y + half)
                    for x, y in line.get_transform().transform(line.get_xydata())]
    bars = [path.get_extents(collection.get_transform()) for collection in ax.collections
            for path in collection.get_paths()]
    return markers, bars


def label_extent(annotation, renderer):
    """The display-space box of an annotation's text alone (Annotation.get_window_extent adds its leader line)."""
    from matplotlib.text import Text

    annotation.update_positions(renderer)
    return Text.get_window_extent(annotation, renderer)


def _error_bars(rows: list[dict[str, Any]], key: str):
    """matplotlib's yerr (2, n) from the rows' 95% CIs, None when a row has none."""
    if any(row.get(f"{key}_ci95_lo") is None for row in rows):
        return None
    return [[row[key] - row[f"{key}_ci95_lo"] for row in rows], [row[f"{key}_ci95_hi"] - row[key] for row in rows]]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


__all__ = ["plot_variants", "plot_differences", "differences_figure", "plot_tradeoff", "tradeoff_figure",
           "place_labels", "label_extent"]
