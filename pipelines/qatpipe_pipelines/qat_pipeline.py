"""The qatpipe DAG, TAO's recipe with MLflow tracking around it:

fingerprint data → prepare data → train (unpruned) → evaluate (unpruned) and prune →
  retrain FP32 →
  [finetune FP32 (the baseline: as trained, or as long as QAT) → export → evaluate FP32 (the baseline's mAP);
   PTQ calibrate]
  [retrain QAT (qat.start: the pruned model, fine-tuning FP32's, or briefly the FP32 baseline; after the
   baseline) → export (Q/DQ + calibration cache)]
→ layer sensitivity of the PTQ and QAT models → ptq-partial (PTQ with its most sensitive layers float, until
  within the gate's budget)
→ per variant (fp32, ptq, ptq-partial, qat): build engine (+ latency benchmark) → validate: the engine's mAP (and
  TensorRT's numbers, emulated where the engine computes others) against the FP32 baseline
→ compare (the variants' table, their differences, pruning block, gate) → register (each variant an MLflow model;
  the QAT one a registry version: alias champion when it passed the gate, rejected when not).

The stages are the rows of stage_table.py: a task per row. A stage logs its own tracking record to MLflow
when it ends (finding the pipeline's run without a task input, so its cache key holds no per-run id); one
log-stages task at the end, never cached, takes every logged stage's record output and logs those this run
does not hold yet: the stages served from KFP's cache. Adding a stage is its component folder and its row there.
"""

# no `from __future__ import annotations`: KFP reads the pipeline signature's annotations as types

import functools
import inspect
import sys
from typing import List

from kfp import dsl, kubernetes
from kfp.dsl import pipeline_task

from qatpipe_kfp.finish_tracking.component import finish_tracking
from qatpipe_kfp.gpu_placement.component import gpu_placement
from qatpipe_kfp.log_stages.component import log_stages_component
from qatpipe_kfp.resolve_spec.component import resolve_spec
from qatpipe_kfp.runtime import CREDENTIAL_KEYS
from qatpipe_kfp.settings import ENGINE_IMAGE, TRAINING_IMAGE
from qatpipe_kfp.start_tracking.component import start_tracking
from qatpipe.spec import spec_output_name
from qatpipe.tracking.live import KFP_RUN_ID_ENVS
from qatpipe_pipelines.stage_table import STAGES, From, Param, Stage

PIPELINE_NAME = "qatpipe"
CACHE_MOUNT_PATH = "/var/cache/qatpipe"
# env var -> key in the credentials Secret (manifests/ has its template). Every key is optional: an unused
# service simply has no keys. Values never pass through pipeline parameters or logs.
SECRET_KEYS_TO_ENV = {key: key for key in CREDENTIAL_KEYS}
NETWORK_RETRIES = 3
TRAINING_RETRIES = 2  # pre-emption, eviction: with --cache-pvc the retry resumes from the last checkpoint
# CPU and memory per kind of task (requests = limits, so no task is BestEffort: evicted first, OOM-killed
# without a trace; training has no CPU limit, see _TaskSettings.cpu); each is a pipeline parameter
# `<kind>_cpu` / `<kind>_memory` with these defaults
TASK_SIZES = {
    "training": ("8", "32Gi"),  # train / retrain on a GPU node: TensorFlow plus the tf.data workers
    "gpu_stage": ("4", "16Gi"),  # evaluate (Keras), build-engine, validate
    "cpu_stage": ("4", "16Gi"),  # data, pruning, export, PTQ, sensitivity, ONNX evaluations, compare, register
    "light": ("1", "2Gi"),  # spec, tracking and logging tasks (MLflow client, artifact uploads)
}
SHM_SIZE = "8Gi"  # memory-backed /dev/shm of training tasks (NCCL, Horovod with gpus > 1 in one pod)
# on every task's pod: MLflow's NetworkPolicy (manifests/tracking/networkpolicy.yaml) admits only pods with it
# (and the pods of the training jobs, by their qatpipe.io/mpijob label)
MLFLOW_CLIENT_LABEL = ("qatpipe.io/mlflow-client", "true")


