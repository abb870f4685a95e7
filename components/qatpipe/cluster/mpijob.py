"""MPIJob manifests for Horovod training: pure dicts, no cluster access.

Two operators are supported, chosen by `api_version`:

- "v2beta1": kubeflow/mpi-operator (v0.8). The launcher reaches the workers over SSH (the operator makes the
  keys and mounts them at `sshAuthMountPath`), so each worker runs `sshd` and the image must provide it for
  the non-root user (the mpi-operator base images' convention: user `mpiuser`, uid 1000, /home/mpiuser).
- "v1": the Kubeflow Training Operator (v1.9). The launcher reaches the workers with `kubectl exec`; the
  operator makes the launcher's ServiceAccount/Role unless one is given, and workers idle in `sleep`.

`validate_manifest` checks a manifest against the CRD's OpenAPI schema and the operators' own admission
rules, so a bad job fails here rather than as a silently pruned field or an operator event. At run time the
launcher checks the admission rules (`operator_problems`) before it creates anything, and creates with the
API server's strict field validation, which refuses what the cluster's own CRD does not define.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qatpipe.cluster.crd import raise_problems, schema_problems
from qatpipe.errors import QatpipeError

GROUP = "kubeflow.org"
KIND = "MPIJob"
PLURAL = "mpijobs"
API_VERSIONS = ("v2beta1", "v1")
OPERATORS = {"v2beta1": "kubeflow/mpi-operator (MPIJob kubeflow.org/v2beta1)",
             "v1": "the Kubeflow Training Operator (MPIJob kubeflow.org/v1)"}

CONTAINER = "qatpipe"
# Our own pod labels: both operators copy the template's labels onto the pods they create, so the launcher
# pod is found the same way whichever operator (and operator release) runs the job.
JOB_LABEL = "qatpipe.io/mpijob"
ROLE_LABEL = "qatpipe.io/mpijob-role"

RUN_AS_USER = 1000
HOROVOD_MPIRUN_FLAGS = ["--bind-to", "none", "--map-by", "slot", "-x", "NCCL_DEBUG=WARN",
                        "-x", "LD_LIBRARY_PATH", "-x", "PATH", "-x", "TF_USE_LEGACY_KERAS"]
DEFAULT_ENV = {"TF_USE_LEGACY_KERAS": "1"}  # tf_keras throughout (see qatpipe/__init__.py)
# v2beta1 workers serve SSH as the non-root user (mpi-operator base image layout)
SSH_AUTH_MOUNT_PATH = "/home/mpiuser/.ssh"
SSHD_COMMAND = ["/usr/sbin/sshd", "-De", "-f", "/home/mpiuser/.sshd_config"]

CLEAN_POD_POLICIES = ("None", "Running", "All")
MAX_NAME = 52  # the operators name pods <job>-launcher and <job>-worker-<i>: 52 + "-worker-999" = 63
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # DNS-1035: Services named after the job need it


@dataclass(frozen=True)
class Resources:
    """Container requests/limits as Kubernetes quantities ("500m", "16Gi"); None leaves one unset."""

    cpu_request: str | None = None
    memory_request: str | None = None
    cpu_limit: str | None = None
    memory_limit: str | None = None

    def to_k8s(self, gpus: int = 0) -> dict[str, dict[str, str]]:
        requests = {k: v for k, v in (("cpu", self.cpu_request), ("memory", self.memory_request)) if v}
        limits = {k: v for k, v in (("cpu", self.cpu_limit), ("memory", self.memory_limit)) if v}
        if gpus:
            limits["nvidia.com/gpu"] = str(gpus)  # extended resources: the request defaults to the limit
        return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


# Workers: no CPU limit, since CFS throttling starves the tf.data input pipeline; memory is bounded.
DEFAULT_WORKER_RESOURCES = Resources(cpu_request="4", memory_request="16Gi", memory_limit="32Gi")
# The launcher only runs mpirun (and, for v1, kubectl exec)
DEFAULT_LAUNCHER_RESOURCES = Resources(cpu_request="100m", memory_request="256Mi", cpu_limit="1",
                                       memory_limit="1Gi")


@dataclass(frozen=True)
class PvcMount:
    """A PersistentVolumeClaim mounted at the same path in the launcher and every worker."""

    claim_name: str
    mount_path: str
    read_only: bool = False


@dataclass
class MpiJobRequest:
    """Everything an MPIJob for one Horovod training run needs; checked on creation (QatpipeError)."""

    name: str
    namespace: str
    image: str
    command: list[str]  # what every Horovod process runs, e.g. ["qatpipe", "train", "-e", spec, "-r", out]
    workers: int = 1
    gpus_per_worker: int = 0  # one Horovod process (slot) per GPU; CPU-only workers run one each
    api_version: str = "v2beta1"
    service_account: str | None = None
    secret_env: str | None = None  # a Secret given to the containers as envFrom (optional: may be absent)
    # Secret keys to forward to every rank with `mpirun -x` (values stay in the Secret, never in the manifest).
    # Needed on v2beta1: processes started over SSH do not inherit the worker container's environment.
    secret_env_keys: list[str] = field(default_factory=list)
    pvc: PvcMount | None = None
    env: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    worker_resources: Resources = DEFAULT_WORKER_RESOURCES
    launcher_resources: Resources = DEFAULT_LAUNCHER_RESOURCES
    timeout_seconds: int | None = None  # runPolicy.activeDeadlineSeconds
    backoff_limit: int = 1  # launcher retries: one, for transient start-up failures
    ttl_seconds_after_finished: int | None = 3600  # matters only when the job is kept (launcher keep=True)
    clean_pod_policy: str = "Running"
    labels: dict[str, str] = field(default_factory=dict)
    worker_command: list[str] | None = None  # None: sshd (v2beta1) or the operator's `sleep` (v1)
    ssh_auth_mount_path: str = SSH_AUTH_MOUNT_PATH  # v2beta1 only

    def __post_init__(self) -> None:
        problems = _request_problems(self)
        if problems:
            raise QatpipeError(f"MPIJob request {self.name!r}: " + "; ".join(problems))

    @property
    def slots_per_worker(self) -> int:
        return max(1, self.gpus_per_worker)

    @property
    def processes(self) -> int:
        return self.workers * self.slots_per_worker


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _request_problems(r: MpiJobRequest) -> list[str]:
    problems = []
    if not isinstance(r.name, str) or not _DNS_LABEL.match(r.name) or len(r.name) > MAX_NAME:
        problems.append(f"name must be lowercase letters, digits and '-', start with a letter and be at most "
                        f"{MAX_NAME} characters (use job_name())")
    if not r.namespace or not isinstance(r.namespace, str):
        problems.append("namespace is required")
    if not r.image or not isinstance(r.image, str):
        problems.append("image is required")
    if not isinstance(r.command, list) or not r.command or not all(isinstance(a, str) for a in r.command):
        problems.append("command must be a non-empty list of strings")
    if not _is_int(r.workers) or r.workers < 1:
        problems.append(f"workers must be an integer >= 1, got {r.workers!r}")
    if not _is_int(r.gpus_per_worker) or r.gpus_per_worker < 0:
        problems.append(f"gpus_per_worker must be an integer >= 0, got {r.gpus_per_worker!r}")
    if r.api_version not in API_VERSIONS:
        problems.append(f"api_version must be one of {', '.join(API_VERSIONS)}, got {r.api_version!r}")
    if r.clean_pod_policy not in CLEAN_POD_POLICIES:
        problems.append(f"clean_pod_policy must be one of {', '.join(CLEAN_POD_POLICIES)}")
    for key in [*r.env, *r.secret_env_keys]:
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            problems.append(f"environment variable name {key!r} is not valid")
    if r.secret_env_keys and not r.secret_env:
        problems.append("secret_env_keys needs secret_env (the Secret that holds them)")
    if not all(isinstance(v, str) for v in r.env.values()):
        problems.append("env values must be strings")
    for label, value in [("timeout_seconds", r.timeout_seconds), ("backoff_limit", r.backoff_limit),
                         ("ttl_seconds_after_finished", r.ttl_seconds_after_finished)]:
        if value is not None and (not _is_int(value) or value < 0):
            problems.append(f"{label} must be a non-negative integer, got {value!r}")
    if r.timeout_seconds == 0:
        problems.append("timeout_seconds must be positive")
    return problems


def job_name(prefix: str, unique: str | None = None) -> str:
    """A valid MPIJob name: `<prefix>-<unique>`, lowercase letters, digits and '-', starting with a letter,
    at most MAX_NAME (52) characters so the operators' pod names stay DNS labels. The unique part is kept
    whole where possible (it is what tells runs apart); the prefix is shortened first."""

    def clean(text: str) -> str:
        return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")

    suffix = clean(unique if unique is not None else uuid.uuid4().hex[:8])[-(MAX_NAME - 2):].strip("-")
    head = clean(prefix)
    if not head or not head[0].isalpha():
        head = f"job-{head}".rstrip("-")
    room = MAX_NAME - len(suffix) - 1 if suffix else MAX_NAME
    head = head[:max(room, 1)].rstrip("-")
    return f"{head}-{suffix}" if suffix else head


def _mpirun_command(r: MpiJobRequest) -> list[str]:
    forwarded = []
    for key in sorted({*r.env, *r.secret_env_keys} - set(DEFAULT_ENV)):
        forwarded += ["-x", key]  # names only: values come from the launcher's environment
    return ["mpirun", "-np", str(r.processes), *HOROVOD_MPIRUN_FLAGS, *forwarded, *r.command]


def _container(r: MpiJobRequest, role: str, name: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": r.image,
        "imagePullPolicy": "IfNotPresent",
        "env": [{"name": k, "value": v} for k, v in sorted({**DEFAULT_ENV, **r.env}.items())],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if role == "launcher":
        container["command"] = _mpirun_command(r)
        container["resources"] = r.launcher_resources.to_k8s()
    else:
        worker_command = r.worker_command if r.worker_command is not None else (
            SSHD_COMMAND if r.api_version == "v2beta1" else None)
        if worker_command:
            container["command"] = list(worker_command)
        container["resources"] = r.worker_resources.to_k8s(r.gpus_per_worker)
    if r.secret_env:
        container["envFrom"] = [{"secretRef": {"name": r.secret_env, "optional": True}}]
    mounts = []
    if r.pvc:
        mounts.append({"name": "data", "mountPath": r.pvc.mount_path, "readOnly": r.pvc.read_only})
    if role == "worker" and r.gpus_per_worker:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if mounts:
        container["volumeMounts"] = mounts
    return container


def pod_template(r: MpiJobRequest, role: str, container: str = CONTAINER) -> dict[str, Any]:
    """The pod template of the launcher (`role` "launcher": mpirun, no GPU) or of a worker ("worker": sshd
    or the operator's command, the GPUs, /dev/shm, the node selector and tolerations), its one container
    named `container`. MPIJobs and TrainJobs (trainjob.py) both run these pods."""
    spec: dict[str, Any] = {
        # non-root, as the restricted Pod Security Standard asks; fsGroup makes the PVC writable for uid 1000
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [_container(r, role, container)],
    }
    if r.service_account:
        spec["serviceAccountName"] = r.service_account
    if r.api_version == "v2beta1":
        # the processes talk to MLflow and S3, never to the Kubernetes API: no token, whatever the account may do
        # (v2beta1 launchers reach their workers over SSH; v1's launcher needs its operator-made account's token)
        spec["automountServiceAccountToken"] = False
    volumes: list[dict[str, Any]] = []
    if r.pvc:
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": r.pvc.claim_name,
                                                                  "readOnly": r.pvc.read_only}})
    if role == "worker":
        if r.gpus_per_worker:
            # NCCL moves data between the GPUs of a pod through shared memory; the runtime's 64 MiB is too small
            # (it counts against the memory limit: bounded, 1 GiB per GPU)
            volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                        "sizeLimit": f"{r.gpus_per_worker}Gi"}})
        if r.node_selector:
            spec["nodeSelector"] = dict(r.node_selector)
        if r.tolerations:
            spec["tolerations"] = [dict(t) for t in r.tolerations]
    if volumes:
        spec["volumes"] = volumes
    labels = {**r.labels, JOB_LABEL: r.name, ROLE_LABEL: role}
    return {"metadata": {"labels": labels}, "spec": spec}


def mpijob_manifest(request: MpiJobRequest) -> dict[str, Any]:
    """The MPIJob (kubeflow.org/<request.api_version>) that runs `request.command` on every slot via mpirun."""
    r = request
    run_policy: dict[str, Any] = {"cleanPodPolicy": r.clean_pod_policy, "backoffLimit": r.backoff_limit}
    if r.timeout_seconds is not None:
        run_policy["activeDeadlineSeconds"] = r.timeout_seconds
    if r.ttl_seconds_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = r.ttl_seconds_after_finished
    replicas = {
        "Launcher": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod_template(r, "launcher")},
        # OnFailure: a worker whose process dies comes back, so a launcher retry finds all its hosts
        "Worker": {"replicas": r.workers, "restartPolicy": "OnFailure", "template": pod_template(r, "worker")},
    }
    spec: dict[str, Any] = {"slotsPerWorker": r.slots_per_worker, "runPolicy": run_policy}
    if r.api_version == "v2beta1":
        spec.update({
            "mpiImplementation": "OpenMPI",
            "sshAuthMountPath": r.ssh_auth_mount_path,
            # mpirun starts once every worker (sshd) is Ready, instead of failing its first SSH attempts
            "launcherCreationPolicy": "WaitForWorkersReady",
        })
    else:
        # the Training Operator keeps the older spec-level field and rejects a value contradicting runPolicy's
        spec["cleanPodPolicy"] = r.clean_pod_policy
        spec["mainContainer"] = CONTAINER
    spec["mpiReplicaSpecs"] = replicas
    return {
        "apiVersion": f"{GROUP}/{r.api_version}",
        "kind": KIND,
        "metadata": {"name": r.name, "namespace": r.namespace, "labels": {**r.labels, JOB_LABEL: r.name}},
        "spec": spec,
    }


# --- validation ---------------------------------------------------------------------------------------------

def operator_problems(manifest: dict[str, Any], version: str) -> list[str]:
    """Rules the operators enforce in their controllers rather than in the CRD schema (after mpi-operator's
    validation.go): a job breaking them is accepted by the API server, then never runs."""
    # mpi-operator allows only these two; the Training Operator also Always and ExitCode
    restart_policies = ("Never", "OnFailure") + (() if version == "v2beta1" else ("Always", "ExitCode"))
    problems = []
    spec = manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {}
    replicas = spec.get("mpiReplicaSpecs") if isinstance(spec.get("mpiReplicaSpecs"), dict) else {}
    for role in ("Launcher", "Worker"):
        replica = replicas.get(role)
        where = f"spec.mpiReplicaSpecs.{role}"
        if not isinstance(replica, dict):
            problems.append(f"{where}: missing (the job needs a {role})")
            continue
        count = replica.get("replicas")
        if role == "Launcher" and count != 1:
            problems.append(f"{where}.replicas: must be 1, got {count!r}")
        if role == "Worker" and (not _is_int(count) or count < 1):
            problems.append(f"{where}.replicas: must be an integer >= 1, got {count!r}")
        if replica.get("restartPolicy") not in restart_policies:
            problems.append(f"{where}.restartPolicy: must be one of {', '.join(restart_policies)}")
        containers = ((replica.get("template") or {}).get("spec") or {}).get("containers")
        if not containers:
            problems.append(f"{where}.template.spec.containers: must define at least one container")
    policy = (spec.get("runPolicy") or {}).get("cleanPodPolicy")
    if policy is not None and policy not in CLEAN_POD_POLICIES:
        problems.append(f"spec.runPolicy.cleanPodPolicy: must be one of {', '.join(CLEAN_POD_POLICIES)}")
    name = (manifest.get("metadata") or {}).get("name")
    worker = replicas.get("Worker")
    workers = worker.get("replicas") if isinstance(worker, dict) else 1
    last_pod = f"{name}-worker-{workers - 1 if _is_int(workers) and workers > 0 else 0}"
    if not isinstance(name, str) or not _DNS_LABEL.match(name) or len(last_pod) > 63:
        problems.append(f"metadata.name: {name!r} must be a DNS label short enough for pod {last_pod!r}")
    return problems


def validate_manifest(manifest: dict[str, Any], crd_path: str | Path) -> None:
    """Raise QatpipeError listing every problem (path: message) of `manifest` against the CRD at
    `crd_path` (the version named by its apiVersion) and the operator's own admission rules."""
    problems = schema_problems(manifest, crd_path)
    version = str(manifest.get("apiVersion", "")).partition("/")[2]
    raise_problems(manifest, Path(crd_path).name, problems + operator_problems(manifest, version))
