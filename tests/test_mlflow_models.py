"""MLflow-native models, registry aliases, live training curves and nesting under an injected run, all against a
real `mlflow server` on loopback (tests/conftest.py) and real models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from qatpipe.tracking.mlflow_runs import INJECTED_RUN_ENV, LIVE_TAG, PARENT_TAG, MlflowTracker


@pytest.fixture(scope="module")
def evaluated_qat(qat_export, tmp_path_factory):
    """The tiny QAT ONNX and its `qatpipe evaluate` folder (metrics.json, detections.json, ground_truth.json)."""
    from qatpipe.stages.evaluate import evaluate

    spec, _, onnx_path, _ = qat_export
    folder = tmp_path_factory.mktemp("evaluate_qat")
    evaluate(spec, onnx_path, folder)
    return spec, onnx_path, folder


def _validation(folder: Path, passed: bool, map50: float) -> Path:
    """A validate-stage folder for register_models: the evaluation's files and the gate's verdict."""
    report = {"variant": "qat", "engine_label": "onnxruntime cpu int8", "map50": map50,
              "baseline_map50": map50 + (0.0 if passed else 0.05), "map50_drop": 0.0 if passed else 0.05,
              "max_map_drop": 0.01, "passed": passed}
    (folder / "validation.json").write_text(json.dumps(report))
    return folder


def _register(tracker, spec, onnx_path, evaluation, tmp_path, passed: bool, run: str,
              same_file: bool = False) -> dict:
    """One pipeline run's register stage; each run's model is a file of its own (a model of other bytes: the
    registry keys versions on the file's digest) unless `same_file`."""
    import shutil

    import onnx

    from qatpipe.stages.register import VariantFiles, register_models

    if not same_file:
        proto = onnx.load(onnx_path)
        onnx.helper.set_model_props(proto, {**{p.key: p.value for p in proto.metadata_props}, "test.run": run})
        onnx_path = tmp_path / f"model-{run}.onnx"
        onnx.save(proto, onnx_path)
    folder = tmp_path / f"validate-{run}"
    shutil.copytree(evaluation, folder)
    metrics = json.loads((folder / "metrics.json").read_text())
    _validation(folder, passed, metrics["map50"])
    parent = tracker.start_pipeline_run("test-models", run, {"run": run})
    manifest = {"source": "spec", "train": str(Path(spec.dataset.train)), "val": str(Path(spec.dataset.val)),
                "counts": {"val": {"images": metrics["num_images"], "objects": {"car": 1}}},
                "digests": {"train": "fedcba9876543210", "val": "0123456789abcdef"}}
    return register_models(tracker, parent, spec, {"qat": VariantFiles(Path(onnx_path), folder)}, manifest,
                           kfp_run_id=f"kfp-{run}", kfp_run_url=f"http://kfp.example/#/runs/details/kfp-{run}")


def test_the_champion_loads_with_pyfunc_and_finds_what_evaluate_found(mlflow_server, evaluated_qat, tmp_path,
                                                                     monkeypatch):
    import mlflow
    import mlflow.onnx
    import mlflow.pyfunc
    import tensorflow as tf

    from qatpipe.data.pipeline import decode_image_file

    monkeypatch.delenv(INJECTED_RUN_ENV, raising=False)
    spec, onnx_path, evaluation = evaluated_qat
    spec = spec.model_copy(deep=True)
    spec.tracking.registered_model = "test-champion-loads"
    tracker = MlflowTracker(mlflow_server)
    result = _register(tracker, spec, onnx_path, evaluation, tmp_path, passed=True, run="a")
    assert result["registered"]["uri"] == "models:/test-champion-loads@champion"

    mlflow.set_tracking_uri(mlflow_server)
    model = mlflow.pyfunc.load_model("models:/test-champion-loads@champion")
    truth = json.loads((evaluation / "ground_truth.json").read_text())
    expected = json.loads((evaluation / "detections.json").read_text())
    image = max(truth["images"], key=lambda im: sum(d["image_id"] == im["id"] for d in expected))
    path = next(Path(spec.dataset.val).rglob(image["file_name"]))
    found = model.predict(np.array([str(path)], dtype=object))
    assert set(found.columns) == {"image", "x1", "y1", "x2", "y2", "score", "class_id", "class_name"}
    mine = sorted(([d["score"], *d["bbox"], d["category_id"] - 1] for d in expected if d["image_id"] == image["id"]),
                  reverse=True)
    assert len(mine) > 0
    got = sorted(([r.score, r.x1, r.y1, r.x2 - r.x1, r.y2 - r.y1, r.class_id] for r in found.itertuples()),
                 reverse=True)
    assert len(got) == len(mine)
    np.testing.assert_allclose(np.array(got), np.array(mine), atol=2e-3)  # detections.json rounds to 1e-3
    assert list(found["class_name"]) == [spec.dataset.classes[c] for c in found["class_id"]]

    # a uint8 batch decoded the way evaluate decodes gives the same boxes
    pixels = tf.image.convert_image_dtype(decode_image_file(str(path)), tf.uint8, saturate=True).numpy()
    batch = model.predict(np.stack([pixels, pixels]))
    assert sorted(batch["image"].unique()) == [0, 1] and len(batch) == 2 * len(found)

    # the same folder is an ONNX model too, and the version carries the run's figures and links
    assert mlflow.onnx.load_model("models:/test-champion-loads@champion").graph.output
    version = tracker.client.get_model_version_by_alias("test-champion-loads", "champion")
    assert version.tags["qatpipe.gate"] == "passed" and version.tags["qatpipe.kfp_run_id"] == "kfp-a"
    assert float(version.tags["qatpipe.map50"]) == pytest.approx(json.loads(
        (evaluation / "metrics.json").read_text())["map50"], abs=1e-5)
    logged = tracker.client.get_logged_model(result["models"]["qat"].split("/")[-1])
    figures = {m.key: m for m in logged.metrics}
    assert figures["map50"].dataset_digest == "0123456789abcdef"
    model_run = tracker.client.get_run(logged.source_run_id)
    assert {i.dataset.digest: i.tags[0].value for i in model_run.inputs.dataset_inputs} == {
        "fedcba9876543210": "training", "0123456789abcdef": "evaluation"}
    assert model_run.data.tags["mlflow.source.type"] == "JOB" and "mlflow.user" in model_run.data.tags


def test_a_missing_validation_report_is_named_before_anything_is_logged(closed_port_uri, tiny_spec, tmp_path):
    from qatpipe.errors import QatpipeError
    from qatpipe.stages.register import VariantFiles, register_models

    tracker = MlflowTracker(closed_port_uri, attempts=1)  # nothing may reach it: the report is read first
    with pytest.raises(QatpipeError, match=rf"^{tmp_path / 'validate' / 'validation.json'}: cannot read the "
                                           r"validation report"):
        register_models(tracker, "0" * 32, tiny_spec(),
                        {"qat": VariantFiles(tmp_path / "model.onnx", tmp_path / "validate")})


def test_bad_images_are_named(evaluated_qat, tmp_path):
    """The pyfunc model on a missing file, a file that is not an image, or an array that is not (H, W, 3)."""
    import mlflow.pyfunc

    from qatpipe.deploy.mlflow_model import save_detector_model
    from qatpipe.errors import DataError

    spec, onnx_path, _ = evaluated_qat
    model = mlflow.pyfunc.load_model(str(save_detector_model(tmp_path / "model", onnx_path, spec)))
    missing = tmp_path / "nope.jpg"
    with pytest.raises(DataError, match=rf"^{missing}: cannot read the image"):
        model.predict(np.array([str(missing)], dtype=object))
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"not a jpeg")
    with pytest.raises(DataError, match=rf"^{corrupt}: cannot read the image"):
        model.predict(np.array([str(corrupt)], dtype=object))
    ragged = np.empty(2, dtype=object)  # images of any sizes: a 1-D object array
    ragged[0], ragged[1] = np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8), np.uint8)
    with pytest.raises(ValueError, match=r"images\[1\]: expected a path or an \(H, W, 3\) array, got ndarray of "
                                         r"shape \(8, 8\)"):
        model.predict(ragged)


