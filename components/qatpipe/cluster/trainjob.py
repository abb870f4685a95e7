"""Kubeflow Trainer v2 manifests for Horovod training: a TrainJob and the TrainingRuntime it runs on. Pure
dicts, no cluster access (launcher.TrainJobLauncher runs them).

The runtime has Trainer's MPI layout (mlPolicy.mpi, OpenMPI): a `node` replicated job of W pods serving SSH
(the workers, with the GPUs) and a `launcher` job of one pod, without a GPU, that runs mpirun once the nodes
are Ready. Trainer's MPI plugin makes the SSH keys and the hostfile and mounts them into the containers named
`node`, so both pods' container has that name. The pods are the ones an MPIJob runs (mpijob.pod_template):
same image, command, resources, /dev/shm, volumes, placement and labels.

Each job brings its own namespaced TrainingRuntime (same name as the job), and the TrainJob sets only
numNodes and numProcPerNode. The TrainJob's other trainer fields (image, command, resourcesPerNode) land on
different containers in different Trainer releases when the runtime is MPI (kubeflow/trainer#4030: on the
launcher only, or also on the workers, where a command replaces sshd); a runtime of the job's own makes every
setting exact on every release. The launcher creates the runtime first and deletes it with the job.

`cluster_runtime_manifest` is the same layout as a ClusterTrainingRuntime (manifests/trainer/), for TrainJobs
written by hand.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from qatpipe.cluster.crd import raise_problems, schema_problems
from qatpipe.cluster.mpijob import JOB_LABEL, MpiJobRequest, PvcMount, pod_template
from qatpipe.errors import QatpipeError

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
KIND = "TrainJob"
PLURAL = "trainjobs"
RUNTIME_KIND = "TrainingRuntime"
RUNTIME_PLURAL = "trainingruntimes"
CLUSTER_RUNTIME_KIND = "ClusterTrainingRuntime"

NODE = "node"  # the replicated job of the workers, and every container's name (the MPI plugin's convention)
LAUNCHER = "launcher"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # marks the job TrainJob.spec.trainer targets
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"
SSH_PORT = 2222  # images/training/sshd_config
CLUSTER_RUNTIME_NAME = "qatpipe-horovod"
# JobSet names pods <jobset>-<replicated job>-<job index>-<pod index>, and that is their hostname in the MPI
# hostfile: a DNS label of at most 63 characters
_HOSTNAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 63 - len(f"-{LAUNCHER}-0-0")  # 50: the launcher pod's hostname stays a DNS label


def _replicated_job(r: MpiJobRequest, role: str) -> dict[str, Any]:
    pod = pod_template(r, role, container=NODE)
    [container] = pod["spec"]["containers"]
    job_spec: dict[str, Any] = {"template": pod}
    if role == "launcher":
        # one attempt per JobSet run: a failed mpirun restarts the whole set (failurePolicy), workers included
        pod["spec"]["restartPolicy"] = "Never"
        job_spec["backoffLimit"] = 0
        return {"name": LAUNCHER, "replicas": 1,
                # mpirun starts once every node's sshd is Ready, instead of failing its first SSH attempts
                "dependsOn": [{"name": NODE, "status": "Ready"}],
                "template": {"metadata": {"labels": {ANCESTOR_LABEL: "trainer"}}, "spec": job_spec}}
    pod["spec"]["restartPolicy"] = "OnFailure"  # a worker whose sshd dies comes back
    container["readinessProbe"] = {"tcpSocket": {"port": SSH_PORT}, "periodSeconds": 5}
    job_spec.update(parallelism=r.workers, completions=r.workers)
    return {"name": NODE, "replicas": 1, "template": {"spec": job_spec}}


def _runtime_spec(r: MpiJobRequest) -> dict[str, Any]:
    jobset: dict[str, Any] = {
        # the hostfile names pods before they are Ready (the launcher waits for them itself)
        "network": {"publishNotReadyAddresses": True},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [LAUNCHER]},
        "failurePolicy": {"maxRestarts": r.backoff_limit},
        "replicatedJobs": [_replicated_job(r, "worker"), _replicated_job(r, "launcher")],
    }
    if r.ttl_seconds_after_finished is not None:
        jobset["ttlSecondsAfterFinished"] = r.ttl_seconds_after_finished
    return {
        "mlPolicy": {"numNodes": r.workers,
                     "mpi": {"numProcPerNode": r.slots_per_worker, "mpiImplementation": "OpenMPI",
                             "sshAuthMountPath": r.ssh_auth_mount_path, "runLauncherAsNode": False}},
        "template": {"spec": jobset},
    }


def training_runtime_manifest(request: MpiJobRequest) -> dict[str, Any]:
    """The job's own TrainingRuntime (namespaced, named like the job): everything the job runs."""
    r = request
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": RUNTIME_KIND,
            "metadata": {"name": r.name, "namespace": r.namespace,
                         "labels": {**r.labels, JOB_LABEL: r.name, FRAMEWORK_LABEL: "horovod"}},
            "spec": _runtime_spec(r)}


