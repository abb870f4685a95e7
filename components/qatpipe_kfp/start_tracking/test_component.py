from mlflow import MlflowClient

from qatpipe.spec import bundled_spec_path
from qatpipe_kfp.start_tracking.component import start_tracking


def test_creates_a_tagged_parent_run_with_the_flat_spec(local_mlflow):
    spec = bundled_spec_path("tiny").read_text()
    run_id = start_tracking.python_func(spec=spec, run_name="nightly", kfp_run_id="kfp-7")
    run = MlflowClient(local_mlflow).get_run(run_id)
    assert run.info.run_name == "nightly" and run.data.tags["qatpipe.kfp_run_id"] == "kfp-7"
    assert run.data.params["train.batch_size"] == "8"
    assert [a.path for a in MlflowClient(local_mlflow).list_artifacts(run_id)] == ["spec.yaml"]


def test_no_tracking_uri_means_untracked(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert start_tracking.python_func(spec="{}", run_name="", kfp_run_id="x") == ""
