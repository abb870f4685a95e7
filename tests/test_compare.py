"""The compare stage on evaluation folders that hold their detections: differences with bootstrap CIs, the
per-class table, the accuracy-vs-latency chart, and what goes to the tracker."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import random_evaluation

from qatpipe.errors import QatpipeError
from qatpipe.fileio import write_json
from qatpipe.metrics.coco import GroundTruth, evaluate_detections, write_coco_files
from qatpipe.models.base import Detections
from qatpipe.metrics.comparison_charts import differences_figure, plot_differences
from qatpipe.metrics.comparison_report import report
from qatpipe.metrics.comparisons import comparisons_from_metrics, pair_metrics, split_pair, verdict
from qatpipe.stages.compare import compare_variants
from qatpipe.tracking.records import StageRecord

CLASSES = ["car", "pedestrian", "cyclist"]


def _evaluation(folder, truth, detections, latency_ms: float | None = None, cpu_int8: dict | None = None):
    """An evaluation folder as evaluate (and validate, with a benchmark) writes it."""
    folder.mkdir()
    metrics = evaluate_detections(truth, detections, CLASSES)
    write_json(folder / "metrics.json", {**metrics.to_dict(), "model_size_mb": 1.0})
    write_coco_files(truth, detections, CLASSES, folder / "ground_truth.json", folder / "detections.json")
    if latency_ms is not None:
        bench = {"batches": [{"batch_size": 1, "latency_ms_p50": latency_ms, "latency_ms_p99": 2 * latency_ms,
                              "throughput": 400.0 / latency_ms}]}
        write_json(folder / "bench.json", {**bench, **({"cpu_int8": cpu_int8} if cpu_int8 else {})})
    return folder, metrics


def _worse(detections: list[Detections]) -> list[Detections]:
    """The same detections with every box shifted by a third of its size: most fall below IoU 0.5."""
    shifted = []
    for det in detections:
        size = det.boxes[:, 2:] - det.boxes[:, :2]
        offset = np.concatenate([size / 3, size / 3], axis=1)
        shifted.append(Detections(det.boxes + offset, det.scores, det.classes))
    return shifted


def test_differences_in_tensorrts_numbers_beside_the_engines(tmp_path):
    """Where validation scored a fast CPU INT8 engine's exact form (tensorrt_emulated/), compare gives the
    differences in those numbers too: the CPU engine can be worse while TensorRT's numbers are not."""
    truth, detections = random_evaluation(10, images=40, max_detections=8)
    fp32, _ = _evaluation(tmp_path / "fp32", truth, detections)
    qat, _ = _evaluation(tmp_path / "qat", truth, _worse(detections))  # the CPU engine: worse
    _evaluation(qat / "tensorrt_emulated", truth, detections)  # TensorRT's numbers: as FP32
    summary = compare_variants({"fp32": fp32, "qat": qat}, tmp_path / "out", resamples=200, seed=0)
    assert summary["comparisons"]["qat-fp32"]["map50"]["ci95"][1] < 0  # the engine: fp32 better
    assert summary["comparisons_tensorrt_emulated"]["qat-fp32"]["map50"] == {"diff": 0.0, "ci95": [0.0, 0.0]}
    table = (tmp_path / "out" / "comparison.md").read_text()
    assert "The same in TensorRT's numbers (INT8 in the exact form, FP16 forms as FP16 rounds them), paired bootstrap" \
        in table
    assert StageRecord.read(tmp_path / "out").metrics["tensorrt.qat-fp32.map50_diff"] == 0.0
    plain = compare_variants({"fp32": fp32, "ptq": fp32}, tmp_path / "plain", resamples=50)
    assert "comparisons_tensorrt_emulated" not in plain  # nothing emulated: no second table


