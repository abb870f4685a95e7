"""retrain: fine-tune the pruned detector, in FP32 or quantization-aware (`qat`), like TAO's retrain, or (given
`start`, the FP32 retrain's model) the retrains after it that `qat.start` asks for; one Horovod process per GPU,
and with `workers` > 1 an MPIJob or TrainJob across nodes."""

from typing import Optional

from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def retrain(retrain_spec: str, qat: bool, dataset: Input[Dataset], pruned: Input[Model], model: Output[Model],
            metrics: Output[Metrics], tensorboard: Output[Artifact], gpus: int = 1, workers: int = 1,
            mpijob_api_version: str = "v2beta1", launcher: str = "mpijob", training_image: str = "",
            credentials_secret: str = "", node_selector: dict = {}, tolerations: list = [], mpijob: bool = False,
            checkpoint_uri: str = "", start: Optional[Input[Model]] = None, baseline: Optional[Input[Model]] = None):
    """Fine-tune the pruned detector in FP32 or quantization-aware (QAT), like TAO's retrain.

    One Horovod process per GPU; with `workers` > 1, or `mpijob`, an MPIJob (or TrainJob) across nodes.

    Args:
        retrain_spec: The spec's retrain view, as YAML: without the qat section for the FP32 task, with it for
            the QAT task and its FP32 control; under qat.excluded_layers auto the QAT task's also has the export,
            ptq, sensitivity and validate sections, which its search for the layers to keep float reads. Its data
            paths are replaced by the prepared data set's.
        qat: Retrain quantization-aware (sets qat.enabled) instead of in FP32; also names the variant, qat or fp32.
        dataset: The prepared data set (prepare-data's `dataset`).
        pruned: The pruned model folder (prune's `pruned`); the file is its `file` metadata (default model.keras).
        gpus: Horovod processes per node, one per GPU.
        workers: Nodes; above 1 the training runs as an MPIJob.
        mpijob_api_version: The MPIJob API version: v2beta1 (mpi-operator) or v1 (Kubeflow Training Operator).
        launcher: How a multi-node training runs: mpijob (an MPIJob) or trainjob (a Kubeflow Trainer v2 TrainJob
            on a TrainingRuntime of its own).
        training_image: The image of the MPIJob's launcher and workers. Empty: the project's training image.
        credentials_secret: The Secret whose credentials the MPIJob's containers get. Empty: none.
        node_selector: Node labels for the MPIJob's pods.
        tolerations: Kubernetes tolerations for the MPIJob's pods.
        mpijob: Run as an MPIJob even on one node; this task then only follows the job.
        checkpoint_uri: s3://bucket/prefix where the resume state is mirrored after every checkpoint when the
            pipeline has no cache volume (under the KFP run id), so that a retried task resumes. Empty: none.
        start: The FP32 retrain's model, for the retrains after it (qatpipe.stages.retrain_plan.plan_retrain). Under
            qat.start fp32 the QAT task fine-tunes it for qat.finetune_epochs under qat.finetune_learning_rate, and
            the FP32 task (the baseline, finetune-fp32) fine-tunes it as long in FP32. Under qat.start pruned the
            QAT task retrains the pruned model and the FP32 task hands `start` on unchanged. Under qat.start
            baseline the FP32 task fine-tunes it as under fp32, and the QAT task fine-tunes `baseline` instead.
            Absent: a retrain of the pruned model.
        baseline: The FP32 baseline's model (finetune-fp32's), for the QAT task: under qat.start baseline QAT
            fine-tunes it for qat.epochs under qat.learning_rate; unused under the other starts.

    Returns:
        model: Folder with model.keras, the training log and tracking.json (QAT: also qat_ranges.json; under
            qat.excluded_layers auto, qat_auto/ with the layers found and the search's reports); its
            metadata holds the framework, file, parameter count, variant and number of processes.
        metrics: The training summary's figures: throughput, time, size, final losses, the kept and best epochs,
            the best val mAP@0.5 and the learning check's figures.
        tensorboard: The TensorBoard event files of the retraining (a Kubeflow Tensorboard can read its URI);
            kept out of the Model artifact, which every later stage downloads.
    """
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.stages.retrain import hand_on
    from qatpipe.stages.retrain_plan import plan_retrain
    from qatpipe.stages.scale_out import run_training_stage
    from qatpipe.tracking.live import parent_run_from_kfp
    from qatpipe.stages.train import summary_metrics
    from qatpipe_kfp.runtime import (cluster_settings, load_stage_spec, stage, training_resume_uri,
                                     training_work_root, write_metrics)

    variant = "qat" if qat else "fp32"
    with stage("finetune-fp32" if start is not None and not qat else f"retrain-{variant}", record=model):
        spec = spec_with_prepared_dataset(load_stage_spec(retrain_spec), dataset.path)
        parent_run_from_kfp()  # live training curves in MLflow (tracking/live.py)
        spec.qat.enabled = qat
        plan = plan_retrain(spec, qat, Path(pruned.path) / pruned.metadata.get("file", "model.keras"),
                            *(None if given is None else Path(given.path) / given.metadata.get("file", "model.keras")
                              for given in (start, baseline)))
        if plan.hands_on:
            summary = hand_on(start.path, model.path)
            # no training, no event files: the folder is still made, since kfp.local treats a cached output
            # whose folder is missing as a cache miss, and would run this stage and all after it again
            Path(tensorboard.path).mkdir(parents=True, exist_ok=True)
        else:
            spec = plan.applied(spec)
            cluster = cluster_settings(training_image, credentials_secret, node_selector, tolerations,
                                       mpijob_api_version, launcher)
            summary = run_training_stage("retrain", spec, model.path, pruned_model=plan.source, processes_per_node=gpus,
                                         nodes=workers, cluster=cluster, use_mpijob=mpijob,
                                         work_root=training_work_root(), tensorboard_dir=tensorboard.path,
                                         stage_name=plan.stage_name, resume_uri=training_resume_uri(checkpoint_uri))
        model.metadata.update({"framework": "tf_keras", "file": "model.keras", "params": summary["params"],
                               "variant": variant, "processes": summary.get("processes", 1)})
        write_metrics(metrics, summary_metrics(summary))
