"""register: every variant as an MLflow model (ONNX flavour + a pyfunc that returns detections), and the QAT one
as a new version of the registered model: alias `tracking.champion_alias` when its validation passed, else
`rejected` with the gate's reason (qatpipe.stages.register)."""

from kfp.dsl import Artifact, Dataset, Input, Markdown, Model, Output

from qatpipe_kfp.settings import component


@component
def register(parent_run_id: str, spec: str, kfp_run_id: str, kfp_ui_url: str, dataset: Input[Dataset],
             fp32_onnx: Input[Model], ptq_onnx: Input[Model], ptq_partial_onnx: Input[Model], qat_onnx: Input[Model],
             qat_engine: Input[Model], fp32_validation: Input[Artifact], ptq_validation: Input[Artifact],
             ptq_partial_validation: Input[Artifact], qat_validation: Input[Artifact],
             report: Output[Markdown]) -> str:
    """Log every variant as an MLflow model and register the QAT one as a new model version.

    The QAT version gets the alias `tracking.champion_alias` when its validation passed the gate, else
    `rejected` with the gate's reason.

    Args:
        parent_run_id: The MLflow parent run id (start-tracking's output). Empty, or no tracking server
            configured: nothing is logged or registered.
        spec: The full resolved spec (resolve-spec's `spec`), as YAML; it names the registered model and the
            champion alias.
        kfp_run_id: The KFP run id, tagged on the variants' model runs and on the registered version.
        kfp_ui_url: The KFP UI's address; with kfp_run_id it gives the run's KFP page, tagged as well. Empty: no
            page tag.
        dataset: The prepared data set; its train and val splits are logged as the model runs' dataset inputs.
        fp32_onnx: The FP32 ONNX model folder, logged as the fp32 MLflow model.
        ptq_onnx: The PTQ INT8 ONNX model folder, logged as the ptq MLflow model.
        ptq_partial_onnx: The ptq-partial ONNX model folder (the PTQ model with its most sensitive layers float),
            logged as the ptq-partial MLflow model.
        qat_onnx: The QAT ONNX model folder, logged as the qat MLflow model together with its deployment files
            (calibration cache, implicit ONNX, export reports).
        qat_engine: The QAT engine folder (build-engine's `engine`); its engine.json joins the QAT model's files.
        fp32_validation: The FP32 variant's validation folder (validate's `results`); its figures go with the model.
        ptq_validation: The PTQ variant's validation folder (validate's `results`); its figures go with the model.
        ptq_partial_validation: The ptq-partial variant's validation folder (validate's `results`); its figures go
            with the model.
        qat_validation: The QAT variant's validation folder (validate's `results`): its validation.json decides
            the alias; its figures, validation report and DeepStream config go with the QAT model.

    Returns:
        report: Each variant's MLflow model, and the registered QAT version with the code to load it, as Markdown.
        Output: The registered QAT model version; empty when nothing was registered.
    """
    from pathlib import Path

    from qatpipe.data.prepare import read_manifest
    from qatpipe.stages.register import VariantFiles, deployment_files, markdown, register_models
    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe_kfp.runtime import kfp_run_url, load_stage_spec, log, stage, write_text

    with stage("register"):
        tracker = MlflowTracker.from_env()
        if tracker is None or not parent_run_id:
            log.warning("no MLflow tracking server: nothing to register")
            write_text(report, markdown(None))
            return ""

        def files(onnx_model, validation, engine=None) -> VariantFiles:
            folder = Path(onnx_model.path)
            extra = deployment_files(folder, Path(engine.path), Path(validation.path)) if engine else []
            return VariantFiles(folder / onnx_model.metadata.get("file", "model.onnx"), Path(validation.path), extra)

        result = register_models(
            tracker, parent_run_id, load_stage_spec(spec),
            {"fp32": files(fp32_onnx, fp32_validation), "ptq": files(ptq_onnx, ptq_validation),
             "ptq-partial": files(ptq_partial_onnx, ptq_partial_validation),
             "qat": files(qat_onnx, qat_validation, qat_engine)},
            read_manifest(dataset.path), kfp_run_id, kfp_run_url(kfp_ui_url, kfp_run_id))
        write_text(report, markdown(result))
        return result["registered"]["version"] if result["registered"] else ""
