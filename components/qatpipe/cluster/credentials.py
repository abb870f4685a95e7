"""The credentials Secret, checked by a run's first task: the pipeline mounts it optional (every key is optional,
and a run without S3 or MLflow needs none), so a Secret that is missing, or lacks a key the run needs, would
otherwise show up as a run that "succeeds" untracked, or fails deep inside a stage. `check_credentials` fails
first, in one line naming the Secret, the key and the namespace.

What a run needs: the S3 keys when the spec reads `s3://` data (unless the pod has a web identity, as with
IRSA); and, whenever a Secret is named, the Secret itself (its MLflow keys are what turns tracking on).
Outside a pod (the local run) only the environment is checked. `check_tracking_access` then asks the MLflow
server itself whether it lets the pod's credentials in: only the server knows whether it runs its basic-auth
app (manifests/tracking/), and a refusal would otherwise surface tasks later, at start-tracking.
"""

from __future__ import annotations

import logging
import os

from qatpipe.errors import QatpipeError

log = logging.getLogger(__name__)

S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
WEB_IDENTITY_ENV = "AWS_WEB_IDENTITY_TOKEN_FILE"  # IRSA and friends: S3 access without keys


class CredentialsError(QatpipeError):
    """The run needs a credential its Secret does not give."""


def needed_keys(s3_uris: list[str]) -> dict[str, str]:
    """Secret key -> why the run needs it."""
    s3 = [uri for uri in s3_uris if str(uri).startswith("s3://")]
    if not s3 or os.environ.get(WEB_IDENTITY_ENV):
        return {}
    return {key: f"the spec reads {s3[0]}" for key in S3_KEYS}


def check_credentials(secret_name: str, s3_uris: list[str], namespace: str | None = None, api_client=None) -> None:
    """Raise CredentialsError (see the module docstring) when the run cannot have what it needs."""
    from qatpipe.cluster.kube_client import pod_namespace

    needs = needed_keys(s3_uris)
    missing = [key for key in needs if not os.environ.get(key)]
    namespace = namespace or pod_namespace()
    if not secret_name or namespace is None:  # no Secret named, or not in a pod: the environment is all
        if missing:
            raise CredentialsError(f"{missing[0]} is not set, and {needs[missing[0]]}: set it"
                                   + (" (no credentials Secret is named: credentials_secret)" if namespace else ""))
        return
    data = _read_secret(secret_name, namespace, api_client)
    if data is None:  # this pod may not read Secrets: judge by the environment alone
        if missing:
            raise CredentialsError(f"{missing[0]} is not set, and {needs[missing[0]]}: add it to Secret "
                                   f"{secret_name} in namespace {namespace} (this pod cannot read Secrets to tell "
                                   f"whether the Secret exists)")
        return
    if data is False:
        raise CredentialsError(
            f"Secret {secret_name} not found in namespace {namespace}, where the pipeline's pods run: "
            + (f"{missing[0]} is needed ({needs[missing[0]]}). " if missing else
               "without it nothing is tracked in MLflow and s3:// is unreadable. ")
            + "Create it there (manifests/secrets/), or run with credentials_secret=\"\"")
    absent = [key for key in missing if key not in data]  # a key the pod has from elsewhere is not asked for
    if absent:
        raise CredentialsError(f"Secret {secret_name} in namespace {namespace} has no key {absent[0]}, and "
                               f"{needs[absent[0]]}")
    log.info("credentials: Secret %s in namespace %s has the keys %s", secret_name, namespace,
             ", ".join(sorted(data)) or "(none)")


TRACKING_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def check_tracking_access(secret_name: str = "", namespace: str | None = None, timeout_s: float = 10.0) -> None:
    """Raise CredentialsError when the MLflow server of MLFLOW_TRACKING_URI (http or https) refuses this pod's
    credentials (MLflow's environment variables: user and password, or a token). A server that cannot be reached
    is left to tracking's own retries and error (a warning here); a file or database URI needs no credentials."""
    import base64
    import http.client
    import urllib.error
    import urllib.request

    from qatpipe.cluster.kube_client import pod_namespace
    from qatpipe.tracking.mlflow_runs import redact_uri

    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        return
    request = urllib.request.Request(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1")
    user, password = (os.environ.get(key) for key in TRACKING_KEYS)
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", "Bearer " + os.environ["MLFLOW_TRACKING_TOKEN"])
    elif user or password:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user or ''}:{password or ''}".encode())
                           .decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return
    except urllib.error.HTTPError as exc:
        if exc.code not in (401, 403):
            log.warning("MLflow at %s answered HTTP %s to a credentials check; going on", redact_uri(uri), exc.code)
            return
        code = exc.code
    except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, timed out, not HTTP, a bad URI
        log.warning("MLflow at %s cannot be reached to check the credentials (%s); going on", redact_uri(uri),
                    type(exc).__name__)
        return
    missing = [key for key in TRACKING_KEYS if not os.environ.get(key)]
    namespace = namespace or pod_namespace()
    where = (f"Secret {secret_name} in namespace {namespace}" if secret_name and namespace else "the environment")
    problem = (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set" if missing else
               f"the user {user} in {' and '.join(TRACKING_KEYS)} was refused")
    raise CredentialsError(f"MLflow at {redact_uri(uri)} refused the pipeline's credentials (HTTP {code}): "
                           f"{problem}; set {' and '.join(TRACKING_KEYS)} in {where} to a user of the server's "
                           f"basic-auth app (manifests/README.md)")


def _read_secret(name: str, namespace: str, api_client=None):
    """The Secret's key names (a set), False when it does not exist, None when it cannot be read."""
    from kubernetes.client import CoreV1Api
    from kubernetes.client.exceptions import ApiException

    from qatpipe.cluster.kube_client import REQUEST_TIMEOUT, load_api_client

    try:
        client = api_client or load_api_client()
        secret = CoreV1Api(client).read_namespaced_secret(name, namespace, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as exc:
        if exc.status == 404:
            return False
        log.warning("cannot read Secret %s in namespace %s (HTTP %s): checking the environment only", name,
                    namespace, exc.status)
        return None
    except Exception as exc:  # no API server reachable, no credentials: the environment is all there is
        log.warning("cannot reach the Kubernetes API to read Secret %s (%s): checking the environment only",
                    name, type(exc).__name__)
        return None
    return set((secret.data or {}).keys()) | set((secret.string_data or {}).keys())


__all__ = ["CredentialsError", "check_credentials", "check_tracking_access", "needed_keys"]