class _TaskSettings:
    """How the pipeline's tasks run: image, credentials, GPU placement, retries, caching.

    Made inside the pipeline function from its parameters; each task then says only what kind it is:
    `cpu(task, network=..., per_run=..., reads_data=..., size=...)` or `gpu(task, reads_data=True, size=...)`.
    """

    def __init__(self, image, engine_image, secret, gpus, node_selector, tolerations, *, sizes, cache_pvc,
                 network_retries, placement, code_version, shm_size):
        self.image, self.engine_image, self.secret = image, engine_image, secret
        self.gpus, self.node_selector, self.tolerations = gpus, node_selector, tolerations
        self.sizes = sizes  # kind -> (cpu, memory), pipeline parameters
        self.cache_pvc, self.network_retries, self.placement = cache_pvc, network_retries, placement
        self.code_version, self.shm_size = code_version, shm_size
        self.training_gpus = gpus  # the GPUs of a training task; gpu-placement's output once it exists

    def cpu(self, task: dsl.PipelineTask, *, network: bool = False, per_run: bool = False,
            reads_data: bool = False, engine: bool = False, size: str = "cpu_stage") -> dsl.PipelineTask:
        """network: talks to S3 / MLflow, so retried; per_run: its result belongs to this run (MLflow ids,
        a URI's current content), so never served from cache; reads_data: gets the dataset cache PVC;
        engine: runs on the engine image (TensorRT) instead of the training image; size: its TASK_SIZES kind."""
        if self.placement:
            cpu, memory = self.sizes[size]
            task.set_cpu_request(cpu).set_memory_request(memory).set_memory_limit(memory)
            if size != "training":  # as the MPIJob workers: CFS throttling would starve tf.data's input pipeline
                task.set_cpu_limit(cpu)
        task.set_container_image(self.engine_image if engine else self.image)
        kubernetes.add_pod_label(task, *MLFLOW_CLIENT_LABEL)
        if self.code_version:
            task.set_env_variable("QATPIPE_CODE_VERSION", self.code_version)
        kubernetes.use_secret_as_env(task, secret_name=self.secret, secret_key_to_env=SECRET_KEYS_TO_ENV,
                                     optional=True)
        if network and self.network_retries:
            task.set_retry(num_retries=self.network_retries, backoff_duration="30s", backoff_factor=2.0)
        if per_run:
            task.set_caching_options(False)
        if reads_data and self.cache_pvc:
            kubernetes.mount_pvc(task, pvc_name=self.cache_pvc, mount_path=CACHE_MOUNT_PATH)
            task.set_env_variable("QATPIPE_CACHE_DIR", CACHE_MOUNT_PATH)
            task.set_env_variable("QATPIPE_CACHE_PVC", self.cache_pvc)  # MPIJobs mount it too
        return task

    def gpu(self, task: dsl.PipelineTask, reads_data: bool = True, engine: bool = False,
            size: str = "gpu_stage") -> dsl.PipelineTask:
        self.cpu(task, reads_data=reads_data, engine=engine, size=size)
        if self.placement:
            task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(
                self.training_gpus if size == "training" else self.gpus)
            kubernetes.add_node_selector_json(task, node_selector_json=self.node_selector)
            kubernetes.add_toleration_json(task, toleration_json=self.tolerations)
        return task

    @staticmethod
    def finds_mlflow_run(task: dsl.PipelineTask) -> dsl.PipelineTask:
        """The KFP run id from the pod's labels, not from a task input (that would defeat the cache): a stage
        that logs its record at its end (and a training its live curves) finds the MLflow run by it."""
        for env, label in zip(KFP_RUN_ID_ENVS, ("pipeline/runid", "pipelines.kubeflow.org/run_id")):
            kubernetes.use_field_path_as_env(task, env, f"metadata.labels['{label}']")
        return task

    def log_stages(self, rows, tasks: dict) -> dsl.PipelineTask:
        """The log-stages task: the records of the logged rows this run did not log at their end (cached ones)."""
        logged = [row for row in rows if row.logs]
        task = log_stages_component({row.name: row.logs for row in logged})(
            parent_run_id=tasks["start-tracking"].outputs["Output"],
            **{row.name.replace("-", "_"): tasks[row.name].outputs[row.logs] for row in logged})
        return self.cpu(task.set_display_name("log-stages"), network=True, per_run=True, size="light")

    def training(self, task: dsl.PipelineTask, mpijob: bool) -> dsl.PipelineTask:
        """train / retrain: on a GPU node with a memory-backed /dev/shm, or (mpijob) a task that only follows
        its MPIJob and holds no GPU."""
        # a pre-empted or evicted pod is retried and resumes from its last checkpoint, which lives on the cache
        # volume (stages/scale_out.py), not in the task's outputs
        task.set_retry(num_retries=TRAINING_RETRIES, backoff_duration="60s", backoff_factor=2.0)
        if mpijob:
            return self.cpu(task, reads_data=True, size="light")
        if self.placement:
            kubernetes.empty_dir_mount(task, volume_name="shm", mount_path="/dev/shm", medium="Memory",
                                       size_limit=self.shm_size)
        return self.gpu(task, size="training")