def trainjob_manifest(request: MpiJobRequest, runtime_kind: str = RUNTIME_KIND,
                      runtime_name: str | None = None) -> dict[str, Any]:
    """The TrainJob of `request` on its own TrainingRuntime (default) or on a named (Cluster)TrainingRuntime.
    It sets only the job's size; `request.timeout_seconds` becomes activeDeadlineSeconds."""
    r = request
    if len(r.name) > MAX_NAME:
        raise QatpipeError(f"TrainJob name {r.name!r} is {len(r.name)} characters; at most {MAX_NAME}, so that its "
                           f"pods' hostnames ({r.name}-{LAUNCHER}-0-0) stay DNS labels")
    spec: dict[str, Any] = {
        "runtimeRef": {"apiGroup": GROUP, "kind": runtime_kind, "name": runtime_name or r.name},
        "trainer": {"numNodes": r.workers, "numProcPerNode": r.slots_per_worker},
    }
    if r.timeout_seconds is not None:
        spec["activeDeadlineSeconds"] = r.timeout_seconds
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": r.name, "namespace": r.namespace, "labels": {**r.labels, JOB_LABEL: r.name}},
            "spec": spec}


def cluster_runtime_manifest(image: str, *, name: str = CLUSTER_RUNTIME_NAME, cache_pvc: str = "qatpipe-cache",
                             cache_mount: str = "/mnt/qatpipe-cache") -> dict[str, Any]:
    """A ClusterTrainingRuntime of the same layout for TrainJobs written by hand: one node with one GPU by
    default (a TrainJob's numNodes and numProcPerNode change that), the dataset-cache PVC of the manifests
    mounted in every pod. The launcher's command is `qatpipe train --help` until the TrainJob's
    trainer.command replaces it (with `mpirun ... qatpipe train -e SPEC -r RESULTS`; docs: manifests/README)."""
    request = MpiJobRequest(name=name, namespace="unused", image=image, command=["qatpipe", "train", "--help"],
                            workers=1, gpus_per_worker=1, pvc=PvcMount(cache_pvc, cache_mount),
                            secret_env="qatpipe-credentials", ttl_seconds_after_finished=3600)
    manifest = training_runtime_manifest(request)
    manifest["kind"] = CLUSTER_RUNTIME_KIND
    manifest["metadata"] = {"name": name, "labels": {FRAMEWORK_LABEL: "horovod"}}
    return manifest


# --- validation ---------------------------------------------------------------------------------------------

def trainer_problems(manifest: dict[str, Any]) -> list[str]:
    """What Trainer's MPI plugin and JobSet need beyond the schema (a job breaking them is accepted by the API
    server, then never runs)."""
    problems = []
    name = (manifest.get("metadata") or {}).get("name")
    spec = manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {}
    if manifest.get("kind") == KIND:
        workers = (spec.get("trainer") or {}).get("numNodes")
        last = workers - 1 if isinstance(workers, int) and workers > 0 else 0
        longest = max(f"{name}-{LAUNCHER}-0-0", f"{name}-{NODE}-0-{last}", key=len)
        if not isinstance(name, str) or len(longest) > 63 or not _HOSTNAME.match(name):
            problems.append(f"metadata.name: {name!r} must be a DNS label short enough for pod hostname "
                            f"{longest!r} (63 characters)")
        return problems
    if (spec.get("mlPolicy") or {}).get("mpi") is None:
        problems.append("spec.mlPolicy.mpi: missing (the runtime must have an MPI policy)")
    jobs = ((spec.get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
    by_name = {job.get("name"): job for job in jobs if isinstance(job, dict)}
    for role in (LAUNCHER, NODE):
        job = by_name.get(role)
        if job is None:
            problems.append(f"spec.template.spec.replicatedJobs: no {role!r} job (Trainer's MPI plugin needs both)")
            continue
        pod = ((job.get("template") or {}).get("spec") or {}).get("template") or {}
        containers = (pod.get("spec") or {}).get("containers") or []
        if NODE not in [c.get("name") for c in containers]:
            problems.append(f"replicatedJobs[{role}]: no container named {NODE!r} (the SSH keys and hostfile are "
                            "mounted only there)")
        if (pod.get("spec") or {}).get("restartPolicy") not in ("Never", "OnFailure"):
            problems.append(f"replicatedJobs[{role}]: a Job's pods need restartPolicy Never or OnFailure")
    return problems


def validate_manifest(manifest: dict[str, Any], crd_path: str | Path) -> None:
    """Raise QatpipeError listing every problem of a TrainJob, TrainingRuntime or ClusterTrainingRuntime
    against its CRD at `crd_path` and the rules Trainer enforces in its controller."""
    raise_problems(manifest, Path(crd_path).name,
                   schema_problems(manifest, crd_path) + trainer_problems(manifest))


def main(argv: list[str] | None = None) -> None:
    """`python -m qatpipe.cluster.trainjob IMAGE`: the ClusterTrainingRuntime of manifests/trainer/ as YAML."""
    import argparse
    import sys

    import yaml

    parser = argparse.ArgumentParser(prog="python -m qatpipe.cluster.trainjob", description=main.__doc__)
    parser.add_argument("image", help="the training image (python -m qatpipe_kfp.settings names it)")
    args = parser.parse_args(argv)
    sys.stdout.write(f"# Generated by `python -m qatpipe.cluster.trainjob {args.image}`: edit trainjob.py, not this.\n"
                     + yaml.safe_dump(cluster_runtime_manifest(args.image), sort_keys=False))


if __name__ == "__main__":
    main()