def test_the_alias_moves_on_a_pass_and_stays_on_a_failure(mlflow_server, evaluated_qat, tmp_path, monkeypatch):
    monkeypatch.delenv(INJECTED_RUN_ENV, raising=False)
    spec, onnx_path, evaluation = evaluated_qat
    spec = spec.model_copy(deep=True)
    spec.tracking.registered_model = "test-aliases"
    tracker = MlflowTracker(mlflow_server)
    client = tracker.client
    first = _register(tracker, spec, onnx_path, evaluation, tmp_path, passed=True, run="1")["registered"]
    second = _register(tracker, spec, onnx_path, evaluation, tmp_path, passed=True, run="2")["registered"]
    assert client.get_registered_model("test-aliases").aliases == {"champion": second["version"],
                                                                   "previous-champion": first["version"]}
    # the replaced champion is kept, not deleted: both versions are in the registry, each with its own verdict
    kept = {v.version: v for v in client.search_model_versions("name='test-aliases'")}
    assert set(kept) == {first["version"], second["version"]}
    assert kept[first["version"]].tags["qatpipe.gate"] == "passed" and kept[first["version"]].status == "READY"
    # a retried register task makes no second version and keeps the true previous champion
    from qatpipe.tracking.registry import LoggedVariant, register_variant

    made = client.get_model_version("test-aliases", second["version"])
    again = register_variant(tracker, "test-aliases", LoggedVariant("qat", made.source.split("/")[-1], made.source,
                                                                    made.run_id), passed=True)
    assert again.version == second["version"]
    assert client.get_registered_model("test-aliases").aliases == {"champion": second["version"],
                                                                   "previous-champion": first["version"]}

    # a re-run of the pipeline that registers the very same model file again: its version, not a new one
    rerun = _register(tracker, spec, tmp_path / "model-2.onnx", evaluation, tmp_path, passed=True, run="2-again",
                      same_file=True)["registered"]
    assert rerun["version"] == second["version"]
    assert len(client.search_model_versions("name='test-aliases'")) == 2

    failed = _register(tracker, spec, onnx_path, evaluation, tmp_path, passed=False, run="3")["registered"]
    assert failed["alias"] == "rejected" and not failed["passed"]
    aliases = client.get_registered_model("test-aliases").aliases
    assert aliases["champion"] == second["version"] and aliases["rejected"] == failed["version"]
    version = client.get_model_version("test-aliases", failed["version"])
    assert version.tags["qatpipe.gate"] == "failed"
    assert "validation gate failed" in version.tags["qatpipe.gate_reason"] and version.description
    assert len(client.search_model_versions("name='test-aliases'")) == 3


