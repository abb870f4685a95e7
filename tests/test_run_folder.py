"""qatpipe_pipelines.run_folder on a small kfp.local folder built here of real files (the stages' own records and
spec YAML), and the local run's summary read through it."""

import json
import os
import time

import pytest

from qatpipe.errors import QatpipeError
from qatpipe.spec import bundled_spec_path, load_spec, spec_to_yaml
from qatpipe.tracking.records import StageRecord
from qatpipe_pipelines.local_run import _collect_summary
from qatpipe_pipelines.run_folder import RunFolder, variant_stage

# kfp.local names a pipeline run <pipeline>-<time>; the newer run here has a name that sorts first
OLDER, NEWER = "qatpipe-2026-01-01-10-00-00-000000", "another-2026-01-01-11-00-00-000000"


def _output(root, run, task, output, stage, files=()):
    folder = root / "kfp" / run / task / output
    folder.mkdir(parents=True)
    StageRecord(stage=stage).write(folder)
    for name in files:
        (folder / name).write_text("{}")
    return folder


@pytest.fixture
def run_folder(tmp_path):
    """A run folder of two pipeline runs: the first ran every stage below, the re-run executed export-qat and
    compare again (kfp.local served the rest from its cache)."""
    root = tmp_path / "out"
    made = {
        "train": _output(root, OLDER, "train", "model", "train", ["train_summary.json"]),
        "evaluate_unpruned": _output(root, OLDER, "evaluate", "results", "evaluate_unpruned"),
        "export_fp32": _output(root, OLDER, "export", "onnx_model", "export_fp32", ["model.onnx"]),
        "old export_qat": _output(root, OLDER, "export-2", "onnx_model", "export_qat", ["model.onnx"]),
        "ptq": _output(root, OLDER, "ptq", "int8_onnx", "ptq", ["model.onnx"]),
        "build_engine_fp32": _output(root, OLDER, "build-engine", "engine", "build_engine_fp32"),
        "build_engine_ptq_partial": _output(root, OLDER, "build-engine-3", "engine", "build_engine_ptq_partial"),
        "validate_fp32": _output(root, OLDER, "validate", "results", "validate_fp32"),
        "old compare": _output(root, OLDER, "compare", "summary", "compare", ["summary.json"]),
        # the newer run's export-qat is the second export task there too: its folder name says nothing of QAT
        "export_qat": _output(root, NEWER, "export-2", "onnx_model", "export_qat", ["model.onnx"]),
        "compare": _output(root, NEWER, "compare", "summary", "compare"),
    }
    # validate's emulation writes its own record a level deeper: part of validate's output, not a stage output
    StageRecord(stage="validate_tensorrt_emulated").write(made["validate_fp32"] / "tensorrt_emulated")
    spec = load_spec(bundled_spec_path("default"), ["train.epochs=3"])
    (root / "kfp" / OLDER / "resolve-spec").mkdir()
    (root / "kfp" / OLDER / "resolve-spec" / "executor_output.json").write_text(
        json.dumps({"parameterValues": {"spec": spec_to_yaml(spec), "train_spec": "dataset: {}"}}))
    (made["compare"] / "summary.json").write_text(json.dumps({"variants": {"fp32": {"map50": 0.5}}}))
    return root, made


def test_a_stage_is_found_by_its_record_newest_pipeline_run_first(run_folder):
    root, made = run_folder
    folder = RunFolder(root)
    assert folder.stage("export_qat") == made["export_qat"]
    assert folder.stage("evaluate_fp32", "evaluate_unpruned") == made["evaluate_unpruned"]  # the first found
    assert folder.find("validate_tensorrt_emulated") is None
    assert folder.find("retrain_qat") is None
    with pytest.raises(QatpipeError, match=r"out: no finished retrain_qat or finetune_fp32 stage"):
        folder.stage("retrain_qat", "finetune_fp32")
    assert [output.stage for output in folder.outputs()].count("compare") == 2


def test_variants_name_each_models_onnx_engine_and_validation(run_folder):
    root, made = run_folder
    variants = RunFolder(root).variants()
    assert list(variants) == ["fp32", "ptq", "ptq-partial", "qat"]
    fp32 = variants["fp32"]
    assert (fp32.name, fp32.onnx, fp32.engine, fp32.validation) == (
        "fp32", made["export_fp32"] / "model.onnx", made["build_engine_fp32"], made["validate_fp32"])
    assert variants["qat"].onnx == made["export_qat"] / "model.onnx"
    assert variants["ptq-partial"].onnx is None and variants["ptq-partial"].engine == made["build_engine_ptq_partial"]
    assert variant_stage("validate", "ptq-partial") == "validate_ptq_partial"
    with pytest.raises(QatpipeError, match="no variant 'int4' \\(found: fp32, ptq, ptq-partial, qat\\)"):
        RunFolder(root).variant("int4")


def test_the_spec_is_the_one_resolve_spec_handed_on(run_folder):
    root, _ = run_folder
    spec = RunFolder(root).spec()
    assert spec.train.epochs == 3
    assert spec == load_spec(bundled_spec_path("default"), ["train.epochs=3"])


def test_a_folder_without_a_pipeline_root_or_summary_is_named(tmp_path, run_folder):
    with pytest.raises(QatpipeError, match=r"nothing: not a `qatpipe run --local` folder \(no kfp/ in it\)"):
        RunFolder(tmp_path / "nothing")
    with pytest.raises(QatpipeError, match=r"summary.json: no summary; the local run did not finish"):
        RunFolder(run_folder[0]).summary()
    (run_folder[0] / "summary.json").write_text('{"wall_seconds": 1.0}')
    assert RunFolder(run_folder[0]).summary() == {"wall_seconds": 1.0}


def test_the_local_runs_summary_is_this_runs_compare_output(run_folder):
    root, made = run_folder
    written = (made["compare"] / "summary.json").stat().st_mtime
    assert _collect_summary(root, written) == {"variants": {"fp32": {"map50": 0.5}}}
    # a compare output older than the run (a cached one, or an earlier run's) is not this run's summary
    old = time.time() - 3600
    os.utime(made["compare"] / "summary.json", (old, old))
    with pytest.raises(QatpipeError, match="the pipeline finished but wrote no compare/summary.json"):
        _collect_summary(root, written)
