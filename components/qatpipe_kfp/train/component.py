"""train: train the unpruned detector (TAO `train`) on the prepared data set; one Horovod process per GPU,
and with `workers` > 1 an MPIJob or TrainJob across
nodes."""

from typing import Optional

from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def train(train_spec: str, dataset: Input[Dataset], model: Output[Model], metrics: Output[Metrics],
          tensorboard: Output[Artifact],
          gpus: int = 1, workers: int = 1, mpijob_api_version: str = "v2beta1", launcher: str = "mpijob",
          training_image: str = "", credentials_secret: str = "", node_selector: dict = {}, tolerations: list = [],
          mpijob: bool = False, checkpoint_uri: str = "", pretrained: Optional[Input[Model]] = None):
    """Train the unpruned detector on the prepared data set (TAO `train`).

    One Horovod process per GPU; with `workers` > 1, or `mpijob`, an MPIJob (or TrainJob) across nodes.

    Args:
        train_spec: The spec's train view (sections dataset, model, augmentation, train, evaluate), as YAML; its
            data paths are replaced by the prepared data set's.
        dataset: The prepared data set (prepare-data's `dataset`).
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
        pretrained: The pretrain stage's folder: where model.pretrained is pipeline:pretrain, the backbone starts
            from its weights.keras (otherwise model.pretrained is read as it is).

    Returns:
        model: The training results folder: model.keras, the training log and summary, and tracking.json; its
            metadata holds the framework, file, parameter count and number of processes.
        metrics: The training summary's figures: throughput, time, size, final losses, the kept and best epochs,
            the best val mAP@0.5 and the learning check's figures.
        tensorboard: The TensorBoard event files of the training (a Kubeflow Tensorboard can read its URI); kept
            out of the Model artifact, which every later stage downloads.
    """
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.errors import SpecError
    from qatpipe.spec import PIPELINE_PRETRAINED
    from qatpipe.stages.scale_out import run_training_stage
    from qatpipe.tracking.live import parent_run_from_kfp
    from qatpipe.stages.train import summary_metrics
    from qatpipe_kfp.runtime import (cluster_settings, load_stage_spec, stage, training_resume_uri,
                                     training_work_root, write_metrics)

    with stage("train", record=model):
        spec = spec_with_prepared_dataset(load_stage_spec(train_spec), dataset.path)
        if spec.model.pretrained == PIPELINE_PRETRAINED:
            if pretrained is None:
                raise SpecError(f"model.pretrained is {PIPELINE_PRETRAINED}, and this train task was given no "
                                "pretrain stage's weights (its `pretrained` input)")
            spec.model.pretrained = str(Path(pretrained.path) / pretrained.metadata.get("file", "weights.keras"))
        parent_run_from_kfp()  # live training curves in MLflow (tracking/live.py)
        cluster = cluster_settings(training_image, credentials_secret, node_selector, tolerations,
                                   mpijob_api_version, launcher)
        summary = run_training_stage("train", spec, model.path, processes_per_node=gpus, nodes=workers,
                                     cluster=cluster, use_mpijob=mpijob, work_root=training_work_root(),
                                     tensorboard_dir=tensorboard.path,
                                     resume_uri=training_resume_uri(checkpoint_uri))
        model.metadata.update({"framework": "tf_keras", "file": "model.keras", "params": summary["params"],
                               "processes": summary.get("processes", 1)})
        write_metrics(metrics, summary_metrics(summary))
