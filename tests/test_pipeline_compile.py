"""The compiled pipeline: its DAG shape, GPU requests, secrets, retries and caching, and the YAML in the repo."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qatpipe_pipelines.qat_pipeline import SECRET_KEYS_TO_ENV
from qatpipe_pipelines.submit import compile_pipeline

REPO_YAML = Path(__file__).resolve().parents[1] / "pipelines" / "qat_pipeline.yaml"
STAGE_TASKS = {"prepare-data", "train", "evaluate", "compare", "log-stage", "log-stage-2", "log-stage-3"}
GPU_TASKS = {"train", "evaluate"}
TRACKING_TASKS = {"start-tracking", "finish-tracking", "compare", "log-stage", "log-stage-2", "log-stage-3"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = compile_pipeline(tmp_path_factory.mktemp("compiled") / "qat_pipeline.yaml")
    pipeline_spec, platform_spec = yaml.safe_load_all(path.read_text())
    return path, pipeline_spec, platform_spec


def _all_tasks(pipeline_spec) -> dict:
    tasks = dict(pipeline_spec["root"]["dag"]["tasks"])
    for component in pipeline_spec["components"].values():
        tasks.update(component.get("dag", {}).get("tasks", {}))
    return tasks


def _upstream(task) -> set[str]:
    producers = set(task.get("dependentTasks", []))
    inputs = task.get("inputs", {})
    for spec in list(inputs.get("artifacts", {}).values()) + list(inputs.get("parameters", {}).values()):
        for key in ("taskOutputArtifact", "taskOutputParameter"):
            if key in spec:
                producers.add(spec[key]["producerTask"])
    return producers


def test_dag_shape(compiled):
    _, spec, _ = compiled
    root = spec["root"]["dag"]["tasks"]
    # everything runs inside the exit handler, so finish-tracking closes the MLflow run whatever fails
    assert set(root) == {"finish-tracking", "exit-handler-1"}
    assert root["finish-tracking"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    handler = spec["components"][root["exit-handler-1"]["componentRef"]["name"]]["dag"]["tasks"]
    assert STAGE_TASKS | {"resolve-spec", "start-tracking"} == set(handler)
    tasks = _all_tasks(spec)
    assert _upstream(tasks["start-tracking"]) == {"resolve-spec"}
    assert _upstream(tasks["prepare-data"]) == {"resolve-spec"}
    assert _upstream(tasks["train"]) == {"prepare-data", "resolve-spec"}
    assert _upstream(tasks["evaluate"]) == {"prepare-data", "train", "resolve-spec"}
    assert _upstream(tasks["compare"]) == {"evaluate", "start-tracking"}
    logged = {tasks[name]["taskInfo"]["name"]: _upstream(tasks[name])
              for name in ("log-stage", "log-stage-2", "log-stage-3")}
    assert logged == {"log-prepare-data": {"prepare-data", "start-tracking"},
                      "log-train": {"train", "start-tracking"},
                      "log-evaluate-fp32": {"evaluate", "start-tracking"}}
    # every stage receives only its spec view
    assert tasks["train"]["inputs"]["parameters"]["train_spec"]["taskOutputParameter"] == {
        "producerTask": "resolve-spec", "outputParameterKey": "train_spec"}


def test_parameters(compiled):
    _, spec, _ = compiled
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {name: p["parameterType"] for name, p in params.items()} == {
        "spec_uri": "STRING", "spec_overrides": "LIST", "run_name": "STRING", "gpus": "NUMBER_INTEGER",
        "image": "STRING", "node_selector": "STRUCT", "tolerations": "LIST", "credentials_secret": "STRING",
    }
    assert params["spec_uri"]["defaultValue"] == "default"


def test_gpu_requests_and_placement(compiled):
    _, spec, platform = compiled
    executors = spec["deploymentSpec"]["executors"]
    tasks = _all_tasks(spec)
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, task in tasks.items():
        executor = spec["components"][task["componentRef"]["name"]].get("executorLabel")
        if executor is None:
            continue
        container = executors[executor]["container"]
        # every task runs on the image parameter
        assert container["image"] == "{{$.inputs.parameters['pipelinechannel--image']}}", name
        accelerator = container.get("resources", {}).get("accelerator")
        if name in GPU_TASKS:
            assert accelerator["resourceType"] == "nvidia.com/gpu"
            assert "pipelinechannel--gpus" in accelerator["resourceCount"]
            assert "nodeSelector" in k8s[executor] and "tolerations" in k8s[executor]
        else:
            assert accelerator is None, name


def test_secrets_come_from_a_kubernetes_secret(compiled):
    path, spec, platform = compiled
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, task in _all_tasks(spec).items():
        executor = spec["components"][task["componentRef"]["name"]].get("executorLabel")
        if executor is None:
            continue
        secret = k8s[executor]["secretAsEnv"][0]
        assert secret["secretNameParameter"]["componentInputParameter"].endswith("credentials_secret")
        assert {item["envVar"] for item in secret["keyToEnv"]} == set(SECRET_KEYS_TO_ENV)
        assert secret["optional"] is True
    # credentials appear only as key names in secretAsEnv (secretKey + envVar per executor), never as
    # parameters or values
    text = path.read_text()
    assert text.count("AWS_SECRET_ACCESS_KEY") == 2 * len(k8s)
    assert text.count("MLFLOW_TRACKING_PASSWORD") == 2 * len(k8s)
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert not [name for name in params if any(word in name for word in ("password", "token", "key"))]


def test_retries_and_caching(compiled):
    _, spec, _ = compiled
    tasks = _all_tasks(spec)
    for name in ("resolve-spec", "start-tracking", "prepare-data", "compare", "log-stage"):
        assert tasks[name]["retryPolicy"]["maxRetryCount"] == 3, name
    assert "retryPolicy" not in tasks["train"]
    for name in TRACKING_TASKS | {"resolve-spec"}:
        assert not tasks[name].get("cachingOptions", {}).get("enableCache", False), name
    for name in ("prepare-data", "train", "evaluate"):
        assert tasks[name]["cachingOptions"]["enableCache"] is True, name


def test_cache_pvc_option(tmp_path):
    path = compile_pipeline(tmp_path / "with_pvc.yaml", cache_pvc="qatpipe-cache")
    _, platform = yaml.safe_load_all(path.read_text())
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    mounted = {name for name, config in k8s.items() if config.get("pvcMount")}
    assert {"exec-prepare-data", "exec-train", "exec-evaluate"} == mounted
    assert k8s["exec-train"]["pvcMount"][0]["mountPath"] == "/var/cache/qatpipe"


def test_repo_yaml_is_in_sync_with_the_code(compiled):
    path, _, _ = compiled
    assert REPO_YAML.read_text() == path.read_text(), (
        "pipelines/qat_pipeline.yaml is stale: run `qatpipe compile -o pipelines/qat_pipeline.yaml`")
