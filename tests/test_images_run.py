"""The images built and run: `make images` (images/build.sh --cpu) with podman, then the tiny pipeline with every
stage in its image (`qatpipe run --local --runner docker`) and MLflow in the MLflow image.

Needs root, podman (or a Docker engine) and debootstrap, and on a cold machine the Ubuntu/Debian archives and PyPI
(the bases and the wheelhouse, cached under $QATPIPE_CACHE, default .cache/); .ci/run installs them. The build is
podman's layer cache keyed on the lock files' and sources' hashes: unchanged, it takes seconds. Cold:
bench/README.md.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SMALL_IMAGES, unavailable

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("training", "engine", "mlflow")
# the tiny spec, shortened for a test (bench/README.md has the whole tiny spec's figures, both runners): a quarter
# of its pixels, the gate off (a 4-epoch model's INT8 drop is noise), sensitivity scoring 2 layers
SHORT = ["tracking.experiment=containers-test", *SMALL_IMAGES, "train.epochs=4", "retrain.epochs=1",
         "sensitivity.max_layers=2", "validate.max_map_drop=1.0"]
SECRET_WORDS = ("PASSWORD", "SECRET", "TOKEN", "ACCESS_KEY")
# podman's image store is the machine's, and every tree tags the same names: a run of this file in another checkout
# (a worktree, a second clone) would retag them mid-run. This lock, the machine's too, makes such runs take turns.
MACHINE_LOCK = Path("/var/tmp/qatpipe-images-test.lock")


def _engine() -> str:
    if os.geteuid() != 0:
        unavailable("building the images needs root (debootstrap, podman)")
    for tool, package in (("debootstrap", "debootstrap"), ("podman", "podman runc")):
        if not shutil.which(tool):
            unavailable(f"{tool} not installed: apt-get install {package}")
    return "podman"


@pytest.fixture(scope="module")
def images():
    """`make images`' build (cached), then the names it tagged; this checkout holds them until the module ends."""
    engine = _engine()
    with MACHINE_LOCK.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger(__name__).warning("waiting for another checkout's image tests (%s)", MACHINE_LOCK)
            fcntl.flock(lock, fcntl.LOCK_EX)
        env = {**os.environ, "PYTHON": sys.executable, "DOCKER": engine}
        result = subprocess.run([str(ROOT / "images" / "build.sh"), "--cpu"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=3600)
        assert result.returncode == 0, \
            f"images/build.sh --cpu failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        from qatpipe_kfp.settings import IMAGES

        yield dict(IMAGES)  # the lock goes with the file's close


def _inspect(image: str) -> dict:
    result = subprocess.run(["podman", "image", "inspect", image], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)[0]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("kind", KINDS)
def test_image_is_non_root_labelled_and_holds_no_secret(images, kind):
    info = _inspect(images[kind])
    config = info["Config"]
    assert config["User"] == "1000:1000", config["User"]
    labels = config["Labels"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert labels["org.opencontainers.image.revision"] == commit
    assert labels["org.opencontainers.image.version"] == images[kind].rpartition(":")[2]
    assert labels["org.opencontainers.image.source"] and "@" not in labels["org.opencontainers.image.source"]
    # no credential in the environment, the build arguments or any layer's command
    names = [entry.partition("=")[0] for entry in config.get("Env") or []]
    assert not [n for n in names if any(word in n.upper() for word in SECRET_WORDS)], names
    history = subprocess.run(["podman", "history", "--no-trunc", "--format", "{{.CreatedBy}}", images[kind]],
                             capture_output=True, text=True, check=True).stdout
    assert not [w for w in SECRET_WORDS if w in history.upper()], history
    record = subprocess.run(["podman", "run", "--rm", "--network", "none", "--entrypoint", "cat", images[kind],
                             "/etc/qatpipe-build"], capture_output=True, text=True, timeout=300).stdout
    assert f"commit {commit}\n" in record, record
    # runs as uid 1000 by default ...
    who = subprocess.run(["podman", "run", "--rm", "--network", "none", "--entrypoint", "id", images[kind], "-u"],
                         capture_output=True, text=True, timeout=300)
    assert who.stdout.strip() == "1000", who.stderr
    # ... and holds no private key, pip/netrc/git credential file or ssh host key (searched as root: all of it)
    found = subprocess.run(["podman", "run", "--rm", "--network", "none", "--user", "0", "--entrypoint", "find",
                            images[kind], "/", "-xdev", "-type", "f", "(", "-name", "*.pem", "-path", "*/home/*",
                            "-o", "-name", "id_rsa*", "-o", "-name", ".netrc", "-o", "-name", "pip.conf", "-o",
                            "-name", "ssh_host_*", "-o", "-name", ".git-credentials", "-o", "-path",
                            "*/.aws/credentials", ")", "-print"], capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [], found.stdout


def _kill_stage_container(log: Path, stage: str, image: str, killed: list, timeout: float = 900) -> None:
    """Once `log` shows `stage` started, SIGKILL the running container of `image` (that stage's: kfp.local runs
    one task at a time, and TensorFlow's import takes seconds), as a node loss or the OOM killer would; its id
    goes in `killed`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.is_file() and f"stage {stage}: started" in log.read_text(errors="replace"):
            running = subprocess.run(["podman", "ps", "-q", "--filter", f"ancestor={image}"], capture_output=True,
                                     text=True).stdout.split()
            for container in running:
                subprocess.run(["podman", "kill", container], capture_output=True)
            killed.extend(running)
            return
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_tiny_pipeline_runs_in_its_images_and_a_killed_stage_resumes(images, tmp_path, monkeypatch):
    from qatpipe_pipelines.local_run import PipelineFailed, run_local

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # MLflow from the MLflow image
    out = tmp_path / "run"
    # the prune stage's container killed mid-stage (a stage without retries: kfp.local retries a killed
    # training stage after its 60 s backoff, as the pipeline's pre-emption retries do): the run fails naming it
    killed: list[str] = []
    killer = threading.Thread(target=_kill_stage_container, daemon=True,
                              args=(out / "containers.log", "prune", images["training"], killed))
    killer.start()
    with pytest.raises(PipelineFailed) as failure:
        run_local(out, "tiny", SHORT, runner="docker")
    killer.join(timeout=60)
    assert len(killed) == 1, killed
    assert str(failure.value).startswith("pipeline stage prune ended without a result (killed"), failure.value
    assert "exited with status 137" in (out / "containers.log").read_text()
    # ... and the re-run resumes as with the subprocess runner: the stages that finished (the training too) come
    # from kfp.local's cache (though the run's MLflow server has a new port), the killed one runs again, and so
    # does everything after it (fingerprint-data, start-tracking and resolve-spec run in every run)
    summary = run_local(out, "tiny", SHORT, runner="docker")
    assert not {"prepare-data", "pretrain", "train"} & set(summary["stages"]), summary["stages"]
    assert summary["stages"]["prune"]["status"] == "done"

    assert list(summary["variants"]) == ["fp32", "ptq", "ptq-partial", "qat"]
    assert summary["variants"]["fp32"]["engine"] == "onnxruntime cpu fp32"  # the engine image's CPU fallback
    assert summary["mlflow"]["tracking_uri"].startswith("http://127.0.0.1:")
    assert all(outcome["status"] == "done" for outcome in summary["stages"].values()), summary["stages"]
    # every task ran in a container of one of the two stage images (container_run prints which)
    log = (out / "containers.log").read_text()
    assert f"image {images['training']}: container " in log and f"image {images['engine']}: container " in log
    assert (out / "mlflow.db").is_file() and (out / "mlflow-server.log").is_file()
    # written as the calling user, not the images' uid 1000
    assert (out / "summary.json").stat().st_uid == os.getuid()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_failed_stage_in_its_container_is_named_and_its_log_kept(images, tmp_path, monkeypatch):
    from qatpipe_pipelines.local_run import PipelineFailed, run_local

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out, missing = tmp_path / "run", tmp_path / "no-such-dataset"
    with pytest.raises(PipelineFailed) as failure:
        run_local(out, "tiny", [f"dataset.train={missing}/train", f"dataset.val={missing}/val"], runner="docker")
    message = str(failure.value)
    assert message.startswith("pipeline stage fingerprint-data failed: ") and str(out / "containers.log") in message
    assert "qatpipe run --local --runner docker --spec tiny" in message
    assert str(missing) in (out / "containers.log").read_text()  # the stage's own error, kept


def test_no_container_engine_says_what_to_install(tmp_path, monkeypatch):
    from qatpipe.errors import QatpipeError
    from qatpipe_pipelines.container_run import docker_client

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nothing.sock")
    with pytest.raises(QatpipeError, match="install podman"):
        docker_client()


def test_compiled_pipeline_names_the_images_make_images_tags():
    """pipelines/qat_pipeline.yaml runs its tasks on the images `make images` tags (qatpipe_kfp.settings)."""
    import yaml

    from qatpipe_kfp.settings import IMAGES

    compiled = next(yaml.safe_load_all((ROOT / "pipelines" / "qat_pipeline.yaml").read_text()))
    inputs = compiled["root"]["inputDefinitions"]["parameters"]
    assert inputs["training_image"]["defaultValue"] == IMAGES["training"]
    assert inputs["engine_image"]["defaultValue"] == IMAGES["engine"]


def test_compile_retargets_the_images_for_a_registry(tmp_path):
    """QATPIPE_IMAGE_REPOSITORY / QATPIPE_IMAGE_TAG at compile time: the names `images/build.sh --repository R
    --tag T --push` pushes."""
    import yaml

    env = {**os.environ, "QATPIPE_IMAGE_REPOSITORY": "registry.example.com:5000/team", "QATPIPE_IMAGE_TAG": "7.7"}
    out = tmp_path / "pipeline.yaml"
    subprocess.run([sys.executable, "-m", "qatpipe.cli", "compile", "-o", str(out)], env=env, check=True,
                   capture_output=True, timeout=600)
    inputs = next(yaml.safe_load_all(out.read_text()))["root"]["inputDefinitions"]["parameters"]
    assert inputs["training_image"]["defaultValue"] == "registry.example.com:5000/team/qatpipe-training:7.7"
    assert inputs["engine_image"]["defaultValue"] == "registry.example.com:5000/team/qatpipe-engine:7.7"


def _wheelhouse_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("qatpipe_images_wheelhouse", ROOT / "images" / "wheelhouse.py")
    wheelhouse = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheelhouse)
    return wheelhouse


def test_wheelhouse_check_names_what_is_missing(tmp_path):
    """images/wheelhouse.py --check (build.sh --cpu runs it before building): no wheelhouse, or one made for an
    older lock, is named with the package, before any build."""
    wheelhouse = _wheelhouse_module()

    assert "no wheelhouse at" in wheelhouse.check(["mlflow"], True, tmp_path / "none")
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "mlflow-0.0.0-py3-none-any.whl").write_bytes(b"not the pinned file")
    first = wheelhouse.pins(ROOT / "images" / "mlflow" / "requirements.lock", True)[0]
    message = wheelhouse.check(["mlflow"], True, tmp_path / "stale")
    assert f"{first.name}=={first.version}" in message and "images/mlflow/requirements.lock" in message
    # --cpu leaves NVIDIA's CUDA wheels out, and only those
    training = [pin.name for pin in wheelhouse.pins(ROOT / "images" / "training" / "requirements.lock", True)]
    assert "tensorflow" in training and not [name for name in training if name.startswith("nvidia-")]
    assert wheelhouse.main(["--check", "--cpu", "--dest", str(tmp_path / "none"), "mlflow"]) == 2


def test_wheelhouse_downloads_only_the_missing_files_and_a_complete_one_needs_no_pip(tmp_path, monkeypatch):
    """A wheelhouse that holds every pinned file is left alone (no pip, no network: offline rebuilds work); one
    that lacks a file asks pip for that file only. pip is replaced by a recorder here (the real download is the
    images fixture's); the files present are given by their hashes."""
    wheelhouse = _wheelhouse_module()
    lock = ROOT / "images" / "mlflow" / "requirements.lock"
    pinned = wheelhouse.pins(lock, True)
    asked = []

    def pip(target, args, check):
        asked.append(Path(args[args.index("-r") + 1]).read_text())

    monkeypatch.setattr(wheelhouse.LOCK, "run_pip", pip)
    monkeypatch.setattr(wheelhouse, "_hashes", lambda dest: {pin.sha256 for pin in pinned[1:]})
    wheelhouse.download(["mlflow"], True, tmp_path)
    assert asked == [f"{pinned[0].name}=={pinned[0].version} --hash=sha256:{pinned[0].sha256}\n"]
    asked.clear()
    monkeypatch.setattr(wheelhouse, "_hashes", lambda dest: {pin.sha256 for pin in pinned})
    wheelhouse.download(["mlflow"], True, tmp_path)
    assert asked == []