def test_compare_reports_differences_with_their_confidence_intervals(tmp_path, caplog):
    truth, detections = random_evaluation(10, images=60, max_detections=8)
    fp32, fp32_metrics = _evaluation(tmp_path / "fp32", truth, detections, latency_ms=4.0)
    ptq, _ = _evaluation(tmp_path / "ptq", truth, detections, latency_ms=1.5)  # the same detections as FP32
    qat, qat_metrics = _evaluation(tmp_path / "qat", truth, _worse(detections), latency_ms=1.2)
    out = tmp_path / "compare"
    with caplog.at_level("INFO", logger="qatpipe.stages.compare"):
        summary = compare_variants({"fp32": fp32, "ptq": ptq, "qat": qat}, out, resamples=1000, seed=5)

    assert summary["bootstrap"] == {"images": 60, "resamples": 1000, "seed": 5}
    assert list(summary["comparisons"]) == ["qat-fp32", "ptq-fp32", "qat-ptq"]
    assert summary["comparisons"]["ptq-fp32"] == {"map50": {"diff": 0.0, "ci95": [0.0, 0.0]},
                                                  "map": {"diff": 0.0, "ci95": [0.0, 0.0]}}
    qat_fp32 = summary["comparisons"]["qat-fp32"]
    assert qat_fp32["map50"]["diff"] == pytest.approx(qat_metrics.map50 - fp32_metrics.map50, abs=1e-9)
    assert qat_fp32["map"]["diff"] == pytest.approx(qat_metrics.map - fp32_metrics.map, abs=1e-9)
    for estimate in qat_fp32.values():
        low, high = estimate["ci95"]
        assert low <= estimate["diff"] <= high < 0  # shifted boxes: clearly worse
    row = summary["variants"]["fp32"]
    assert row["map50_ci95_lo"] < row["map50"] < row["map50_ci95_hi"]
    assert row["map_ci95_lo"] < row["map"] < row["map_ci95_hi"]
    assert summary["per_class_ap50"]["car"] == {"objects": fp32_metrics.per_class["car"]["num_gt"],
                                                "fp32": fp32_metrics.per_class["car"]["ap50"],
                                                "ptq": fp32_metrics.per_class["car"]["ap50"],
                                                "qat": qat_metrics.per_class["car"]["ap50"]}
    assert json.loads((out / "summary.json").read_text()) == summary

    table = (out / "comparison.md").read_text()
    diff = qat_fp32["map50"]
    assert (f"| qat-fp32 | mAP@0.5 | {100 * diff['diff']:+.2f} | [{100 * diff['ci95'][0]:+.2f}, "
            f"{100 * diff['ci95'][1]:+.2f}] | fp32 better |") in table
    assert "| ptq-fp32 | mAP@0.5 | +0.00 | [+0.00, +0.00] | no significant difference |" in table
    assert "60 images, 1000 resamples, seed 5" in table
    assert f"| fp32 | {row['map50']:.4f} [{row['map50_ci95_lo']:.4f}, {row['map50_ci95_hi']:.4f}] |" in table
    assert "| class | objects | fp32 | ptq | qat |" in table
    cyclist = "| cyclist | 0 | n/a | n/a | n/a |"  # no ground truth: no AP
    assert cyclist in table
    assert (out / "accuracy_latency.png").stat().st_size > 5000
    assert (out / "differences.png").stat().st_size > 5000  # the forest plot of the differences
    # the forest plot, the bar chart and the accuracy-vs-latency chart
    assert (out / "comparison.html").read_text().count("data:image/png;base64,") == 3
    assert "fp32 better" in caplog.text and "no significant difference" in caplog.text

    record = StageRecord.read(out)
    assert record.metrics["qat-fp32.map50_diff"] == diff["diff"]
    assert [record.metrics["qat-fp32.map50_ci95_lo"], record.metrics["qat-fp32.map50_ci95_hi"]] == diff["ci95"]
    assert record.metrics["fp32.map50_ci95_lo"] == row["map50_ci95_lo"]
    assert record.params["bootstrap_resamples"] == 1000 and record.params["bootstrap_seed"] == 5
    assert {"accuracy_latency.png", "differences.png", "comparison.png"} <= set(record.artifacts)

    again = compare_variants({"fp32": fp32, "ptq": ptq, "qat": qat}, tmp_path / "again", resamples=1000, seed=5)
    assert again["comparisons"] == summary["comparisons"]  # seeded
    other = compare_variants({"fp32": fp32, "qat": qat}, tmp_path / "other", resamples=1000, seed=6)
    assert list(other["comparisons"]) == ["qat-fp32"]  # only the pairs whose variants both were evaluated
    assert other["comparisons"]["qat-fp32"]["map50"]["ci95"] != diff["ci95"]


