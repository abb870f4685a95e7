"""Shared fixtures. Everything here is real: real files, real TensorFlow, real pycocotools."""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from qatpipe.spec import bundled_spec_path, load_spec  # noqa: E402

CLASSES = ["car", "pedestrian", "cyclist"]
# The MPIJob CRD schemas the operators released: ../shared/schemas beside the repository (QATPIPE_CRD_SCHEMAS
# names another folder with the same layout)
CRD_SCHEMAS = Path(os.environ.get("QATPIPE_CRD_SCHEMAS")
                   or Path(__file__).resolve().parents[1].parent / "shared" / "schemas")
CRD_SCHEMA_FILES = ("mpi-operator-v0.8.2/kubeflow.org_mpijobs.yaml",
                    "kubeflow-training-v1.9.0/kubeflow.org_mpijobs.yaml",
                    *(f"kubeflow-trainer-v2.3.0/trainer.kubeflow.org_{kind}.yaml"
                      for kind in ("trainjobs", "trainingruntimes", "clustertrainingruntimes")))


# The suite's slowest files, slowest first (each one's tests took 60-750 s in a 2-worker run; the two whole
# pipelines first). xdist hands whole files to the two workers (--dist=loadfile) in collection order
# (--no-loadscope-reorder: by default it orders files by their number of tests, which sent these few-test files
# last and left the longest running alone at the end); collected first, they start first, and the many short
# files even out the two workers' ends. A new file that takes minutes belongs here.
SLOWEST_FILES = (
    "tests/test_images_run.py", "tests/test_local_pipeline.py", "tests/test_ssd_pipeline.py", "tests/test_horovod.py",
    "tests/test_engines.py", "tests/test_images.py", "tests/test_faults.py", "tests/test_train_validation.py",
    "tests/test_manifests.py", "tests/test_preemption.py", "tests/test_backbones.py", "tests/test_export.py",
    "tests/test_sensitivity.py", "tests/test_mlflow_models.py",
    "tests/test_walkthrough.py", "tests/test_components_shipped.py", "tests/test_train.py", "tests/test_pretrained.py",
    "tests/test_pruning.py", "tests/test_precision.py", "tests/test_scale_out.py",
)


def pytest_collection_modifyitems(config, items):
    """SLOWEST_FILES first, in that order; the other files after them as collected."""
    rank = {path: number for number, path in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def in_ci() -> bool:
    """CI=true (GitHub Actions, GitLab CI and most others set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def unavailable(reason: str):
    """A test whose tool or data is missing here: skipped with `reason`, except under CI=true, where it fails
    (CI must run every test; a skip there would pass silently)."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: this test must run there, not be skipped)", pytrace=False)
    pytest.skip(reason)


def crd_schemas_missing() -> str | None:
    """Why the operators' CRD schemas cannot be read here, or None."""
    where = "../shared/schemas beside the repository, or the folder QATPIPE_CRD_SCHEMAS names"
    if not CRD_SCHEMAS.is_dir():
        return f"CRD schema folder {CRD_SCHEMAS} not found ({where})"
    missing = [name for name in CRD_SCHEMA_FILES if not (CRD_SCHEMAS / name).is_file()]
    return f"CRD schemas missing under {CRD_SCHEMAS}: {', '.join(missing)} ({where})" if missing else None


