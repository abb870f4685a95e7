import json
from pathlib import Path

import pytest
from kfp import dsl

from qatpipe_kfp.compare.component import compare

PRUNE_REPORT = {"params_before": 1000, "params_after": 400, "flops_before": 2_000_000_000,
                "flops_after": 900_000_000, "flops_ratio": 0.45, "params_ratio": 0.4, "groups": []}


def _evaluation(folder: Path, map50: float, map_: float, size: float, throughput: float | None = None,
                passed: bool | None = None, engine: str | None = None, emulated: float | None = None) -> dsl.Artifact:
    """An evaluation folder; with `throughput` / `passed` a validation folder (engine benchmark, gate)."""
    folder.mkdir()
    (folder / "metrics.json").write_text(json.dumps({"map50": map50, "map": map_, "model_size_mb": size}))
    if throughput is not None:
        batches = [{"batch_size": 1, "latency_ms_p50": 1000 / throughput * 2, "latency_ms_p99": 9.0, "throughput": 1},
                   {"batch_size": 8, "latency_ms_p50": 8000 / throughput, "latency_ms_p99": 99.0,
                    "throughput": throughput}]
        (folder / "bench.json").write_text(json.dumps({"batches": batches}))
    if passed is not None:
        validation = {"passed": passed, "engine_label": engine, "max_map_drop": 0.01}
        if engine:  # the engine's compute layers per precision
            int8 = "int8" in engine
            validation["layer_precision"] = {"int8": 15 if int8 else 0, "fp16": 0, "fp32": 0 if int8 else 15}
        (folder / "validation.json").write_text(json.dumps(
            validation if emulated is None else {**validation, "map50_tensorrt_emulated": emulated}))
    return dsl.Artifact(uri=str(folder))


