"""The qatpipe DAG, TAO's recipe with MLflow tracking around it:

prepare data → train (unpruned) → evaluate (unpruned) and prune →
  [retrain FP32 → export → evaluate FP32; export → PTQ calibrate → evaluate PTQ]
  [retrain QAT → export (explicit Q/DQ + calibration cache) → evaluate QAT]
→ per variant: build engine (+ latency benchmark) → validate against the FP32 baseline
→ compare (FP32 / PTQ / QAT table, pruning block, gate) → register (each variant an MLflow model; the QAT one
  a registry version: alias champion when it passed the gate, challenger when not).

Adding a stage: a component folder under components/qatpipe_kfp/, its spec sections in
qatpipe.spec.STAGE_SECTIONS (and an output of resolve-spec), then here one call wrapped in `run.cpu(...)` or
`run.gpu(...)`, and `run.logged(...)` for its tracking record.
"""

# no `from __future__ import annotations`: KFP reads the pipeline signature's annotations as types

from typing import List

from kfp import dsl, kubernetes

from qatpipe_kfp.build_engine.component import build_engine
from qatpipe_kfp.compare.component import compare
from qatpipe_kfp.evaluate.component import evaluate
from qatpipe_kfp.export.component import export
from qatpipe_kfp.finish_tracking.component import finish_tracking
from qatpipe_kfp.log_stage.component import log_stage
from qatpipe_kfp.prepare_data.component import prepare_data
from qatpipe_kfp.prune.component import prune
from qatpipe_kfp.ptq.component import ptq
from qatpipe_kfp.resolve_spec.component import resolve_spec
from qatpipe_kfp.register.component import register
from qatpipe_kfp.retrain.component import retrain
from qatpipe_kfp.runtime import CREDENTIAL_KEYS
from qatpipe_kfp.settings import ENGINE_IMAGE, TRAINING_IMAGE
from qatpipe_kfp.start_tracking.component import start_tracking
from qatpipe_kfp.train.component import train
from qatpipe.tracking.live import KFP_RUN_ID_ENVS
from qatpipe_kfp.validate.component import validate

PIPELINE_NAME = "qatpipe"
CACHE_MOUNT_PATH = "/var/cache/qatpipe"
# env var -> key in the credentials Secret (manifests/ has its template). Every key is optional: an unused
# service simply has no keys. Values never pass through pipeline parameters or logs.
SECRET_KEYS_TO_ENV = {key: key for key in CREDENTIAL_KEYS}
NETWORK_RETRIES = 3


class _TaskSettings:
    """How the pipeline's tasks run: image, credentials, GPU placement, retries, caching.

    Made inside the pipeline function from its parameters; each task then says only what kind it is:
    `cpu(task, network=..., per_run=..., reads_data=...)` or `gpu(task, reads_data=True)`.
    """

    def __init__(self, image, engine_image, secret, gpus, node_selector, tolerations, *, cache_pvc,
                 network_retries, gpu_placement, code_version):
        self.image, self.engine_image, self.secret = image, engine_image, secret
        self.gpus, self.node_selector, self.tolerations = gpus, node_selector, tolerations
        self.cache_pvc, self.network_retries, self.gpu_placement = cache_pvc, network_retries, gpu_placement
        self.code_version = code_version

    def cpu(self, task: dsl.PipelineTask, *, network: bool = False, per_run: bool = False,
            reads_data: bool = False, engine: bool = False) -> dsl.PipelineTask:
        """network: talks to S3 / MLflow, so retried; per_run: its result belongs to this run (MLflow ids,
        a URI's current content), so never served from cache; reads_data: gets the dataset cache PVC;
        engine: runs on the engine image (TensorRT) instead of the training image."""
        task.set_container_image(self.engine_image if engine else self.image)
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

    def gpu(self, task: dsl.PipelineTask, reads_data: bool = True, engine: bool = False) -> dsl.PipelineTask:
        self.cpu(task, reads_data=reads_data, engine=engine)
        if self.gpu_placement:
            task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(self.gpus)
            kubernetes.add_node_selector_json(task, node_selector_json=self.node_selector)
            kubernetes.add_toleration_json(task, toleration_json=self.tolerations)
        return task

    def logged(self, stage_output, parent_run_id, display_name: str) -> dsl.PipelineTask:
        """A log-stage task: the stage's tracking record becomes a nested MLflow run of this pipeline run."""
        task = log_stage(parent_run_id=parent_run_id, stage_output=stage_output).set_display_name(display_name)
        return self.cpu(task, network=True, per_run=True)


