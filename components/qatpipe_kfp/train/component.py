"""train: train the unpruned detector (TAO `train`) on the prepared data set."""

from kfp.dsl import Dataset, Input, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def train(train_spec: str, dataset: Input[Dataset], model: Output[Model], metrics: Output[Metrics]):
    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.stages.train import train as train_stage
    from qatpipe.tracking.records import numeric_leaves
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics

    with stage("train"):
        spec = spec_with_prepared_dataset(load_stage_spec(train_spec), dataset.path)
        summary = train_stage(spec, model.path)
        model.metadata.update({"framework": "tf_keras", "file": "model.keras", "params": summary["params"]})
        write_metrics(metrics, numeric_leaves({key: summary[key] for key in (
            "params", "images_per_second", "wall_seconds", "final_losses")}))