def _input(value, tasks: dict[str, dsl.PipelineTask], params: dict):
    if isinstance(value, From):
        return tasks[value.task].outputs[value.output]
    return params[value.name] if isinstance(value, Param) else value


def _stage_task(row: Stage, run: _TaskSettings, tasks: dict, params: dict, scale_out: dict,
                mpijob: bool) -> dsl.PipelineTask:
    """The task of one stage_table row, placed as its row says; one that logs a record finds the MLflow run."""
    inputs = {name: _input(value, tasks, params) for name, value in row.inputs.items()}
    if row.spec_input:
        view = row.view or row.spec_input.removesuffix("_spec")
        inputs[row.spec_input] = tasks["resolve-spec"].outputs[spec_output_name(view)]
    if row.runs == "training":
        inputs.update(scale_out)
    task = row.component(**inputs).set_display_name(row.name)
    for name in row.after:
        task.after(tasks[name])
    if row.runs == "training":
        run.training(task, mpijob)
    elif row.runs == "gpu":
        run.gpu(task, reads_data=row.reads_data, engine=row.engine)
    else:
        run.cpu(task, network=row.network, per_run=row.per_run, reads_data=row.reads_data, engine=row.engine,
                size="light" if row.runs == "light" else "cpu_stage")
    if row.logs:
        run.finds_mlflow_run(task)
    return task


class _CallerNamesOnly:
    """`inspect` as kfp.dsl.pipeline_task sees it while the pipeline is built. Each task setter (set_cpu_limit,
    set_env_variable, ...) calls inspect.stack() for its own name, should it have to raise; that reads the source
    file and module of every frame on the stack, some 250 times a build: 3.5 s of a 4 s build on 2 cores, 15-20 s
    in a process with TensorFlow loaded and a deep stack (a test). The frames and their function names are all it
    takes from there."""

    def __getattr__(self, name):
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list:
        frame, frames = sys._getframe(1), []
        while frame is not None:
            frames.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name,
                                            None, None))
            frame = frame.f_back
        return frames


def _caller_names_only(build):
    @functools.wraps(build)
    def building(*args, **kwargs):
        real, pipeline_task.inspect = pipeline_task.inspect, _CallerNamesOnly()
        try:
            return build(*args, **kwargs)
        finally:
            pipeline_task.inspect = real

    return building


