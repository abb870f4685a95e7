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