def test_writes_table_chart_summary_and_the_pruning_block(artifact, tmp_path):
    inputs = dict(
        fp32=_evaluation(tmp_path / "fp32", 0.81, 0.52, 1.6, 100.0, True, "onnxruntime cpu fp32"),
        ptq=_evaluation(tmp_path / "ptq", 0.78, 0.49, 0.5, 250.0, False, "onnxruntime cpu int8", 0.775),
        ptq_partial=_evaluation(tmp_path / "ptq-partial", 0.805, 0.50, 0.6, 200.0, True, "onnxruntime cpu int8",
                                0.80),
        qat=_evaluation(tmp_path / "qat", 0.80, 0.51, 0.5, 300.0, True, "onnxruntime cpu int8", 0.805),
        unpruned=_evaluation(tmp_path / "unpruned", 0.82, 0.53, 4.0))
    (tmp_path / "pruned").mkdir()
    (tmp_path / "pruned" / "prune_report.json").write_text(json.dumps(PRUNE_REPORT))
    outputs = dict(summary=artifact(dsl.Artifact, "summary"), table=artifact(dsl.Markdown, "table"),
                   chart=artifact(dsl.HTML, "chart"), metrics=artifact(dsl.Metrics, "metrics"))
    compare.python_func(parent_run_id="", pruned=dsl.Model(uri=str(tmp_path / "pruned")), **inputs, **outputs)
    summary = json.loads((Path(outputs["summary"].path) / "summary.json").read_text())
    assert list(summary["variants"]) == ["fp32", "ptq", "ptq-partial", "qat"]  # the input ptq_partial, named
    assert summary["variants"]["qat"] == {
        "engine": "onnxruntime cpu int8", "layers": "15 / 0 / 0", "map50": 0.80, "map50_tensorrt_emulated": 0.805,
        "map50_dla_emulated": None,  # export.target gpu: no DLA form scored
        "quantized_by": None,  # what quantized a PTQ model; QAT's was trained quantized
        "map": 0.51,
        "latency_ms_p50": 1000 / 300 * 2, "latency_ms_p99": 9.0, "throughput": 300.0,
        "throughput_batch": 8, "speedup_vs_fp32": 3.0, "size_mb": 0.5, "params": 400, "gflops": 0.9,
        "cpu_int8": None}  # the test's bench.json says nothing of the CPU's int8 form
    assert summary["variants"]["fp32"]["speedup_vs_fp32"] == 1.0
    assert summary["pruning"] == {**{k: v for k, v in PRUNE_REPORT.items() if k != "groups"},
                                  "unpruned_map50": 0.82, "unpruned_map": 0.53, "unpruned_size_mb": 4.0,
                                  "fp32_map50_change": -0.01}
    assert summary["validation"] == {"fp32": True, "ptq": False, "ptq-partial": True, "qat": True}
    assert summary["gate_passed"] is True  # the QAT model passed
    assert "mlflow" not in summary  # tracking off
    table = Path(outputs["table"].path).read_text()
    # every row says what it is: the engine's backend, device and precision; and TensorRT's numbers for INT8
    assert ("| variant | engine | compute layers INT8 / FP16 / FP32 | mAP@0.5 | mAP@0.5, TensorRT's numbers | "
            "mAP@[.5:.95] |") in table
    assert ("| qat | onnxruntime cpu int8 | 15 / 0 / 0 | 0.8000 | 0.8050 | 0.5100 | 6.67 | 9.00 | 300.0 | 3.00x | "
            "0.50 | 400 | 0.900 |") in table
    assert "| fp32 | onnxruntime cpu fp32 | 0 / 0 / 15 | 0.8100 | n/a | 0.5200 |" in table
    assert "ptq FAILED, ptq-partial passed, qat passed; gate (QAT): PASSED" in table
    assert "| ptq-partial | onnxruntime cpu int8 | 15 / 0 / 0 | 0.8050 | 0.8000 | 0.5000 |" in table
    assert "2.000 → 0.900 GFLOPs (x0.450)" in table and "retrained FP32 -1.00 points" in table
    assert "data:image/png;base64," in Path(outputs["chart"].path).read_text()
    assert outputs["metrics"].metadata["qat.map50"] == 0.80
    assert outputs["metrics"].metadata["qat.map50_tensorrt_emulated"] == 0.805
    assert outputs["metrics"].metadata["ptq-partial.map50"] == 0.805
    record = json.loads((Path(outputs["summary"].path) / "tracking.json").read_text())
    assert record["params"]["qat.engine"] == "onnxruntime cpu int8"
    assert outputs["metrics"].metadata["pruning.flops_ratio"] == 0.45


