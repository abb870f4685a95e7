"""An MLflow model serves anywhere: it carries the qatpipe wheel that logged it, its requirements name that wheel by
its path in the model folder, and a copy of the folder loads and predicts in a fresh Python whose qatpipe comes
from that wheel alone (no source tree, no editable install). The real `mlflow models serve`, which installs
TensorFlow and the rest from the package index, is bench/mlflow_serve.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from qatpipe.tracking.mlflow_runs import INJECTED_RUN_ENV, MlflowTracker

# Run in the fresh process: setuptools' editable finder (a .pth in the venv) would map `qatpipe` to the checkout
# the venv was installed from; it is removed before anything imports qatpipe, so only PYTHONPATH's install counts.
FRESH = r"""
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
model_dir, image, installed = sys.argv[1:4]
import mlflow.pyfunc, numpy as np
import qatpipe
from qatpipe.deploy import wheel
from qatpipe.errors import ModelFileError
found = mlflow.pyfunc.load_model(model_dir).predict(np.array([image], dtype=object))
rebuilt = wheel.qatpipe_wheel()  # this qatpipe is a regular install: its files, zipped back
wheel._built.clear()
(__import__("pathlib").Path(installed) / "qatpipe" / "specs" / "tiny.yaml").unlink()
try:
    wheel.qatpipe_wheel()
    missing_error = None
except ModelFileError as exc:
    missing_error = str(exc)
print("RESULT " + json.dumps({"qatpipe": qatpipe.__file__, "rows": found.values.tolist(), "rebuilt": str(rebuilt),
                              "missing_error": missing_error}))
"""


def _wheel_files(path: Path) -> dict[str, bytes]:
    """A wheel's files but its RECORD (whose lines differ in order and form between builders)."""
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist() if not name.endswith(".dist-info/RECORD")}


def test_a_logged_model_carries_its_wheel_and_predicts_from_it_alone(mlflow_server, qat_export, tmp_path,
                                                                       monkeypatch):
    import mlflow
    import mlflow.artifacts
    import mlflow.pyfunc
    import numpy as np

    import qatpipe.deploy.mlflow_model
    from qatpipe.deploy import wheel as wheel_module
    from qatpipe.tracking.registry import log_variant_model

    monkeypatch.delenv(INJECTED_RUN_ENV, raising=False)
    spec, _, onnx_path, _ = qat_export
    builds = []  # the real builder, counted: two variants, one wheel
    real_build = wheel_module._build_from_source
    monkeypatch.setattr(wheel_module, "_build_from_source", lambda *a: builds.append(a) or real_build(*a))
    monkeypatch.setattr(wheel_module, "_built", {})
    tracker = MlflowTracker(mlflow_server)
    parent = tracker.start_pipeline_run("test-wheel", "w", {"run": "w"})
    logged = [log_variant_model(tracker, parent, variant, onnx_path, spec, {"map50": 0.5})
              for variant in ("ptq", "qat")]
    assert len(builds) == 1

    # the model as another machine gets it: downloaded from the tracking server into a folder of its own
    mlflow.set_tracking_uri(mlflow_server)
    model = Path(mlflow.artifacts.download_artifacts(logged[1].model_uri, dst_path=str(tmp_path / "elsewhere")))
    wheels = sorted((model / "wheels").rglob("*.whl"))
    assert len(wheels) == 1
    carried = wheels[0].relative_to(model).as_posix()
    # under the code's digest: MLflow names a model's environment after its requirement strings
    assert re.fullmatch(r"wheels/tree-[0-9a-f]{16}/qatpipe-0\.1\.0-py3-none-any\.whl", carried), carried
    requirements = (model / "requirements.txt").read_text().split()
    assert carried in requirements and not any(r.startswith("qatpipe") for r in requirements)
    conda = yaml.safe_load((model / "conda.yaml").read_text())
    assert carried in next(d["pip"] for d in conda["dependencies"] if isinstance(d, dict))
    assert yaml.safe_load((model / "python_env.yaml").read_text())["dependencies"] == ["-r requirements.txt"]
    # it is the code that logged the model, this checkout's
    files = _wheel_files(wheels[0])
    assert files["qatpipe/deploy/mlflow_model.py"] == Path(qatpipe.deploy.mlflow_model.__file__).read_bytes()

    # installed from the folder alone, by the path requirements.txt gives, as MLflow installs it (cwd: the folder)
    installed = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                           str(installed), carried], cwd=model, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

    # a fresh Python, in an empty folder, with nothing of this checkout on its path
    image = str(next(Path(spec.dataset.val).rglob("*.jpg")))
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(installed), "PYTHONNOUSERSITE": "1",
           "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", FRESH, str(model), image, str(installed)], cwd=work, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert Path(result["qatpipe"]).is_relative_to(installed)

    # it finds what the model finds in this process
    here = mlflow.pyfunc.load_model(str(model)).predict(np.array([image], dtype=object))
    assert len(result["rows"]) == len(here) > 0
    np.testing.assert_allclose(np.array([r[1:6] for r in result["rows"]], float),
                               here[["x1", "y1", "x2", "y2", "score"]].to_numpy(float), atol=1e-4)
    assert [r[7] for r in result["rows"]] == list(here["class_name"])

    # from that regular install qatpipe rebuilds the same wheel; with a file of it gone it says which, and stops
    assert Path(result["rebuilt"]).name == wheels[0].name and Path(result["rebuilt"]).parent.name.startswith("record-")
    assert not Path(result["rebuilt"]).exists()  # its process's cache went with it
    assert result["missing_error"].startswith(f"cannot rebuild the qatpipe wheel from the install in {installed}")
    assert "qatpipe/specs/tiny.yaml" in result["missing_error"]