@pytest.fixture
def crd_schemas() -> Path:
    """The CRD schema folder; its tests skip without it, and fail under CI=true."""
    if reason := crd_schemas_missing():
        unavailable(reason)
    return CRD_SCHEMAS


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `name` that `build(folder)` fills, built once per test run and shared by its pytest-xdist
    workers (each worker's session fixtures would otherwise train the same model again): the first worker to
    ask builds it under an flock while the others wait, then read it. A folder left half-built (its builder
    died) is built again."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # <basetemp>/popen-gwN: the run's base temp is shared
        root = root.parent
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """A small synthetic KITTI dataset at the tiny spec's image size, made once per test run (shared by the
    xdist workers; read only)."""
    from qatpipe.data.synth import write_synthetic_dataset

    def build(root):
        size = load_spec(bundled_spec_path("tiny")).dataset.image_size
        write_synthetic_dataset(root, num_train=192, num_val=48, seed=3, image_height=size.height,
                                image_width=size.width)

    return built_once(tmp_path_factory, "tiny_data", build)


# Half the tiny spec's image size each way, a quarter of its pixels: for tests of how training runs (resume,
# distribution, validation, files, logs, precision) rather than of what it learns. A 2-epoch run of the tiny model:
# 28 s -> 15 s (its early layers, at full resolution, cost the same at any backbone width)
SMALL_IMAGES = ("dataset.image_size.height=96", "dataset.image_size.width=160")
# each arch at a small size it takes (SSD's must be a multiple of its largest stride, 64)
SMALL_ARCH = {"detectnet_v2": SMALL_IMAGES,
              "ssd": ("model.arch=ssd", "dataset.image_size.height=128", "dataset.image_size.width=192")}


@pytest.fixture
def tiny_spec(tiny_dataset):
    """The bundled tiny spec pointed at the session's synthetic data; pass overrides as KEY=VALUE."""

    def make(*overrides: str):
        return load_spec(
            bundled_spec_path("tiny"),
            [f"dataset.train={tiny_dataset / 'train'}", f"dataset.val={tiny_dataset / 'val'}", *overrides],
        )

    return make


def write_kitti(root: Path, labels: dict[str, str], size=(160, 96), image_bytes: dict[str, bytes] | None = None):
    """A hand-made KITTI folder: stem -> label text; images are plain JPEGs of `size` (w, h)."""
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "labels").mkdir(parents=True, exist_ok=True)
    for stem, text in labels.items():
        if image_bytes and stem in image_bytes:
            (root / "images" / f"{stem}.jpg").write_bytes(image_bytes[stem])
        else:
            Image.new("RGB", size, (120, 90, 60)).save(root / "images" / f"{stem}.jpg")
        (root / "labels" / f"{stem}.txt").write_text(text)
    return root


def kitti_line(cls="car", x1=10, y1=20, x2=50, y2=60) -> str:
    return f"{cls} 0.00 0 0.00 {x1} {y1} {x2} {y2} 0 0 0 0 0 0 0"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on loopback (SQLite backend, proxied artifact store); yields its URI."""
    import subprocess
    import sys
    import time
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow_server")
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    log_file = open(root / "server.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=log_file, stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield uri
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    log_file.close()


@pytest.fixture
def closed_port_uri() -> str:
    """An http:// URI on loopback where nothing listens."""
    return f"http://127.0.0.1:{_free_port()}"


@pytest.fixture(scope="session")
def trained_tiny(tiny_dataset, tmp_path_factory):
    """A briefly trained tiny detector (enough detections to compare evaluations); trained once per test run
    (shared by the xdist workers: its files are read, never written)."""
    from qatpipe.spec import bundled_spec_path, load_spec
    from qatpipe.stages.train import train

    spec = load_spec(bundled_spec_path("tiny"), [f"dataset.train={tiny_dataset / 'train'}",
                                                 f"dataset.val={tiny_dataset / 'val'}", "train.epochs=6"])
    folder = built_once(tmp_path_factory, "trained", lambda folder: train(spec, folder))
    return spec, folder / "model.keras"


@pytest.fixture(scope="session")
def qat_export(trained_tiny, tmp_path_factory):
    """One epoch of QAT on the tiny detector, exported: (spec, keras model path, onnx path, report); made once
    per test run (shared by the xdist workers)."""
    import pickle

    from qatpipe.stages.export import export
    from qatpipe.stages.retrain import retrain

    spec, model = trained_tiny
    spec = spec.model_copy(deep=True)
    spec.qat.enabled, spec.retrain.epochs, spec.qat.calibration_batches = True, 1, 4

    def build(folder):
        summary = retrain(spec, model, folder / "retrain")
        report = export(spec, summary["model"], folder / "qat.onnx")
        (folder / "fixture.pickle").write_bytes(pickle.dumps((summary["model"], report)))

    folder = built_once(tmp_path_factory, "qat", build)
    qat_model, report = pickle.loads((folder / "fixture.pickle").read_bytes())
    return spec, Path(qat_model), folder / "qat.onnx", report


