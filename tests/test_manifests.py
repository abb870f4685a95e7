"""manifests/: both kustomize overlays, built with the real kustomize and checked against the Kubernetes 1.33
schemas and the project's rules (non-root, limits, probes, pinned images, no committed secret, least-privilege
RBAC, the MLflow server's settings). No cluster needed; skipped without kustomize or kubectl."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

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


def _kustomize(directory: Path) -> list[str]:
    if exe := shutil.which("kustomize"):
        return [exe, "build", str(directory)]
    if exe := shutil.which("kubectl"):
        return [exe, "kustomize", str(directory)]
    pytest.skip("neither kustomize nor kubectl on PATH: cannot build the overlays")


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


@overlays
def test_overlay_builds_to_valid_objects_in_its_namespace(overlay):
    objects = build(overlay)
    errors = []
    for obj in objects:
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

    # the database URI (with its password) comes through the environment, never the command line, which any
    # process list shows; the kubelet expands it from the variables defined before it
    assert "--backend-store-uri" not in options and not [a for a in argv if "POSTGRES_PASSWORD" in a]
    names = [e["name"] for e in c["env"]]
    assert names.index("MLFLOW_BACKEND_STORE_URI") > names.index("POSTGRES_PASSWORD")
    assert _expand(env["MLFLOW_BACKEND_STORE_URI"], env) == (
        "postgresql://mlflow:$(POSTGRES_PASSWORD)@postgres:5432/mlflow")
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
    # the password reaches the server from the same Secret as PostgreSQL's
    database = only(objects, "StatefulSet", "postgres")["spec"]["template"]["spec"]["containers"][0]
    password = [e["valueFrom"]["secretKeyRef"] for e in c["env"] + database["env"]
                if e["name"] == "POSTGRES_PASSWORD"]
    assert len(password) == 2 and password[0] == password[1]


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
    # the pipeline's namespace, and nothing wider: no empty namespaceSelector, no ipBlock
    expected = [{"podSelector": {}}] + ([] if pipeline == tracking else [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": pipeline}}}])
    assert rule["from"] == expected