def test_the_forest_plot_draws_every_pair_the_summary_holds(tmp_path):
    """differences.png: one row per pair of summary.json's differences, whatever their names (here a fourth
    variant's pair added by hand, as any new variant brings its own), each point at its difference in points
    with its CI as a horizontal bar, coloured by where the CI lies, its figures printed beside it; TensorRT's
    numbers as open diamonds in the same rows; the gate's budget dashed on the a-fp32 rows only."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    from qatpipe.stages.validate import REPORT_FILE as VALIDATION_FILE

    truth, detections = random_evaluation(10, images=40, max_detections=8)
    folders = {"fp32": _evaluation(tmp_path / "fp32", truth, detections)[0],
               "ptq": _evaluation(tmp_path / "ptq", truth, detections)[0],
               "qat": _evaluation(tmp_path / "qat", truth, _worse(detections))[0]}  # the CPU engine: worse
    _evaluation(folders["qat"] / "tensorrt_emulated", truth, detections)  # TensorRT's numbers: as FP32
    for name, folder in folders.items():
        write_json(folder / VALIDATION_FILE, {"passed": name != "qat", "max_map_drop": 0.02})
    summary = compare_variants(folders, tmp_path / "out", resamples=200, seed=0)
    assert summary["max_map_drop"] == {"fp32": 0.02, "ptq": 0.02, "qat": 0.02}
    assert (tmp_path / "out" / "differences.png").stat().st_size > 5000
    assert "differences.png" in StageRecord.read(tmp_path / "out").artifacts

    # a fourth variant: no code names it; its pair is a row like the others, with its own budget
    summary["variants"]["ptq-partial"] = {"map50": 0.5}
    summary["max_map_drop"]["ptq-partial"] = 0.03
    summary["comparisons"]["ptq-partial-fp32"] = {"map50": {"diff": -0.012, "ci95": [-0.025, 0.004]},
                                                  "map": {"diff": -0.01, "ci95": [-0.02, 0.001]}}
    pairs = ["qat-fp32", "ptq-fp32", "qat-ptq", "ptq-partial-fp32"]
    assert plot_differences(summary, tmp_path / "four.png").stat().st_size > 5000
    fig = differences_figure(summary)
    ax = fig.axes[0]
    rows = {label.get_text(): y for label, y in zip(ax.get_yticklabels(), ax.get_yticks())}
    assert sorted(rows, key=rows.get, reverse=True) == pairs  # one row each, top to bottom in the summary's order

    def drawn(marker):
        """(row, x, colour) of each point drawn with `marker`; the y offset within a row rounded away."""
        return sorted((round(line.get_ydata()[0]), line.get_xdata()[0], line.get_color()) for line in ax.lines
                      if line.get_marker() == marker)

    engines = drawn("o")
    assert [row for row, _, _ in engines] == sorted(rows.values())  # a point per row
    for pair in pairs:
        (_, x, colour), = [point for point in engines if point[0] == rows[pair]]
        estimate = summary["comparisons"][pair]["map50"]
        assert x == pytest.approx(100 * estimate["diff"])  # in points
        side = "below" if estimate["ci95"][1] < 0 else "above" if estimate["ci95"][0] > 0 else "holds"
        assert colour == {"below": "tab:red", "above": "tab:blue", "holds": "0.45"}[side]
    assert dict((row, colour) for row, _, colour in engines)[rows["qat-fp32"]] == "tab:red"  # fp32 better
    emulated = drawn("D")  # TensorRT's numbers, in the rows of the pairs they hold
    assert [row for row, _, _ in emulated] == sorted(rows[pair] for pair in summary["comparisons_tensorrt_emulated"])
    assert dict((row, x) for row, x, _ in emulated)[rows["qat-fp32"]] == 0.0  # as FP32 there
    # the CI bars: a horizontal segment per point, from the CI's low to its high end, in points
    bars = [segment for collection in ax.collections if not collection.get_linestyle()[0][1]
            for segment in collection.get_segments() if segment[0][1] == segment[1][1]]
    assert len(bars) == len(engines) + len(emulated)
    low, high = summary["comparisons"]["qat-fp32"]["map50"]["ci95"]
    assert any(np.allclose(segment[:, 0], [100 * low, 100 * high]) for segment in bars)
    # the budget: dashed at -100 x max_map_drop, on the a-fp32 rows and no other
    dashed = [segment for collection in ax.collections if isinstance(collection, LineCollection)
              and collection.get_linestyle()[0][1] for segment in collection.get_segments()]
    budget = {round(segment[:, 1].mean()): segment[0][0] for segment in dashed}
    assert budget == {rows["qat-fp32"]: -2.0, rows["ptq-fp32"]: -2.0, rows["ptq-partial-fp32"]: -3.0}
    assert any(line.get_xdata()[0] == 0 and line.get_linestyle() == "-" for line in ax.lines)  # the zero line
    texts = [text.get_text() for text in ax.texts]  # the figures beside each point
    qat_fp32 = summary["comparisons"]["qat-fp32"]["map50"]
    assert (f"engine   {100 * qat_fp32['diff']:+6.2f} [{100 * qat_fp32['ci95'][0]:+6.2f}, "
            f"{100 * qat_fp32['ci95'][1]:+6.2f}]  fp32 better") in texts
    assert "engine    -1.20 [ -2.50,  +0.40]  no significant difference" in texts
    assert "TensorRT  +0.00 [ +0.00,  +0.00]  no significant difference" in texts
    assert len(texts) == len(engines) + len(emulated)
    plt.close(fig)
    assert differences_figure({"variants": {}, "comparisons": {}}) is None


def test_files_the_same_byte_for_byte_are_matched_and_resampled_once(tmp_path, monkeypatch):
    """ptq-partial that kept no layer float holds PTQ's files, and a TensorRT-emulated folder can hold what another
    variant's engine found: compare matches and resamples each distinct file once, in both of its bootstraps,
    and every name gets that file's figures."""
    from qatpipe.metrics import bootstrap
    from qatpipe.stages import compare

    calls = {"match": 0, "resample": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            if name == "match" or len(args[1]) > 1:  # weighted_maps: resampled weights, not the point estimate
                calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(compare, "match_detections", counted("match", compare.match_detections))
    monkeypatch.setattr(bootstrap, "weighted_maps", counted("resample", bootstrap.weighted_maps))
    truth, detections = random_evaluation(10, images=40, max_detections=8)
    worse = _worse(detections)
    found = {"fp32": detections, "ptq": worse, "ptq-partial": worse, "qat": _worse(worse)}
    folders = {name: _evaluation(tmp_path / name, truth, found[name])[0] for name in found}
    _evaluation(folders["fp32"] / "tensorrt_emulated", truth, worse)  # TensorRT's numbers: PTQ's engine's file
    summary = compare_variants(folders, tmp_path / "out", resamples=200, seed=0)
    assert calls == {"match": 3, "resample": 3}  # three distinct files in eight places
    assert summary["comparisons"]["ptq-partial-ptq"]["map50"] == {"diff": 0.0, "ci95": [0.0, 0.0]}
    # TensorRT's fp32 is PTQ's engine's file: the same matching and resampling, so the same figures exactly
    assert summary["comparisons_tensorrt_emulated"]["qat-fp32"] == summary["comparisons"]["qat-ptq"]
    assert summary["comparisons"]["qat-fp32"]["map50"]["ci95"][1] < 0  # and they differ from the engine's fp32


def test_the_fourth_variant_ptq_partial_gets_its_differences_and_forest_plot_rows(tmp_path):
    """The pipeline's four variants: ptq-partial (PTQ with its sensitive layers float) against FP32, against PTQ
    (what keeping those layers float won) and QAT against it join the differences, summary.json, the tables
    and the forest plot, its name split right though it holds "-"; its gate budget dashed on its -fp32 row."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    from qatpipe.stages.validate import REPORT_FILE as VALIDATION_FILE

    truth, detections = random_evaluation(10, images=40, max_detections=8)
    found = {"fp32": detections, "ptq": _worse(detections), "ptq-partial": detections, "qat": detections}
    folders = {name: _evaluation(tmp_path / name, truth, found[name], latency_ms=latency)[0]
               for name, latency in (("fp32", 4.0), ("ptq", 1.2), ("ptq-partial", 1.6), ("qat", 1.2))}
    for name, folder in folders.items():
        write_json(folder / VALIDATION_FILE, {"passed": name != "ptq", "max_map_drop": 0.02})
    out = tmp_path / "out"
    summary = compare_variants(folders, out, resamples=200, seed=0)

    pairs = ["qat-fp32", "ptq-fp32", "ptq-partial-fp32", "ptq-partial-ptq", "qat-ptq", "qat-ptq-partial"]
    assert list(summary["variants"]) == ["fp32", "ptq", "ptq-partial", "qat"]
    assert list(summary["comparisons"]) == pairs
    gained = summary["comparisons"]["ptq-partial-ptq"]["map50"]
    assert gained["ci95"][0] > 0  # the float layers won back what PTQ lost, on every resample
    assert summary["comparisons"]["ptq-partial-fp32"]["map50"] == {"diff": 0.0, "ci95": [0.0, 0.0]}
    assert summary["validation"] == {"fp32": True, "ptq": False, "ptq-partial": True, "qat": True}
    assert summary["max_map_drop"]["ptq-partial"] == 0.02
    assert json.loads((out / "summary.json").read_text()) == summary
    table = (out / "comparison.md").read_text()
    assert (f"| ptq-partial-ptq | mAP@0.5 | {100 * gained['diff']:+.2f} | [{100 * gained['ci95'][0]:+.2f}, "
            f"{100 * gained['ci95'][1]:+.2f}] | ptq-partial better |") in table
    assert "| qat-ptq-partial | mAP@0.5 | +0.00 | [+0.00, +0.00] | no significant difference |" in table
    assert "| ptq-partial-fp32 | mAP@0.5 | +0.00 | [+0.00, +0.00] | no significant difference |" in table
    assert "ptq FAILED, ptq-partial passed, qat passed; gate (QAT): PASSED" in table
    assert "| class | objects | fp32 | ptq | ptq-partial | qat |" in table
    assert (out / "comparison.html").read_text().count("data:image/png;base64,") == 3
    record = StageRecord.read(out)
    assert record.metrics["ptq-partial-ptq.map50_diff"] == gained["diff"]
    assert record.metrics["ptq-partial.map50"] == summary["variants"]["ptq-partial"]["map50"]
    assert record.params["variants"] == "fp32,ptq,ptq-partial,qat"

    # the forest plot: a row per pair in that order, the gate's budget on the three a-fp32 rows
    fig = differences_figure(summary)
    ax = fig.axes[0]
    rows = {label.get_text(): y for label, y in zip(ax.get_yticklabels(), ax.get_yticks())}
    assert sorted(rows, key=rows.get, reverse=True) == pairs
    points = {round(line.get_ydata()[0]): line for line in ax.lines if line.get_marker() == "o"}
    assert points[rows["ptq-partial-ptq"]].get_color() == "tab:blue"  # CI above 0: a (ptq-partial) better
    assert points[rows["ptq-fp32"]].get_color() == "tab:red"
    dashed = [segment for collection in ax.collections if isinstance(collection, LineCollection)
              and collection.get_linestyle()[0][1] for segment in collection.get_segments()]
    assert {round(segment[:, 1].mean()) for segment in dashed} == {rows[p] for p in pairs if p.endswith("-fp32")}
    assert any(text.get_text().endswith("ptq-partial better") for text in ax.texts)
    plt.close(fig)


@pytest.mark.parametrize("spread", [0.0, 0.003, 0.01, None])
def test_tradeoff_labels_of_close_points_do_not_overlap(spread):
    """The default run's qat and fp32 sit at nearly one mAP, qat's long label reaching over fp32's point (and
    ptq near them; None: all four variants on one point): each label is placed clear of the others, measured as
    the saved figure lays them out, where one fixed offset printed them over each other."""
    import matplotlib.pyplot as plt

    from qatpipe.metrics.comparison_charts import label_extent, tradeoff_figure

    points = ({"fp32": (2.0, 0.62, "fp32"), "ptq": (1.25, 0.61 - spread, "int8"), "qat": (1.2, 0.62 - spread, "int8")}
              if spread is not None else dict.fromkeys(("unpruned", "fp32", "ptq", "qat"), (1.0, 0.5, "int8")))
    variants = {name: {"latency_ms_p50": latency, "map50": map50, "engine": f"onnxruntime cpu {precision}",
                       "map50_ci95_lo": map50 - 0.03, "map50_ci95_hi": map50 + 0.03}
                for name, (latency, map50, precision) in points.items()}
    label = {name: f"{name} ({row['engine']})" for name, row in variants.items()}
    fig = tradeoff_figure(variants)
    fig.tight_layout()  # as _save does before writing the PNG
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    boxes = {text.get_text(): label_extent(text, renderer) for text in ax.texts}
    assert set(boxes) == set(label.values())
    clashes = [(a, b) for a in boxes for b in boxes if a < b and boxes[a].overlaps(boxes[b])]
    assert not clashes
    assert all(fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
               for box in boxes.values())
    if spread == 0:  # what one fixed offset (6, 6) did with the same points: qat's label over fp32's
        naive = [label_extent(ax.annotate(label[name], (variants[name]["latency_ms_p50"], variants[name]["map50"]),
                                          textcoords="offset points", xytext=(6, 6), fontsize=8), renderer)
                 for name in ("qat", "fp32")]
        assert naive[0].overlaps(naive[1])
    plt.close(fig)


def test_without_detections_there_is_no_interval(tmp_path):
    truth, detections = random_evaluation(11, images=10)
    fp32, _ = _evaluation(tmp_path / "fp32", truth, detections)
    for name in ("detections.json", "ground_truth.json"):
        (fp32 / name).unlink()
    summary = compare_variants({"fp32": fp32}, tmp_path / "out")
    assert "comparisons" not in summary and "bootstrap" not in summary
    assert "map50_ci95_lo" not in summary["variants"]["fp32"]
    assert not (tmp_path / "out" / "accuracy_latency.png").exists()  # no benchmark: no latency to plot
    assert not (tmp_path / "out" / "differences.png").exists()  # no differences: no forest plot
    assert "differences.png" not in StageRecord.read(tmp_path / "out").artifacts
    assert "Differences" not in (tmp_path / "out" / "comparison.md").read_text()


def test_variants_scored_on_other_images_are_refused(tmp_path):
    truth, detections = random_evaluation(12, images=10)
    fp32, _ = _evaluation(tmp_path / "fp32", truth, detections)
    moved = [GroundTruth(gt.boxes + 1, gt.classes) for gt in truth]
    qat, _ = _evaluation(tmp_path / "qat", moved, detections)
    with pytest.raises(QatpipeError, match="qat were evaluated on other val images or labels than fp32"):
        compare_variants({"fp32": fp32, "qat": qat}, tmp_path / "out")


def test_the_bootstrap_takes_other_pairs_for_the_benches(tmp_path):
    """bench/dla.py and ptq_tools.py pair their own variants through compare.uncertainty, same checks."""
    from qatpipe.stages.compare import uncertainty

    truth, detections = random_evaluation(12, images=10)
    qdq, _ = _evaluation(tmp_path / "qdq", truth, detections)
    dla, _ = _evaluation(tmp_path / "dla", truth, _worse(detections))
    pairs = uncertainty({"qdq": qdq, "dla": dla}, pairs=[("dla", "qdq")])["pairs"]
    assert list(pairs) == ["dla-qdq"] and pairs["dla-qdq"]["map50"]["ci95"][1] < 0  # worse on every image
    assert uncertainty({"qdq": qdq, "dla": dla})["pairs"] == {}  # the pipeline's pairs: none of these names
    moved, _ = _evaluation(tmp_path / "moved", [GroundTruth(gt.boxes + 1, gt.classes) for gt in truth], detections)
    with pytest.raises(QatpipeError, match="moved were evaluated on other val images"):
        uncertainty({"qdq": qdq, "moved": moved}, pairs=[("moved", "qdq")])


def test_flat_metrics_round_trip_and_verdicts():
    comparisons = {"qat-fp32": {"map50": {"diff": -0.01, "ci95": [-0.03, 0.01]},
                                "map": {"diff": 0.02, "ci95": [0.005, 0.04]}}}
    flat = pair_metrics(comparisons)
    assert flat == {"qat-fp32.map50_diff": -0.01, "qat-fp32.map50_ci95_lo": -0.03, "qat-fp32.map50_ci95_hi": 0.01,
                    "qat-fp32.map_diff": 0.02, "qat-fp32.map_ci95_lo": 0.005, "qat-fp32.map_ci95_hi": 0.04}
    assert comparisons_from_metrics(flat) == comparisons
    assert verdict("qat-fp32", [-0.03, 0.01]) == "no significant difference"
    assert verdict("qat-fp32", [0.005, 0.04]) == "qat better"
    assert verdict("qat-fp32", [-0.04, -0.005]) == "fp32 better"
    # a variant's name may hold "-": the variants' names split the pair
    assert split_pair("ptq-partial-fp32", ["fp32", "ptq-partial"]) == ("ptq-partial", "fp32")
    assert split_pair("qat-ptq-partial", ["qat", "ptq-partial"]) == ("qat", "ptq-partial")
    assert split_pair("qat-fp32") == ("qat", "fp32")
    assert verdict("ptq-partial-fp32", [0.005, 0.04], ["fp32", "ptq-partial"]) == "ptq-partial better"
    text = report({"variants": {"qat": {"map50": 0.8}}, "comparisons": comparisons})
    assert "qat-fp32  mAP@0.5       -1.00                [-3.00, +1.00]   no significant difference" in text


def test_the_ptq_row_says_what_quantized_it(tmp_path):
    """validate records a PTQ model's tool, version and method (its ONNX metadata, stages/ptq.py); the summary's
    row and the table's "INT8 by" column carry it, and the column is absent when no variant has it."""
    from qatpipe.stages.validate import REPORT_FILE as VALIDATION_FILE

    truth, detections = random_evaluation(3, images=20, max_detections=6)
    fp32, _ = _evaluation(tmp_path / "fp32", truth, detections)
    ptq, _ = _evaluation(tmp_path / "ptq", truth, detections)
    write_json(ptq / VALIDATION_FILE, {"passed": True, "quantized_by": "modelopt 0.47.0, entropy"})
    summary = compare_variants({"fp32": fp32, "ptq": ptq}, tmp_path / "out", resamples=20)
    assert summary["variants"]["ptq"]["quantized_by"] == "modelopt 0.47.0, entropy"
    assert summary["variants"]["fp32"]["quantized_by"] is None
    table = (tmp_path / "out" / "comparison.md").read_text()
    assert "INT8 by" in table and "modelopt 0.47.0, entropy" in table
    (ptq / VALIDATION_FILE).unlink()
    compare_variants({"fp32": fp32, "ptq": ptq}, tmp_path / "plain", resamples=20)
    assert "INT8 by" not in (tmp_path / "plain" / "comparison.md").read_text()


