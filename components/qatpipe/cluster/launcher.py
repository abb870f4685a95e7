"""Run a training job to its end: create it, follow its conditions and its launcher's log, delete it.

Two kinds of job, one class each: MpiJobLauncher (MPIJob, mpi-operator's v2beta1 or the Training Operator's
v1) and TrainJobLauncher (Kubeflow Trainer v2's TrainJob, with the TrainingRuntime trainjob.py makes for it).
The job's status is read with a plain `get` every `poll_seconds` (no watch: simple, and it survives API
server restarts without resourceVersion bookkeeping). The launcher pod is found by the `qatpipe.io/mpijob`
and `qatpipe.io/mpijob-role` labels that mpijob.py and trainjob.py put on the pod templates (the operators
and JobSet copy template labels onto their pods); its log is re-read each poll and only lines not yet shown
are logged.

The RBAC the caller needs in the job's namespace: create, get, delete on the job's resource (mpijobs in
kubeflow.org; trainjobs and trainingruntimes in trainer.kubeflow.org); pods list; pods/log get. Without the
last two the job still runs, only its log is not shown.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from qatpipe.cluster import mpijob, trainjob
from qatpipe.cluster.crd import raise_problems
from qatpipe.cluster.mpijob import JOB_LABEL, ROLE_LABEL
from qatpipe.errors import QatpipeError

if TYPE_CHECKING:
    from kubernetes.client import ApiClient
    from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

TAIL_LINES = 20  # launcher log lines quoted when the job fails
REQUEST_TIMEOUT = 60  # seconds for any single API call, so a stalled connection cannot hang the run
_TRANSIENT = {0, 429, 500, 502, 503, 504}


NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
TOKEN_FILE = NAMESPACE_FILE.with_name("token")


def pod_namespace() -> str | None:
    """The namespace of this pod's ServiceAccount; None outside a pod."""
    return NAMESPACE_FILE.read_text().strip() if NAMESPACE_FILE.is_file() else None


def pod_service_account() -> str | None:
    """The name of this pod's ServiceAccount, read from its token's claims (`sub` is
    system:serviceaccount:<namespace>:<name>; the signature is not checked: the token is this pod's own and
    only its name is wanted); None outside a pod or when the token is not a JWT."""
    import base64

    if not TOKEN_FILE.is_file():
        return None
    try:
        payload = TOKEN_FILE.read_text().strip().split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        prefix, _, name = claims["sub"].rpartition(":")
    except (IndexError, ValueError, KeyError, AttributeError):
        log.warning("%s is not a ServiceAccount token: the job's pods run as the namespace's default account",
                    TOKEN_FILE)
        return None
    return name if prefix.startswith("system:serviceaccount:") and name else None


def load_api_client() -> ApiClient:
    """A client for this pod's cluster (its ServiceAccount), else for the kube config's current context."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
        source = "in-cluster ServiceAccount"
    except config.ConfigException as in_cluster:
        try:
            # KUBECONFIG read now: the client reads it once, when it is first imported
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                    client_configuration=configuration)
            source = "kube config"
        except Exception as exc:  # ConfigException, or a missing / unreadable file
            raise QatpipeError(
                "no Kubernetes credentials: not running in a pod with a ServiceAccount "
                f"({in_cluster}), and no usable kube config (KUBECONFIG or ~/.kube/config: {exc})") from exc
    log.debug("Kubernetes API at %s (%s)", _safe_host(configuration.host), source)
    return client.ApiClient(configuration)


def _safe_host(url: str) -> str:
    parts = urlsplit(url or "")
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}" if parts.hostname else "?"


def _server_message(exc: ApiException) -> str:
    """The API server's own explanation (a Status object's message), short."""
    body = exc.body.decode("utf-8", "replace") if isinstance(exc.body, bytes) else str(exc.body or "")
    try:
        message = json.loads(body).get("message") or ""
    except (ValueError, AttributeError):
        message = body.strip()
    message = message or str(exc.reason or "")
    return message if len(message) <= 300 else message[:297] + "..."


def _rbac_error(verb: str, resource: str, group: str, namespace: str, exc: ApiException) -> QatpipeError:
    api_group = group or '"" (core)'
    return QatpipeError(
        f"permission denied: the Kubernetes identity in use may not {verb} {resource} in namespace "
        f"{namespace!r}. Grant it an RBAC Role with verbs [{verb}] on resources [{resource}] (apiGroups "
        f"[{api_group}]) in {namespace!r} and bind it (server said: {_server_message(exc)})")


@dataclass(frozen=True)
class Resource:
    """A namespaced custom resource as the API server names it."""

    kind: str
    group: str
    version: str
    plural: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def kubectl(self) -> str:
        """Its name for `kubectl delete`: plural.group, which no other resource's short name shadows."""
        return f"{self.plural}.{self.group}"


