"""pretrain: the backbone trained as a classifier of object and background crops (qatpipe pretrain), whose weights
train starts from when the spec's model.pretrained is pipeline:pretrain; otherwise it records that it was skipped."""

from kfp.dsl import Dataset, Input, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def pretrain(pretrain_spec: str, dataset: Input[Dataset], weights: Output[Model], metrics: Output[Metrics]):
    """Pretrain the detector's backbone as a classifier of the data's object crops, when the spec asks for it.

    The classes are the data set's, plus background crops. Runs only when the spec's model.pretrained is `pipeline:pretrain`: train then starts from these weights. Any
    other value (none, a file, keras:imagenet) skips it in a second, and train reads model.pretrained itself.

    Args:
        pretrain_spec: The spec's pretrain view (sections dataset, model, pretrain), as YAML; its data paths are
            replaced by the prepared data set's, whose train split it crops when pretrain.data is empty.
        dataset: The prepared data set (prepare-data's `dataset`).

    Returns:
        weights: Folder with weights.keras (the classifier; train loads its backbone layers by name),
            classes.json, pretrain_summary.json, the epoch log and tracking.json; its metadata holds the file and
            the held-back top-1, or `skipped`.
        metrics: Held-back top-1 (overall and per class), chance and majority-class levels, crop counts, speed.
    """
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.spec import PIPELINE_PRETRAINED
    from qatpipe.stages.pretrain import STAGE, WEIGHTS_FILE, pretrain as pretrain_stage, summary_metrics
    from qatpipe.tracking.records import StageRecord
    from qatpipe_kfp.runtime import load_stage_spec, log, stage, write_metrics

    with stage(STAGE, record=weights):
        spec = load_stage_spec(pretrain_spec)
        if spec.model.pretrained != PIPELINE_PRETRAINED:
            reason = f"model.pretrained is {spec.model.pretrained or 'not set'}, not {PIPELINE_PRETRAINED}"
            log.info("pretrain skipped: %s", reason)
            Path(weights.path).mkdir(parents=True, exist_ok=True)
            StageRecord(stage=STAGE, params={"skipped": reason}, tags={"qatpipe.skipped": "true"}).write(weights.path)
            weights.metadata["skipped"] = True
            write_metrics(metrics, {})
            return
        summary = pretrain_stage(spec_with_prepared_dataset(spec, dataset.path), weights.path)
        weights.metadata.update({"framework": "tf_keras", "file": WEIGHTS_FILE, "top1": summary["top1"],
                                 "backbone": summary["backbone"]})
        write_metrics(metrics, summary_metrics(summary))
