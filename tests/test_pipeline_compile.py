"""The compiled pipeline: its DAG shape, GPU requests, secrets, retries and caching, and the YAML in the repo."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from qatpipe_pipelines.qat_pipeline import MLFLOW_CLIENT_LABEL, SECRET_KEYS_TO_ENV
from qatpipe_pipelines.stage_table import STAGES as STAGE_ROWS, stage_names
from qatpipe_pipelines.submit import compile_pipeline

REPO_YAML = Path(__file__).resolve().parents[1] / "pipelines" / "qat_pipeline.yaml"
# tasks by display name, from the stage table (qatpipe_pipelines/stage_table.py)
VARIANTS = ("fp32", "ptq", "ptq-partial", "qat")
ONNX_TASKS = {"fp32": "export-fp32", "ptq": "ptq", "ptq-partial": "ptq-partial", "qat": "export-qat"}
STAGES = stage_names(logged=True)  # each logs its tracking record, and log-stages takes it
# the ONNX evaluations run ONNX Runtime's CPU build: no GPU for them
GPU_TASKS = stage_names(runs=("training", "gpu"))
TRAINING_TASKS = stage_names(runs=("training",))
LIGHT_TASKS = {"resolve-spec", "start-tracking", "finish-tracking", "gpu-placement", "log-stages",
               *stage_names(runs=("light",))}
CACHED_TASKS = {row.name for row in STAGE_ROWS if not row.per_run} | {"gpu-placement"}  # a function of parameters


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = compile_pipeline(tmp_path_factory.mktemp("compiled") / "qat_pipeline.yaml")
    pipeline_spec, platform_spec = yaml.safe_load_all(path.read_text())
    return path, pipeline_spec, platform_spec


def _all_tasks(pipeline_spec) -> dict:
    """Display name -> task, over the root DAG and the exit handler's."""
    tasks = dict(pipeline_spec["root"]["dag"]["tasks"])
    for component in pipeline_spec["components"].values():
        tasks.update(component.get("dag", {}).get("tasks", {}))
    return {task["taskInfo"]["name"]: task for task in tasks.values()}


def _upstream(spec, task) -> set[str]:
    """Display names of the tasks `task` reads from or waits for."""
    names = {}
    for component in [spec["root"], *spec["components"].values()]:
        for task_id, other in component.get("dag", {}).get("tasks", {}).items():
            names[task_id] = other["taskInfo"]["name"]
    producers = set(task.get("dependentTasks", []))
    inputs = task.get("inputs", {})
    for value in list(inputs.get("artifacts", {}).values()) + list(inputs.get("parameters", {}).values()):
        for key in ("taskOutputArtifact", "taskOutputParameter"):
            if key in value:
                producers.add(value[key]["producerTask"])
    return {names[p] for p in producers}


