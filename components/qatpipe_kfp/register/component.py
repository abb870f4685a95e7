"""register: the validated QAT model (explicit-quantisation ONNX, its engine metadata, the DeepStream config)
as a new version in the MLflow model registry. The pipeline runs it only when the gate passed (dsl.If)."""

from kfp.dsl import Artifact, Input, Model

from qatpipe_kfp.settings import component


@component
def register(parent_run_id: str, model_name: str, onnx_model: Input[Model], engine: Input[Model],
             validation: Input[Artifact]) -> str:
    from pathlib import Path

    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe_kfp.runtime import log, stage

    with stage("register"):
        tracker = MlflowTracker.from_env()
        if tracker is None or not parent_run_id:
            log.warning("no MLflow tracking server: nothing to register")
            return ""
        folder = "deployment"
        for path in sorted(Path(onnx_model.path).iterdir()):
            if path.is_file() and path.suffix in (".onnx", ".cache", ".json"):
                tracker.log_artifact(parent_run_id, path, folder)
        tracker.log_artifact(parent_run_id, Path(engine.path) / "engine.json", folder)
        for name in ("validation.json", "validation.md", "deepstream"):
            if (Path(validation.path) / name).exists():
                tracker.log_artifact(parent_run_id, Path(validation.path) / name, folder)
        version = tracker.register_model(parent_run_id, folder, model_name,
                                         tags={"variant": validation.metadata.get("variant", "qat"),
                                               "engine_backend": engine.metadata.get("backend", "")})
        return str(version.version)
