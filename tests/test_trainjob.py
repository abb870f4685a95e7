"""Kubeflow Trainer v2: the TrainJob and TrainingRuntime manifests against the v2.3.0 CRDs, the ClusterTrainingRuntime
in manifests/trainer/, and TrainJobLauncher against the played Kubernetes API (no cluster or Trainer controller
can run here: played_kubernetes.py scripts the TrainJob's conditions and serves the launcher pod's log)."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from pathlib import Path

import pytest
import yaml

from conftest import CRD_SCHEMAS
from played_kubernetes import LOG_LINES, TJ_COMPLETE, TJ_CREATED, TJ_FAILED, PlayedKubernetes, serve
from qatpipe.cluster import trainjob
from qatpipe.cluster.mpijob import JOB_LABEL, ROLE_LABEL, MpiJobRequest, PvcMount
from qatpipe.errors import QatpipeError

TRAINER = CRD_SCHEMAS / "kubeflow-trainer-v2.3.0"
CRDS = {"TrainJob": TRAINER / "trainer.kubeflow.org_trainjobs.yaml",
        "TrainingRuntime": TRAINER / "trainer.kubeflow.org_trainingruntimes.yaml",
        "ClusterTrainingRuntime": TRAINER / "trainer.kubeflow.org_clustertrainingruntimes.yaml"}
needs_schemas = pytest.mark.usefixtures("crd_schemas")  # skipped without them, failed under CI=true (conftest)
MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
COMMAND = ["qatpipe", "train", "-e", "/cache/jobs/x/spec.yaml", "-r", "/cache/jobs/x/results"]
VARIANTS = {
    "1 cpu worker": {},
    "4 workers x 8 gpus, everything": dict(
        workers=4, gpus_per_worker=8, pvc=PvcMount("qatpipe-cache", "/cache"),
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, secret_env="qatpipe-credentials",
        secret_env_keys=["AWS_ACCESS_KEY_ID"], service_account="qatpipe-trainer", timeout_seconds=7200,
        env={"MLFLOW_TRACKING_URI": "http://mlflow.ml:5000"}, labels={"team": "vision"}),
    "1 worker x 2 gpus, no ttl": dict(gpus_per_worker=2, ttl_seconds_after_finished=None, backoff_limit=0),
}


def request(**overrides) -> MpiJobRequest:
    values = dict(name="qat-train-abc123", namespace="ml", image="registry.local/qatpipe-train:0.1",
                  command=list(COMMAND))
    return MpiJobRequest(**{**values, **overrides})


def replicated(runtime: dict, name: str) -> dict:
    [job] = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == name]
    return job


def pod(runtime: dict, name: str) -> dict:
    return replicated(runtime, name)["template"]["spec"]["template"]


# --- manifests ----------------------------------------------------------------------------------------------

@needs_schemas
@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_validate_against_the_trainer_crds(variant):
    r = request(**VARIANTS[variant])
    trainjob.validate_manifest(trainjob.training_runtime_manifest(r), CRDS["TrainingRuntime"])
    trainjob.validate_manifest(trainjob.trainjob_manifest(r), CRDS["TrainJob"])


def test_runtime_layout_launcher_without_gpu_nodes_with_gpus_and_ssh():
    r = request(**VARIANTS["4 workers x 8 gpus, everything"])
    runtime = trainjob.training_runtime_manifest(r)
    assert runtime["metadata"]["name"] == r.name and runtime["metadata"]["namespace"] == "ml"
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 4, "mpi": {
        "numProcPerNode": 8, "mpiImplementation": "OpenMPI", "sshAuthMountPath": "/home/mpiuser/.ssh",
        "runLauncherAsNode": False}}
    jobset = runtime["spec"]["template"]["spec"]
    assert jobset["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["launcher"]}

    launcher, node = pod(runtime, "launcher"), pod(runtime, "node")
    [lc], [nc] = launcher["spec"]["containers"], node["spec"]["containers"]
    assert lc["name"] == nc["name"] == "node"  # where Trainer's MPI plugin mounts the SSH keys and hostfile
    assert "nvidia.com/gpu" not in json.dumps(lc["resources"]) and nc["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert lc["command"][:3] == ["mpirun", "-np", "32"] and lc["command"][-len(COMMAND):] == COMMAND
    assert nc["command"][0] == "/usr/sbin/sshd" and nc["readinessProbe"]["tcpSocket"]["port"] == trainjob.SSH_PORT
    assert replicated(runtime, "launcher")["dependsOn"] == [{"name": "node", "status": "Ready"}]
    assert replicated(runtime, "launcher")["template"]["metadata"]["labels"] == {trainjob.ANCESTOR_LABEL: "trainer"}
    assert replicated(runtime, "node")["template"]["spec"]["parallelism"] == 4
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in node["spec"]["volumes"]
    assert node["spec"]["nodeSelector"] and "nodeSelector" not in launcher["spec"]
    assert launcher["metadata"]["labels"][ROLE_LABEL] == "launcher"
    assert launcher["metadata"]["labels"][JOB_LABEL] == r.name
    for spec in (launcher["spec"], node["spec"]):
        assert spec["securityContext"]["runAsNonRoot"] and spec["serviceAccountName"] == "qatpipe-trainer"
        assert spec["restartPolicy"] in ("Never", "OnFailure")


def test_trainjob_sets_only_the_size_so_every_trainer_release_runs_the_same_pods():
    job = trainjob.trainjob_manifest(request(workers=3, gpus_per_worker=2, timeout_seconds=600))
    assert job["spec"] == {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                          "name": "qat-train-abc123"},
                           "trainer": {"numNodes": 3, "numProcPerNode": 2}, "activeDeadlineSeconds": 600}


def test_secret_values_never_enter_the_manifests():
    r = request(secret_env="qatpipe-credentials", secret_env_keys=["AWS_SECRET_ACCESS_KEY"])
    text = json.dumps([trainjob.training_runtime_manifest(r), trainjob.trainjob_manifest(r)])
    assert '"secretRef": {"name": "qatpipe-credentials"' in text  # by reference only
    assert "-x\", \"AWS_SECRET_ACCESS_KEY" in text  # forwarded to every rank by name


@needs_schemas
@pytest.mark.parametrize("break_it, expected", [
    (lambda m: pod(m, "node")["spec"]["containers"][0].update(name="worker"), "no container named 'node'"),
    (lambda m: m["spec"]["template"]["spec"]["replicatedJobs"].pop(), "no 'launcher' job"),
    (lambda m: m["spec"]["mlPolicy"]["mpi"].update(mpiImplementaton="OpenMPI"), "mpiImplementaton"),
    (lambda m: pod(m, "node")["spec"]["containers"][0]["resources"]["limits"].update(memory="lots"),
     "not a Kubernetes quantity"),
])
def test_validation_catches_what_the_api_server_or_trainer_would_refuse(break_it, expected):
    runtime = trainjob.training_runtime_manifest(request(workers=2, gpus_per_worker=1))
    break_it(runtime)
    with pytest.raises(QatpipeError, match="TrainingRuntime .* is invalid") as caught:
        trainjob.validate_manifest(runtime, CRDS["TrainingRuntime"])
    assert expected in str(caught.value)


@needs_schemas
def test_a_name_too_long_for_the_pod_hostnames_is_refused():
    with pytest.raises(QatpipeError, match="is 51 characters; at most 50"):
        trainjob.trainjob_manifest(request(name="q" * 51))  # an MPIJob may have 52
    job = trainjob.trainjob_manifest(request(name="q" * 50))
    trainjob.validate_manifest(job, CRDS["TrainJob"])
    job["metadata"]["name"] = "q" * 51  # written by hand
    with pytest.raises(QatpipeError, match="short enough for pod hostname"):
        trainjob.validate_manifest(job, CRDS["TrainJob"])


@needs_schemas
def test_cluster_runtime_in_the_manifests_is_the_generated_one_and_valid():
    from qatpipe_kfp.settings import TRAINING_IMAGE

    committed = yaml.safe_load((MANIFESTS / "trainer" / "clustertrainingruntime.yaml").read_text())
    image = pod(committed, "node")["spec"]["containers"][0]["image"]
    assert image == TRAINING_IMAGE  # the project's training image, as images/build.sh names it
    assert committed == json.loads(json.dumps(trainjob.cluster_runtime_manifest(image)))
    trainjob.validate_manifest(committed, CRDS["ClusterTrainingRuntime"])
    assert "namespace" not in committed["metadata"]  # cluster-scoped


# --- the launcher against the played API ----------------------------------------------------------------------

@pytest.fixture
def played_api():
    from kubernetes.client import ApiClient, Configuration

    with contextlib.ExitStack() as stack:
        def start(script=(TJ_COMPLETE,), log: str = "", chunk: int = 40):
            kube = PlayedKubernetes(list(script), log, chunk)
            client = ApiClient(Configuration(host=stack.enter_context(serve(kube))))
            stack.callback(client.close)
            return kube, client

        yield start


def launch(client, r: MpiJobRequest, timeout: float = 30, **kwargs):
    from qatpipe.cluster.launcher import TrainJobLauncher

    launcher = TrainJobLauncher(api_client=client, runtime=trainjob.training_runtime_manifest(r), poll_seconds=0.01)
    return launcher.run(trainjob.trainjob_manifest(r), timeout_seconds=timeout, **kwargs)


def test_trainjob_runs_to_complete_streams_the_log_and_deletes_job_and_runtime(played_api, caplog):
    kube, client = played_api([TJ_CREATED] * 6 + [TJ_COMPLETE], "\n".join(LOG_LINES) + "\n")
    r = request(workers=2, gpus_per_worker=4)
    caplog.set_level(logging.INFO, logger="qatpipe.cluster")

    status = launch(client, r)

    assert any(c["type"] == "Complete" for c in status["conditions"])
    assert [o["kind"] for o in kube.created] == ["TrainingRuntime", "TrainJob"]  # the runtime first
    assert kube.create_queries == ["fieldValidation=Strict"] * 2  # a field the cluster's CRDs lack is refused
    assert kube.created[1] == json.loads(json.dumps(trainjob.trainjob_manifest(r)))
    assert kube.deleted == [(r.name, "Background")] and kube.deleted_runtimes == [r.name]
    assert kube.selectors[0] == f"{JOB_LABEL}={r.name},{ROLE_LABEL}=launcher"
    lines = [m.getMessage()[len(r.name) + 3:] for m in caplog.records if m.getMessage().startswith(f"[{r.name}] ")]
    assert lines == LOG_LINES
    messages = [m.getMessage() for m in caplog.records]
    assert any(m.startswith(f"TrainJob ml/{r.name}: pods launcher: 1 active, node: 1 active 1 ready")
               for m in messages)
    assert f"Deleted TrainJob ml/{r.name}" in messages and f"Deleted TrainingRuntime ml/{r.name}" in messages


def test_failed_trainjob_names_the_reason_and_cleans_up(played_api):
    kube, client = played_api([TJ_CREATED, TJ_FAILED], "[1,0]<stderr>:RuntimeError: NCCL error\n")
    r = request()
    with pytest.raises(QatpipeError, match="TrainJob ml/qat-train-abc123 failed .*FailedJobs: jobset failed") as caught:
        launch(client, r)
    assert "RuntimeError: NCCL error" in str(caught.value)
    assert kube.deleted == [(r.name, "Background")] and kube.deleted_runtimes == [r.name]


def test_trainjob_times_out_and_cleans_up(played_api):
    kube, client = played_api([TJ_CREATED], "[1,0]<stdout>:Epoch 1/500\n")
    with pytest.raises(QatpipeError, match=r"timed out after 0.3 s \(last state: Created\)"):
        launch(client, request(), timeout=0.3)
    assert kube.deleted and kube.deleted_runtimes


def test_missing_trainer_crd_says_what_to_install(played_api):
    kube, client = played_api()
    kube.create_error = (404, "404 page not found")
    with pytest.raises(QatpipeError, match="Kubeflow Trainer v2") as caught:
        launch(client, request())
    assert "trainingruntimes.trainer.kubeflow.org/v1alpha1" in str(caught.value)
    assert kube.deleted == [] and kube.deleted_runtimes == []


def test_replace_existing_replaces_an_earlier_attempts_runtime_and_job(played_api):
    kube, client = played_api()
    r = request()
    kube.runtimes[r.name] = trainjob.training_runtime_manifest(r)
    kube.jobs[r.name] = trainjob.trainjob_manifest(r)  # left by a killed attempt of the same work
    with pytest.raises(QatpipeError, match="already exists"):
        launch(client, r)
    launch(client, r, replace_existing=True)
    assert kube.deleted_runtimes == [r.name, r.name] and [n for n, _ in kube.deleted] == [r.name, r.name]


def test_a_runtime_breaking_trainers_rules_fails_before_anything_is_created(played_api):
    """JobSet would accept a runtime without the node container, and the MPI plugin would never run it."""
    from qatpipe.cluster.launcher import TrainJobLauncher

    kube, client = played_api()
    r = request()
    runtime = trainjob.training_runtime_manifest(r)
    pod(runtime, "node")["spec"]["containers"][0]["name"] = "worker"
    with pytest.raises(QatpipeError, match="TrainingRuntime .* invalid against the rules of Kubeflow Trainer's MPI "
                                           "plugin and JobSet (?s:.*)no container named 'node'"):
        TrainJobLauncher(api_client=client, runtime=runtime).run(trainjob.trainjob_manifest(r), 10)
    assert kube.created == []


def test_a_runtime_that_is_not_the_jobs_is_refused(played_api):
    from qatpipe.cluster.launcher import TrainJobLauncher

    kube, client = played_api()
    other = trainjob.training_runtime_manifest(request(name="other-job"))
    with pytest.raises(QatpipeError, match="is not the TrainingRuntime 'other-job'"):
        TrainJobLauncher(api_client=client, runtime=other).run(trainjob.trainjob_manifest(request()), 10)
    assert kube.created == []


def test_scale_out_runs_a_trainjob_when_asked(played_api, tiny_spec, tmp_path, monkeypatch):
    """The stage's path: the job's spec staged on the shared volume, a TrainJob on its own runtime; the played
    job fails, which is an error naming it, and the job's folder stays for a retry."""
    from qatpipe.stages.scale_out import ClusterSettings, run_training_stage

    kube, client = played_api([TJ_CREATED, TJ_FAILED])
    monkeypatch.setattr("qatpipe.cluster.launcher.load_api_client", lambda: copy.copy(client))
    cluster = ClusterSettings(image="x:1", shared_pvc="qatpipe-cache", shared_mount=str(tmp_path / "shared"),
                              namespace="ml", api_version="v1", launcher="trainjob", timeout_seconds=60)
    with pytest.raises(QatpipeError, match="TrainJob ml/qatpipe-train-.* failed"):
        run_training_stage("train", tiny_spec(), tmp_path / "results", nodes=2, processes_per_node=2, cluster=cluster)
    runtime, job = kube.created
    assert job["spec"]["trainer"] == {"numNodes": 2, "numProcPerNode": 2}
    # a TrainJob's workers serve SSH whatever mpijob_api_version says
    assert pod(runtime, "node")["spec"]["containers"][0]["command"][0] == "/usr/sbin/sshd"
    assert "-e" in pod(runtime, "launcher")["spec"]["containers"][0]["command"]
    assert len(list((tmp_path / "shared" / "jobs").iterdir())) == 1 and not (tmp_path / "results").exists()


def test_an_unknown_launcher_is_refused(tmp_path):
    from qatpipe.stages.scale_out import ClusterSettings

    with pytest.raises(QatpipeError, match="launcher must be one of mpijob, trainjob"):
        ClusterSettings(image="x", shared_pvc="p", shared_mount=str(tmp_path), launcher="slurm")
