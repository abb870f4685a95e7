"""The first task's check of the credentials Secret, against the played Kubernetes API (no cluster can run
here: tests/played_kubernetes.py) and the environment."""

from __future__ import annotations

import base64
import contextlib

import pytest

from played_kubernetes import PlayedKubernetes, serve, status_body
from qatpipe.cluster.credentials import S3_KEYS, CredentialsError, check_credentials

S3_DATA = ["s3://datasets/kitti/train", "s3://datasets/kitti/val"]


@pytest.fixture
def api():
    """(PlayedKubernetes, ApiClient) on a fresh played API server."""
    from kubernetes.client import ApiClient, Configuration

    kube = PlayedKubernetes([], "")
    with contextlib.ExitStack() as stack:
        client = ApiClient(Configuration(host=stack.enter_context(serve(kube))))
        stack.callback(client.close)
        yield kube, client


@pytest.fixture(autouse=True)
def no_credentials(monkeypatch):
    for key in (*S3_KEYS, "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(key, raising=False)


def _data(*keys: str) -> dict[str, str]:
    return {key: base64.b64encode(b"x").decode() for key in keys}


def test_a_missing_secret_names_itself_and_the_namespace(api):
    kube, client = api
    with pytest.raises(CredentialsError, match=r"^Secret qatpipe-credentials not found in namespace "
                                               r"kubeflow-user-a, where the pipeline's pods run: "
                                               r"AWS_ACCESS_KEY_ID is needed \(the spec reads s3://datasets/kitti/"
                                               r"train\)"):
        check_credentials("qatpipe-credentials", S3_DATA, "kubeflow-user-a", client)
    # also when the run reads no S3: without the Secret nothing would be tracked, silently
    with pytest.raises(CredentialsError, match="without it nothing is tracked in MLflow"):
        check_credentials("qatpipe-credentials", [], "kubeflow-user-a", client)


def test_a_missing_key_names_the_key(api):
    kube, client = api
    kube.secrets[("team", "creds")] = _data("AWS_ACCESS_KEY_ID", "MLFLOW_TRACKING_URI")
    with pytest.raises(CredentialsError, match=r"^Secret creds in namespace team has no key AWS_SECRET_ACCESS_KEY, "
                                               r"and the spec reads s3://"):
        check_credentials("creds", S3_DATA, "team", client)
    kube.secrets[("team", "creds")] = _data(*S3_KEYS)
    check_credentials("creds", S3_DATA, "team", client)  # complete: no error
    check_credentials("creds", ["/data/train"], "team", client)  # local data needs no S3 keys


def test_keys_the_pod_has_from_elsewhere_are_not_asked_of_the_secret(api, monkeypatch):
    kube, client = api
    kube.secrets[("team", "creds")] = _data("MLFLOW_TRACKING_URI")  # S3 keys come from, say, a PodDefault
    for key in S3_KEYS:
        monkeypatch.setenv(key, "from-a-poddefault")
    check_credentials("creds", S3_DATA, "team", client)


def test_unreadable_secrets_fall_back_to_the_environment(api, monkeypatch):
    kube, client = api
    kube.secret_error = (403, status_body(403, "Forbidden", 'secrets "creds" is forbidden'))
    with pytest.raises(CredentialsError, match=r"AWS_ACCESS_KEY_ID is not set.*Secret creds in namespace team "
                                               r"\(this pod cannot read Secrets"):
        check_credentials("creds", S3_DATA, "team", client)
    for key in S3_KEYS:
        monkeypatch.setenv(key, "from-the-secret")
    check_credentials("creds", S3_DATA, "team", client)


def test_outside_a_pod_only_the_environment_counts(monkeypatch, tmp_path):
    from qatpipe.cluster import kube_client

    monkeypatch.setattr(kube_client, "NAMESPACE_FILE", tmp_path / "no-service-account")
    with pytest.raises(CredentialsError, match="AWS_ACCESS_KEY_ID is not set, and the spec reads s3://"):
        check_credentials("qatpipe-credentials", S3_DATA, None)
    check_credentials("qatpipe-credentials", ["/local/train"], None)
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/secrets/eks/token")  # IRSA: no keys needed
    check_credentials("qatpipe-credentials", S3_DATA, None)


def test_tracking_access_is_checked_only_against_a_server(monkeypatch, caplog):
    """A file or database tracking URI needs no credentials; a server that cannot be reached is left to tracking's
    own retries (a warning). The refusals are tested against the real basic-auth server (test_manifests.py)."""
    from conftest import _free_port
    from qatpipe.cluster.credentials import check_tracking_access

    for uri in ("sqlite:///x/mlflow.db", "file:///x/mlruns", ""):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        check_tracking_access("creds", "team")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:secret@127.0.0.1:{_free_port()}")
    check_tracking_access("creds", "team", timeout_s=2)
    assert "cannot be reached to check the credentials" in caplog.text and "secret" not in caplog.text