def test_training_curves_are_live_and_a_resumed_training_continues_them(mlflow_server, tiny_spec, tmp_path,
                                                                        monkeypatch):
    import tf_keras as keras

    from qatpipe.stages.train import train
    from qatpipe.tracking.live import PARENT_RUN_ENV
    from qatpipe.tracking.records import StageRecord

    from conftest import SMALL_IMAGES, Preempted, PreemptAfter

    monkeypatch.delenv(INJECTED_RUN_ENV, raising=False)
    tracker = MlflowTracker(mlflow_server)
    parent = tracker.start_pipeline_run("test-live", "live", {})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv(PARENT_RUN_ENV, parent)
    spec = tiny_spec("train.epochs=2", "train.checkpoint_interval=1", "train.validation_interval=1", *SMALL_IMAGES)
    seen = []

    class WhileTraining(keras.callbacks.Callback):  # runs after the live callback, inside the same epoch
        def on_epoch_end(self, epoch, logs=None):
            runs = tracker.stage_runs(parent, "train")
            assert len(runs) == 1 and runs[0].info.status == "RUNNING" and runs[0].data.tags[LIVE_TAG] == "true"
            seen.append({key: sorted(m.step for m in tracker.client.get_metric_history(runs[0].info.run_id, key))
                         for key in ("loss", "lr", "images_per_second", "val_map50")})

    with pytest.raises(Preempted):
        train(spec, tmp_path / "train", extra_callbacks=[WhileTraining(), PreemptAfter(1)])
    train(spec, tmp_path / "train", extra_callbacks=[WhileTraining()])  # the retried task resumes at epoch 2
    assert seen == [{"loss": [1], "lr": [1], "images_per_second": [1], "val_map50": [1]},
                    {"loss": [1, 2], "lr": [1, 2], "images_per_second": [1, 2], "val_map50": [1, 2]}]

    child = tracker.log_stage(parent, StageRecord.read(tmp_path / "train"), tmp_path / "train")
    run = tracker.client.get_run(child)
    assert run.info.status == "FINISHED" and run.data.tags[PARENT_TAG] == parent
    assert [m.step for m in tracker.client.get_metric_history(child, "loss")] == [1, 2]  # not logged twice
    assert "model.keras" in {a.path for a in tracker.client.list_artifacts(child)}