def build_pipeline(cache_pvc: "str | None" = None, network_retries: int = NETWORK_RETRIES,
                   gpu_placement: bool = True, code_version: str = "", mpijob: bool = False):
    """The pipeline function. Compile-time options:
    cache_pvc: mount this existing PVC as the dataset cache of every stage that reads data (a mount cannot be
        made optional at run time);
    network_retries: retries of the stages that talk to S3 / MLflow (the local run uses 0: a failure there
        is reported at once, and MLflow calls retry on their own);
    gpu_placement: GPU requests, node selector and tolerations on the GPU stages. The local run turns it off:
        kfp.local ignores them anyway, and kfp 2.17's local runner cannot resolve a pipeline parameter used
        in them inside the exit handler;
    code_version: set as QATPIPE_CODE_VERSION in every task, so that a cache keyed on the task's environment
        (kfp.local's) misses when the library changes. On a cluster the image tag plays that part;
    mpijob: train and retrain always run as MPIJobs of `workers` x `gpus` processes, and their own tasks, which
        only follow the job, request no GPU (else a task with workers > 1 holds `gpus` GPUs while its job runs,
        a request KFP cannot make depend on a run-time parameter). Needs cache_pvc.
    """

    @dsl.pipeline(
        name=PIPELINE_NAME,
        description="FP32 training to a validated INT8 TensorRT detector, TAO-style (train → prune → QAT), "
                    "tracked in MLflow",
    )
    def qat_pipeline(
        spec_uri: str = "default",
        spec_overrides: List[str] = [],
        run_name: str = "",
        gpus: int = 1,
        workers: int = 1,
        mpijob_api_version: str = "v2beta1",
        training_image: str = TRAINING_IMAGE,
        engine_image: str = ENGINE_IMAGE,
        node_selector: dict = {},
        tolerations: list = [],
        credentials_secret: str = "qatpipe-credentials",
        kfp_ui_url: str = "",
    ):
        """
        spec_uri: bundled spec name (default, tiny), a path inside the image, or s3://bucket/key.
        spec_overrides: KEY=VALUE spec overrides, e.g. ["train.epochs=20"].
        run_name: name of the MLflow parent run (default "qatpipe").
        gpus: GPUs per training / engine stage (nvidia.com/gpu); train and retrain run one Horovod process
            per GPU.
        workers: nodes for train and retrain: above 1, each runs as an MPIJob of `workers` x `gpus` Horovod
            processes (needs the mpi-operator, and the pipeline compiled with --cache-pvc for a shared volume).
        mpijob_api_version: v2beta1 (mpi-operator) or v1 (Kubeflow Training Operator).
        training_image: the image of every stage but build-engine and validate (images/build.sh).
        engine_image: the image of build-engine and validate: TensorRT (images/build.sh).
        node_selector: node labels for GPU stages, e.g. {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}.
        tolerations: Kubernetes tolerations for GPU stages, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists",
            "effect": "NoSchedule"}].
        credentials_secret: Kubernetes Secret with the S3 / MLflow credentials (keys: SECRET_KEYS_TO_ENV).
        kfp_ui_url: the KFP UI's address (`qatpipe submit` sets it): MLflow runs and model versions then link
            to this run's page.
        """
        run = _TaskSettings(training_image, engine_image, credentials_secret, gpus, node_selector, tolerations,
                            cache_pvc=cache_pvc, network_retries=network_retries, gpu_placement=gpu_placement,
                            code_version=code_version)

        # an exit task may not depend on other tasks: it finds the MLflow run by the KFP run id
        finish = run.cpu(finish_tracking(kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER), per_run=True)

        with dsl.ExitHandler(finish, name="stages"):
            specs = run.cpu(resolve_spec(spec_uri=spec_uri, overrides=spec_overrides), network=True,
                            per_run=True)  # per run: the URI's content may change
            tracking = run.cpu(start_tracking(spec=specs.outputs["spec"], run_name=run_name,
                                              kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, kfp_ui_url=kfp_ui_url),
                               network=True, per_run=True)
            parent_run_id = tracking.outputs["Output"]

            data = run.cpu(prepare_data(data_spec=specs.outputs["data_spec"]), network=True, reads_data=True)
            run.logged(data.outputs["dataset"], parent_run_id, "log-prepare-data")

            scale_out = dict(gpus=gpus, workers=workers, mpijob_api_version=mpijob_api_version,
                             training_image=training_image, credentials_secret=credentials_secret,
                             node_selector=node_selector, tolerations=tolerations, mpijob=mpijob)

            def training_task(task: dsl.PipelineTask) -> dsl.PipelineTask:
                # the KFP run id from the pod's labels, not a task input (that would defeat the cache): the
                # task finds the MLflow run with it and logs its curves there while it trains
                for env, label in zip(KFP_RUN_ID_ENVS, ("pipeline/runid", "pipelines.kubeflow.org/run_id")):
                    kubernetes.use_field_path_as_env(task, env, f"metadata.labels['{label}']")
                # an MPIJob does the training: the task that follows it needs no GPU
                return run.cpu(task, reads_data=True) if mpijob else run.gpu(task)

            trained = training_task(train(train_spec=specs.outputs["train_spec"], dataset=data.outputs["dataset"],
                                          **scale_out))
            run.logged(trained.outputs["model"], parent_run_id, "log-train")

            def evaluated(name: str, model) -> dsl.PipelineTask:
                task = run.gpu(evaluate(evaluate_spec=specs.outputs["evaluate_spec"], variant=name,
                                        dataset=data.outputs["dataset"], model=model))
                task.set_display_name(f"evaluate-{name}")
                run.logged(task.outputs["results"], parent_run_id, f"log-evaluate-{name}")
                return task

            def exported(name: str, model) -> dsl.PipelineTask:
                task = run.cpu(export(export_spec=specs.outputs["export_spec"], variant=name, model=model))
                task.set_display_name(f"export-{name}")
                run.logged(task.outputs["onnx_model"], parent_run_id, f"log-export-{name}")
                return task

            unpruned_eval = evaluated("unpruned", trained.outputs["model"])

            pruned = run.cpu(prune(prune_spec=specs.outputs["prune_spec"], model=trained.outputs["model"]))
            run.logged(pruned.outputs["pruned"], parent_run_id, "log-prune")

            retrained = {}
            for name, qat, view in (("fp32", False, "retrain_spec"), ("qat", True, "retrain_qat_spec")):
                task = training_task(retrain(retrain_spec=specs.outputs[view], qat=qat,
                                             dataset=data.outputs["dataset"], pruned=pruned.outputs["pruned"],
                                             **scale_out))
                task.set_display_name(f"retrain-{name}")
                run.logged(task.outputs["model"], parent_run_id, f"log-retrain-{name}")
                retrained[name] = task

            fp32_onnx = exported("fp32", retrained["fp32"].outputs["model"])
            qat_onnx = exported("qat", retrained["qat"].outputs["model"])
            calibrated = run.cpu(ptq(ptq_spec=specs.outputs["ptq_spec"], dataset=data.outputs["dataset"],
                                     fp32_onnx=fp32_onnx.outputs["onnx_model"]), reads_data=True)
            run.logged(calibrated.outputs["int8_onnx"], parent_run_id, "log-ptq")

            onnx_models = {"fp32": fp32_onnx.outputs["onnx_model"], "ptq": calibrated.outputs["int8_onnx"],
                           "qat": qat_onnx.outputs["onnx_model"]}
            evaluations = {name: evaluated(name, model) for name, model in onnx_models.items()}

            # deployment: an engine per variant, validated by running it against the FP32 baseline
            engines, validations = {}, {}
            for name, model in onnx_models.items():
                built = run.gpu(build_engine(engine_spec=specs.outputs["engine_spec"], variant=name,
                                             onnx_model=model), reads_data=False, engine=True)
                built.set_display_name(f"build-engine-{name}")
                run.logged(built.outputs["engine"], parent_run_id, f"log-build-engine-{name}")
                checked = run.gpu(validate(validate_spec=specs.outputs["validate_spec"], variant=name,
                                           dataset=data.outputs["dataset"], engine=built.outputs["engine"],
                                           onnx_model=model, baseline=evaluations["fp32"].outputs["results"]),
                              engine=True)
                checked.set_display_name(f"validate-{name}")
                run.logged(checked.outputs["results"], parent_run_id, f"log-validate-{name}")
                engines[name], validations[name] = built, checked

            run.cpu(compare(parent_run_id=parent_run_id, fp32=validations["fp32"].outputs["results"],
                            ptq=validations["ptq"].outputs["results"], qat=validations["qat"].outputs["results"],
                            unpruned=unpruned_eval.outputs["results"], pruned=pruned.outputs["pruned"]),
                    network=True, per_run=True)

            # every variant as an MLflow model; the QAT one registered, as champion only when it passed the gate
            run.cpu(register(parent_run_id=parent_run_id, spec=specs.outputs["spec"],
                             kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, kfp_ui_url=kfp_ui_url,
                             dataset=data.outputs["dataset"], fp32_onnx=onnx_models["fp32"],
                             ptq_onnx=onnx_models["ptq"], qat_onnx=onnx_models["qat"],
                             qat_engine=engines["qat"].outputs["engine"],
                             **{f"{name}_validation": validations[name].outputs["results"]
                                for name in ("fp32", "ptq", "qat")}), network=True, per_run=True)

    return qat_pipeline


qat_pipeline = build_pipeline()
