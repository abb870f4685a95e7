"""The pipeline's stages, one row each: its component, what feeds each input, where it runs, what it logs.

qat_pipeline.py makes a task per row, in this order, and one log-stages task at the end whose inputs are the
`logs` outputs of the rows that log (it logs the records of those served from KFP's cache); the compile and
local-run tests take the stage names and kinds from here. Adding a stage is its component folder under
components/qatpipe_kfp/ and its row here (and, when it reads a spec view no stage has yet, that view's row in
qatpipe.spec.STAGE_SECTIONS, which resolve-spec's outputs follow); then `make compile` rewrites the YAML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kfp import dsl

from qatpipe_kfp.build_engine.component import build_engine
from qatpipe_kfp.compare.component import compare
from qatpipe_kfp.evaluate.component import evaluate
from qatpipe_kfp.export.component import export
from qatpipe_kfp.fingerprint_data.component import fingerprint_data
from qatpipe_kfp.prepare_data.component import prepare_data
from qatpipe_kfp.pretrain.component import pretrain
from qatpipe_kfp.prune.component import prune
from qatpipe_kfp.ptq.component import ptq
from qatpipe_kfp.ptq_partial.component import ptq_partial
from qatpipe_kfp.register.component import register
from qatpipe_kfp.retrain.component import retrain
from qatpipe_kfp.sensitivity.component import sensitivity
from qatpipe_kfp.train.component import train
from qatpipe_kfp.validate.component import validate


@dataclass(frozen=True)
class From:
    """An input fed by an earlier task's output (a stage row's name, or resolve-spec / start-tracking)."""
    task: str
    output: str = "Output"


@dataclass(frozen=True)
class Param:
    """An input fed by a pipeline parameter."""
    name: str


@dataclass(frozen=True)
class Stage:
    """One task of the DAG. `inputs` maps the component's inputs to a From, a Param or a constant; its spec
    input (the one named `<view>_spec`) is fed resolve-spec's output of `view` (default: that input's prefix)."""
    name: str  # the task's display name (and KFP's MLflow plugin's run name of the task)
    component: Any
    inputs: dict[str, Any] = field(default_factory=dict)
    runs: Literal["training", "gpu", "cpu", "light"] = "cpu"  # training: + the scale-out inputs, Horovod/MPIJob
    view: str | None = None
    engine: bool = False  # on the engine image (TensorRT)
    reads_data: bool = False  # mounts the dataset cache PVC
    network: bool = False  # talks to S3 / MLflow: retried
    per_run: bool = False  # its result belongs to this run: never served from the cache
    # the output that holds its tracking record: the component passes it to runtime.stage(name, record=...), which
    # logs it when the stage ends; log-stages gets it as its input <name> (ptq-partial -> ptq_partial)
    logs: str | None = None
    after: tuple[str, ...] = ()  # tasks it waits for without reading them

    @property
    def spec_input(self) -> str | None:
        names = [name for name in self.component.component_spec.inputs if name.endswith("_spec")]
        return names[0] if names else None


VARIANTS = ("fp32", "ptq", "ptq-partial", "qat")
DATASET = From("prepare-data", "dataset")
PARENT_RUN = From("start-tracking")
ONNX = {"fp32": From("export-fp32", "onnx_model"), "ptq": From("ptq", "int8_onnx"),
        "ptq-partial": From("ptq-partial", "onnx_model"), "qat": From("export-qat", "onnx_model")}
VALIDATED = {variant: From(f"validate-{variant}", "results") for variant in VARIANTS}
# a variant that may be another's very model (ptq-partial keeping no layer float is PTQ): its engine and validation
# take that variant's where the bytes match, instead of building, measuring and scoring the same model again
SAME_AS = {"ptq-partial": "ptq"}


def arg(variant: str) -> str:
    """A variant's name as a component input's (a Python identifier): ptq-partial -> ptq_partial."""
    return variant.replace("-", "_")


TRAINING = dict(runs="training", reads_data=True, logs="model", after=("start-tracking",))  # live curves: MLflow run

STAGES: tuple[Stage, ...] = (
    # the data as it is now (S3 listing, files' digests) keys prepare-data's cache, beside the spec
    Stage("fingerprint-data", fingerprint_data, runs="light", network=True, per_run=True, reads_data=True),
    Stage("prepare-data", prepare_data, {"data_fingerprint": From("fingerprint-data")}, network=True,
          reads_data=True, logs="dataset"),
    # the backbone as a classifier of the data's crops, when model.pretrained is pipeline:pretrain (else skipped)
    Stage("pretrain", pretrain, {"dataset": DATASET}, runs="gpu", reads_data=True, logs="weights"),
    Stage("train", train, {"dataset": DATASET, "pretrained": From("pretrain", "weights")}, **TRAINING),
    # a Keras model runs on TensorFlow's GPU; the ONNX ones below on ONNX Runtime's CPU build
    Stage("evaluate-unpruned", evaluate, {"variant": "unpruned", "dataset": DATASET, "model": From("train", "model")},
          runs="gpu", reads_data=True, logs="results"),
    Stage("prune", prune, {"model": From("train", "model")}, logs="pruned"),
    # TAO's recipe: the pruned model retrained in FP32; then, as qat.start says at run time (stages/retrain_plan.py),
    # the FP32 baseline (that model handed on, or fine-tuned) and QAT: a retrain of the pruned model, a fine-tuning
    # of the FP32 retrain's model, or a short one of the baseline. KFP's DAG is fixed, so all orders share this shape.
    Stage("retrain-fp32", retrain, {"qat": False, "dataset": DATASET, "pruned": From("prune", "pruned")},
          **TRAINING),
    Stage("finetune-fp32", retrain, {"qat": False, "dataset": DATASET, "pruned": From("prune", "pruned"),
                                     "start": From("retrain-fp32", "model")}, view="finetune_fp32", **TRAINING),
    # it also waits for the FP32 baseline, which it fine-tunes under qat.start baseline
    Stage("retrain-qat", retrain, {"qat": True, "dataset": DATASET, "pruned": From("prune", "pruned"),
                                   "start": From("retrain-fp32", "model"), "baseline": From("finetune-fp32", "model")},
          view="retrain_qat", **TRAINING),
    *(Stage(f"export-{variant}", export, {"variant": variant, "dataset": DATASET, "model": From(source, "model")},
            reads_data=True, logs="onnx_model") for variant, source in (("fp32", "finetune-fp32"),
                                                                        ("qat", "retrain-qat"))),
    Stage("ptq", ptq, {"dataset": DATASET, "fp32_onnx": ONNX["fp32"]}, reads_data=True, logs="int8_onnx"),
    # which layers of the INT8 models cost their accuracy (ONNX Runtime's CPU build, a val sample); PTQ's ranking
    # picks the layers ptq-partial keeps float until it is within validate.max_map_drop of FP32
    Stage("sensitivity", sensitivity, {"dataset": DATASET, "fp32_onnx": ONNX["fp32"], "ptq_onnx": ONNX["ptq"],
                                       "qat_onnx": ONNX["qat"]}, reads_data=True, logs="results"),
    Stage("ptq-partial", ptq_partial, {"dataset": DATASET, "fp32_onnx": ONNX["fp32"], "ptq_onnx": ONNX["ptq"],
                                       "sensitivity": From("sensitivity", "results")},
          reads_data=True, logs="onnx_model"),
    # the FP32 ONNX's mAP: the baseline every variant's engine is validated against. The INT8 models are scored
    # once, by their validation (the engine, and TensorRT's numbers where the engine computes others): an ONNX
    # evaluation of each scored the same model on the same images a second time
    Stage("evaluate-fp32", evaluate, {"variant": "fp32", "dataset": DATASET, "model": ONNX["fp32"]},
          reads_data=True, logs="results"),
    # per variant: its engine, then that engine validated against the FP32 evaluation
    *(row for variant in VARIANTS for row in (
        Stage(f"build-engine-{variant}", build_engine, {
            "variant": variant, "onnx_model": ONNX[variant], "gpu_type": Param("gpu_type"),
            **({"same_as": From(f"build-engine-{SAME_AS[variant]}", "engine")} if variant in SAME_AS else {})},
              runs="gpu", engine=True, logs="engine"),
        Stage(f"validate-{variant}", validate, {
            "variant": variant, "dataset": DATASET, "engine": From(f"build-engine-{variant}", "engine"),
            "onnx_model": ONNX[variant], "baseline": From("evaluate-fp32", "results"),
            **({"same_as": VALIDATED[SAME_AS[variant]]} if variant in SAME_AS else {})},
              runs="gpu", engine=True, reads_data=True, logs="results"))),
    Stage("compare", compare, {"parent_run_id": PARENT_RUN, **{arg(v): VALIDATED[v] for v in VARIANTS},
                               "unpruned": From("evaluate-unpruned", "results"), "pruned": From("prune", "pruned")},
          network=True, per_run=True),
    # every variant as an MLflow model; the QAT one registered, as champion only when it passed the gate; only
    # after compare succeeded, so a run that could not compare its variants registers nothing
    Stage("register", register, {"parent_run_id": PARENT_RUN, "spec": From("resolve-spec", "spec"),
                                 "kfp_run_id": dsl.PIPELINE_JOB_ID_PLACEHOLDER, "kfp_ui_url": Param("kfp_ui_url"),
                                 "dataset": DATASET, **{f"{arg(v)}_onnx": ONNX[v] for v in VARIANTS},
                                 "qat_engine": From("build-engine-qat", "engine"),
                                 **{f"{arg(v)}_validation": VALIDATED[v] for v in VARIANTS}},
          network=True, per_run=True, after=("compare",)),
)


def stage_names(*, runs: tuple[str, ...] = ("training", "gpu", "cpu", "light"), logged: bool | None = None
                ) -> set[str]:
    """The rows' names, by where they run and whether they log a tracking record (the tests' lists)."""
    return {row.name for row in STAGES if row.runs in runs and (logged is None or bool(row.logs) == logged)}
