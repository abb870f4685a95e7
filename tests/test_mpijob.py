"""qatpipe.cluster: MPIJob manifests against the operators' released CRD schemas, and the launcher end to end.

No Kubernetes cluster can run on this machine, so the Kubernetes API is played by a small HTTP server on
127.0.0.1 (http.server in a thread) that the real `kubernetes` client talks to over HTTP. It stores the
MPIJob it is sent, answers status reads, lists the launcher pod and serves its log. What an operator would
do is scripted: the MPIJob's conditions advance one step per status read, and the launcher's log grows a
few characters per read (so lines arrive in pieces, as they do from a running pod).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re

import pytest

from qatpipe.cluster import MpiJobRequest, PvcMount, Resources, job_name, mpijob_manifest, validate_manifest
from qatpipe.cluster.mpijob import JOB_LABEL, MAX_NAME, ROLE_LABEL
from qatpipe.errors import QatpipeError

from conftest import CRD_SCHEMAS
from played_kubernetes import (  # the played API server, shared with test_scale_out.py
    CREATED, FAILED, LOG_LINES, RUNNING, SUCCEEDED, PlayedKubernetes, serve, status_body)

SCHEMAS = CRD_SCHEMAS
CRDS = {
    "v2beta1": SCHEMAS / "mpi-operator-v0.8.2" / "kubeflow.org_mpijobs.yaml",
    "v1": SCHEMAS / "kubeflow-training-v1.9.0" / "kubeflow.org_mpijobs.yaml",
}
needs_schemas = pytest.mark.usefixtures("crd_schemas")  # skipped without them, failed under CI=true (conftest)
VERSIONS = ["v2beta1", "v1"]
COMMAND = ["qatpipe", "train", "-e", "/cache/jobs/x/spec.yaml", "-r", "/cache/jobs/x/results"]
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def request(**overrides) -> MpiJobRequest:
    values = dict(name="qat-train-abc123", namespace="ml", image="registry.local/qatpipe-train:0.1",
                  command=list(COMMAND))
    values.update(overrides)
    return MpiJobRequest(**values)


# --- manifests ----------------------------------------------------------------------------------------------

VARIANTS = {
    "1 cpu worker": {},
    "4 workers x 8 gpus, everything": dict(
        workers=4, gpus_per_worker=8, pvc=PvcMount("qatpipe-cache", "/cache"), tolerations=[GPU_TOLERATION],
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, secret_env="qatpipe-credentials",
        secret_env_keys=["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"], service_account="qatpipe-trainer",
        env={"MLFLOW_TRACKING_URI": "http://mlflow.ml:5000"}, timeout_seconds=7200, labels={"team": "vision"},
        worker_resources=Resources("8", "64Gi", None, "96Gi")),
    "4 cpu workers, pvc read-only": dict(workers=4, pvc=PvcMount("datasets", "/data", read_only=True)),
    "1 worker x 8 gpus, secret only": dict(gpus_per_worker=8, secret_env="creds", clean_pod_policy="All",
                                           ttl_seconds_after_finished=None, backoff_limit=0),
}


@needs_schemas
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_validate_against_the_crd(version, variant):
    manifest = mpijob_manifest(request(api_version=version, **VARIANTS[variant]))
    assert manifest["apiVersion"] == f"kubeflow.org/{version}"
    validate_manifest(manifest, CRDS[version])


def test_manifest_v2beta1_contents():
    r = request(workers=4, gpus_per_worker=8, env={"MLFLOW_TRACKING_URI": "http://x"}, secret_env="creds",
                secret_env_keys=["AWS_SECRET_ACCESS_KEY"], pvc=PvcMount("cache", "/cache"),
                tolerations=[GPU_TOLERATION], timeout_seconds=600)
    spec = mpijob_manifest(r)["spec"]
    assert spec["slotsPerWorker"] == 8 and spec["mpiImplementation"] == "OpenMPI"
    assert spec["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 1, "activeDeadlineSeconds": 600,
                                 "ttlSecondsAfterFinished": 3600}
    launcher, worker = spec["mpiReplicaSpecs"]["Launcher"], spec["mpiReplicaSpecs"]["Worker"]
    assert (launcher["replicas"], launcher["restartPolicy"], worker["replicas"]) == (1, "OnFailure", 4)

    command = launcher["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["mpirun", "-np", "32"]  # 4 workers x 8 slots
    assert command[-len(COMMAND):] == COMMAND
    flags = " ".join(command[3:-len(COMMAND)])
    for flag in ["--bind-to none", "--map-by slot", "-x NCCL_DEBUG=WARN", "-x LD_LIBRARY_PATH", "-x PATH",
                 "-x TF_USE_LEGACY_KERAS", "-x MLFLOW_TRACKING_URI", "-x AWS_SECRET_ACCESS_KEY"]:
        assert flag in flags
    assert "http://x" not in command  # names are forwarded, values stay in the environment

    for role, replica in [("launcher", launcher), ("worker", worker)]:
        pod = replica["template"]
        assert pod["metadata"]["labels"] == {JOB_LABEL: r.name, ROLE_LABEL: role}
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["spec"]["securityContext"]["runAsUser"] == 1000
        container = pod["spec"]["containers"][0]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["envFrom"] == [{"secretRef": {"name": "creds", "optional": True}}]
        assert {"name": "data", "mountPath": "/cache", "readOnly": False} in container["volumeMounts"]
        assert {"name": "data", "persistentVolumeClaim": {"claimName": "cache", "readOnly": False}} \
            in pod["spec"]["volumes"]
    worker_container = worker["template"]["spec"]["containers"][0]
    assert worker_container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert worker_container["command"][0] == "/usr/sbin/sshd"
    assert worker["template"]["spec"]["tolerations"] == [GPU_TOLERATION]
    assert "nvidia.com/gpu" not in str(launcher["template"]["spec"]["containers"][0]["resources"])


def test_manifest_v1_contents():
    spec = mpijob_manifest(request(api_version="v1", workers=2, clean_pod_policy="All"))["spec"]
    # the Training Operator rejects spec.cleanPodPolicy contradicting runPolicy's: both are set alike
    assert spec["cleanPodPolicy"] == spec["runPolicy"]["cleanPodPolicy"] == "All"
    assert spec["slotsPerWorker"] == 1 and "mpiImplementation" not in spec
    worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert "command" not in worker  # the operator makes v1 workers `sleep`; mpirun reaches them by kubectl exec
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher["command"][:3] == ["mpirun", "-np", "2"]


@needs_schemas
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("breakage, expected", [
    (lambda m: m["spec"]["mpiReplicaSpecs"]["Worker"].__setitem__("replicas", "4"),
     "spec.mpiReplicaSpecs.Worker.replicas: '4' is not of type 'integer'"),
    (lambda m: m["spec"]["mpiReplicaSpecs"].pop("Launcher"), "spec.mpiReplicaSpecs.Launcher: missing"),
    (lambda m: m["spec"].__setitem__("slotPerWorker", 2), "'slotPerWorker' was unexpected"),
    (lambda m: m["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"]
     ["limits"].__setitem__("memory", "32 GB"), "resources.limits.memory: '32 GB' is not a Kubernetes quantity"),
    (lambda m: m["spec"]["mpiReplicaSpecs"]["Launcher"].__setitem__("replicas", 2),
     "Launcher.replicas: must be 1"),
    (lambda m: m["metadata"].__setitem__("name", "x" * 60), "metadata.name"),
])
def test_broken_manifests_fail_validation(version, breakage, expected):
    manifest = mpijob_manifest(request(api_version=version, workers=4, gpus_per_worker=2))
    breakage(manifest)
    with pytest.raises(QatpipeError, match="is invalid") as caught:
        validate_manifest(manifest, CRDS[version])
    assert expected in str(caught.value)


@needs_schemas
def test_manifest_checked_against_the_other_operators_crd_fails():
    with pytest.raises(QatpipeError, match="defines MPIJob in kubeflow.org versions v1"):
        validate_manifest(mpijob_manifest(request()), CRDS["v1"])


@pytest.mark.parametrize("overrides, expected", [
    (dict(workers="4"), "workers must be an integer"),
    (dict(workers=0), "workers must be an integer >= 1"),
    (dict(gpus_per_worker=-1), "gpus_per_worker"),
    (dict(api_version="v2"), "api_version"),
    (dict(name="Bad_Name"), "name must be"),
    (dict(command="qatpipe train"), "command"),
    (dict(env={"BAD-NAME": "1"}), "BAD-NAME"),
])
def test_bad_requests_are_refused(overrides, expected):
    with pytest.raises(QatpipeError, match=expected):
        request(**overrides)


def test_job_name():
    assert job_name("QAT Train/DetectNet_v2", "Run-42") == "qat-train-detectnet-v2-run-42"
    assert job_name("7eleven", "a1") == "job-7eleven-a1"  # a Service is named after the job: starts with a letter
    long = job_name("p" * 80, "0123456789abcdef")
    assert len(long) <= MAX_NAME and long.endswith("-0123456789abcdef")
    for name in [long, job_name("x"), job_name("--", "--"), job_name("a", "z" * 90)]:
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= MAX_NAME, name
        request(name=name)  # accepted
    assert job_name("x") != job_name("x")  # a random unique part by default


# --- the launcher against a played Kubernetes API ------------------------------------------------------------

@pytest.fixture
def played_api():
    """start(script, log) -> (PlayedKubernetes, ApiClient) pointed at a fresh played API server."""
    from kubernetes.client import ApiClient, Configuration

    with contextlib.ExitStack() as stack:
        def start(script: list[list[dict]] = (SUCCEEDED,), log: str = "", chunk: int = 40):
            kube = PlayedKubernetes(list(script), log, chunk)
            client = ApiClient(Configuration(host=stack.enter_context(serve(kube))))
            stack.callback(client.close)
            return kube, client

        yield start


def launcher_for(client, version: str = "v2beta1"):
    from qatpipe.cluster.launcher import MpiJobLauncher

    return MpiJobLauncher(api_client=client, api_version=version, poll_seconds=0.01)


def streamed_lines(caplog, name: str) -> list[str]:
    prefix = f"[{name}] "
    return [r.getMessage()[len(prefix):] for r in caplog.records if r.getMessage().startswith(prefix)
            and r.name == "qatpipe.cluster.launcher"]


@pytest.mark.parametrize("version", VERSIONS)
def test_run_succeeds_streams_the_log_and_deletes(played_api, caplog, version):
    kube, client = played_api([CREATED, RUNNING, RUNNING, RUNNING, RUNNING, RUNNING, RUNNING, SUCCEEDED],
                              "\n".join(LOG_LINES) + "\n")
    r = request(api_version=version, workers=2, gpus_per_worker=4, env={"HOROVOD_SECRETISH": "s3cr3t-value"})
    manifest = mpijob_manifest(r)
    caplog.set_level(logging.INFO, logger="qatpipe.cluster")

    status = launcher_for(client, version).run(manifest, timeout_seconds=30)

    assert any(c["type"] == "Succeeded" for c in status["conditions"])
    assert kube.created == [json.loads(json.dumps(manifest))]  # the body sent is the manifest, unchanged
    assert kube.create_queries == ["fieldValidation=Strict"]  # a field the cluster's CRD lacks is refused
    assert kube.deleted == [(r.name, "Background")]
    assert kube.selectors[0] == f"{JOB_LABEL}={r.name},{ROLE_LABEL}=launcher"
    assert streamed_lines(caplog, r.name) == LOG_LINES  # each line once, whole, in order
    messages = [rec.getMessage() for rec in caplog.records]
    assert any(m.startswith(f"MPIJob ml/{r.name}: Running (MPIJobRunning) after") for m in messages)
    succeeded = next(i for i, m in enumerate(messages) if m.startswith(f"MPIJob ml/{r.name}: Succeeded"))
    assert messages.index(f"[{r.name}] {LOG_LINES[0]}") < succeeded  # shown while it ran, not only at the end
    assert any(m == f"Deleted MPIJob ml/{r.name}" for m in messages)
    assert "s3cr3t-value" not in caplog.text  # env values are never logged


def test_run_failure_names_the_reason_and_the_last_log_lines(played_api, caplog):
    lines = [f"[1,0]<stderr>:frame {i}" for i in range(30)] + ["[1,0]<stderr>:RuntimeError: NCCL error: unhandled"]
    kube, client = played_api([CREATED, RUNNING, RUNNING, FAILED], "\n".join(lines) + "\n", chunk=25)
    r = request(workers=2)
    caplog.set_level(logging.INFO, logger="qatpipe.cluster")

    with pytest.raises(QatpipeError) as caught:
        launcher_for(client).run(mpijob_manifest(r), timeout_seconds=30)

    text = str(caught.value)
    assert f"MPIJob ml/{r.name} failed" in text
    assert "BackoffLimitExceeded: Job has reached the specified backoff limit" in text
    assert "RuntimeError: NCCL error: unhandled" in text and "frame 11" in text
    assert "frame 10\n" not in text  # only the last 20 lines are quoted
    assert kube.deleted == [(r.name, "Background")]
    assert streamed_lines(caplog, r.name) == lines


class PlayedClock:
    """The launcher's `time` on a played clock: monotonic() moves only when it sleeps, so that a timeout is a
    number of polls, whatever the machine's speed."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_run_times_out_and_deletes(played_api, monkeypatch):
    """A job that stays Running: polled every poll_seconds until timeout_seconds have passed on the launcher's
    clock (the last wait cut to the deadline), then one last log read, the error and the deletion."""
    from qatpipe.cluster import launcher
    from qatpipe.cluster.launcher import MpiJobLauncher

    clock = PlayedClock()
    monkeypatch.setattr(launcher, "time", clock)
    kube, client = played_api([CREATED, RUNNING], "[1,0]<stdout>:Epoch 1/500\n")
    r = request()
    with pytest.raises(QatpipeError, match=r"timed out after 295 s \(last state: Running\)") as caught:
        MpiJobLauncher(api_client=client, api_version="v2beta1", poll_seconds=10).run(mpijob_manifest(r),
                                                                                      timeout_seconds=295)
    assert clock.sleeps == [10.0] * 29 + [5.0]  # never past the deadline
    assert kube.reads == 31  # a status read at 0, 10, ..., 290 s and at 295 s, the one that times out
    assert "Epoch 1/500" in str(caught.value)
    assert kube.deleted == [(r.name, "Background")]


