"""Following a running job: the conditions that become true and its pods' counts (JobProgress), and its launcher
pod's log (LauncherLog), re-read each poll with only the lines not yet shown logged. Both log to the logger they
are given (the launcher's: one logger for everything about a job)."""

from __future__ import annotations

import collections
import logging
from typing import Any

from qatpipe.cluster.kube_client import api_call, rbac_error
from qatpipe.cluster.mpijob import JOB_LABEL, ROLE_LABEL
from qatpipe.errors import QatpipeError

TAIL_LINES = 20  # launcher log lines quoted when the job fails


def true_condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The condition of type `kind` in a job's status, where it is true; else None."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == kind and str(condition.get("status")) == "True":
            return condition
    return None


class JobProgress:
    """Logs each condition that becomes true (Created, Running, Restarting, ...) and the pods' counts."""

    def __init__(self, kind: str, name: str, namespace: str, log: logging.Logger):
        self.kind, self.log = kind, log
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
                self.log.log(level, "%s %s: %s%s after %.0f s", self.kind, self.job, kind,
                             f" ({condition['reason']})" if condition.get("reason") else "", elapsed)
        replicas = pod_counts(status)
        if replicas and replicas != self.replicas:
            self.replicas = replicas
            self.log.info("%s %s: pods %s", self.kind, self.job, replicas)


def pod_counts(status: dict[str, Any]) -> str:
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


class LauncherLog:
    """Follows the launcher pod's log: logs each complete line once, keeps the last TAIL_LINES."""

    def __init__(self, core, kind: str, name: str, namespace: str, container: str, log: logging.Logger):
        """`core`: a kubernetes CoreV1Api; `kind`, `name`, `namespace`: the job's; `container`: the launcher's."""
        self.core, self.kind, self.log = core, kind, log
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
                self.log.info("[%s] launcher %s (restarts: %d): following the new log", self.name, *source)
            self.source, self.shown = source, 0
        text = self._read(source[0])
        if text is None:
            return
        lines = text.split("\n")
        # the last piece is a line still being written (or "" after a final newline): wait for its end
        complete = lines if final and lines[-1] else lines[:-1]
        if len(complete) < self.shown:  # the kubelet rotated the log: what is there now is all new
            self.log.info("[%s] launcher log rotated: following it from its new start", self.name)
            self.shown = 0
        for line in complete[self.shown:]:
            line = line.rstrip("\r")
            self.log.info("[%s] %s", self.name, line)
            self.tail.append(line)
        self.shown = max(self.shown, len(complete))

    def tail_text(self) -> str:
        if not self.tail:
            return ""
        return f"\nLast {len(self.tail)} launcher log line(s):\n  " + "\n  ".join(self.tail)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            self.log.warning("%s %s/%s: %s", self.kind, self.namespace, self.name, message)

    def _launcher_pod(self):
        from kubernetes.client.exceptions import ApiException

        try:
            pods = api_call(self.core.api_client, self.core.list_namespaced_pod, self.namespace,
                            label_selector=self.selector).items
        except ApiException as exc:
            if exc.status == 403:
                self._warn_once("list", "launcher log not shown: "
                                + str(rbac_error("list", "pods", "", self.namespace, exc)))
            else:
                self.log.debug("listing the launcher pod failed (HTTP %s)", exc.status)
            return None
        except QatpipeError as exc:
            self.log.debug("listing the launcher pod failed: %s", exc)
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
            response = api_call(self.core.api_client, self.core.read_namespaced_pod_log, pod, self.namespace,
                                container=self.container, _preload_content=False)
            return response.data.decode("utf-8", "replace")
        except ApiException as exc:
            if exc.status == 403:
                self._warn_once("log", "launcher log not shown: "
                                + str(rbac_error("get", "pods/log", "", self.namespace, exc)))
            else:  # 400: container not started yet; 404: pod just replaced
                self.log.debug("reading the launcher log failed (HTTP %s)", exc.status)
            return None
        except QatpipeError as exc:
            self.log.debug("reading the launcher log failed: %s", exc)
            return None
