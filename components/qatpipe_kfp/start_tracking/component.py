"""start-tracking: the MLflow parent run of this pipeline run (or the one the KFP backend injected), tagged
with the KFP run id so the exit handler, which may not depend on other tasks, can find it, and with the run's
KFP page; its `link` output is the MLflow run's address, shown in the KFP UI."""

from kfp.dsl import Markdown, Output

from qatpipe_kfp.settings import component


@component
def start_tracking(spec: str, run_name: str, kfp_run_id: str, link: Output[Markdown], kfp_ui_url: str = "") -> str:
    import tempfile
    from pathlib import Path

    from qatpipe.spec import flatten
    from qatpipe.tracking.mlflow_runs import KFP_RUN_TAG, KFP_RUN_URL_TAG, MlflowTracker
    from qatpipe_kfp.runtime import kfp_run_url, load_stage_spec, log, stage, write_text

    with stage("start-tracking"):
        tracker = MlflowTracker.from_env()
        if tracker is None:
            log.warning("MLFLOW_TRACKING_URI is not set: this run is not tracked in MLflow")
            write_text(link, "This run is not tracked in MLflow (MLFLOW_TRACKING_URI is not set).\n")
            return ""
        tracker.check()
        resolved = load_stage_spec(spec)
        url = kfp_run_url(kfp_ui_url, kfp_run_id)
        run_id = tracker.start_pipeline_run(resolved.tracking.experiment, run_name or "qatpipe",
                                            flatten(resolved.to_dict()),
                                            tags={KFP_RUN_TAG: kfp_run_id, **({KFP_RUN_URL_TAG: url} if url else {})})
        with tempfile.TemporaryDirectory() as tmp:
            spec_file = Path(tmp) / "spec.yaml"
            spec_file.write_text(spec, encoding="utf-8")
            tracker.log_artifact(run_id, spec_file)
        write_text(link, f"MLflow run: [{run_id}]({tracker.run_url(run_id)})\n")
        return run_id
