"""The whole pipeline through kfp.local (each stage a subprocess), tracked in a real MLflow server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from qatpipe.cli import main
from qatpipe.errors import TrackingError
from qatpipe.export.bundle import ExportBundle
from qatpipe.quantization.partial import ranking
from qatpipe.tracking.mlflow_runs import LIVE_TAG, PARENT_TAG, STAGE_TAG
from qatpipe_pipelines.local_run import PipelineFailed, run_local
from qatpipe_pipelines.stage_table import stage_names

VARIANTS = ("fp32", "ptq", "ptq-partial", "qat")
INT8_VARIANTS = ("ptq", "ptq-partial", "qat")
HEAVY_STAGES = stage_names(logged=True)  # the stage table's rows that log a tracking record
# nested MLflow runs: one per stage record, and the register stage's run per variant's MLflow model
STAGE_RUNS = {name.replace("-", "_") for name in HEAVY_STAGES} | {f"model-{v}" for v in VARIANTS}
# The gate, as the pipeline applies it to every variant (its mAP@0.5 and TensorRT's numbers against FP32's). Measured
# on this machine: FP32 0.382 (bootstrap CI 0.328-0.442 over the 48 val images), PTQ 0.428, QAT 0.427; TensorRT's
# numbers FP32 0.369, PTQ 0.438, QAT 0.357: the worst drop 2.5 points (QAT's TensorRT numbers). 8 points leaves room
# for another CPU's training to land elsewhere in that CI, and still fails an INT8 model that quantization broke.
MAX_MAP_DROP = 0.08
# random weights: the pretrain stage records that it was skipped (the pretrained start through kfp.local:
# test_components_shipped.py)
# sensitivity scores 6 of the 15 layers per model (the noisiest; 2 evaluations each): the stage's wiring and
# outputs, in a third of the time (tests/test_sensitivity.py measures every layer)
# the fine-tunings' own schedule: tiny's train.learning_rate but for min_lr 1e-9 above its 1e-4 (the same training to
# within that), so that the tracked params show which stages trained under it
FINETUNE_MIN_LR = 1.00001e-4
# the order qat.start: fp32 (QAT fine-tunes the FP32 retrain's model beside the baseline); test_ssd_pipeline runs
# the default order, baseline
OVERRIDES = ["tracking.experiment=pipeline-test", f"validate.max_map_drop={MAX_MAP_DROP}", "sensitivity.max_layers=6",
             f"qat.finetune_learning_rate={{min_lr: {FINETUNE_MIN_LR}, max_lr: 3.0e-3, soft_start: 0.1, "
             "annealing_point: 0.7}", "qat.start=fp32"]


def _pipeline_runs(client: MlflowClient, experiment: str):
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], "tags.`qatpipe.kind` = 'pipeline'",
                              order_by=["attributes.start_time ASC"])


def _children(client: MlflowClient, parent) -> dict:
    runs = client.search_runs([parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'")
    return {run.data.tags[STAGE_TAG]: run for run in runs}


@pytest.mark.slow
# the whole pipeline, then its cached re-run: 883 s with sensitivity and ptq-partial on 2 cores under a load average
# of 4-5 (2026-11-26; of the new stages' own times sensitivity took 28 s, ptq-partial 9 s)
@pytest.mark.timeout(1500)
def test_local_pipeline_tiny_spec_then_rerun_reuses_stages(tmp_path, mlflow_server, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    out = tmp_path / "run"
    summary = run_local(out, "tiny", OVERRIDES)

    assert json.loads((out / "summary.json").read_text()) == summary
    assert list(summary["variants"]) == list(VARIANTS)  # all four scored in ONNX Runtime
    fp32 = summary["variants"]["fp32"]
    assert set(fp32) == {"engine", "layers", "quantized_by", "map50", "map50_tensorrt_emulated", "map50_dla_emulated",
                         "map", "latency_ms_p50", "latency_ms_p99",
                         "throughput", "throughput_batch", "speedup_vs_fp32", "size_mb", "params", "gflops",
                         "map50_ci95_lo", "map50_ci95_hi", "map_ci95_lo", "map_ci95_hi", "cpu_int8"}
    # every row says what ran it; each also carries TensorRT's numbers: the INT8 ones' (fast CPU form), and
    # under engine.fp16 the FP16 form's, which for the FP32 model differ from its CPU engine's by FP16 rounding
    assert fp32["engine"] == "onnxruntime cpu fp32"
    assert fp32["map50_tensorrt_emulated"] == pytest.approx(fp32["map50"], abs=0.02)
    for variant in INT8_VARIANTS:
        row = summary["variants"][variant]
        assert row["engine"] == "onnxruntime cpu int8", variant
        assert row["map50_tensorrt_emulated"] is not None, variant
    # the PTQ row says what quantized it (ptq.tool, its version and method); the others were not post-quantized
    assert summary["variants"]["ptq"]["quantized_by"].startswith("onnxruntime ")
    assert summary["variants"]["ptq"]["quantized_by"].endswith(", percentile")
    assert fp32["quantized_by"] is None and summary["variants"]["qat"]["quantized_by"] is None
    # ... and its compute layers per precision (INT8 / FP16 / FP32): the FP32 engine all float32, QAT's all INT8
    layers = {name: [int(n) for n in row["layers"].split(" / ")] for name, row in summary["variants"].items()}
    assert layers["fp32"][:2] == [0, 0] and layers["fp32"][2] > 0
    assert layers["qat"][0] == layers["fp32"][2] and layers["qat"][1:] == [0, 0]
    assert 0 < layers["ptq-partial"][0] <= layers["ptq"][0]  # PTQ's INT8 layers, but those it keeps float
    assert fp32["map50_ci95_lo"] <= fp32["map50"] <= fp32["map50_ci95_hi"]
    # the variants' differences with their bootstrap CIs, over the evaluations' own detections
    assert summary["bootstrap"] == {"images": 48, "resamples": 1000, "seed": 0}
    assert list(summary["comparisons"]) == ["qat-fp32", "ptq-fp32", "ptq-partial-fp32", "ptq-partial-ptq", "qat-ptq",
                                            "qat-ptq-partial"]
    qat_fp32 = summary["comparisons"]["qat-fp32"]["map50"]
    assert qat_fp32["diff"] == pytest.approx(summary["variants"]["qat"]["map50"] - fp32["map50"], abs=1e-9)
    assert qat_fp32["ci95"][0] <= qat_fp32["diff"] <= qat_fp32["ci95"][1]
    assert fp32["map50"] > 0.3 and 0 < fp32["map"] < fp32["map50"]
    # every variant ran as an engine (ONNX Runtime here) and was benchmarked at batch 1 and 4 (tiny spec)
    assert all(row["latency_ms_p50"] > 0 and row["throughput_batch"] == 4 for row in summary["variants"].values())
    assert fp32["speedup_vs_fp32"] == 1.0
    for variant in ("ptq", "qat"):  # INT8 models within the gate's budget of FP32, at under half its size
        row = summary["variants"][variant]
        assert fp32["map50"] - row["map50"] <= MAX_MAP_DROP and row["size_mb"] < 0.5 * fp32["size_mb"], variant
    pruning = summary["pruning"]
    assert pruning["flops_after"] < pruning["flops_before"] and pruning["params_after"] == fp32["params"]
    assert pruning["unpruned_map50"] > 0.3  # the tiny spec's 20 epochs learnt (test_train's runs 6 of them)
    assert pruning["fp32_map50_change"] == pytest.approx(fp32["map50"] - pruning["unpruned_map50"], abs=1e-4)
    assert summary["validation"] == dict.fromkeys(VARIANTS, True) and summary["gate_passed"] is True
    assert summary["mlflow"]["experiment"] == "pipeline-test"
    assert summary["mlflow"]["tracking_uri"] == mlflow_server
    assert {name for name, o in summary["stages"].items() if o["status"] == "done"} >= HEAVY_STAGES | {"compare"}

    client = MlflowClient(mlflow_server)
    (parent,) = _pipeline_runs(client, "pipeline-test")
    assert parent.info.run_id == summary["mlflow"]["run_id"]
    assert parent.info.status == "FINISHED"  # closed by the exit handler
    assert parent.data.params["train.epochs"] == "20"
    assert parent.data.metrics["variant.fp32.map50"] == pytest.approx(fp32["map50"])
    assert parent.data.metrics["variant.qat.map50"] == pytest.approx(summary["variants"]["qat"]["map50"])
    assert parent.data.metrics["pruning.flops_ratio"] == pytest.approx(pruning["flops_ratio"])
    assert parent.data.metrics["comparison.qat-fp32.map50_diff"] == pytest.approx(qat_fp32["diff"])
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "comparison")} >= {
        "comparison/summary.json", "comparison/comparison.png", "comparison/accuracy_latency.png",
        "comparison/differences.png"}  # the forest plot of the differences
    children = _children(client, parent)
    assert set(children) == STAGE_RUNS
    losses = client.get_metric_history(children["train"].info.run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(1, 21))  # per-epoch loss, epochs 1..20
    assert losses[-1].value < losses[0].value
    val_map50 = client.get_metric_history(children["train"].info.run_id, "val_map50")  # validated every epoch
    assert sorted(m.step for m in val_map50) == list(range(1, 21))
    # ... and logged live, epoch by epoch while it trained (the local run's tasks find the pipeline run through
    # its output folder), not all at once by the record at the stage's end
    assert children["train"].data.tags[LIVE_TAG] == "true"
    stamps = [m.timestamp for m in sorted(val_map50, key=lambda m: m.step)]
    assert len(set(stamps)) == 20 and stamps == sorted(stamps)
    train_run = children["train"].data
    assert train_run.tags["qatpipe.kept"] == "best"
    assert train_run.metrics["best_val_map50"] == pytest.approx(max(m.value for m in val_map50))
    assert children["evaluate_fp32"].data.metrics["map50"] == pytest.approx(fp32["map50"])
    assert children["evaluate_fp32"].data.metrics["class_accuracy"] > 0.5  # the learning check reached MLflow
    assert children["evaluate_fp32"].data.tags["qatpipe.findings"] == "none"
    assert "model.keras" in {a.path for a in client.list_artifacts(children["train"].info.run_id)}
    assert "not pipeline:pretrain" in children["pretrain"].data.params["skipped"]
    assert children["retrain_qat"].data.params["qat.enabled"] == "True"
    # qat.start fp32: QAT fine-tunes the FP32 retrain (3 epochs) for qat.finetune_epochs (1), and so does the baseline
    assert len(client.get_metric_history(children["retrain_fp32"].info.run_id, "loss")) == 3  # retrain.epochs
    for stage in ("retrain_qat", "finetune_fp32"):
        assert len(client.get_metric_history(children[stage].info.run_id, "loss")) == 1, stage
    assert children["finetune_fp32"].data.params["qat.start"] == "fp32"
    for stage, min_lr in (("retrain_fp32", 1.0e-4), ("retrain_qat", FINETUNE_MIN_LR),
                          ("finetune_fp32", FINETUNE_MIN_LR)):  # the fine-tunings' plan, applied by the component
        assert float(children[stage].data.params["train.learning_rate.min_lr"]) == min_lr, stage
    assert children["finetune_fp32"].data.params["qat.enabled"] == "False"
    qat_files = {a.path for a in client.list_artifacts(children["export_qat"].info.run_id)}
    exported = ExportBundle(Path("model.onnx"))  # the export component's file
    assert {exported.onnx.name, exported.cache.name, exported.implicit.name, exported.scales.name} <= qat_files
    assert children["validate_qat"].data.metrics["passed"] == 1.0
    assert children["validate_qat"].data.metrics["map50_tensorrt_emulated"] == pytest.approx(
        summary["variants"]["qat"]["map50_tensorrt_emulated"])
    # TensorRT's numbers (the exact int8 form) against the CPU engine's (its fast form where the CPU has one): on
    # 48 val images with ~55 objects a class, one detection moves mAP@0.5 by ~0.6 points, so within 0.02.
    # (test_engines checks an engine against evaluate's numbers for the ONNX as exported.)
    for variant in ("ptq", "qat"):
        assert summary["variants"][variant]["map50_tensorrt_emulated"] == pytest.approx(
            children[f"validate_{variant}"].data.metrics["map50"], abs=0.02), variant
    assert not {name for name in children if name.startswith("evaluate_")} - {"evaluate_fp32", "evaluate_unpruned"}
    assert parent.data.tags["qatpipe.engine.qat"] == "onnxruntime cpu int8"
    # the differences again in TensorRT's numbers (the INT8 engines' exact form, the FP16 forms' rounding),
    # beside the CPU engines' ones
    trt_qat_fp32 = summary["comparisons_tensorrt_emulated"]["qat-fp32"]["map50"]
    assert trt_qat_fp32["diff"] == pytest.approx(
        summary["variants"]["qat"]["map50_tensorrt_emulated"] - fp32["map50_tensorrt_emulated"], abs=1e-9)
    assert parent.data.metrics["comparison_tensorrt.qat-fp32.map50_diff"] == pytest.approx(trt_qat_fp32["diff"])
    # nvinfer's network-mode follows the engine's precision: INT8 (1) for the Q/DQ models, FP16 (2) for FP32
    modes = {path.stem.removeprefix("config_infer_primary_"): dict(
                 line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)["network-mode"]
             for path in out.rglob("deepstream/config_infer_primary_*.txt")}
    assert modes == {"fp32": "2", "ptq": "1", "ptq-partial": "1", "qat": "1"}
    assert "batch1.latency_ms_p50" in children["build_engine_qat"].data.metrics
    # layer sensitivity of both INT8 models: one nested run with each model's figures, tables and charts
    [ranked] = [json.loads(path.read_text()) for path in out.rglob("results/ptq/sensitivity.json")]
    assert ranked["layers_total"] == 15 and len(ranked["layers"]) == 6  # sensitivity.max_layers
    measured = children["sensitivity"]
    assert measured.data.metrics["ptq.layers_measured"] == 6 and measured.data.metrics["qat.layers_total"] == 15
    assert measured.data.metrics["ptq.map50_int8"] == pytest.approx(ranked["map50_int8"])
    assert {a.path for name in ("ptq", "qat") for a in client.list_artifacts(measured.info.run_id, name)} >= {
        "ptq/sensitivity.png", "ptq/sensitivity.json", "qat/sensitivity.png"}
    assert "sensitivity.html" in {a.path for a in client.list_artifacts(measured.info.run_id)}
    # ... and the head of PTQ's ranking is what ptq-partial kept float (keep_float auto), within the gate's budget
    [partial] = [json.loads(path.read_text()) for path in out.rglob("ptq_partial.json")]
    assert partial["keep_float"] == "auto" and partial["budget_met"] is True
    assert partial["float_layers"] == ranking(ranked)[:len(partial["float_layers"])]
    assert children["ptq_partial"].data.metrics["float_layers"] == len(partial["float_layers"])
    assert parent.data.metrics["comparison.ptq-partial-ptq.map50_diff"] == pytest.approx(
        summary["comparisons"]["ptq-partial-ptq"]["map50"]["diff"])
    # the gate passed: the QAT model is the registry's champion, an MLflow model that finds objects in an image
    # and carries the deployment files
    import mlflow.artifacts
    import mlflow.pyfunc
    import numpy as np

    version = client.get_model_version_by_alias("qatpipe-detectnet-v2", "champion")
    assert version.run_id == children["model-qat"].info.run_id and version.source.startswith("models:/m-")
    assert version.tags["qatpipe.gate"] == "passed" and version.tags["qatpipe.engine"] == "onnxruntime cpu int8"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    image = next((out / "kfp").rglob("prepare-data/dataset/val/images/*.jpg"))
    found = mlflow.pyfunc.load_model("models:/qatpipe-detectnet-v2@champion").predict(
        np.array([str(image)], dtype=object))
    assert len(found) > 0 and set(found["class_name"]) <= {"car", "pedestrian", "cyclist"}
    folder = mlflow.artifacts.download_artifacts("models:/qatpipe-detectnet-v2@champion", dst_path=str(tmp_path / "m"))
    carried = {path.name for path in (tmp_path / "m" / "artifacts").iterdir()}
    exported = ExportBundle(Path("model.onnx"))
    assert {exported.onnx.name, "spec.yaml", exported.cache.name, exported.implicit.name, "engine.json",
            "validation.json", "deepstream"} <= carried, folder

    # a gate the model cannot pass fails, end to end on this run's QAT engine: `qatpipe validate` with no
    # budget against a perfect FP32 baseline exits 1 with passed false, and writes no DeepStream config
    verdicts = [json.loads(path.read_text()) for path in out.rglob("validate*/results/validation.json")]
    [passed] = [v for v in verdicts if v["variant"] == "qat"]  # the run's QAT verdict: its engine and baseline
    dataset = next(out.rglob("prepare-data/dataset/dataset.json")).parent
    baseline = json.loads(Path(passed["baseline"]).read_text())
    (tmp_path / "perfect.json").write_text(json.dumps({**baseline, "map50": 1.0}))
    gate = tmp_path / "gate"
    assert main(["validate", "-e", "tiny", "--set", f"dataset.train={dataset / 'train'}",
                 "--set", f"dataset.val={dataset / 'val'}", "--set", "validate.max_map_drop=0",
                 "-m", passed["engine"], "--baseline", str(tmp_path / "perfect.json"), "--variant", "qat",
                 "-o", str(gate)]) == 1
    verdict = json.loads((gate / "validation.json").read_text())
    assert verdict["passed"] is False and verdict["max_map_drop"] == 0
    assert verdict["map50"] == pytest.approx(summary["variants"]["qat"]["map50"])  # the same engine, rescored
    assert verdict["map50_drop"] == pytest.approx(1.0 - verdict["map50"], abs=1e-6)
    assert not (gate / "deepstream").exists()

    # `qatpipe compare` reads the same table back from MLflow
    assert main(["compare", "--tracking-uri", mlflow_server, "--experiment", "pipeline-test",
                 "-o", str(tmp_path / "chart.png")]) == 0
    printed = capsys.readouterr().out
    assert f"{fp32['map50']:.4f}" in printed  # and the differences, from the run's comparison.* metrics:
    assert re.search(r"^qat-fp32 +mAP@0\.5 ", printed, re.M) and f"{100 * qat_fp32['diff']:+.2f}" in printed
    assert re.search(r"^ptq-partial-ptq +mAP@0\.5 ", printed, re.M)  # the fourth variant's too (columns widen)
    assert 'mlflow.pyfunc.load_model("models:/qatpipe-detectnet-v2@champion")' in printed  # how to run it
    assert (tmp_path / "chart.png").stat().st_size > 1000

    # a re-run into the same folder, from the command line, reuses every finished stage, prints the table
    # with the pruning and validation lines and the differences, and is tracked as a new pipeline run
    capsys.readouterr()
    sets = [arg for override in OVERRIDES for arg in ("--set", override)]
    assert main(["run", "--local", "--spec", "tiny", "--output", str(out), *sets]) == 0
    printed = capsys.readouterr().out
    assert "Pruning: " in printed and "gate (QAT): PASSED" in printed and f"{fp32['map50']:.4f}" in printed
    assert "onnxruntime cpu int8" in printed and "mAP@0.5, TensorRT's numbers" in printed
    assert "Differences, paired bootstrap over the val images (48 images, 1000 resamples, seed 0)" in printed
    again = json.loads((out / "summary.json").read_text())
    assert again["variants"] == summary["variants"]
    assert not HEAVY_STAGES & set(again["stages"])  # served from kfp.local's cache, not executed
    assert again["mlflow"]["run_id"] != summary["mlflow"]["run_id"]
    second = _pipeline_runs(client, "pipeline-test")[-1]
    assert set(_children(client, second)) == STAGE_RUNS
    # the re-run registered the same QAT model file (every stage cached): the version it made, not a second one
    assert client.get_registered_model("qatpipe-detectnet-v2").aliases == {"champion": version.version}
    assert len(client.search_model_versions("name = 'qatpipe-detectnet-v2'")) == 1


def test_failed_stage_names_itself_and_how_to_resume(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the local SQLite store
    out = tmp_path / "run"
    missing = tmp_path / "no-such-data"
    with pytest.raises(PipelineFailed) as caught:
        run_local(out, "tiny", [f"dataset.train={missing}/train", f"dataset.val={missing}/val"])
    message = str(caught.value)
    assert message.startswith("pipeline stage fingerprint-data failed: ")  # the first task to look at the data
    assert f"{missing}/train: dataset.train: dataset folder not found" in message
    assert f"re-run `qatpipe run --local --spec tiny --output {out}" in message
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (parent,) = _pipeline_runs(client, "qatpipe")
    assert parent.info.status == "FAILED"


def test_a_stage_killed_without_a_record_is_named_by_its_stage_name(tmp_path):
    """A task whose process (or container) was killed leaves no stage record: kfp.local's task name (retrain-2,
    coloured) is named as the stage (finetune-fp32), with how to resume. tests/test_images_run.py kills one."""
    from qatpipe_pipelines.local_run import _display_names, _failure_message
    from qatpipe_pipelines.qat_pipeline import build_pipeline

    stages = _display_names(build_pipeline(network_retries=0, placement=False, code_version="test"))
    assert stages["retrain-2"] == "finetune-fp32" and stages["train"] == "train"
    killed = RuntimeError("Task \x1b[96m'retrain-2'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m")
    message = _failure_message(tmp_path / "stage_log.jsonl", killed, tmp_path / "run", "tiny", [], stages=stages)
    assert message.startswith("pipeline stage finetune-fp32 ended without a result (killed, out of memory")
    assert f"re-run `qatpipe run --local --spec tiny --output {tmp_path / 'run'}`" in message
    assert "\x1b" not in _failure_message(tmp_path / "none", RuntimeError("\x1b[91mboom\x1b[0m"), tmp_path, "tiny", [])


def test_unreachable_tracking_server_stops_before_any_stage(tmp_path, monkeypatch, closed_port_uri):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed_port_uri)
    with pytest.raises(TrackingError, match=f"MLflow at {closed_port_uri}: connecting failed after 3 attempt"):
        run_local(tmp_path / "run", "tiny")
    assert not (tmp_path / "run" / "kfp").exists()


def test_bad_spec_fails_before_the_pipeline_starts(tmp_path):
    from qatpipe.errors import SpecError

    with pytest.raises(SpecError, match="train.epochz"):
        run_local(tmp_path / "run", "tiny", ["train.epochz=3"])
