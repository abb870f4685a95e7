"""The exit codes a script can test for (0 done, 1 the gate failed, 2 bad input, 3 an internal error) and the
checks every command makes before any work: each bad input is one line on stderr, exit 2, no traceback, and no
data set, output folder or lock left behind. The commands run as a user runs them, `python -m qatpipe.cli` in a
subprocess, from an empty working folder."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import kitti_line, write_kitti
from qatpipe.cli import main


def qatpipe(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items()
           if key not in ("TF_CPP_MIN_LOG_LEVEL", "MLFLOW_TRACKING_URI", "KFP_TOKEN")}  # qatpipe's own defaults
    env["KUBECONFIG"] = "/nonexistent"
    return subprocess.run([sys.executable, "-m", "qatpipe.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def one_line(result: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one line a refused command prints (stderr), after checking its exit code and that it is alone."""
    assert result.returncode == code, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


# each: the command line, what its one line says, and what it must not have made (`.qatpipe-cache`: the
# synthetic data set `-e default` generates, over a minute, before any stage)
BAD_INPUTS = {
    "submit-host": (["submit", "--host", "not-a-url"], "--host 'not-a-url': not an http(s) URL", []),
    "compare-folder": (["compare", "--tracking-uri", "store"], "--tracking-uri store: not an MLflow store", []),
    "compare-no-store": (["compare"], "no MLflow store: pass --tracking-uri or set MLFLOW_TRACKING_URI", []),
    "evaluate": (["evaluate", "-e", "default", "-m", "missing.keras"], "-m missing.keras: model file not found",
                 [".qatpipe-cache", "evaluate"]),
    "evaluate-kind": (["evaluate", "-e", "default", "-m", "store/notes.txt"], "-m store/notes.txt: not a model",
                      [".qatpipe-cache", "store/evaluate"]),
    "pretrain-data": (["pretrain", "-e", "tiny", "-r", "out", "--set", "pretrain.data=[nowhere]"],
                      "nowhere: pretrain.data[0]: data set folder not found", ["out"]),
    "export": (["export", "-e", "default", "-m", "missing.keras", "-o", "out/m.onnx"],
               "-m missing.keras: model file not found", [".qatpipe-cache", "out"]),
    "export-kind": (["export", "-e", "default", "-m", "model.onnx", "-o", "out/m.onnx"],
                    "-m model.onnx: not a Keras model file", [".qatpipe-cache", "out"]),
    "ptq": (["ptq", "-e", "default", "-m", "missing.onnx", "-o", "out/p.onnx"],
            "-m missing.onnx: model file not found", [".qatpipe-cache", "out"]),
    "build-engine": (["build-engine", "-e", "default", "-m", "missing.onnx", "-o", "out/engine"],
                     "-m missing.onnx: model file not found", [".qatpipe-cache", "out"]),
    "bench-engine": (["bench-engine", "-e", "default", "-m", "engine"], "-m engine: engine folder not found",
                     [".qatpipe-cache", "engine"]),
    "validate": (["validate", "-e", "default", "-m", "engine", "--baseline", "metrics.json"],
                 "-m engine: engine folder not found", [".qatpipe-cache", "engine"]),
    "validate-baseline": (["validate", "-e", "default", "-m", "built", "--baseline", "metrics.json"],
                          "--baseline metrics.json: the FP32 model's metrics file not found",
                          [".qatpipe-cache", "built/validate"]),
    "retrain": (["retrain", "-e", "default", "-m", "missing.keras", "-r", "out"],
                "-m missing.keras: model file not found", [".qatpipe-cache", "out"]),
    "prune": (["prune", "-m", "model.keras", "-o", "out", "-pth", "2", "-n", "max"],
              "-m model.keras: corrupt model file", ["out"]),
    "compile-shm": (["compile", "--shm-size", "lots", "-o", "p.yaml"],
                    "--shm-size 'lots': not a Kubernetes memory quantity", ["p.yaml"]),
    "compile-pvc": (["compile", "--cache-pvc", "Bad_PVC!", "-o", "p.yaml"],
                    "--cache-pvc 'Bad_PVC!': not a PersistentVolumeClaim name", ["p.yaml"]),
    "synth-overwrite": (["data", "synth", "--out", "data", "--train", "2", "--val", "1"],
                        "data/train: exists and is not empty; choose another --out, or give --overwrite", []),
    "synth-count": (["data", "synth", "--out", "new", "--train", "-1"], "argument --train: -1: need at least 0",
                    ["new"]),
    "flag-value": (["train", "-e", "tiny", "-r", "out", "--gpus", "two"], "argument --gpus: 'two': not a whole number",
                   ["out"]),
    "missing-data": (["train", "-e", "tiny", "-r", "new/run", "--set", "dataset.train=nowhere", "--set",
                      "dataset.val=nowhere"], "nowhere: dataset.train: dataset folder not found", ["new"]),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working folder holding the inputs the bad commands name: an empty folder (no MLflow store), an engine
    folder, an ONNX-named file, a file named .keras that is no zip, a data set."""
    folder = tmp_path_factory.mktemp("cli")
    (folder / "store").mkdir()
    (folder / "store" / "notes.txt").write_text("not a model")
    (folder / "built").mkdir()
    (folder / "built" / "engine.json").write_text(json.dumps({  # engine.json as a build writes it, no engine
        "backend": "onnxruntime", "engine_file": "model.onnx", "source_onnx": "m.onnx", "source_sha256": "0",
        "precision": "fp32", "runtime_version": "1", "device": "cpu", "input_name": "input",
        "batch_profile": {"min": 1, "opt": 1, "max": 1}}))
    (folder / "model.onnx").write_bytes(b"not a graph")
    (folder / "model.keras").write_bytes(b"not a zip")
    write_kitti(folder / "data" / "train", {"000001": kitti_line()})
    return folder


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_exit_2_before_any_work(case, workdir):
    argv, says, never_made = BAD_INPUTS[case]
    before = sorted(p.relative_to(workdir) for p in workdir.rglob("*"))
    line = one_line(qatpipe(*argv, cwd=workdir))
    assert says in line
    assert not [name for name in never_made if (workdir / name).exists()]
    assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == before  # nothing made, nothing removed


def test_submit_checks_the_spec_before_anything_is_sent(workdir):
    """A bad key under spec_overrides fails here, naming it, before the (unreachable) backend is tried."""
    result = qatpipe("submit", "--host", "http://127.0.0.1:9", "spec_overrides=[train.bogus=1]", cwd=workdir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "train.bogus" in result.stderr and "KFP at" not in result.stderr
    # a good spec passes the check and meets the closed port: still one line, exit 2
    assert "KFP at http://127.0.0.1:9: unreachable" in one_line(
        qatpipe("submit", "--host", "http://127.0.0.1:9", "spec_uri=tiny", cwd=workdir))


def test_a_failed_stage_leaves_no_folder_and_cpu_runs_are_quiet_about_cuda(tmp_path):
    """train loads TensorFlow, then meets a bad label: exit 2 naming the file and line; the results folder it
    made (and its lock) is gone, and no "failed call to cuInit" on a machine without a GPU."""
    root = write_kitti(tmp_path / "ds", {"000001": kitti_line() + "\n" + kitti_line("car", 10, 20, 500, 60)})
    result = qatpipe("train", "-e", "tiny", "-r", "new/run", "--set", f"dataset.train={root}", "--set",
                     f"dataset.val={root}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{root / 'labels' / '000001.txt'}:2: box 10.0 20.0 500.0 60.0 lies outside" in result.stderr
    assert "cuInit" not in result.stderr
    assert not (tmp_path / "new").exists()


def test_bare_compare_reads_the_store_make_main_writes(tmp_path):
    """`make main` (`qatpipe run --local`) keeps its MLflow store in results/pipeline/mlflow.db: `qatpipe compare`
    with no store named reads it, and says so."""
    from qatpipe.tracking.mlflow_runs import MlflowTracker

    store = tmp_path / "results" / "pipeline" / "mlflow.db"
    store.parent.mkdir(parents=True)
    tracker = MlflowTracker(f"sqlite:///{store}")
    run_id = tracker.start_pipeline_run("qatpipe", "pipeline", {"train.epochs": 1})
    tracker.log_variants(run_id, {"fp32": {"engine": "onnxruntime cpu fp32", "map50": 0.9123, "map": 0.6}})
    result = qatpipe("compare", "-o", "chart.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"reading MLflow at sqlite:///{store}" in result.stderr
    assert "0.9123" in result.stdout and (tmp_path / "chart.png").is_file()
    # the same store named by its folder
    assert qatpipe("compare", "--tracking-uri", "results/pipeline", "-o", "chart.png", cwd=tmp_path).returncode == 0


def test_version_and_help(tmp_path):
    from qatpipe import __version__

    version = qatpipe("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"qatpipe {__version__}"
    usage = qatpipe("--help", cwd=tmp_path)
    assert usage.returncode == 0 and "exit codes: 0 done; 1 the gate failed" in " ".join(usage.stdout.split())


def test_help_loads_no_heavy_library():
    """Every verb's --help answers without TensorFlow, MLflow or KFP (seconds each to import)."""
    script = ("import argparse, sys\nfrom qatpipe.cli import build_parser, main\n"
              "(verbs,) = [a.choices for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]\n"
              "verbs = [[verb] for verb in verbs]\n"
              "for argv in [*verbs, ['data', 'synth'], ['data', 'upload'], ['spec', 'show']]:\n"
              "    try:\n        main([*argv, '--help'])\n    except SystemExit as done:\n"
              "        assert done.code == 0, argv\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'tf_keras', 'mlflow', 'kfp'}))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------ 3: an internal error; 1: the gate


def _crash(args):
    raise RuntimeError("a bug\nover two lines")


def test_an_internal_error_is_one_line_and_a_log_file(monkeypatch, tmp_path, caplog, capsys):
    """Exit 3: one line naming the error and the file that holds the traceback; --debug prints it instead.
    (The crash is planted: a command that crashes for real would be a bug to fix.)"""
    import qatpipe.cli.spec

    monkeypatch.setattr(qatpipe.cli.spec, "cmd_show", _crash)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with caplog.at_level(logging.ERROR):
        assert main(["spec", "show", "-e", "tiny"]) == 3
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    (log_file,) = tmp_path.glob("qatpipe-error-*.log")
    assert record.getMessage() == (f"internal error (a bug in qatpipe, not in your input): RuntimeError: a bug over "
                                   f"two lines; the traceback is in {log_file} (--debug prints it here)")
    assert "Traceback" in log_file.read_text() and "qatpipe spec show -e tiny" in log_file.read_text()
    assert "Traceback" not in capsys.readouterr().err
    assert main(["spec", "show", "-e", "tiny", "--debug"]) == 3
    assert "Traceback" in capsys.readouterr().err and len(list(tmp_path.glob("qatpipe-error-*.log"))) == 1


def test_run_exits_1_when_the_gate_fails(monkeypatch, tmp_path, capsys):
    """`run --local` prints the table and exits 1 when the QAT model missed the gate. The pipeline takes minutes
    (test_local_pipeline.py runs it and checks exit 0); here run_local's summary is given, gate failed."""
    import qatpipe_pipelines.local_run

    summary = {"variants": {"fp32": {"engine": "onnxruntime cpu fp32", "map50": 0.9}}, "gate_passed": False}
    monkeypatch.setattr(qatpipe_pipelines.local_run, "run_local", lambda *args, **kwargs: summary)
    assert main(["run", "--local", "--spec", "tiny", "--output", str(tmp_path / "run")]) == 1
    assert "0.9" in capsys.readouterr().out
    summary["gate_passed"] = True
    assert main(["run", "--local", "--spec", "tiny", "--output", str(tmp_path / "run")]) == 0