@pytest.mark.parametrize("flags", [frozenset({"avx2", "avx512_vnni", "amx_int8"}), frozenset({"avx2", "fma"})],
                         ids=["vnni", "no-vnni"])
def test_cpu_int8_speed_ups_name_the_cpus_int8_support(tmp_path, flags):
    """Each int8 CPU engine's row names how the CPU that benchmarked it ran int8 (bench.json's `cpu_int8`, the
    engines' own decision) in a column beside its speed-up, and says so where the speed is not TensorRT's; the
    stage's record (the MLflow comparison's tags) carries the same words. The flags are passed in, as two kinds
    of CPU report them."""
    from qatpipe.engines.onnxruntime_backend import cpu_int8, cpu_form_for, int8_kernels_exact

    form = "fast" if int8_kernels_exact(flags, "x86_64") else "exact"  # what engine.cpu_form auto builds there
    assert cpu_form_for("auto") == ("fast" if int8_kernels_exact() else "exact")  # ... as it does here
    support = cpu_int8(form, flags, "x86_64")
    truth, detections = random_evaluation(3, images=20, max_detections=6)
    folders = {"fp32": _evaluation(tmp_path / "fp32", truth, detections, latency_ms=4.0)[0],
               "qat": _evaluation(tmp_path / "qat", truth, detections, latency_ms=2.0, cpu_int8=support)[0]}
    summary = compare_variants(folders, tmp_path / "out", resamples=20)
    assert summary["variants"]["qat"]["cpu_int8"] == support["note"] and summary["variants"]["fp32"]["cpu_int8"] is None
    table = (tmp_path / "out" / "comparison.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| variant"))
    assert "| speed-up vs FP32 | CPU int8 |" in header  # beside the speed-up
    assert f"| 2.00x | {support['note']} |" in table
    assert "| 1.00x | n/a |" in table  # the FP32 engine: no int8
    not_tensorrt = "speeds are not TensorRT's" in table
    assert not_tensorrt == (not int8_kernels_exact(flags, "x86_64"))
    assert ("no VNNI/AMX" in table) == not_tensorrt
    assert StageRecord.read(tmp_path / "out").params["qat.cpu_int8"] == support["note"]
    # `qatpipe compare` prints the rows MLflow gives back the same way
    assert f"{support['note']}" in report({"variants": {"qat": {"map50": 0.5, "cpu_int8": support["note"]}}})
    plain = compare_variants({"fp32": folders["fp32"]}, tmp_path / "plain", resamples=20)
    assert "CPU int8" not in report(plain)  # no int8 CPU engine: no column
