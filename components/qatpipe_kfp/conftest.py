"""Fixtures for the component folders' own tests (each folder's test_component.py)."""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
from kfp import dsl  # noqa: E402


@pytest.fixture
def artifact(tmp_path):
    """make(kind, name): an output artifact of `kind` (dsl.Dataset, ...) at tmp_path/name, as KFP would pass."""

    def make(kind=dsl.Artifact, name="artifact"):
        return kind(name=name, uri=str(tmp_path / name), metadata={})

    return make


@pytest.fixture
def local_mlflow(tmp_path, monkeypatch):
    """A real MLflow store in a SQLite file (no server needed for the component contract)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)  # a SQLite store's default artifact root is ./mlruns
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return uri


@pytest.fixture(autouse=True)
def _no_pipeline_run_leaks(monkeypatch):
    """A test that found a pipeline's MLflow run (tracking.live.parent_run_from_kfp sets it in os.environ, for its
    subprocesses) must not hand it to the next test in the same worker, whose store does not hold it."""
    monkeypatch.delenv("QATPIPE_MLFLOW_PARENT_RUN", raising=False)
