"""Data-parallel training under Horovod: real horovodrun, two processes on this CPU, Gloo.

Horovod is built by the install step (images/horovod/build-wheel.sh); where it is missing the tests skip and
say so (and fail under CI=true, where `make test` has built it); a build that is there but does not import fails.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import SMALL_ARCH, SMALL_IMAGES, unavailable
from qatpipe.training.distributed import World, horovodrun_command


def _horovod_broken() -> tuple[str | None, str | None]:
    """(why Horovod is missing, why it is broken): at most one set. Missing is no `horovod` package; a package whose
    TensorFlow binding does not import (a build against another TensorFlow, a missing library) is broken."""
    try:
        import horovod.tensorflow  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name == "horovod":
            return "Horovod is not installed: `make install` builds it (images/horovod/build-wheel.sh)", None
        return None, f"Horovod is installed but horovod.tensorflow does not import: {exc}"
    except Exception as exc:  # ImportError of its compiled library, or what its import raises
        return None, f"Horovod is installed but horovod.tensorflow does not import: {type(exc).__name__}: {exc}"
    return None, None


HOROVOD_MISSING, HOROVOD_BROKEN = _horovod_broken()


@pytest.fixture(scope="session")
def horovod():
    """For the tests that run Horovod (session-scoped, so that it is checked before the data set is made)."""
    if HOROVOD_BROKEN:
        pytest.fail(HOROVOD_BROKEN, pytrace=False)
    if HOROVOD_MISSING:
        unavailable(HOROVOD_MISSING)

pytestmark = pytest.mark.slow

# each process trains through the stage function and saves the weights it ends with, so the test can compare
# the ranks (the stage itself writes files from rank 0 only)
RANK_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    from qatpipe.models import get_architecture
    from qatpipe.spec import load_spec
    from qatpipe.stages.train import train
    from qatpipe.training.distributed import init_world

    spec_path, results, weights_dir = sys.argv[1:4]
    world = init_world()  # first, as the stages do: it pins threads / GPU before TensorFlow starts
    spec = load_spec(spec_path)
    model = get_architecture(spec).build_model()
    train(spec, results, model=model)
    np.savez(os.path.join(weights_dir, f"rank{world.rank}.npz"), *model.get_weights())
""")


def _env() -> dict:
    return {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.parametrize("arch", ["detectnet_v2", "ssd"])
def test_two_horovod_processes_end_with_identical_weights_and_the_loss_falls(horovod, arch, tiny_spec, tmp_path):
    from qatpipe.spec import dump_spec

    # keep=last: with keep=best rank 0 alone swaps in the best epoch's weights after training (it writes the model)
    spec = tiny_spec("train.epochs=4", "train.keep=last", *SMALL_ARCH[arch])
    spec_path = tmp_path / "spec.yaml"
    dump_spec(spec, spec_path)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    results, weights = tmp_path / "results", tmp_path / "weights"
    weights.mkdir()
    command = horovodrun_command(2, [], "gloo")[:6] + [sys.executable, str(script), str(spec_path), str(results),
                                                        str(weights)]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    ranks = [np.load(weights / f"rank{rank}.npz") for rank in (0, 1)]
    assert len(ranks[0].files) == len(ranks[1].files) > 0
    for name in ranks[0].files:  # trainable weights, BN statistics and all: one model on both ranks
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)

    with open(results / "training_log.csv") as log_file:
        rows = list(csv.DictReader(log_file))
    losses = [float(row["loss"]) for row in rows]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    assert all(float(row["val_map50"]) >= 0 for row in rows)  # rank 0 validated every epoch, nobody deadlocked
    summary = json.loads((results / "train_summary.json").read_text())
    assert summary["processes"] == 2
    # each process trains on half of every epoch: steps per epoch halve
    assert summary["steps_per_epoch"] == summary["train_images"] // 2 // spec.train.batch_size
    assert json.loads((results / "world.json").read_text()) == {"processes": 2}


def test_gpus_on_one_host_runs_horovod_processes_and_a_resume_must_use_the_same_count(horovod, tiny_spec,
                                                                                       tmp_path):
    from qatpipe.stages.scale_out import run_training_stage

    spec = tiny_spec("train.epochs=1", *SMALL_IMAGES)
    # what the train component does with gpus=2: `qatpipe train --gpus 2` on a spec file (horovodrun), in a
    # work folder; the model comes to the results, the resume state does not
    summary = run_training_stage("train", spec, tmp_path / "model", processes_per_node=2)
    assert summary["processes"] == 2 and (tmp_path / "model" / "model.keras").is_file()
    assert not (tmp_path / "model" / "checkpoints").exists()

    # a TAO-style results folder (the command line's -r) keeps its checkpoints: extending that run on one
    # process would change the learning rate and the schedule under it
    data = Path(spec.dataset.train).parent
    command = [sys.executable, "-m", "qatpipe.cli", "train", "-e", "tiny", "--set", f"dataset.train={data / 'train'}",
               "--set", f"dataset.val={data / 'val'}", *(arg for item in SMALL_IMAGES for arg in ("--set", item)),
               "-r", str(tmp_path / "run")]
    first = subprocess.run(command + ["--set", "train.epochs=1", "--gpus", "2"], env=_env(), capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run(command + ["--set", "train.epochs=2"], env=_env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 2
    assert "run on 2 process(es); resume it with --gpus 2" in again.stderr

    # a finished run is only read back: one process may do that
    read_back = subprocess.run(command + ["--set", "train.epochs=1"], env=_env(), capture_output=True, text=True,
                               timeout=300)
    assert read_back.returncode == 0, read_back.stderr[-2000:]
    assert "already trained for 1 epochs; nothing to do" in read_back.stderr


def test_single_process_world_is_rank_zero_and_changes_nothing():
    world = World()
    assert world.is_chief and not world.distributed and world.shard == (0, 1)
    optimizer = object()
    assert world.wrap_optimizer(optimizer) is optimizer and world.callbacks() == []
    assert world.broadcast(7, "x") == 7