@_caller_names_only
def build_pipeline(cache_pvc: "str | None" = None, network_retries: int = NETWORK_RETRIES,
                   placement: bool = True, code_version: str = "", mpijob: bool = False,
                   shm_size: str = SHM_SIZE, local_images: "dict[str, str] | None" = None):
    """The pipeline function. Compile-time options:
    cache_pvc: mount this existing PVC as the dataset cache of every stage that reads data (a mount cannot be
        made optional at run time);
    network_retries: retries of the stages that talk to S3 / MLflow (the local run uses 0: a failure there
        is reported at once, and MLflow calls retry on their own);
    placement: the settings of the tasks' pods: CPU and memory sizes, GPU requests, node selector and
        tolerations on the GPU stages, /dev/shm. The local run turns it off: kfp.local ignores them anyway,
        and kfp 2.17's local runner cannot resolve a pipeline parameter used in them inside the exit handler;
    code_version: set as QATPIPE_CODE_VERSION in every task, so that a cache keyed on the task's environment
        (kfp.local's) misses when the library changes. On a cluster the image tag plays that part;
    mpijob: train and retrain always run as MPIJobs of `workers` x `gpus` processes, and their own tasks, which
        only follow the job, request no GPU (else a task with workers > 1 holds `gpus` GPUs while its job runs,
        a request KFP cannot make depend on a run-time parameter). Needs cache_pvc;
    shm_size: the size limit of the training tasks' memory-backed /dev/shm (counted in their memory limit; KFP
        takes no run-time parameter there);
    local_images: {"training": ..., "engine": ...}, the tasks' images as fixed names instead of the
        training_image / engine_image parameters, which kfp.local's DockerRunner does not resolve.
    """

    @dsl.pipeline(
        name=PIPELINE_NAME,
        description="FP32 training to a validated INT8 TensorRT detector, TAO-style (train → prune → QAT), "
                    "tracked in MLflow",
    )
    def qat_pipeline(
        spec_uri: str = "default",
        spec_overrides: List[str] = [],
        train_data: str = "",
        val_data: str = "",
        run_name: str = "",
        gpus: int = 1,
        workers: int = 1,
        mpijob_api_version: str = "v2beta1",
        launcher: str = "mpijob",
        training_image: str = TRAINING_IMAGE,
        engine_image: str = ENGINE_IMAGE,
        node_selector: dict = {},
        tolerations: list = [],
        credentials_secret: str = "qatpipe-credentials",
        kfp_ui_url: str = "",
        gpu_type: str = "",
        training_cpu: str = TASK_SIZES["training"][0],
        training_memory: str = TASK_SIZES["training"][1],
        gpu_stage_cpu: str = TASK_SIZES["gpu_stage"][0],
        gpu_stage_memory: str = TASK_SIZES["gpu_stage"][1],
        cpu_stage_cpu: str = TASK_SIZES["cpu_stage"][0],
        cpu_stage_memory: str = TASK_SIZES["cpu_stage"][1],
        light_cpu: str = TASK_SIZES["light"][0],
        light_memory: str = TASK_SIZES["light"][1],
        checkpoint_uri: str = "",
    ):
        """Train, prune, QAT-retrain, export, build and validate an INT8 detector; FP32, PTQ and PTQ-partial alongside.

        Args:
            spec_uri: bundled spec name (default, tiny), a path inside the image, or s3://bucket/key.
            spec_overrides: KEY=VALUE spec overrides, e.g. ["train.epochs=20"].
            train_data: your training data: a KITTI folder (images/ and labels/) as s3://bucket/prefix or a path
                the pods can read; it replaces the spec's dataset.train. Empty: the spec's data (the bundled specs
                generate a synthetic set).
            val_data: your validation data, a KITTI folder as s3://bucket/prefix or a path the pods can read; it
                replaces the spec's dataset.val.
            run_name: name of the MLflow parent run (default "qatpipe").
            gpus: GPUs per training / engine stage (nvidia.com/gpu); train and retrain run one Horovod process
                per GPU.
            workers: nodes for train and retrain: above 1, each runs as an MPIJob of `workers` x `gpus` Horovod
                processes (needs the mpi-operator, and the pipeline compiled with --cache-pvc for a shared volume).
            mpijob_api_version: v2beta1 (mpi-operator) or v1 (Kubeflow Training Operator).
            launcher: how train and retrain run across nodes: mpijob (an MPIJob, of mpijob_api_version) or trainjob
                (a Kubeflow Trainer v2 TrainJob on a TrainingRuntime of its own; needs Trainer v2.3+).
            training_image: the image of every stage but build-engine and validate (images/build.sh).
            engine_image: the image of build-engine and validate: TensorRT (images/build.sh).
            node_selector: node labels for GPU stages, e.g. {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}.
            tolerations: Kubernetes tolerations for GPU stages, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"}].
            credentials_secret: Kubernetes Secret with the S3 / MLflow credentials, each key optional:
                AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, MLFLOW_TRACKING_URI,
                MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN, MLFLOW_S3_ENDPOINT_URL.
            kfp_ui_url: the KFP UI's address (`qatpipe submit` sets it): MLflow runs and model versions then link
                to this run's page.
            gpu_type: the GPU model engines are built for, as nvidia.com/gpu.product names it (e.g.
                "NVIDIA-A100-SXM4-80GB"): every GPU stage runs on nodes of that model (added to node_selector
                as nvidia.com/gpu.product), and it keys build-engine's cache, so an engine is reused only on that
                model (and checked on the node). Empty: no model pinned; engines are cached for any GPU.
            training_cpu: CPU request of train / retrain on GPU nodes (no CPU limit: input pipelines burst); with
                workers > 1 their tasks only follow their jobs and take the light sizes and no GPU (gpu-placement).
            training_memory: memory (request = limit) of train / retrain.
            gpu_stage_cpu: CPU (request = limit) of evaluate-unpruned, build-engine and validate.
            gpu_stage_memory: memory (request = limit) of evaluate-unpruned, build-engine and validate.
            cpu_stage_cpu: CPU (request = limit) of the CPU stages (data, prune, export, PTQ, sensitivity,
                ptq-partial, the ONNX evaluations, compare, register).
            cpu_stage_memory: memory (request = limit) of the CPU stages.
            light_cpu: CPU (request = limit) of the spec, tracking and logging tasks (and the tasks that follow
                an MPIJob).
            light_memory: memory (request = limit) of those light tasks.
            checkpoint_uri: s3://bucket/prefix for train and retrain's resume state when the pipeline is compiled
                without --cache-pvc: mirrored after every checkpoint under the KFP run id and job, so that a
                retried (pre-empted) task resumes at its next epoch; removed once the model is kept. Empty: a
                retry without the cache volume starts its training again.
        """
        sizes = {"training": (training_cpu, training_memory), "gpu_stage": (gpu_stage_cpu, gpu_stage_memory),
                 "cpu_stage": (cpu_stage_cpu, cpu_stage_memory), "light": (light_cpu, light_memory)}
        if local_images:  # kfp.local's DockerRunner takes the image as written: a parameter stays a placeholder
            training_image, engine_image = local_images["training"], local_images["engine"]
        run = _TaskSettings(training_image, engine_image, credentials_secret, gpus, node_selector, tolerations,
                            sizes=sizes, cache_pvc=cache_pvc, network_retries=network_retries,
                            placement=placement, code_version=code_version, shm_size=shm_size)

        # an exit task may not depend on other tasks: it finds the MLflow run by the KFP run id
        finish = run.cpu(finish_tracking(kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER), per_run=True, size="light")

        with dsl.ExitHandler(finish, name="stages"):
            specs = run.cpu(resolve_spec(spec_uri=spec_uri, overrides=spec_overrides,
                                         credentials_secret=credentials_secret, train_data=train_data,
                                         val_data=val_data), network=True, per_run=True,
                            size="light")  # per run: the URI's content may change
            # task outputs, as KFP takes no expression over parameters: the GPU stages' node selector (node_selector
            # plus gpu_type's GPU model, so gpu_type pins the model that keys build-engine's cache), and what a
            # training task holds (with workers > 1 it only follows its job: no GPU, the light sizes)
            placed = run.cpu(gpu_placement(node_selector=node_selector, gpu_type=gpu_type, gpus=gpus, workers=workers,
                                           training_cpu=training_cpu, training_memory=training_memory,
                                           light_cpu=light_cpu, light_memory=light_memory), size="light")
            run.node_selector, run.training_gpus = placed.outputs["node_selector"], placed.outputs["training_gpus"]
            run.sizes["training"] = (placed.outputs["training_cpu"], placed.outputs["training_memory"])
            scale_out = dict(gpus=gpus, workers=workers, mpijob_api_version=mpijob_api_version, launcher=launcher,
                             training_image=training_image, credentials_secret=credentials_secret,
                             node_selector=run.node_selector, tolerations=tolerations, mpijob=mpijob,
                             checkpoint_uri=checkpoint_uri)
            tracking = run.cpu(start_tracking(spec=specs.outputs["spec"], run_name=run_name,
                                              kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, kfp_ui_url=kfp_ui_url),
                               network=True, per_run=True, size="light")
            tasks = {"resolve-spec": specs, "start-tracking": tracking}
            params = {"gpu_type": gpu_type, "kfp_ui_url": kfp_ui_url}
            for row in STAGES:
                tasks[row.name] = _stage_task(row, run, tasks, params, scale_out, mpijob)
            run.log_stages(STAGES, tasks)

    return qat_pipeline


qat_pipeline = build_pipeline()
