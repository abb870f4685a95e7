"""The qatpipe DAG: resolve spec → prepare data → train → evaluate → compare, with MLflow tracking around it.

Target shape (later stages slot in where marked): prepare data → train (unpruned) → prune →
[retrain FP32 → PTQ calibrate → build engine → validate] and [retrain QAT → export → build engine → validate]
→ compare → register (if the gate passes).

Adding a stage: a component folder under components/qatpipe_kfp/, its spec sections in
qatpipe.spec.STAGE_SECTIONS (and an output of resolve-spec), then here one call, `_on_project_image`, the
placement helper it needs (`_on_gpu`, `_with_data_access`) and `_tracked`.
"""

# no `from __future__ import annotations`: KFP reads the pipeline signature's annotations as types

from typing import List

from kfp import dsl, kubernetes

from qatpipe_kfp.compare.component import compare
from qatpipe_kfp.evaluate.component import evaluate
from qatpipe_kfp.finish_tracking.component import finish_tracking
from qatpipe_kfp.log_stage.component import log_stage
from qatpipe_kfp.prepare_data.component import prepare_data
from qatpipe_kfp.resolve_spec.component import resolve_spec
from qatpipe_kfp.settings import DEFAULT_IMAGE
from qatpipe_kfp.start_tracking.component import start_tracking
from qatpipe_kfp.train.component import train

PIPELINE_NAME = "qatpipe"
CACHE_MOUNT_PATH = "/var/cache/qatpipe"
# env var -> key in the credentials Secret (manifests/ has its template). Every key is optional: an unused
# service simply has no keys. Values never pass through pipeline parameters or logs.
SECRET_KEYS_TO_ENV = {
    "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
    "AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL",
    "MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME": "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD": "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN": "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_S3_ENDPOINT_URL": "MLFLOW_S3_ENDPOINT_URL",
}
NETWORK_RETRIES = 3


def build_pipeline(cache_pvc: "str | None" = None, network_retries: int = NETWORK_RETRIES,
                   gpu_placement: bool = True):
    """The pipeline function. Compile-time options:
    cache_pvc: mount this existing PVC as the dataset cache of every stage that reads data (a mount cannot be
        made optional at run time);
    network_retries: retries of the stages that talk to S3 / MLflow (the local run uses 0: a failure there
        is reported at once, and MLflow calls retry on their own);
    gpu_placement: GPU requests, node selector and tolerations on the GPU stages. The local run turns it off:
        kfp.local ignores them anyway, and kfp 2.17's local runner cannot resolve a pipeline parameter used
        in them inside the exit handler.
    """

    def _on_project_image(task: dsl.PipelineTask, image) -> dsl.PipelineTask:
        return task.set_container_image(image)

    def _with_credentials(task: dsl.PipelineTask, secret) -> dsl.PipelineTask:
        kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env=SECRET_KEYS_TO_ENV,
                                     optional=True)
        return task

    def _network_retries(task: dsl.PipelineTask) -> dsl.PipelineTask:
        if network_retries:
            task.set_retry(num_retries=network_retries, backoff_duration="30s", backoff_factor=2.0)
        return task

    def _with_data_access(task: dsl.PipelineTask, secret) -> dsl.PipelineTask:
        _with_credentials(task, secret)
        if cache_pvc:
            kubernetes.mount_pvc(task, pvc_name=cache_pvc, mount_path=CACHE_MOUNT_PATH)
            task.set_env_variable("QATPIPE_CACHE_DIR", CACHE_MOUNT_PATH)
        return task

    def _on_gpu(task: dsl.PipelineTask, gpus, node_selector, tolerations) -> dsl.PipelineTask:
        if not gpu_placement:
            return task
        task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(gpus)
        kubernetes.add_node_selector_json(task, node_selector_json=node_selector)
        kubernetes.add_toleration_json(task, toleration_json=tolerations)
        return task

    def _untracked_by_cache(task: dsl.PipelineTask) -> dsl.PipelineTask:
        # talks to MLflow for this run: never served from cache
        return task.set_caching_options(False)

    def _tracked(stage_output, parent_run_id, image, secret, name: str) -> dsl.PipelineTask:
        task = log_stage(parent_run_id=parent_run_id, stage_output=stage_output).set_display_name(f"log-{name}")
        _on_project_image(task, image)
        _with_credentials(task, secret)
        return _network_retries(_untracked_by_cache(task))

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
        image: str = DEFAULT_IMAGE,
        node_selector: dict = {},
        tolerations: list = [],
        credentials_secret: str = "qatpipe-credentials",
    ):
        """
        spec_uri: bundled spec name (default, tiny), a path inside the image, or s3://bucket/key.
        spec_overrides: KEY=VALUE spec overrides, e.g. ["train.epochs=20"].
        run_name: name of the MLflow parent run (default "qatpipe").
        gpus: GPUs per training / engine stage (nvidia.com/gpu).
        image: the project image every stage runs on.
        node_selector: node labels for GPU stages, e.g. {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}.
        tolerations: Kubernetes tolerations for GPU stages, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists",
            "effect": "NoSchedule"}].
        credentials_secret: Kubernetes Secret with the S3 / MLflow credentials (keys: SECRET_KEYS_TO_ENV).
        """
        specs = resolve_spec(spec_uri=spec_uri, overrides=spec_overrides)
        _with_data_access(_on_project_image(specs, image), credentials_secret)
        _network_retries(_untracked_by_cache(specs))  # the URI's content may change between runs

        tracking = start_tracking(spec=specs.outputs["spec"], run_name=run_name,
                                  kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        _network_retries(_untracked_by_cache(_with_credentials(_on_project_image(tracking, image),
                                                               credentials_secret)))
        parent_run_id = tracking.output

        finish = finish_tracking(kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        _untracked_by_cache(_with_credentials(_on_project_image(finish, image), credentials_secret))

        with dsl.ExitHandler(finish, name="stages"):
            data = prepare_data(data_spec=specs.outputs["data_spec"])
            _network_retries(_with_data_access(_on_project_image(data, image), credentials_secret))
            _tracked(data.outputs["dataset"], parent_run_id, image, credentials_secret, "prepare-data")

            trained = train(train_spec=specs.outputs["train_spec"], dataset=data.outputs["dataset"])
            _on_gpu(_with_data_access(_on_project_image(trained, image), credentials_secret), gpus,
                    node_selector, tolerations)
            _tracked(trained.outputs["model"], parent_run_id, image, credentials_secret, "train")

            # later: prune → retrain FP32 / QAT → PTQ calibrate / export → build engine → validate

            fp32_eval = evaluate(evaluate_spec=specs.outputs["evaluate_spec"], variant="fp32",
                                 dataset=data.outputs["dataset"], model=trained.outputs["model"])
            fp32_eval.set_display_name("evaluate-fp32")
            _on_gpu(_with_data_access(_on_project_image(fp32_eval, image), credentials_secret), gpus,
                    node_selector, tolerations)
            _tracked(fp32_eval.outputs["results"], parent_run_id, image, credentials_secret, "evaluate-fp32")

            comparison = compare(parent_run_id=parent_run_id, fp32=fp32_eval.outputs["results"])
            _network_retries(_untracked_by_cache(_with_credentials(_on_project_image(comparison, image),
                                                                   credentials_secret)))
            # later: register the validated model, under dsl.If(gate passed)

    return qat_pipeline


qat_pipeline = build_pipeline()