def test_with_an_injected_run_every_stage_run_is_its_child(mlflow_server, evaluated_qat, tmp_path, monkeypatch):
    """KFP's MLflow plugin injects MLFLOW_RUN_ID (the task's nested run); MLflow's fluent API can take an
    environment MLFLOW_RUN_ID for a nested run's parent (mlflow issue 15713). Every run qatpipe makes,
    the models' runs included, stays a child of the pipeline run."""
    from qatpipe.tracking.records import StageRecord
    from qatpipe.tracking.registry import log_variant_model

    spec, onnx_path, evaluation = evaluated_qat
    tracker = MlflowTracker(mlflow_server)
    experiment = tracker.experiment_id("test-injected-nesting")
    root = tracker.client.create_run(experiment, run_name="kfp-run").info.run_id
    task_run = tracker.client.create_run(experiment, run_name="start-tracking", tags={PARENT_TAG: root}).info.run_id
    monkeypatch.setenv(INJECTED_RUN_ENV, task_run)
    parent = tracker.start_pipeline_run("ignored", "p", {}, tags={"qatpipe.kfp_run_id": "kfp-nest"})
    assert parent == root
    StageRecord(stage="evaluate_qat", metrics={"map50": 0.5}).write(tmp_path)
    staged = tracker.log_stage(parent, StageRecord.read(tmp_path), tmp_path)
    live = tracker.live_stage_run(parent, "train")
    # mlflow's fluent API is pointed at this store only while the model is logged: the caller's settings stay
    import mlflow.tracking._model_registry.utils as registry_utils
    import mlflow.tracking._tracking_service.utils as tracking_utils

    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "callers-own-store"))
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    monkeypatch.setattr(tracking_utils, "_tracking_uri", None)
    monkeypatch.setattr(registry_utils, "_registry_uri", None)
    model = log_variant_model(tracker, parent, "qat", onnx_path, spec, {"map50": 0.5})
    assert tracking_utils._tracking_uri is None and registry_utils._registry_uri is None
    assert os.environ["MLFLOW_TRACKING_URI"] == str(tmp_path / "callers-own-store")
    assert "MLFLOW_REGISTRY_URI" not in os.environ
    for run_id in (staged, live, model.run_id):
        assert tracker.client.get_run(run_id).data.tags[PARENT_TAG] == root
    assert tracker.client.get_logged_model(model.model_id).source_run_id == model.run_id
    assert tracker.client.get_run(task_run).outputs.model_outputs == []  # not the injected task run's model


def test_a_training_pod_finds_the_pipeline_run_from_its_kfp_run_id(mlflow_server, monkeypatch):
    """The training task's KFP run id (from its pod's labels) names the pipeline run, never a stage run that
    carries the same id (the model runs do)."""
    from qatpipe.tracking.live import KFP_RUN_ID_ENVS, PARENT_RUN_ENV, parent_run_from_kfp

    monkeypatch.delenv(INJECTED_RUN_ENV, raising=False)
    monkeypatch.setenv(PARENT_RUN_ENV, "")  # recorded, so what parent_run_from_kfp sets is undone after
    tracker = MlflowTracker(mlflow_server)
    parent = tracker.start_pipeline_run("test-find-parent", "p", {}, tags={"qatpipe.kfp_run_id": "kfp-find"})
    tracker.start_stage_run(parent, "model-qat", {"qatpipe.kfp_run_id": "kfp-find"})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv(KFP_RUN_ID_ENVS[0], "")  # an Argo label the backend did not set
    monkeypatch.setenv(KFP_RUN_ID_ENVS[1], "kfp-find")
    assert parent_run_from_kfp() == parent
    assert os.environ[PARENT_RUN_ENV] == parent  # for the training processes it starts