def random_evaluation(seed: int, images: int = 40, classes: int = 3, max_objects: int = 6, max_detections: int = 20):
    """(ground truth, detections) per image, random but detector-like: jittered boxes on the objects (some of the
    wrong class), false positives, images without objects, scores rounded to two decimals (ties); the last class
    has no ground truth."""
    import numpy as np

    from qatpipe.metrics.coco import GroundTruth
    from qatpipe.models.base import Detections

    rng = np.random.default_rng(seed)
    truth, detections = [], []
    for _ in range(images):
        count = int(rng.integers(0, max_objects + 1))
        corner = rng.uniform(0, 400, (count, 2))
        boxes = np.concatenate([corner, corner + rng.uniform(10, 80, (count, 2))], axis=1).astype(np.float32)
        labels = rng.integers(0, classes - 1, count).astype(np.int32)
        truth.append(GroundTruth(boxes, labels))
        found = int(rng.integers(0, max_detections + 1))
        if count:
            source = rng.integers(0, count, found)
            det_boxes = boxes[source] + rng.normal(0, 6, (found, 4))
            det_labels = np.where(rng.random(found) < 0.8, labels[source], rng.integers(0, classes, found))
        else:
            det_boxes, det_labels = np.zeros((found, 4)), rng.integers(0, classes, found)
        stray = (rng.random(found) < 0.3) | (count == 0)
        det_boxes[stray] = rng.uniform(0, 400, (int(stray.sum()), 1)) + np.array([0, 0, 40, 40])
        detections.append(Detections(det_boxes.astype(np.float32), np.round(rng.random(found), 2).astype(np.float32),
                                     det_labels.astype(np.int32)))
    return truth, detections


class Preempted(Exception):
    """Raised by PreemptAfter."""


def PreemptAfter(epoch: int):  # noqa: N802 (used like a class)
    """A Keras callback standing in for a pod being killed: stops training right after epoch `epoch` (from 1)."""
    import tf_keras as keras

    class _PreemptAfter(keras.callbacks.Callback):
        def on_epoch_end(self, done, logs=None):
            if done + 1 == epoch:
                raise Preempted()

    return _PreemptAfter()


def masked_copy(model, removed_of):
    """`model` with every removed channel cut off downstream: the weights of each Conv2D/Dense that read a
    removed channel zeroed (`removed_of(layer)`: the input channels removed for that layer). A pruned model must
    compute exactly what this copy computes."""
    import tf_keras as keras

    masked = keras.models.clone_model(model)
    masked.set_weights(model.get_weights())
    for layer in masked.layers:
        if type(layer) in (keras.layers.Conv2D, keras.layers.Dense):
            removed = removed_of(layer)
            if removed:
                weights = layer.get_weights()
                weights[0][..., removed, :] = 0
                layer.set_weights(weights)
    return masked


def one_conv_onnx(path: Path) -> Path:
    """An FP32 ONNX of one 1x1 Conv (3 -> 4 channels, all-ones weights) on a 1x3x8x8 NCHW input, at `path`."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def read_add_past_its_qdq(proto):
    """Plant a missing quantizer in a Q/DQ ONNX: the first Add with a dequantized input reads that input's float
    tensor instead (DQ <- Q <- the float tensor), as if the export had dropped its Q/DQ. Returns the Add."""
    producers = {out: node for node in proto.graph.node for out in node.output}

    def dequantized(name):
        return name in producers and producers[name].op_type == "DequantizeLinear"

    add = next(n for n in proto.graph.node if n.op_type == "Add" and any(dequantized(i) for i in n.input))
    index = next(k for k, name in enumerate(add.input) if dequantized(name))
    add.input[index] = producers[producers[add.input[index]].input[0]].input[0]
    return add


@pytest.fixture(autouse=True)
def _no_pipeline_run_leaks(monkeypatch):
    """A test that found a pipeline's MLflow run (tracking.live.parent_run_from_kfp sets it in os.environ, for its
    subprocesses) must not hand it to the next test in the same worker, whose store does not hold it."""
    monkeypatch.delenv("QATPIPE_MLFLOW_PARENT_RUN", raising=False)
