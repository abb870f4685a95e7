"""Each component as KFP ships it: only the function's source runs, in a fresh process (kfp.local).

The folder tests call the Python functions in-process, where a body could lean on a module-level name by
mistake and still pass; here such a body fails. train and evaluate run this way in test_local_pipeline.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from kfp import dsl, local
from mlflow import MlflowClient

from conftest import SMALL_IMAGES
from qatpipe_kfp.compare.component import compare
from qatpipe_kfp.fingerprint_data.component import fingerprint_data
from qatpipe_kfp.finish_tracking.component import finish_tracking
from qatpipe_kfp.log_stages.component import log_stages_component
from qatpipe_kfp.prepare_data.component import prepare_data
from qatpipe_kfp.resolve_spec.component import resolve_spec
from qatpipe_kfp.start_tracking.component import start_tracking


@pytest.fixture
def evaluation_dir(tmp_path):
    folder = tmp_path / "evaluation"
    folder.mkdir()
    (folder / "metrics.json").write_text(json.dumps({"map50": 0.8, "map": 0.5, "model_size_mb": 1.0}))
    pruned = tmp_path / "pruned"
    pruned.mkdir()
    (pruned / "prune_report.json").write_text(json.dumps({
        "params_before": 100, "params_after": 40, "flops_before": 10**9, "flops_after": 4 * 10**8,
        "flops_ratio": 0.4, "params_ratio": 0.4}))
    return folder


def test_light_components_run_from_their_shipped_source(tmp_path, monkeypatch, evaluation_dir):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)  # the SQLite store's artifacts land in ./mlruns

    @dsl.pipeline
    def light_stages():
        finish = finish_tracking(kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER).set_caching_options(False)
        with dsl.ExitHandler(finish):
            specs = resolve_spec(spec_uri="tiny", overrides=["dataset.synthetic.train_images=6",
                                                             "dataset.synthetic.val_images=3"])
            parent = start_tracking(spec=specs.outputs["spec"], run_name="shipped",
                                    kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER).outputs["Output"]
            fingerprint = fingerprint_data(data_spec=specs.outputs["data_spec"])
            data = prepare_data(data_spec=specs.outputs["data_spec"], data_fingerprint=fingerprint.output)
            # prepare-data finds no pipeline run at its end (no KFP run id, no local run's folder): log-stages logs it
            log_stages_component({"prepare-data": "dataset"})(parent_run_id=parent, prepare_data=data.outputs["dataset"])
            evaluation = dsl.importer(artifact_uri=str(evaluation_dir), artifact_class=dsl.Artifact).output
            pruned = dsl.importer(artifact_uri=str(evaluation_dir.parent / "pruned"), artifact_class=dsl.Model)
            compare(parent_run_id=parent, fp32=evaluation, ptq=evaluation, ptq_partial=evaluation, qat=evaluation,
                    unpruned=evaluation, pruned=pruned.output)

    local.init(local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
    light_stages()

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("qatpipe").experiment_id],
                                "attributes.run_name = 'shipped'")
    assert run.info.status == "FINISHED"
    assert run.data.metrics["variant.fp32.map50"] == 0.8
    assert run.data.metrics["pruning.flops_ratio"] == 0.4
    (child,) = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
    assert child.info.run_name == "prepare_data" and child.data.metrics["train.images"] == 6
    assert re.fullmatch("[0-9a-f]{16}", child.data.tags["qatpipe.record"])  # the record's digest
    # the synthetic data set's splits are the pipeline run's dataset inputs
    assert {i.dataset.name for i in client.get_run(run.info.run_id).inputs.dataset_inputs} == {
        "synthetic/train", "synthetic/val"}


@pytest.mark.timeout(900)
def test_train_starts_from_the_runs_own_pretrain_stage(tmp_path, monkeypatch):
    """model.pretrained: pipeline:pretrain through kfp.local, as the pipeline wires it: the pretrain stage trains
    the backbone on the prepared set's crops, and train loads its weights.keras (its report says what loaded)."""
    from qatpipe_kfp.pretrain.component import pretrain
    from qatpipe_kfp.train.component import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    overrides = ["dataset.synthetic.train_images=24", "dataset.synthetic.val_images=4", *SMALL_IMAGES, "train.epochs=1",
                 "train.validation_interval=0", "model.pretrained=pipeline:pretrain", "pretrain.epochs=1"]

    @dsl.pipeline
    def pretrained_start():
        specs = resolve_spec(spec_uri="tiny", overrides=overrides)
        data = prepare_data(data_spec=specs.outputs["data_spec"])
        weights = pretrain(pretrain_spec=specs.outputs["pretrain_spec"], dataset=data.outputs["dataset"])
        train(train_spec=specs.outputs["train_spec"], dataset=data.outputs["dataset"],
              pretrained=weights.outputs["weights"])

    local.init(local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
    pretrained_start()

    (summary,) = (tmp_path / "kfp").rglob("pretrain_summary.json")
    assert json.loads(summary.read_text())["crops"] > 24  # objects and background crops of 24 images
    (report,) = (tmp_path / "kfp").rglob("pretrained_report.json")
    loaded = json.loads(report.read_text())
    assert loaded["source"].endswith("weights.keras") and summary.parent.name in loaded["source"]
    assert len(loaded["loaded"]) > 10 and loaded["random_backbone"] == [] and loaded["skipped"] == []


def test_compiled_components_describe_every_input_and_output():
    """The KFP UI shows each component input's and output's description, which KFP parses from the component's
    docstring: inputs from `Args:`, and outputs (return values and `Output[...]` artifacts alike) only from
    `Returns:`, KFP's docstring style."""
    pipeline_yaml = Path(__file__).resolve().parents[1] / "pipelines" / "qat_pipeline.yaml"
    spec = next(yaml.safe_load_all(pipeline_yaml.read_text()))  # the second document is the platform spec
    checked, missing = 0, []
    for name, component in spec["components"].items():
        # only the container components come from our functions; a DAG component (the exit handler's
        # comp-exit-handler-1) gets the pipeline's parameters as `pipelinechannel--*` inputs, and KFP 2.17 gives
        # those no description (the pipeline's own parameters, under `root`, carry them)
        if "executorLabel" not in component:
            continue
        for side in ("inputDefinitions", "outputDefinitions"):
            for kind in ("parameters", "artifacts"):
                for key, entry in component.get(side, {}).get(kind, {}).items():
                    checked += 1
                    if not str(entry.get("description", "")).strip():
                        missing.append(f"{name}: {side}.{kind}.{key}")
    assert checked > 100, checked  # 18 components, most of them used more than once
    assert not missing, ("no description; add it to the component's docstring (inputs under Args:, outputs under "
                         "Returns:): " + ", ".join(missing))


def test_every_component_folder_has_metadata_matching_its_function():
    """One folder per component with its code, README, tests and metadata.yaml (kubeflow/pipelines-components'
    layout); the metadata's name is the folder's and its description the component docstring's first line."""
    import importlib
    import inspect

    root = Path(__file__).resolve().parents[1] / "components" / "qatpipe_kfp"
    folders = sorted(f for f in root.iterdir() if (f / "component.py").is_file())
    # every folder is a component of the compiled pipeline, and every component there has its folder
    compiled = next(yaml.safe_load_all((root.parents[1] / "pipelines" / "qat_pipeline.yaml").read_text()))
    used = {re.sub(r"-\d+$", "", name.removeprefix("comp-")).replace("-", "_")
            for name, component in compiled["components"].items() if "dag" not in component}
    assert {folder.name for folder in folders} == used
    for folder in folders:
        assert {"README.md", "metadata.yaml", "test_component.py"} <= {p.name for p in folder.iterdir()}, folder.name
        metadata = yaml.safe_load((folder / "metadata.yaml").read_text())
        module = importlib.import_module(f"qatpipe_kfp.{folder.name}.component")
        # log-stages is made when the pipeline is built, its inputs from the stage table's rows
        made = getattr(module, folder.name, None) or getattr(module, f"{folder.name}_component")({"prune": "pruned"})
        function = made.python_func
        assert metadata["name"] == folder.name
        assert metadata["description"] == inspect.getdoc(function).splitlines()[0], folder.name
        assert metadata["stability"] in ("alpha", "beta", "stable") and "qatpipe" in metadata["tags"]


def test_data_parameters_replace_the_specs_data(tmp_path, monkeypatch):
    """The pipeline's train_data / val_data reach every stage's view in place of the spec's dataset.train / val,
    and win over an override of the same key; a path with YAML-looking text stays a string."""
    monkeypatch.chdir(tmp_path)
    local.init(local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
    train, val = tmp_path / "kitti: train", tmp_path / "123"
    task = resolve_spec(spec_uri="tiny", overrides=["dataset.train=/elsewhere"], train_data=str(train),
                        val_data=str(val))
    for view in ("data_spec", "train_spec", "evaluate_spec"):
        dataset = yaml.safe_load(task.outputs[view])["dataset"]
        assert (dataset["train"], dataset["val"]) == (str(train), str(val)), view
    untouched = resolve_spec(spec_uri="tiny", overrides=[])
    assert yaml.safe_load(untouched.outputs["data_spec"])["dataset"]["train"] is None
