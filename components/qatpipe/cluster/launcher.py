"""Run a training job to its end: create it, follow its conditions and its launcher's log, delete it.

Two kinds of job, one class each: MpiJobLauncher (MPIJob, mpi-operator's v2beta1 or the Training Operator's
v1) and TrainJobLauncher (Kubeflow Trainer v2's TrainJob, with the TrainingRuntime trainjob.py makes for it).
The job's status is read with a plain `get` every `poll_seconds` (no watch: simple, and it survives API
server restarts without resourceVersion bookkeeping). The launcher pod is found by the `qatpipe.io/mpijob`
and `qatpipe.io/mpijob-role` labels that mpijob.py and trainjob.py put on the pod templates (the operators
and JobSet copy template labels onto their pods); its log is re-read each poll and only lines not yet shown
are logged (job_log.py follows the job; kube_client.py is the API client and its errors).

The RBAC the caller needs in the job's namespace: create, get, delete on the job's resource (mpijobs in
kubeflow.org; trainjobs and trainingruntimes in trainer.kubeflow.org); pods list; pods/log get. Without the
last two the job still runs, only its log is not shown.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from qatpipe.cluster import mpijob, trainjob
from qatpipe.cluster.crd import raise_problems
from qatpipe.cluster.job_log import JobProgress, LauncherLog, true_condition
from qatpipe.cluster.kube_client import (TRANSIENT, Resource, api_call, load_api_client, rbac_error,
                                         server_message)
from qatpipe.errors import QatpipeError

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)


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
        return api_call(self.api_client, call, *args, **kwargs)

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
                raise rbac_error("create", resource.plural, resource.group, namespace, exc) from None
            if exc.status == 404:
                message = server_message(exc)
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
                               f"{exc.status}): {server_message(exc)}") from None
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
                raise rbac_error("get", r.plural, r.group, namespace, exc) from None
            if exc.status == 404:
                raise QatpipeError(f"{r.kind} {namespace}/{name} disappeared while running (deleted by someone "
                                   "else?)") from None
            if exc.status in TRANSIENT:
                log.warning("%s %s/%s: reading its status failed (HTTP %s), retrying", r.kind, namespace, name,
                            exc.status)
                return None
            raise QatpipeError(f"{r.kind} {namespace}/{name}: reading its status failed (HTTP {exc.status}): "
                               f"{server_message(exc)}") from None
        except QatpipeError as exc:  # unreachable for a moment: the deadline still bounds the wait
            log.warning("%s %s/%s: %s, retrying", r.kind, namespace, name, exc)
            return None

    def _follow(self, name: str, namespace: str, container: str, timeout_seconds: float) -> dict[str, Any]:
        kind = self.resource.kind
        launcher_log = LauncherLog(self.core, kind, name, namespace, container, log)
        progress = JobProgress(kind, name, namespace, log)
        start = time.monotonic()
        while True:
            job = self._get(name, namespace)
            elapsed = time.monotonic() - start
            status = (job or {}).get("status") or {}
            progress.update(status, elapsed)
            finished = true_condition(status, self.succeeded) or true_condition(status, "Failed")
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
                            rbac_error("delete", resource.plural, resource.group, namespace, exc), by_hand)
            else:
                log.warning("Could not delete %s %s/%s (HTTP %s: %s): %s", resource.kind, namespace, name,
                            exc.status, server_message(exc), by_hand)
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