def test_the_rebuilt_wheel_has_the_installed_files(tmp_path):
    """A regular install's files zipped back are the wheel they came from (RECORD aside), in a fresh process."""
    from qatpipe.deploy.wheel import qatpipe_wheel

    built = qatpipe_wheel()
    installed = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(installed), str(built)], check=True)
    out = tmp_path / "out"
    script = ("import sys, shutil; sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '')"
              ".startswith('__editable__')]; from qatpipe.deploy.wheel import qatpipe_wheel; "
              f"shutil.copy(qatpipe_wheel(), {str(out)!r})")
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True,
                   env={"PATH": os.environ["PATH"], "PYTHONPATH": str(installed), "PYTHONNOUSERSITE": "1"})
    assert _wheel_files(out) == _wheel_files(built)
    with zipfile.ZipFile(out) as archive:  # rebuilt from the install (fixed dates), not built from a source tree
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
    # and pip installs it (it reads the RECORD and WHEEL written here)
    rebuilt = out.rename(tmp_path / built.name)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(tmp_path / "again"), str(rebuilt)], check=True)
    assert (tmp_path / "again" / "qatpipe-0.1.0.dist-info" / "METADATA").is_file()


def test_no_wheel_no_model(tmp_path):
    """qatpipe imported from a bare copy of its package (no install's dist-info, no pyproject.toml above it), in
    a fresh process: saving a model stops at once with an error naming the folder, and writes nothing."""
    import shutil

    import qatpipe

    bare = tmp_path / "bare"
    shutil.copytree(Path(qatpipe.__file__).parent, bare / "qatpipe", ignore=shutil.ignore_patterns("__pycache__"))
    script = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '')"
              ".startswith('__editable__')]\n"
              "from qatpipe.deploy.mlflow_model import save_detector_model\n"
              "from qatpipe.errors import ModelFileError\n"
              "try:\n    save_detector_model('model', 'model.onnx', spec=None)\n"
              "except ModelFileError as exc:\n    print('ERROR', exc)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": str(bare), "PYTHONNOUSERSITE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"ERROR cannot put qatpipe in the MLflow model: {bare / 'qatpipe'} is neither a "
                                  "regular install"), done.stdout
    assert not (tmp_path / "model").exists()