class JobExists(QatpipeError):
    """A job of that name is already there."""


GONE_TIMEOUT = 300.0  # seconds to wait for a replaced job's deletion


class JobLauncher:
    """Create a job (and the objects it needs first), follow it to its success or failure, delete it.
    Subclasses say which resource, which condition means success and where the launcher's container is."""

    resource: Resource
    succeeded = "Succeeded"  # the condition type of success; "Failed" is failure for every kind
    install_hint = ""  # what to install when the API server does not know the resource
    admission_rules = ""  # the name of what admission_problems checks, for its error

    def __init__(self, api_client: ApiClient | None = None, namespace: str | None = None,
                 poll_seconds: float = 5.0):
        from kubernetes import client

        self.api_client = api_client if api_client is not None else load_api_client()
        self.namespace = namespace  # None: the manifest's metadata.namespace
        self.poll_seconds = poll_seconds
        self.custom = client.CustomObjectsApi(self.api_client)
        self.core = client.CoreV1Api(self.api_client)

    # --- what differs per kind --------------------------------------------------------------------------------

    def companions(self, manifest: dict[str, Any]) -> list[tuple[Resource, dict[str, Any]]]:
        """Objects created before the job, in this order, and deleted after it."""
        return []

    def launcher_container(self, manifest: dict[str, Any]) -> str:
        raise NotImplementedError

    def describe(self, manifest: dict[str, Any]) -> str:
        return ""

    def admission_problems(self, manifest: dict[str, Any]) -> list[str]:
        """What the operator enforces beyond the CRD schema: a resource breaking it is accepted by the API
        server, then never runs."""
        return []

    # --- public ---------------------------------------------------------------------------------------------

    def run(self, manifest: dict[str, Any], timeout_seconds: float, keep: bool = False,
            replace_existing: bool = False) -> dict[str, Any]:
        """Create `manifest`, stream its launcher's log, and return the job's final status once it has
        succeeded. Raises QatpipeError when it fails, when `timeout_seconds` pass, or on API errors. The job
        (and so its pods) and its companions are deleted at the end whatever happened, unless `keep` (for
        debugging). `replace_existing`: a job of the same name (left by an earlier attempt of the same work)
        is deleted first instead of being an error."""
        name, namespace = self._target(manifest)
        container = self.launcher_container(manifest)
        companions = self.companions(manifest)
        for _, obj in [*companions, (self.resource, manifest)]:  # before anything is created
            raise_problems(obj, self.admission_rules, self.admission_problems(obj))
        created: list[tuple[Resource, str]] = []
        try:
            for resource, obj in [*companions, (self.resource, manifest)]:
                self._create_or_replace(resource, obj, namespace, timeout_seconds, replace_existing)
                created.append((resource, obj["metadata"]["name"]))
            return self._follow(name, namespace, container, timeout_seconds)
        finally:
            for resource, made in reversed(created):
                if keep:
                    log.info("Keeping %s %s/%s (keep=True): delete it with `kubectl delete %s %s -n %s`",
                             resource.kind, namespace, made, resource.kubectl, made, namespace)
                else:
                    self._delete(resource, made, namespace)

    # --- steps ----------------------------------------------------------------------------------------------

    def _target(self, manifest: dict[str, Any]) -> tuple[str, str]:
        want, kind = self.resource.api_version, self.resource.kind
        if manifest.get("apiVersion") != want or manifest.get("kind") != kind:
            raise QatpipeError(f"this launcher runs {want} {kind}s, got {manifest.get('apiVersion')} "
                               f"{manifest.get('kind')}" + (" (set api_version to match the manifest)"
                                                            if kind == "MPIJob" else ""))
        metadata = manifest.get("metadata") or {}
        name, namespace = metadata.get("name"), metadata.get("namespace")
        if not name:
            raise QatpipeError(f"the {kind} manifest has no metadata.name")
        if self.namespace and namespace and namespace != self.namespace:
            raise QatpipeError(f"{kind} {name}: manifest namespace {namespace!r} differs from the launcher's "
                               f"{self.namespace!r}")
        namespace = self.namespace or namespace
        if not namespace:
            raise QatpipeError(f"{kind} {name}: no namespace (set metadata.namespace or the launcher's)")
        return name, namespace

    def _api(self, call, *args, **kwargs):
        """One API call with a bounded time; an unreachable server becomes a QatpipeError."""
        import urllib3

        try:
            return call(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        except urllib3.exceptions.HTTPError as exc:
            host = _safe_host(self.api_client.configuration.host)
            raise QatpipeError(f"cannot reach the Kubernetes API at {host}: {type(exc).__name__}") from exc

    def _create_or_replace(self, resource: Resource, obj: dict[str, Any], namespace: str, timeout_seconds: float,
                           replace_existing: bool) -> None:
        name = obj["metadata"]["name"]
        try:
            self._create(resource, obj, name, namespace)
        except JobExists:
            if not replace_existing:
                raise
            log.warning("%s %s/%s exists (an earlier attempt): deleting it and starting again", resource.kind,
                        namespace, name)
            self._delete(resource, name, namespace)
            self._wait_gone(resource, name, namespace, timeout_seconds=min(timeout_seconds, GONE_TIMEOUT))
            self._create(resource, obj, name, namespace)

    def _wait_gone(self, resource: Resource, name: str, namespace: str, timeout_seconds: float) -> None:
        from kubernetes.client.exceptions import ApiException

        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                self._api(self.custom.get_namespaced_custom_object, resource.group, resource.version, namespace,
                          resource.plural, name)
            except ApiException as exc:
                if exc.status == 404:
                    return
            if time.monotonic() > deadline:
                raise QatpipeError(f"{resource.kind} {namespace}/{name}: still there {timeout_seconds:.0f} s after "
                                   f"its deletion; delete it by hand (kubectl delete {resource.kubectl} {name} -n "
                                   f"{namespace}) and retry")
            time.sleep(self.poll_seconds)

    def _create(self, resource: Resource, obj: dict[str, Any], name: str, namespace: str) -> None:
        from kubernetes.client.exceptions import ApiException

        what = f"{resource.kind} {namespace}/{name} ({resource.api_version})"
        details = self.describe(obj) if resource == self.resource else ""
        log.info("Creating %s%s", what, f": {details}" if details else "")
        try:
            # Strict: a field the cluster's CRD does not define is refused, not pruned silently
            self._api(self.custom.create_namespaced_custom_object, resource.group, resource.version, namespace,
                      resource.plural, obj, field_validation="Strict")
        except ApiException as exc:
            if exc.status == 403:
                raise _rbac_error("create", resource.plural, resource.group, namespace, exc) from None
            if exc.status == 404:
                message = _server_message(exc)
                if 'namespaces "' in message:
                    raise QatpipeError(f"{resource.kind} {name}: namespace {namespace!r} does not exist") from None
                raise QatpipeError(
                    f"{resource.kind} {name}: the API server does not know {resource.plural}.{resource.group}/"
                    f"{resource.version}: the {resource.kind} CRD of that version is not installed. Install "
                    f"{self.install_hint} (kubectl get crd {resource.plural}.{resource.group} -o "
                    "jsonpath='{.spec.versions[*].name}' shows the versions it has)") from None
            if exc.status == 409:
                raise JobExists(
                    f"a {resource.kind} named {name!r} already exists in namespace {namespace!r}: use another name "
                    f"(job_name() adds a unique part) or delete it (kubectl delete {resource.kubectl} {name} -n "
                    f"{namespace})") from None
            raise QatpipeError(f"{resource.kind} {namespace}/{name}: the API server refused it (HTTP "
                               f"{exc.status}): {_server_message(exc)}") from None
        log.info("Created %s %s/%s", resource.kind, namespace, name)

    def _get(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The job, or None after a transient error (the next poll tries again)."""
        from kubernetes.client.exceptions import ApiException

        r = self.resource
        try:
            return self._api(self.custom.get_namespaced_custom_object, r.group, r.version, namespace, r.plural,
                             name)
        except ApiException as exc:
            if exc.status == 403:
                raise _rbac_error("get", r.plural, r.group, namespace, exc) from None
            if exc.status == 404:
                raise QatpipeError(f"{r.kind} {namespace}/{name} disappeared while running (deleted by someone "
                                   "else?)") from None
            if exc.status in _TRANSIENT:
                log.warning("%s %s/%s: reading its status failed (HTTP %s), retrying", r.kind, namespace, name,
                            exc.status)
                return None
            raise QatpipeError(f"{r.kind} {namespace}/{name}: reading its status failed (HTTP {exc.status}): "
                               f"{_server_message(exc)}") from None
        except QatpipeError as exc:  # unreachable for a moment: the deadline still bounds the wait
            log.warning("%s %s/%s: %s, retrying", r.kind, namespace, name, exc)
            return None

    def _follow(self, name: str, namespace: str, container: str, timeout_seconds: float) -> dict[str, Any]:
        kind = self.resource.kind
        launcher_log = _LauncherLog(self, name, namespace, container)
        progress = _Progress(kind, name, namespace)
        start = time.monotonic()
        while True:
            job = self._get(name, namespace)
            elapsed = time.monotonic() - start
            status = (job or {}).get("status") or {}
            progress.update(status, elapsed)
            finished = _true_condition(status, self.succeeded) or _true_condition(status, "Failed")
            launcher_log.poll(final=finished is not None)
            if finished is not None and finished["type"] == self.succeeded:
                log.info("%s %s/%s succeeded after %.0f s", kind, namespace, name, elapsed)
                return status
            if finished is not None:
                why = ": ".join(str(finished[k]) for k in ("reason", "message") if finished.get(k))
                raise QatpipeError(f"{kind} {namespace}/{name} failed after {elapsed:.0f} s: "
                                   f"{why or 'no reason given'}" + launcher_log.tail_text())
            if elapsed >= timeout_seconds:
                launcher_log.poll(final=True)
                raise QatpipeError(f"{kind} {namespace}/{name} timed out after {timeout_seconds:g} s "
                                   f"(last state: {progress.state or 'not started'})" + launcher_log.tail_text())
            time.sleep(max(0.0, min(self.poll_seconds, timeout_seconds - elapsed)))

    def _delete(self, resource: Resource, name: str, namespace: str) -> None:
        """Best effort, never raises: it runs in `finally`, where an error would hide the real one."""
        from kubernetes.client.exceptions import ApiException

        by_hand = f"kubectl delete {resource.kubectl} {name} -n {namespace}"
        try:
            # Background: the object goes at once (its name is free again); the GC removes its pods after
            self._api(self.custom.delete_namespaced_custom_object, resource.group, resource.version, namespace,
                      resource.plural, name, propagation_policy="Background")
            log.info("Deleted %s %s/%s", resource.kind, namespace, name)
        except ApiException as exc:
            if exc.status == 404:
                log.info("%s %s/%s was already deleted", resource.kind, namespace, name)
            elif exc.status == 403:
                log.warning("Could not delete %s %s/%s: %s. Delete it by hand: %s", resource.kind, namespace, name,
                            _rbac_error("delete", resource.plural, resource.group, namespace, exc), by_hand)
            else:
                log.warning("Could not delete %s %s/%s (HTTP %s: %s): %s", resource.kind, namespace, name,
                            exc.status, _server_message(exc), by_hand)
        except QatpipeError as exc:
            log.warning("Could not delete %s %s/%s (%s): %s", resource.kind, namespace, name, exc, by_hand)


class MpiJobLauncher(JobLauncher):
    """MPIJobs: mpi-operator's kubeflow.org/v2beta1 or the Training Operator's kubeflow.org/v1."""

    def __init__(self, api_client: ApiClient | None = None, namespace: str | None = None,
                 api_version: str = "v2beta1", poll_seconds: float = 5.0):
        if api_version not in mpijob.API_VERSIONS:
            raise QatpipeError(f"api_version must be one of {', '.join(mpijob.API_VERSIONS)}, got {api_version!r}")
        self.api_version = api_version
        self.resource = Resource(mpijob.KIND, mpijob.GROUP, api_version, mpijob.PLURAL)
        self.install_hint = (f"{mpijob.OPERATORS[api_version]}, or pick the api_version the cluster has")
        self.admission_rules = f"the admission rules of {mpijob.OPERATORS[api_version]}"
        super().__init__(api_client, namespace, poll_seconds)

    def launcher_container(self, manifest: dict[str, Any]) -> str:
        """The name of the launcher's main container (the one running mpirun), whose log is followed."""
        try:
            return manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["name"]
        except (KeyError, IndexError, TypeError):
            raise QatpipeError("the MPIJob manifest has no launcher container (spec.mpiReplicaSpecs.Launcher."
                               "template.spec.containers[0].name); build it with mpijob_manifest()") from None

    def admission_problems(self, manifest: dict[str, Any]) -> list[str]:
        return mpijob.operator_problems(manifest, self.api_version)

    def describe(self, manifest: dict[str, Any]) -> str:
        spec = manifest.get("spec") or {}
        workers = ((spec.get("mpiReplicaSpecs") or {}).get("Worker") or {}).get("replicas")
        return f"{workers} worker(s) x {spec.get('slotsPerWorker', 1)} slot(s)"


class TrainJobLauncher(JobLauncher):
    """Kubeflow Trainer v2 TrainJobs (trainer.kubeflow.org/v1alpha1). `run` takes the TrainJob; the
    TrainingRuntime it refers to (trainjob.training_runtime_manifest) is given to the constructor when the
    job brings its own, and is then created first and deleted with the job."""

    resource = Resource(trainjob.KIND, trainjob.GROUP, trainjob.VERSION, trainjob.PLURAL)
    succeeded = "Complete"
    install_hint = "Kubeflow Trainer v2 (v2.3 or later), or run the job as an MPIJob (launcher: mpijob)"
    admission_rules = "the rules of Kubeflow Trainer's MPI plugin and JobSet"

    def __init__(self, api_client: ApiClient | None = None, namespace: str | None = None,
                 runtime: dict[str, Any] | None = None, poll_seconds: float = 5.0):
        self.runtime = runtime
        super().__init__(api_client, namespace, poll_seconds)

    def companions(self, manifest: dict[str, Any]) -> list[tuple[Resource, dict[str, Any]]]:
        if self.runtime is None:
            return []
        ref = (manifest.get("spec") or {}).get("runtimeRef") or {}
        made = self.runtime["metadata"]["name"]
        if ref.get("kind") != trainjob.RUNTIME_KIND or ref.get("name") != made:
            raise QatpipeError(f"TrainJob {manifest['metadata'].get('name')}: its runtimeRef {ref} is not the "
                               f"TrainingRuntime {made!r} given with it")
        return [(Resource(trainjob.RUNTIME_KIND, trainjob.GROUP, trainjob.VERSION, trainjob.RUNTIME_PLURAL),
                 self.runtime)]

    def admission_problems(self, manifest: dict[str, Any]) -> list[str]:
        return trainjob.trainer_problems(manifest)

    def launcher_container(self, manifest: dict[str, Any]) -> str:
        return trainjob.NODE  # the MPI plugin's name for the containers it mounts the SSH keys into

    def describe(self, manifest: dict[str, Any]) -> str:
        trainer = (manifest.get("spec") or {}).get("trainer") or {}
        ref = (manifest.get("spec") or {}).get("runtimeRef") or {}
        return (f"{trainer.get('numNodes')} node(s) x {trainer.get('numProcPerNode')} process(es), runtime "
                f"{ref.get('kind')} {ref.get('name')}")


def _true_condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for condition in status.get("conditions") or []:
        if condition.get("type") == kind and str(condition.get("status")) == "True":
            return condition
    return None


class _Progress:
    """Logs each condition that becomes true (Created, Running, Restarting, ...) and the pods' counts."""

    def __init__(self, kind: str, name: str, namespace: str):
        self.kind = kind
        self.job = f"{namespace}/{name}"
        self.seen: dict[str, tuple[str, str]] = {}
        self.replicas = ""
        self.state = ""

    def update(self, status: dict[str, Any], elapsed: float) -> None:
        for condition in status.get("conditions") or []:
            kind, value = condition.get("type", "?"), str(condition.get("status"))
            key = (value, condition.get("reason", ""))
            if self.seen.get(kind) == key:
                continue
            self.seen[kind] = key
            if value == "True":
                self.state = kind
                level = logging.WARNING if kind in ("Failed", "Restarting", "Suspended") else logging.INFO
                log.log(level, "%s %s: %s%s after %.0f s", self.kind, self.job, kind,
                        f" ({condition['reason']})" if condition.get("reason") else "", elapsed)
        replicas = _counts(status)
        if replicas and replicas != self.replicas:
            self.replicas = replicas
            log.info("%s %s: pods %s", self.kind, self.job, replicas)


def _counts(status: dict[str, Any]) -> str:
    """"Launcher: 1 active, Worker: 2 active": MPIJob's replicaStatuses (role -> counts) or TrainJob's
    jobsStatus (one entry per replicated job)."""
    if isinstance(status.get("jobsStatus"), list):
        groups = [(s.get("name", "?"), s) for s in status["jobsStatus"] if isinstance(s, dict)]
    else:
        groups = sorted((role, counts) for role, counts in (status.get("replicaStatuses") or {}).items()
                        if isinstance(counts, dict))
    return ", ".join(f"{role}: " + " ".join(f"{n} {k}" for k, n in sorted(counts.items())
                                             if isinstance(n, int) and not isinstance(n, bool) and n)
                     for role, counts in groups)


class _LauncherLog:
    """Follows the launcher pod's log: logs each complete line once, keeps the last TAIL_LINES."""

    def __init__(self, launcher: JobLauncher, name: str, namespace: str, container: str):
        self.kind = launcher.resource.kind
        self.core = launcher.core
        self.api = launcher._api
        self.name, self.namespace, self.container = name, namespace, container
        self.selector = f"{JOB_LABEL}={name},{ROLE_LABEL}=launcher"
        self.source: tuple[str, int] | None = None  # (pod, restarts) whose log is being followed
        self.shown = 0  # lines of that log already logged
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.warned: set[str] = set()

    def poll(self, final: bool = False) -> None:
        pod = self._launcher_pod()
        if pod is None:
            return
        statuses = (pod.status.container_statuses if pod.status else None) or []
        restarts = sum(s.restart_count or 0 for s in statuses if s.name == self.container)
        source = (pod.metadata.name, restarts)  # a restarted container starts a new log
        if source != self.source:
            if self.source is not None:
                log.info("[%s] launcher %s (restarts: %d): following the new log", self.name, *source)
            self.source, self.shown = source, 0
        text = self._read(source[0])
        if text is None:
            return
        lines = text.split("\n")
        # the last piece is a line still being written (or "" after a final newline): wait for its end
        complete = lines if final and lines[-1] else lines[:-1]
        if len(complete) < self.shown:  # the kubelet rotated the log: what is there now is all new
            log.info("[%s] launcher log rotated: following it from its new start", self.name)
            self.shown = 0
        for line in complete[self.shown:]:
            line = line.rstrip("\r")
            log.info("[%s] %s", self.name, line)
            self.tail.append(line)
        self.shown = max(self.shown, len(complete))

    def tail_text(self) -> str:
        if not self.tail:
            return ""
        return f"\nLast {len(self.tail)} launcher log line(s):\n  " + "\n  ".join(self.tail)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning("%s %s/%s: %s", self.kind, self.namespace, self.name, message)

    def _launcher_pod(self):
        from kubernetes.client.exceptions import ApiException

        try:
            pods = self.api(self.core.list_namespaced_pod, self.namespace, label_selector=self.selector).items
        except ApiException as exc:
            if exc.status == 403:
                self._warn_once("list", "launcher log not shown: "
                                + str(_rbac_error("list", "pods", "", self.namespace, exc)))
            else:
                log.debug("listing the launcher pod failed (HTTP %s)", exc.status)
            return None
        except QatpipeError as exc:
            log.debug("listing the launcher pod failed: %s", exc)
            return None

        def age_order(pod):
            created = pod.metadata.creation_timestamp
            return (created is not None, created or 0, pod.metadata.name)

        # a Job (v2beta1) may replace a failed launcher pod: follow the newest
        return max(pods, key=age_order, default=None)

    def _read(self, pod: str) -> str | None:
        from kubernetes.client.exceptions import ApiException

        try:
            # raw bytes: the client would otherwise json-decode a log that happens to be valid JSON
            response = self.api(self.core.read_namespaced_pod_log, pod, self.namespace,
                                container=self.container, _preload_content=False)
            return response.data.decode("utf-8", "replace")
        except ApiException as exc:
            if exc.status == 403:
                self._warn_once("log", "launcher log not shown: "
                                + str(_rbac_error("get", "pods/log", "", self.namespace, exc)))
            else:  # 400: container not started yet; 404: pod just replaced
                log.debug("reading the launcher log failed (HTTP %s)", exc.status)
            return None
        except QatpipeError as exc:
            log.debug("reading the launcher log failed: %s", exc)
            return None