def test_dag_shape(compiled):
    _, spec, _ = compiled
    root = spec["root"]["dag"]["tasks"]
    # everything runs inside the exit handler, so finish-tracking closes the MLflow run whatever fails
    assert set(root) == {"finish-tracking", "exit-handler-1"}
    assert root["finish-tracking"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    handler = spec["components"][root["exit-handler-1"]["componentRef"]["name"]]["dag"]["tasks"]
    # one bookkeeping task for every stage's tracking record: 31 tasks in the UI graph (58 with a log task each and
    # an ONNX evaluation of each INT8 variant)
    assert {task["taskInfo"]["name"] for task in handler.values()} == (
        {row.name for row in STAGE_ROWS} | {"log-stages", "resolve-spec", "start-tracking", "gpu-placement"})
    assert len(handler) + len(root) == len(STAGE_ROWS) + 6 == 31
    tasks = _all_tasks(spec)

    def upstream(name):
        # every stage reads its spec view, and every GPU stage's node selector is gpu-placement's output
        found = _upstream(spec, tasks[name]) - {"resolve-spec"}
        assert ("gpu-placement" in found) == (name in GPU_TASKS), name
        return found - {"gpu-placement"}

    assert upstream("start-tracking") == set() and upstream("fingerprint-data") == set()
    # the data as it is now keys prepare-data's cache (fingerprint-data runs every time, prepare-data is cached)
    assert upstream("prepare-data") == {"fingerprint-data"}
    assert tasks["prepare-data"]["inputs"]["parameters"]["data_fingerprint"]["taskOutputParameter"] == {
        "producerTask": "fingerprint-data", "outputParameterKey": "Output"}
    # the pretrain stage runs only where the spec asks for it (at run time); train reads its weights then
    assert upstream("pretrain") == {"prepare-data"}
    assert upstream("train") == {"prepare-data", "pretrain", "start-tracking"}  # its live curves need the MLflow run
    assert upstream("evaluate-unpruned") == {"prepare-data", "train"}
    # TAO's recipe: prune the trained model, retrain it (FP32); then, as qat.start says at run time, QAT from
    # the pruned model, fine-tuning the FP32 retrain's or the FP32 baseline, and the baseline handed on or
    # fine-tuned; QAT waits for the baseline, which it fine-tunes under start baseline
    assert upstream("prune") == {"train"}
    assert upstream("retrain-fp32") == {"prepare-data", "prune", "start-tracking"}
    assert upstream("finetune-fp32") == {"prepare-data", "prune", "start-tracking", "retrain-fp32"}
    assert upstream("retrain-qat") == upstream("finetune-fp32") | {"finetune-fp32"}
    for name in ("retrain-qat", "finetune-fp32"):
        assert tasks[name]["inputs"]["artifacts"]["start"]["taskOutputArtifact"] == {
            "producerTask": "retrain", "outputArtifactKey": "model"}, name
    baseline = tasks["retrain-qat"]["inputs"]["artifacts"]["baseline"]["taskOutputArtifact"]
    assert baseline["outputArtifactKey"] == "model" and _upstream(spec, {"dependentTasks": [
        baseline["producerTask"]]}) == {"finetune-fp32"}
    assert "start" not in tasks["retrain-fp32"]["inputs"]["artifacts"]
    assert "baseline" not in tasks["finetune-fp32"]["inputs"]["artifacts"]
    # export reads the data too: the FP16 guard's ranges come from training images; the FP32 variant is the
    # baseline (finetune-fp32), not the first retrain
    assert upstream("export-fp32") == {"prepare-data", "finetune-fp32"}
    assert upstream("export-qat") == {"prepare-data", "retrain-qat"}
    # the PTQ baseline calibrates the FP32 retrain's ONNX; every variant is scored from its ONNX
    assert upstream("ptq") == {"prepare-data", "export-fp32"}
    assert upstream("evaluate-fp32") == {"prepare-data", "export-fp32"}
    # the INT8 models are scored once, by their validation: no ONNX evaluation of them besides
    assert not {name for name in tasks if name.startswith("evaluate-")} - {"evaluate-fp32", "evaluate-unpruned"}
    # layer sensitivity of both INT8 models (against the FP32 ONNX, on val images); PTQ's ranking picks the layers
    # the fourth variant, ptq-partial, keeps float
    assert upstream("sensitivity") == {"prepare-data", "export-fp32", "ptq", "export-qat"}
    assert upstream("ptq-partial") == {"prepare-data", "export-fp32", "ptq", "sensitivity"}
    ids = {task_id: task["taskInfo"]["name"] for component in [spec["root"], *spec["components"].values()]
           for task_id, task in component.get("dag", {}).get("tasks", {}).items()}

    def producer(name, artifact):
        """(display name of the task feeding `name`'s input `artifact`, its output)."""
        source = tasks[name]["inputs"]["artifacts"][artifact]["taskOutputArtifact"]
        return ids[source["producerTask"]], source["outputArtifactKey"]

    assert producer("ptq-partial", "sensitivity") == ("sensitivity", "results")
    for name, view in (("sensitivity", "sensitivity"), ("ptq-partial", "ptq_partial")):
        assert tasks[name]["inputs"]["parameters"][f"{view}_spec"]["taskOutputParameter"] == {
            "producerTask": "resolve-spec", "outputParameterKey": f"{view}_spec"}, name
    # each variant's engine is built from its ONNX and validated against the FP32 evaluation
    # ptq-partial's also read PTQ's engine and validation, to take them where its model is PTQ's byte for byte
    same = {"ptq-partial": "ptq"}
    for v in VARIANTS:
        onnx_task = ONNX_TASKS[v]
        also = {f"build-engine-{same[v]}"} if v in same else set()
        assert upstream(f"build-engine-{v}") == {onnx_task, *also}
        assert upstream(f"validate-{v}") == {"prepare-data", f"build-engine-{v}", onnx_task, "evaluate-fp32",
                                             *({f"validate-{same[v]}"} if v in same else ())}
        assert ("same_as" in tasks[f"validate-{v}"]["inputs"]["artifacts"]) == (v in same)
    assert producer("build-engine-ptq-partial", "same_as") == ("build-engine-ptq", "engine")
    assert producer("validate-ptq-partial", "same_as") == ("validate-ptq", "results")
    assert upstream("compare") == {"start-tracking", "prune", "evaluate-unpruned",
                                   *(f"validate-{v}" for v in VARIANTS)}
    # register logs every variant's model and registers the QAT one (the gate decides its alias, so it runs
    # whether the gate passed or not), once compare has succeeded
    assert "triggerPolicy" not in tasks["register"]
    assert upstream("register") == {"start-tracking", "prepare-data", *ONNX_TASKS.values(), "build-engine-qat",
                                    "compare", *(f"validate-{v}" for v in VARIANTS)}
    # a variant's name as an input's: ptq-partial's validation reaches compare and register as ptq_partial
    assert producer("compare", "ptq_partial") == ("validate-ptq-partial", "results")
    assert producer("register", "ptq_partial_onnx") == ("ptq-partial", "onnx_model")
    assert producer("register", "ptq_partial_validation") == ("validate-ptq-partial", "results")
    assert tasks["validate-ptq-partial"]["inputs"]["parameters"]["variant"]["runtimeValue"]["constant"] == (
        "ptq-partial")
    # log-stages reads every logged stage's record output (the row's `logs`), as the input named after the stage
    assert upstream("log-stages") == STAGES | {"start-tracking"}
    for row in STAGE_ROWS:
        if row.logs:
            assert producer("log-stages", row.name.replace("-", "_")) == (row.name, row.logs), row.name
    # every stage receives only its spec view; the QAT retrain gets the view with the qat section
    assert tasks["train"]["inputs"]["parameters"]["train_spec"]["taskOutputParameter"] == {
        "producerTask": "resolve-spec", "outputParameterKey": "train_spec"}
    qat_view = tasks["retrain-qat"]["inputs"]["parameters"]
    assert qat_view["retrain_spec"]["taskOutputParameter"]["outputParameterKey"] == "retrain_qat_spec"
    assert qat_view["qat"]["runtimeValue"]["constant"] is True
    assert tasks["retrain-fp32"]["inputs"]["parameters"]["qat"]["runtimeValue"]["constant"] is False
    # the baseline reads qat.start and qat.finetune_epochs, so it gets a view with the qat section: its own, which
    # never carries what only QAT reads (qat.excluded_layers auto's sections)
    control = tasks["finetune-fp32"]["inputs"]["parameters"]
    assert control["retrain_spec"]["taskOutputParameter"]["outputParameterKey"] == "finetune_fp32_spec"
    assert control["qat"]["runtimeValue"]["constant"] is False


def test_parameters(compiled):
    _, spec, _ = compiled
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {name: p["parameterType"] for name, p in params.items()} == {
        "spec_uri": "STRING", "spec_overrides": "LIST", "train_data": "STRING", "val_data": "STRING",
        "run_name": "STRING", "gpus": "NUMBER_INTEGER",
        "workers": "NUMBER_INTEGER", "mpijob_api_version": "STRING", "launcher": "STRING", "training_image": "STRING",
        "engine_image": "STRING", "node_selector": "STRUCT", "tolerations": "LIST", "credentials_secret": "STRING",
        "kfp_ui_url": "STRING", "gpu_type": "STRING", "checkpoint_uri": "STRING",
        **{f"{kind}_{what}": "STRING" for kind in ("training", "gpu_stage", "cpu_stage", "light")
           for what in ("cpu", "memory")},
    }
    # train and retrain get it (their resume state on S3 without the cache volume)
    tasks = _all_tasks(spec)
    for name in TRAINING_TASKS:
        assert tasks[name]["inputs"]["parameters"]["checkpoint_uri"]["componentInputParameter"] == (
            "pipelinechannel--checkpoint_uri"), name
    # the image defaults are the names images/build.sh builds
    from qatpipe_kfp.settings import IMAGES

    assert params["training_image"]["defaultValue"] == IMAGES["training"]
    assert params["engine_image"]["defaultValue"] == IMAGES["engine"]
    assert params["spec_uri"]["defaultValue"] == "default"
    # the KFP UI shows each parameter's description, parsed from the pipeline's Args: docstring
    assert all(p.get("description", "").strip() for p in params.values()), [
        name for name, p in params.items() if not p.get("description")]
    assert spec["root"]["inputDefinitions"]["parameters"]["training_memory"]["description"].startswith("memory")
    # described for the UI's users, not in the code's names: the Secret's keys spelled out
    from qatpipe_kfp.runtime import CREDENTIAL_KEYS

    assert all(key in params["credentials_secret"]["description"] for key in CREDENTIAL_KEYS)
    assert not [name for name, p in params.items() if re.search(r"\b[A-Z]+(_[A-Z]+)+_TO_[A-Z_]+\b|\.py\b",
                                                                  p.get("description", ""))]
    assert "dataset.train" in params["train_data"]["description"] and "s3://" in params["val_data"]["description"]


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
        # TensorRT stages run on the engine image, every other task on the training image
        image = "engine_image" if name.startswith(("build-engine", "validate-")) else "training_image"
        assert container["image"] == f"{{{{$.inputs.parameters['pipelinechannel--{image}']}}}}", name
        accelerator = container.get("resources", {}).get("accelerator")
        if name in GPU_TASKS:
            assert accelerator["resourceType"] == "nvidia.com/gpu"
            # a training task's GPUs are gpu-placement's: gpus on one node, 0 when it only follows its job
            source = "gpu-placement-training_gpus" if name in TRAINING_TASKS else "gpus"
            assert accelerator["resourceCount"] == f"{{{{$.inputs.parameters['pipelinechannel--{source}']}}}}", name
            # node_selector plus gpu_type's GPU model, computed by gpu-placement at run time
            assert k8s[executor]["nodeSelector"] == {"nodeSelectorJson": {"taskOutputParameter": {
                "outputParameterKey": "node_selector", "producerTask": "gpu-placement"}}}, name
            assert "tolerations" in k8s[executor]
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
        # the label MLflow's NetworkPolicy admits
        assert k8s[executor]["podMetadata"]["labels"] == dict([MLFLOW_CLIENT_LABEL]), name
    # credentials appear only as key names in secretAsEnv (secretKey + envVar per executor), never as
    # parameters or values
    # (and once in credentials_secret's description, which lists the Secret's keys for the UI)
    text = path.read_text()
    params = spec["root"]["inputDefinitions"]["parameters"]
    described = params["credentials_secret"]["description"]
    for key in ("AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD"):
        assert text.count(key) == 2 * len(k8s) + described.count(key) and described.count(key) == 1, key
    assert not [name for name in params if any(word in name for word in ("password", "token", "key"))]


def test_retries_and_caching(compiled):
    _, spec, _ = compiled
    tasks = _all_tasks(spec)
    for name in ("resolve-spec", "start-tracking", "fingerprint-data", "prepare-data", "compare", "log-stages"):
        assert tasks[name]["retryPolicy"]["maxRetryCount"] == 3, name
    for name in TRAINING_TASKS:  # pre-emption: retried, resuming from the cache volume's checkpoints
        assert tasks[name]["retryPolicy"] == {"maxRetryCount": 2, "backoffDuration": "60s", "backoffFactor": 2.0,
                                              "backoffMaxDuration": "3600s"}, name
    for name, task in tasks.items():  # stages are cached on their inputs; per-run tracking tasks never
        cached = task.get("cachingOptions", {}).get("enableCache", False)
        assert cached == (name in CACHED_TASKS), name


def test_cache_pvc_option(tmp_path):
    path = compile_pipeline(tmp_path / "with_pvc.yaml", cache_pvc="qatpipe-cache")
    spec, platform = yaml.safe_load_all(path.read_text())
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    executor_of = {name: spec["components"][task["componentRef"]["name"]]["executorLabel"]
                   for name, task in _all_tasks(spec).items() if "componentRef" in task
                   and "executorLabel" in spec["components"][task["componentRef"]["name"]]}
    mounted = {name for name, executor in executor_of.items() if k8s[executor].get("pvcMount")}
    # the stages that read the data set
    assert mounted == {row.name for row in STAGE_ROWS if row.reads_data}
    assert mounted >= {"fingerprint-data", "prepare-data", *TRAINING_TASKS, "evaluate-unpruned", "export-fp32", "ptq",
                       "sensitivity", "ptq-partial", *(f"validate-{v}" for v in VARIANTS)}  # the engine builds do not
    assert k8s[executor_of["train"]]["pvcMount"][0]["mountPath"] == "/var/cache/qatpipe"


def test_repo_yaml_is_in_sync_with_the_code(compiled):
    path, _, _ = compiled
    assert REPO_YAML.read_text() == path.read_text(), (
        "pipelines/qat_pipeline.yaml is stale: run `qatpipe compile -o pipelines/qat_pipeline.yaml`")


def test_train_and_retrain_get_the_scale_out_parameters(compiled):
    _, spec, _ = compiled
    tasks = _all_tasks(spec)
    for name in TRAINING_TASKS:
        params = tasks[name]["inputs"]["parameters"]
        for key in ("gpus", "workers", "mpijob_api_version", "launcher", "training_image", "credentials_secret",
                    "tolerations"):
            assert params[key]["componentInputParameter"] == f"pipelinechannel--{key}", (name, key)
        # an MPIJob's pods get the GPU stages' node selector (node_selector + gpu_type), gpu-placement's output
        assert params["node_selector"]["taskOutputParameter"] == {"producerTask": "gpu-placement",
                                                                  "outputParameterKey": "node_selector"}, name


def test_cache_pvc_tells_training_tasks_its_claim_for_mpijobs(tmp_path):
    path = compile_pipeline(tmp_path / "p.yaml", cache_pvc="qatpipe-cache")
    pipeline_spec, _ = yaml.safe_load_all(path.read_text())
    executors = pipeline_spec["deploymentSpec"]["executors"]
    tasks = _all_tasks(pipeline_spec)
    executor = pipeline_spec["components"][tasks["train"]["componentRef"]["name"]]["executorLabel"]
    env = {item["name"]: item["value"] for item in executors[executor]["container"].get("env", [])}
    assert env["QATPIPE_CACHE_PVC"] == "qatpipe-cache" and env["QATPIPE_CACHE_DIR"] == "/var/cache/qatpipe"


def test_mpijob_option_runs_training_as_mpijobs_from_tasks_without_gpus(tmp_path):
    path = compile_pipeline(tmp_path / "p.yaml", cache_pvc="qatpipe-cache", mpijob=True)
    pipeline_spec, _ = yaml.safe_load_all(path.read_text())
    executors = pipeline_spec["deploymentSpec"]["executors"]
    tasks = _all_tasks(pipeline_spec)
    for name in TRAINING_TASKS:
        assert tasks[name]["inputs"]["parameters"]["mpijob"]["runtimeValue"]["constant"] is True
        executor = pipeline_spec["components"][tasks[name]["componentRef"]["name"]]["executorLabel"]
        assert "accelerator" not in executors[executor]["container"].get("resources", {}), name
    # the other GPU stages keep their GPUs
    executor = pipeline_spec["components"][tasks["evaluate-unpruned"]["componentRef"]["name"]]["executorLabel"]
    assert executors[executor]["container"]["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"


def test_logging_stages_know_the_kfp_run_without_a_cache_busting_input(compiled):
    """A stage logs its record when it ends (and train / retrain their live curves): each reads the KFP run id
    from its pod's labels (both label names KFP backends use), so no per-run value enters their inputs and a
    cached stage stays cached."""
    _, spec, platform = compiled
    tasks = _all_tasks(spec)
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert TRAINING_TASKS < STAGES
    for name in STAGES:
        executor = spec["components"][tasks[name]["componentRef"]["name"]]["executorLabel"]
        assert {item["name"]: item["fieldPath"] for item in k8s[executor]["fieldPathAsEnv"]} == {
            "QATPIPE_KFP_RUN_ID": "metadata.labels['pipeline/runid']",
            "QATPIPE_KFP_RUN_ID_V2": "metadata.labels['pipelines.kubeflow.org/run_id']"}, name
        params = tasks[name]["inputs"].get("parameters", {})
        assert not any("PIPELINE_JOB" in json.dumps(value) or "start-tracking" in json.dumps(value)
                       for value in params.values()), name


def test_every_task_has_cpu_and_memory_requests_and_limits(compiled):
    """No BestEffort pods: every executor requests and is limited to its kind's CPU and memory (training: no CPU
    limit), pipeline parameters a run can override; training tasks get a memory-backed /dev/shm."""
    from qatpipe_pipelines.qat_pipeline import TASK_SIZES

    _, spec, platform = compiled
    executors = spec["deploymentSpec"]["executors"]
    params = spec["root"]["inputDefinitions"]["parameters"]
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    with_shm = set()
    for name, task in _all_tasks(spec).items():
        executor = spec["components"][task["componentRef"]["name"]].get("executorLabel")
        if executor is None:
            continue
        kind = ("training" if name in TRAINING_TASKS else "light" if name in LIGHT_TASKS
                else "gpu_stage" if name in GPU_TASKS else "cpu_stage")
        resources = executors[executor]["container"]["resources"]
        for what, keys in (("cpu", ("resourceCpuRequest", "resourceCpuLimit")),
                           ("memory", ("resourceMemoryRequest", "resourceMemoryLimit"))):
            for key in keys:
                if key == "resourceCpuLimit" and kind == "training":  # CFS throttling starves tf.data
                    assert key not in resources, name
                    continue
                # the training tasks' sizes pass through gpu-placement (light when they only follow a job)
                source = f"gpu-placement-{kind}_{what}" if kind == "training" else f"{kind}_{what}"
                assert resources[key] == f"{{{{$.inputs.parameters['pipelinechannel--{source}']}}}}", (name, key)
            assert params[f"{kind}_{what}"]["defaultValue"] == TASK_SIZES[kind][what == "memory"]
        shm = k8s.get(executor, {}).get("emptyDirMounts", [])  # the only emptyDir a task has: /dev/shm
        if name in TRAINING_TASKS:
            assert shm == [{"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "8Gi", "volumeName": "shm"}], name
            with_shm.add(name)
        else:
            assert shm == [], name
    assert with_shm == TRAINING_TASKS  # every training task was seen, and had it
    placement = _all_tasks(spec)["gpu-placement"]["inputs"]["parameters"]
    for key in ("gpus", "workers", "training_cpu", "training_memory", "light_cpu", "light_memory", "gpu_type",
                "node_selector"):
        assert placement[key] == {"componentInputParameter": f"pipelinechannel--{key}"}, key


def test_shm_size_option_and_the_mpijob_followers(tmp_path):
    """--shm-size sizes /dev/shm; with --mpijob the training tasks only follow their jobs: light, no GPU, no shm."""
    path = compile_pipeline(tmp_path / "mpijob.yaml", cache_pvc="qatpipe-cache", mpijob=True)
    spec, platform = yaml.safe_load_all(path.read_text())
    tasks = _all_tasks(spec)
    executors = spec["deploymentSpec"]["executors"]
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name in TRAINING_TASKS:
        executor = spec["components"][tasks[name]["componentRef"]["name"]]["executorLabel"]
        resources = executors[executor]["container"]["resources"]
        assert "accelerator" not in resources and "light_memory" in resources["resourceMemoryLimit"], name
        assert not k8s[executor].get("emptyDirMounts"), name
    path = compile_pipeline(tmp_path / "shm.yaml", shm_size="16Gi")
    spec, platform = yaml.safe_load_all(path.read_text())
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    executor = spec["components"][_all_tasks(spec)["train"]["componentRef"]["name"]]["executorLabel"]
    assert k8s[executor]["emptyDirMounts"][0]["sizeLimit"] == "16Gi"


def test_engines_are_cached_per_gpu_model(compiled):
    """gpu_type is an input of every build-engine task (KFP's cache key), so an engine built on one GPU model
    is not reused on another; the tasks that only read the engine follow its artifact."""
    _, spec, _ = compiled
    tasks = _all_tasks(spec)
    for variant in VARIANTS:
        gpu_type = tasks[f"build-engine-{variant}"]["inputs"]["parameters"]["gpu_type"]
        assert gpu_type == {"componentInputParameter": "pipelinechannel--gpu_type"}, variant



def test_each_logged_stage_logs_the_output_its_row_names():
    """The stage table's `logs` output is what log-stages reads; the component hands the same output to
    runtime.stage(record=...), which logs it when the stage ends."""
    import inspect

    for row in STAGE_ROWS:
        passed = re.findall(r"with stage\(.*record=(\w+)\):", inspect.getsource(row.component.python_func))
        assert passed == ([row.logs] if row.logs else []), row.name
