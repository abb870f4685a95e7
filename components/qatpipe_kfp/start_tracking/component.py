"""start-tracking: the MLflow parent run of this pipeline run (or the one the KFP backend injected), tagged
with the KFP run id so the exit handler, which may not depend on other tasks, can find it, and with the run's
KFP page; its `link` output is the MLflow run's address, shown in the KFP UI."""

from kfp.dsl import Markdown, Output

from qatpipe_kfp.settings import component


@component
def start_tracking(spec: str, run_name: str, kfp_run_id: str, link: Output[Markdown], kfp_ui_url: str = "") -> str:
    """Start (or join) the MLflow parent run of this pipeline run, tagged with the KFP run id and page.

    The tag lets the exit handler, which may not depend on other tasks, find the run. Without
    MLFLOW_TRACKING_URI nothing is tracked.

    Args:
        spec: The full resolved spec (resolve-spec's `spec`), as YAML: its tracking.experiment names the
            experiment; it is logged flattened as the run's params and as the file spec.yaml.
        run_name: The parent run's name. Empty: "qatpipe".
        kfp_run_id: The KFP run id the parent run is tagged with (the pipeline passes its job id placeholder).
        kfp_ui_url: The KFP UI's address; the run is then also tagged with its KFP page. Empty: no page tag.

    Returns:
        link: The MLflow run's address for the KFP UI, as Markdown (or a note that the run is not tracked).
        Output: The MLflow parent run id; empty when MLFLOW_TRACKING_URI is not set.
    """
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