def test_forbidden_log_is_one_warning_and_the_job_still_runs(played_api, caplog):
    kube, client = played_api([CREATED, RUNNING, RUNNING, SUCCEEDED], "[1,0]<stdout>:hello\n")
    kube.log_error = (403, status_body(403, "Forbidden", 'pods "x" is forbidden: cannot get resource "pods/log"'))
    r = request()
    caplog.set_level(logging.INFO, logger="qatpipe.cluster")
    launcher_for(client).run(mpijob_manifest(r), timeout_seconds=10)
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "verbs [get] on resources [pods/log]" in warnings[0]
    assert streamed_lines(caplog, r.name) == [] and kube.deleted == [(r.name, "Background")]


def test_keep_skips_the_deletion(played_api, caplog):
    kube, client = played_api([SUCCEEDED])
    caplog.set_level(logging.INFO, logger="qatpipe.cluster")
    launcher_for(client).run(mpijob_manifest(request()), timeout_seconds=10, keep=True)
    assert kube.deleted == [] and "keep=True" in caplog.text


def test_a_job_breaking_the_operators_admission_rules_fails_before_anything_is_created(played_api):
    """The API server would accept it and the operator would never run it: the launcher refuses it first."""
    kube, client = played_api()
    manifest = mpijob_manifest(request())
    manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"] = 2
    with pytest.raises(QatpipeError, match=r"invalid against the admission rules of kubeflow/mpi-operator .*\n  "
                                           r"spec.mpiReplicaSpecs.Launcher.replicas: must be 1, got 2"):
        launcher_for(client).run(manifest, timeout_seconds=10)
    assert kube.created == [] and kube.deleted == []