def test_the_ui_and_mlflow_get_the_differences_their_forest_plot_and_the_per_class_table(artifact, tmp_path,
                                                                                          local_mlflow):
    import base64

    import numpy as np
    from mlflow.tracking import MlflowClient

    from qatpipe.metrics.coco import GroundTruth, evaluate_detections, write_coco_files
    from qatpipe.models.base import Detections
    from qatpipe.tracking.mlflow_runs import MlflowTracker

    truth = [GroundTruth(np.array([[10, 10, 60, 60], [100, 20, 150, 90]], np.float32), np.array([0, 1], np.int32))
             for _ in range(20)]
    found = {"fp32": [Detections(gt.boxes, np.array([0.9, 0.8], np.float32), gt.classes) for gt in truth],
             "ptq": [Detections(gt.boxes[:1], np.array([0.9], np.float32), gt.classes[:1]) for gt in truth]}
    found["ptq_partial"] = found["qat"] = found["fp32"]  # keeping the pedestrian layer float won it back
    inputs = {}
    for name, detections in found.items():
        inputs[name] = _evaluation(tmp_path / name, 0.0, 0.0, 0.5, 200.0, True)
        metrics = evaluate_detections(truth, detections, ["car", "pedestrian"])
        (tmp_path / name / "metrics.json").write_text(json.dumps({**metrics.to_dict(), "model_size_mb": 0.5}))
        write_coco_files(truth, detections, ["car", "pedestrian"], tmp_path / name / "ground_truth.json",
                         tmp_path / name / "detections.json")
    inputs["unpruned"] = _evaluation(tmp_path / "unpruned", 0.82, 0.53, 4.0)
    (tmp_path / "pruned").mkdir()
    (tmp_path / "pruned" / "prune_report.json").write_text(json.dumps(PRUNE_REPORT))
    outputs = dict(summary=artifact(dsl.Artifact, "summary"), table=artifact(dsl.Markdown, "table"),
                   chart=artifact(dsl.HTML, "chart"), metrics=artifact(dsl.Metrics, "metrics"))
    parent = MlflowTracker(local_mlflow).start_pipeline_run("exp", "p", {})
    compare.python_func(parent_run_id=parent, pruned=dsl.Model(uri=str(tmp_path / "pruned")), **inputs, **outputs)
    table = Path(outputs["table"].path).read_text()
    assert "| qat-fp32 | mAP@0.5 | +0.00 | [+0.00, +0.00] | no significant difference |" in table
    assert "| ptq-fp32 | mAP@0.5 | -50.00 | [-50.00, -50.00] | fp32 better |" in table  # pedestrians missed
    assert "| ptq-partial-ptq | mAP@0.5 | +50.00 | [+50.00, +50.00] | ptq-partial better |" in table
    assert "| qat-ptq-partial | mAP@0.5 | +0.00 | [+0.00, +0.00] | no significant difference |" in table
    assert "| pedestrian | 20 | 1.0000 | 0.0000 | 1.0000 |" in table
    # the KFP UI's HTML: the forest plot of the differences first, then the bar chart and accuracy vs latency
    page = Path(outputs["chart"].path).read_text()
    assert page.count("data:image/png;base64,") == 3
    forest = (Path(outputs["summary"].path) / "differences.png").read_bytes()
    assert page.index(base64.b64encode(forest).decode("ascii")) < page.index(base64.b64encode(
        (Path(outputs["summary"].path) / "comparison.png").read_bytes()).decode("ascii"))
    # ... and the MLflow parent run's comparison/ the same file
    client = MlflowClient(local_mlflow)
    logged = {a.path for a in client.list_artifacts(parent, "comparison")}
    assert {"comparison/differences.png", "comparison/comparison.png", "comparison/summary.json"} <= logged
    assert Path(client.download_artifacts(parent, "comparison/differences.png", str(tmp_path / "dl"))).read_bytes() \
        == forest
    assert outputs["metrics"].metadata["ptq-fp32.map50_diff"] == pytest.approx(-0.5)
    assert outputs["metrics"].metadata["qat.map50_ci95_lo"] == pytest.approx(1.0)
    summary = json.loads((Path(outputs["summary"].path) / "summary.json").read_text())
    assert summary["bootstrap"]["resamples"] == 1000 and list(summary["comparisons"]) == [
        "qat-fp32", "ptq-fp32", "ptq-partial-fp32", "ptq-partial-ptq", "qat-ptq", "qat-ptq-partial"]
    assert summary["max_map_drop"] == {"fp32": 0.01, "ptq": 0.01, "ptq-partial": 0.01, "qat": 0.01}  # gate lines
    # the MLflow parent run: the fourth variant's figures and its differences, as `qatpipe compare` reads them back
    run = client.get_run(parent).data
    assert run.metrics["variant.ptq-partial.map50"] == pytest.approx(1.0)
    assert run.metrics["comparison.ptq-partial-ptq.map50_diff"] == pytest.approx(0.5)
    assert run.tags["qatpipe.variants"] == "fp32,ptq,ptq-partial,qat"
    tracker = MlflowTracker(local_mlflow)
    assert tracker.read_variants(parent)["ptq-partial"]["map50"] == pytest.approx(1.0)
    assert summary["mlflow"]["run_id"] == parent
