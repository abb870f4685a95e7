"""`qatpipe submit` against a local HTTP server that records what a KFP API server would receive.

No Kubeflow Pipelines backend can run here (no Kubernetes), so the server below answers the three v2beta1
calls `kfp.Client` makes (find experiment, create experiment, create run) with minimal valid JSON. What is
checked is what we send: the endpoints, the bearer token from $KFP_TOKEN, the compiled pipeline spec and
the typed run parameters; and the URL we print.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qatpipe.cli import main
from qatpipe.errors import QatpipeError
from qatpipe_pipelines.submit import (check_compile_options, check_spec, compile_pipeline, parse_arguments,
                                      submit)


class _RecordingKfpApi(BaseHTTPRequestHandler):
    requests: list = []

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, status: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _record(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        entry = {"method": self.command, "path": self.path, "auth": self.headers.get("Authorization"),
                 "body": body}
        self.requests.append(entry)
        return entry

    def do_GET(self):
        entry = self._record()
        if entry["path"].startswith("/apis/v2beta1/healthz"):
            return self._reply(200, {"multi_user": False})
        if entry["path"].startswith("/apis/v2beta1/experiments"):
            return self._reply(200, {"experiments": [], "total_size": 0})
        self._reply(404, {"error": "not found", "code": 5})

    def do_POST(self):
        entry = self._record()
        if entry["path"].startswith("/apis/v2beta1/experiments"):
            return self._reply(200, {"experiment_id": "exp-1", "display_name": entry["body"]["display_name"]})
        if entry["path"].startswith("/apis/v2beta1/runs"):
            return self._reply(200, {"run_id": "run-42", "display_name": entry["body"]["display_name"],
                                     "experiment_id": "exp-1", "state": "PENDING"})
        self._reply(404, {"error": "not found", "code": 5})


@pytest.fixture
def kfp_api():
    _RecordingKfpApi.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RecordingKfpApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _RecordingKfpApi.requests
    server.shutdown()


def test_submit_creates_a_run(kfp_api, monkeypatch, capsys):
    host, requests = kfp_api
    monkeypatch.setenv("KFP_TOKEN", "test-token")
    code = main(["submit", "--host", host, "--experiment", "detectors", "--run-name", "qat-1",
                 "--service-account", "default-editor",
                 "spec_uri=s3://specs/kitti.yaml", "gpus=2", "spec_overrides=[train.epochs=3]",
                 'node_selector={"nvidia.com/gpu.product": "A100"}'])
    assert code == 0
    assert capsys.readouterr().out.strip() == f"{host}/#/runs/details/run-42"

    created = [r for r in requests if r["method"] == "POST"]
    assert [r["path"].split("?")[0] for r in created] == ["/apis/v2beta1/experiments", "/apis/v2beta1/runs"]
    assert all(r["auth"] == "Bearer test-token" for r in requests)
    assert created[0]["body"]["display_name"] == "detectors"
    run = created[1]["body"]
    assert run["display_name"] == "qat-1" and run["experiment_id"] == "exp-1"
    assert run["service_account"] == "default-editor"  # the identity the run's pods take
    # the package's two documents travel together: the DAG, and the Kubernetes settings (secrets, GPUs)
    assert run["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "qatpipe"
    assert "kubernetes" in run["pipeline_spec"]["platform_spec"]["platforms"]
    assert run["runtime_config"]["parameters"] == {
        "spec_uri": "s3://specs/kitti.yaml", "gpus": 2, "spec_overrides": ["train.epochs=3"],
        "node_selector": {"nvidia.com/gpu.product": "A100"},
        "kfp_ui_url": host,  # MLflow links back to the run's page
    }
    assert "test-token" not in json.dumps(run)  # the token travels only in the header


def test_submit_reports_an_unreachable_host(closed_port_uri, monkeypatch):
    monkeypatch.delenv("KFP_TOKEN", raising=False)
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    with pytest.raises(QatpipeError, match=r"KFP at http://127\.0\.0\.1:\d+: unreachable"):
        submit(closed_port_uri, {})


def test_pipeline_arguments_are_checked():
    assert parse_arguments(["spec_uri=007", "gpus=0", "tolerations=[]"]) == {
        "spec_uri": "007", "gpus": 0, "tolerations": []}
    with pytest.raises(QatpipeError, match="unknown pipeline parameter 'gpu'"):
        parse_arguments(["gpu=2"])
    with pytest.raises(QatpipeError, match="expected NAME=VALUE"):
        parse_arguments(["gpus"])
    with pytest.raises(QatpipeError, match=r"spec_overrides='train.epochs=3': expected list"):
        parse_arguments(["spec_overrides=train.epochs=3"])
    with pytest.raises(QatpipeError, match=r"gpus='two': expected int"):
        parse_arguments(["gpus=two"])


def test_the_host_and_compile_options_are_checked_before_anything_runs(tmp_path):
    """Values Kubernetes or urllib would refuse later (or a pod spec would carry): one line naming the flag."""
    with pytest.raises(QatpipeError, match=r"^--host 'not-a-url': not an http\(s\) URL"):
        submit("not-a-url", {})
    for pvc in ("Bad_PVC!", "-cache", "x" * 254):
        with pytest.raises(QatpipeError, match="--cache-pvc .*: not a PersistentVolumeClaim name"):
            compile_pipeline(tmp_path / "p.yaml", cache_pvc=pvc)
    for size in ("lots", "0", "-1Gi", "100m"):
        with pytest.raises(QatpipeError, match=f"--shm-size '{size}': not a Kubernetes memory quantity"):
            compile_pipeline(tmp_path / "p.yaml", shm_size=size)
    assert not (tmp_path / "p.yaml").exists()
    check_compile_options("dataset-cache.v2", "512Mi")  # good ones pass


def test_the_spec_is_checked_here_where_it_can_be_read(caplog):
    with pytest.raises(QatpipeError, match="train.bogus"):
        check_spec({"spec_overrides": ["train.bogus=1"]})  # the default spec, with a bad key
    check_spec({"spec_uri": "tiny", "spec_overrides": ["train.epochs=2"]})
    with caplog.at_level(logging.INFO):
        check_spec({"spec_uri": "/specs/in-the-image.yaml"})  # not here: the cluster's resolve-spec checks it
    assert "spec_uri /specs/in-the-image.yaml is not on this machine" in caplog.text