def test_forbidden_create_names_the_rbac_permission(played_api):
    kube, client = played_api()
    kube.create_error = (403, status_body(
        403, "Forbidden", 'mpijobs.kubeflow.org is forbidden: User "system:serviceaccount:ml:pipeline-runner" '
        'cannot create resource "mpijobs" in API group "kubeflow.org" in the namespace "ml"'))
    with pytest.raises(QatpipeError) as caught:
        launcher_for(client).run(mpijob_manifest(request()), timeout_seconds=10)
    text = str(caught.value)
    assert "permission denied" in text and "verbs [create] on resources [mpijobs]" in text
    assert "apiGroups [kubeflow.org]" in text and "'ml'" in text
    assert kube.deleted == []  # nothing was created, so nothing to delete


@pytest.mark.parametrize("version, operator", [("v2beta1", "kubeflow/mpi-operator"),
                                               ("v1", "Kubeflow Training Operator")])
def test_missing_crd_names_the_operator(played_api, version, operator):
    kube, client = played_api()
    kube.create_error = (404, "404 page not found")  # what the API server says for an unknown group/version
    with pytest.raises(QatpipeError, match="CRD of that version is not installed") as caught:
        launcher_for(client, version).run(mpijob_manifest(request(api_version=version)), timeout_seconds=10)
    assert operator in str(caught.value) and f"mpijobs.kubeflow.org/{version}" in str(caught.value)


