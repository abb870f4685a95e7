"""`qatpipe compile` and `qatpipe submit`: the pipeline as a package, and a run of it on a KFP backend.

`qatpipe submit --host URL key=value ...` is `kfp run create -e NAME -f qat_pipeline.yaml key=value ...`
done through `kfp.Client`. The token comes from $KFP_TOKEN or the kube config's current user; never from
arguments, so it stays out of shell history and logs.
"""

import contextlib
import logging
import os
import re
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

from qatpipe.errors import QatpipeError

log = logging.getLogger(__name__)

TOKEN_ENV = "KFP_TOKEN"
DEFAULT_EXPERIMENT = "qatpipe"
# a PersistentVolumeClaim's name: a DNS-1123 subdomain (lower-case alphanumerics, '-' and '.', at most 253)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def check_compile_options(cache_pvc: str | None = None, shm_size: str | None = None) -> None:
    """The values `compile_pipeline` writes into pod specs, checked as Kubernetes will check them, so a bad one
    fails here and not when the run's pods are created."""
    if cache_pvc is not None and (len(cache_pvc) > 253 or not _DNS_SUBDOMAIN.match(cache_pvc)):
        raise QatpipeError(f"--cache-pvc {cache_pvc!r}: not a PersistentVolumeClaim name (a DNS-1123 subdomain: "
                           f"lower-case letters, digits, '-' and '.', starting and ending with a letter or digit, "
                           f"at most 253 characters)")
    if shm_size is not None:
        from kubernetes.utils import parse_quantity

        try:
            size = parse_quantity(shm_size)
        except (ValueError, TypeError):
            size = None
        if size is None or size < 1:
            raise QatpipeError(f"--shm-size {shm_size!r}: not a Kubernetes memory quantity of at least one byte, "
                               f"e.g. 8Gi or 512Mi")


def check_host(host: str) -> str:
    """The KFP endpoint without a trailing '/'; a QatpipeError unless it is an http(s) URL with a host."""
    parts = urllib.parse.urlsplit(host)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise QatpipeError(f"--host {host!r}: not an http(s) URL; give the KFP API endpoint, e.g. "
                           f"https://kubeflow.example.com/pipeline")
    return host.rstrip("/")


def compile_pipeline(output: str | Path, cache_pvc: str | None = None, mpijob: bool = False,
                     shm_size: str | None = None) -> Path:
    check_compile_options(cache_pvc, shm_size)
    from kfp import compiler

    from qatpipe_pipelines.qat_pipeline import SHM_SIZE, build_pipeline

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_pipeline(cache_pvc=cache_pvc, mpijob=mpijob, shm_size=shm_size or SHM_SIZE),
                                str(output))
    log.info("compiled pipeline: %s", output)
    return output


def parse_arguments(items: list[str]) -> dict[str, Any]:
    """['gpus=2', 'spec_overrides=[train.epochs=3]'] -> {'gpus': 2, 'spec_overrides': ['train.epochs=3']}.

    Values are YAML; each is checked against the pipeline parameter's type here, not by the backend later."""
    types = {name: spec.type for name, spec in _pipeline_inputs().items()}
    arguments: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise QatpipeError(f"pipeline argument {item!r}: expected NAME=VALUE")
        if name not in types:
            raise QatpipeError(f"unknown pipeline parameter {name!r}; known: {', '.join(sorted(types))}")
        kind = types[name]
        if kind == "String":  # text stays text ("007", "true")
            arguments[name] = raw
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise QatpipeError(f"pipeline argument {name}: value is not valid YAML: {exc}") from None
        expected = {"Integer": int, "Dict": dict}.get(kind, list if "List" in kind else object)
        if not isinstance(value, expected) or isinstance(value, bool):
            raise QatpipeError(f"pipeline argument {name}={raw!r}: expected {expected.__name__} ({kind}), "
                               f"e.g. {name}=[a, b]" if expected is list else
                               f"pipeline argument {name}={raw!r}: expected {expected.__name__} ({kind})")
        arguments[name] = value
    return arguments


