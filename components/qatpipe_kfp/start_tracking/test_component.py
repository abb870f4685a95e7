from kfp import dsl
from mlflow import MlflowClient

from qatpipe.spec import bundled_spec_path
from qatpipe_kfp.start_tracking.component import start_tracking


def test_creates_a_tagged_parent_run_with_the_flat_spec(local_mlflow, artifact):
    spec = bundled_spec_path("tiny").read_text()
    link = artifact(dsl.Markdown, "link")
    run_id = start_tracking.python_func(spec=spec, run_name="nightly", kfp_run_id="kfp-7",
                                        kfp_ui_url="https://kubeflow.example.com/pipeline/", link=link)
    run = MlflowClient(local_mlflow).get_run(run_id)
    assert run.info.run_name == "nightly" and run.data.tags["qatpipe.kfp_run_id"] == "kfp-7"
    # links both ways: the MLflow run to the KFP run's page, the KFP UI (the link output) to the MLflow run
    assert run.data.tags["qatpipe.kfp_run_url"] == "https://kubeflow.example.com/pipeline/#/runs/details/kfp-7"
    assert f"/#/experiments/{run.info.experiment_id}/runs/{run_id}" in open(link.path).read()
    assert run.data.tags["mlflow.source.type"] == "JOB" and "mlflow.user" in run.data.tags
    assert run.data.params["train.batch_size"] == "8"
    assert [a.path for a in MlflowClient(local_mlflow).list_artifacts(run_id)] == ["spec.yaml"]


def test_no_tracking_uri_means_untracked(monkeypatch, artifact):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    link = artifact(dsl.Markdown, "link")
    assert start_tracking.python_func(spec="{}", run_name="", kfp_run_id="x", kfp_ui_url="", link=link) == ""
    assert "not tracked" in open(link.path).read()