def test_missing_namespace_is_told_apart_from_a_missing_crd(played_api):
    kube, client = played_api()
    kube.create_error = (404, status_body(404, "NotFound", 'namespaces "ml" not found',
                                          {"name": "ml", "kind": "namespaces"}))
    with pytest.raises(QatpipeError, match="namespace 'ml' does not exist"):
        launcher_for(client).run(mpijob_manifest(request()), timeout_seconds=10)


def test_existing_job_is_reported_and_left_alone(played_api):
    kube, client = played_api()
    manifest = mpijob_manifest(request())
    kube.jobs[manifest["metadata"]["name"]] = copy.deepcopy(manifest)  # someone else's job of that name
    with pytest.raises(QatpipeError, match="already exists in namespace 'ml'"):
        launcher_for(client).run(manifest, timeout_seconds=10)
    assert kube.deleted == [] and manifest["metadata"]["name"] in kube.jobs


def test_replace_existing_deletes_an_earlier_attempts_job_and_creates_it_again(played_api, caplog):
    kube, client = played_api()
    manifest = mpijob_manifest(request())
    name = manifest["metadata"]["name"]
    kube.jobs[name] = copy.deepcopy(manifest)  # left running by a killed attempt of the same work
    with caplog.at_level(logging.WARNING):
        launcher_for(client).run(manifest, timeout_seconds=10, replace_existing=True)
    assert [deleted for deleted, _ in kube.deleted] == [name, name]  # the stale one, then ours when done
    assert len(kube.created) == 1 and "exists (an earlier attempt): deleting it" in caplog.text


def test_manifest_of_another_version_is_refused(played_api):
    _, client = played_api()
    with pytest.raises(QatpipeError, match="runs kubeflow.org/v1 MPIJobs"):
        launcher_for(client, "v1").run(mpijob_manifest(request()), timeout_seconds=10)


def test_no_credentials_anywhere_is_a_clear_error(monkeypatch, tmp_path):
    from qatpipe.cluster.launcher import MpiJobLauncher

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    with pytest.raises(QatpipeError, match="no Kubernetes credentials"):
        MpiJobLauncher()