def check_spec(arguments: dict[str, Any]) -> None:
    """The run's spec (spec_uri, spec_overrides) resolved here as the pipeline's resolve-spec task will, so a bad
    key or value fails before anything is sent. One this machine cannot read (a path inside the image, an s3://
    object without credentials here) is left to the cluster, which checks it first thing."""
    from qatpipe.storage import is_s3_uri
    from qatpipe.errors import StorageError
    from qatpipe.spec_sources import load_spec_uri, spec_path

    inputs = _pipeline_inputs()
    uri = arguments.get("spec_uri", inputs["spec_uri"].default)
    overrides = list(arguments.get("spec_overrides", inputs["spec_overrides"].default))
    if not is_s3_uri(uri) and not spec_path(uri).is_file():
        log.info("spec_uri %s is not on this machine (a path inside the image?): the run's resolve-spec task "
                 "checks it", uri)
        return
    try:
        load_spec_uri(uri, overrides)
    except StorageError as exc:
        log.warning("spec_uri %s: not readable from here (%s); the run's resolve-spec task checks it", uri, exc)


def _pipeline_inputs() -> dict:
    """The pipeline's parameters: name -> kfp InputSpec (type, default)."""
    from qatpipe_pipelines.qat_pipeline import build_pipeline

    return build_pipeline().component_spec.inputs


def kfp_token() -> str | None:
    """$KFP_TOKEN, else the bearer token of the kube config's current user, else None (no auth)."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    try:
        from kubernetes import client as k8s_client, config as k8s_config

        configuration = k8s_client.Configuration()
        k8s_config.load_kube_config(client_configuration=configuration)
    except Exception:  # no kube config, or one without a usable user: submit without a token
        return None
    bearer = configuration.api_key.get("authorization", "") or configuration.api_key.get("BearerToken", "")
    return bearer.removeprefix("Bearer ").strip() or None


def submit(host: str, arguments: dict[str, Any], experiment: str = DEFAULT_EXPERIMENT,
           namespace: str | None = None, run_name: str | None = None, package: str | Path | None = None,
           service_account: str | None = None) -> str:
    """Create a run of the pipeline on the KFP backend at `host`; returns the run's URL. `namespace`: the
    Kubeflow profile the run (and its pods) belongs to; `service_account`: the one its pods run as (standalone
    KFP: pipeline-runner; Kubeflow profiles: default-editor), which must be able to read the credentials Secret
    and, for MPIJobs, create them (manifests/)."""
    host = check_host(host)
    import kfp

    arguments = {"kfp_ui_url": host, **arguments}  # MLflow runs and model versions link to the run's page
    token = kfp_token()
    _check_reachable(host, token)
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(package) if package else compile_pipeline(Path(tmp) / "qat_pipeline.yaml")
        if not package.is_file():
            raise QatpipeError(f"{package}: pipeline package not found")
        try:
            # kfp.Client prints its own links; stdout is kept for the run URL alone (scripts read it)
            with contextlib.redirect_stdout(sys.stderr):
                client = kfp.Client(host=host, existing_token=token,
                                    **({"namespace": namespace} if namespace else {}))
                result = client.create_run_from_pipeline_package(
                    str(package), arguments=arguments, run_name=run_name, experiment_name=experiment,
                    namespace=namespace, service_account=service_account,
                )
        except Exception as exc:  # kfp_server_api.ApiException, urllib3 / connection errors
            status = getattr(exc, "status", None)
            detail = " ".join(str(getattr(exc, "reason", None) or exc).split())[:400]
            raise QatpipeError(
                f"KFP at {host}: creating the run failed"
                + (f" (HTTP {status})" if status else "")
                + f": {detail}. Check --host, and $KFP_TOKEN or your kube config for credentials."
            ) from None
    url = f"{host}/#/runs/details/{result.run_id}"
    log.info("submitted run %s to experiment %r", result.run_id, experiment)
    return url


def _check_reachable(host: str, token: str | None, timeout_s: float = 10.0) -> None:
    """One quick healthz call: kfp.Client would retry an unreachable host for half a minute, silently."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{host}/apis/v2beta1/healthz")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise QatpipeError(f"KFP at {host}: HTTP {exc.code}, not authorised: set $KFP_TOKEN or log in with "
                               f"your kube config") from None
        return  # other answers: it is up; let kfp.Client deal with the details
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise QatpipeError(f"KFP at {host}: unreachable ({reason}); check --host") from None
