"""The Kubernetes API as the launchers use it: a client for this pod's cluster (or the kube config's), this pod's
namespace and ServiceAccount, calls with a bounded time, and the API server's refusals as one-line errors that
say what to grant or install."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from qatpipe.errors import QatpipeError

if TYPE_CHECKING:
    from kubernetes.client import ApiClient
    from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 60  # seconds for any single API call, so a stalled connection cannot hang the run
TRANSIENT = {0, 429, 500, 502, 503, 504}  # HTTP statuses worth another try

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
    log.debug("Kubernetes API at %s (%s)", safe_host(configuration.host), source)
    return client.ApiClient(configuration)


def safe_host(url: str) -> str:
    """scheme://host:port of `url`, nothing else of it (no credentials, no path) for a log line."""
    parts = urlsplit(url or "")
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}" if parts.hostname else "?"


def server_message(exc: ApiException) -> str:
    """The API server's own explanation (a Status object's message), short."""
    body = exc.body.decode("utf-8", "replace") if isinstance(exc.body, bytes) else str(exc.body or "")
    try:
        message = json.loads(body).get("message") or ""
    except (ValueError, AttributeError):
        message = body.strip()
    message = message or str(exc.reason or "")
    return message if len(message) <= 300 else message[:297] + "..."


def rbac_error(verb: str, resource: str, group: str, namespace: str, exc: ApiException) -> QatpipeError:
    """A 403 as the Role that would allow it."""
    api_group = group or '"" (core)'
    return QatpipeError(
        f"permission denied: the Kubernetes identity in use may not {verb} {resource} in namespace "
        f"{namespace!r}. Grant it an RBAC Role with verbs [{verb}] on resources [{resource}] (apiGroups "
        f"[{api_group}]) in {namespace!r} and bind it (server said: {server_message(exc)})")


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


def api_call(api_client: ApiClient, call, *args, **kwargs):
    """`call(*args, **kwargs)`, one API call, with a bounded time; an unreachable server becomes a QatpipeError."""
    import urllib3

    try:
        return call(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
    except urllib3.exceptions.HTTPError as exc:
        raise QatpipeError(f"cannot reach the Kubernetes API at {safe_host(api_client.configuration.host)}: "
                           f"{type(exc).__name__}") from exc
