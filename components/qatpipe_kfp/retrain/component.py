"""retrain: fine-tune the pruned detector, in FP32 or quantisation-aware (`qat`), like TAO's retrain."""

from kfp.dsl import Dataset, Input, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def retrain(retrain_spec: str, qat: bool, dataset: Input[Dataset], pruned: Input[Model], model: Output[Model],
            metrics: Output[Metrics]):
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.stages.retrain import retrain as retrain_stage
    from qatpipe.tracking.records import numeric_leaves
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics

    variant = "qat" if qat else "fp32"
    with stage(f"retrain-{variant}"):
        spec = spec_with_prepared_dataset(load_stage_spec(retrain_spec), dataset.path)
        spec.qat.enabled = qat
        source = Path(pruned.path) / pruned.metadata.get("file", "model.keras")
        summary = retrain_stage(spec, source, model.path)
        model.metadata.update({"framework": "tf_keras", "file": "model.keras", "params": summary["params"],
                               "variant": variant})
        write_metrics(metrics, numeric_leaves({key: summary[key] for key in (
            "params", "images_per_second", "wall_seconds", "final_losses")}))
