"""Data-parallel training with Horovod, the way TAO's `--gpus N` does it.

Two halves:
- `launch(gpus, argv)`: the CLI re-runs its own command line under `horovodrun -np N` (one process per GPU, or
  per CPU share where there is no GPU). Inside an MPIJob, mpi-operator's launcher starts the processes with
  `mpirun` instead, and nothing here launches.
- `World`: what a training process needs to know and do once it runs under Horovod (rank, size; pin its GPU;
  shard the data; scale the learning rate; wrap the optimizer; the broadcast and metric-averaging callbacks;
  whether it writes checkpoints, logs and MLflow records, which only rank 0 does).

Horovod is imported only when a process runs under it: single-process training never needs it installed.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from qatpipe.devices import gpu_names
from qatpipe.errors import QatpipeError

log = logging.getLogger(__name__)

# set by the launchers in every process they start: horovodrun (Gloo) and mpirun (Open MPI, in MPIJobs)
_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched_by_horovod() -> bool:
    """True inside a process started by horovodrun or mpirun with more than one process."""
    return any(int(os.environ.get(name, "1")) > 1 for name in _SIZE_VARIABLES)


def horovodrun_command(processes: int, argv: list[str], controller: str = "gloo") -> list[str]:
    """`horovodrun -np N --gloo|--mpi python -m qatpipe.cli ARGS` on this host."""
    horovodrun = shutil.which("horovodrun") or os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        raise QatpipeError("--gpus N needs Horovod: `make install` builds it (images/horovod/build-wheel.sh)")
    return [horovodrun, "-np", str(processes), "-H", f"localhost:{processes}", f"--{controller}",
            sys.executable, "-m", "qatpipe.cli", *argv]


def launch(processes: int, argv: list[str], controller: str = "gloo") -> int:
    """Run this command line (`argv`, without the program name) as `processes` Horovod processes on this host
    and wait for them; returns their exit code. NCCL carries the GPU all-reduces when Horovod was built with
    it (the training image); Gloo otherwise (CPU)."""
    gpus = len(gpu_names())
    if gpus and processes > gpus:
        raise QatpipeError(f"--gpus {processes}: this host has {gpus} GPU(s)")
    if not gpus:
        log.warning("--gpus %d: no GPU found; running %d CPU processes that share this host's cores",
                    processes, processes)
    command = horovodrun_command(processes, argv, controller)
    log.info("starting %d Horovod processes (%s): %s", processes, controller, " ".join(command[:6]))
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1"}  # the processes know they are children: HOROVOD_SIZE
    return subprocess.run(command, env=env, check=False).returncode


@dataclass(frozen=True)
class World:
    """One training process's place in the data-parallel job (rank 0 of 1 without Horovod)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def is_chief(self) -> bool:
        """Rank 0: the one process that writes checkpoints, the model, logs and tracking records."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def shard(self) -> tuple[int, int]:
        return self.rank, self.size

    # -- the Horovod pieces; each is a no-op in a single process ---------------------------------------------
    def wrap_optimizer(self, optimizer):
        """All-reduce (average) gradients across processes before each update."""
        if not self.distributed:
            return optimizer
        import horovod.tensorflow.keras as hvd

        return hvd.DistributedOptimizer(optimizer)

    def callbacks(self) -> list:
        """First in the list: start every process from rank 0's weights and optimizer state (also after a
        resume), and average the epoch's metrics so rank 0 logs the job's loss, not its shard's."""
        if not self.distributed:
            return []
        import horovod.tensorflow.keras as hvd

        return [hvd.callbacks.BroadcastGlobalVariablesCallback(0), _epoch_averages()]

    def broadcast(self, value, name: str):
        """Rank 0's value of a small Python object, on every process."""
        if not self.distributed:
            return value
        import horovod.tensorflow as hvd_tf

        return hvd_tf.broadcast_object(value, root_rank=0, name=name)


def _epoch_averages():
    """A callback that averages, at each epoch end, what every process computed from its own shard:
    - the epoch's metrics, so rank 0 logs and checkpoints the job's loss, not its shard's (Horovod's own
      MetricAverageCallback calls Keras 3's backend and fails on tf_keras models);
    - BatchNormalization's moving statistics and QAT's activation ranges (gradients are averaged, these are
      not), so the checkpoint rank 0 writes holds the statistics of all the data and every process goes on
      from the same ones."""
    import horovod.tensorflow as hvd_tf
    import tensorflow as tf
    import tf_keras as keras

    class EpochAverages(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            for variable in self.model.non_trainable_variables:
                if variable.dtype.is_floating:
                    variable.assign(hvd_tf.allreduce(variable.value(), op=hvd_tf.Average,
                                                     name=f"average_{variable.name}"))
            for key, value in sorted((logs or {}).items()):
                logs[key] = float(hvd_tf.allreduce(tf.constant(value, tf.float64), op=hvd_tf.Average,
                                                   name=f"average_metric_{key}"))

    return EpochAverages()


@functools.cache
def init_world() -> World:
    """Initialise Horovod when this process runs under it (pins its GPU, splits the CPU threads), else the
    single-process world. Once per process: later calls return the same world."""
    if not launched_by_horovod():
        return World()
    try:
        import horovod.tensorflow.keras as hvd
    except ImportError as exc:
        raise QatpipeError(f"started by horovodrun/mpirun but Horovod does not import: {exc}") from None
    import tensorflow as tf

    hvd.init()
    world = World(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
    gpus = tf.config.list_physical_devices("GPU")
    try:
        if gpus:  # one GPU per process; memory growth so a process does not take the whole device
            gpu = gpus[world.local_rank % len(gpus)]
            tf.config.experimental.set_memory_growth(gpu, True)
            tf.config.set_visible_devices(gpu, "GPU")
        else:  # processes on one host share its cores instead of each starting a thread per core
            threads = max(1, (os.cpu_count() or 1) // world.local_size)
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(max(1, threads // 2))
    except RuntimeError as exc:  # TensorFlow already started (a model built before training): too late
        log.warning("Horovod rank %d: could not pin devices / threads: %s", world.rank, exc)
    if not world.is_chief:  # rank 0 speaks for the job
        logging.getLogger("qatpipe").setLevel(logging.WARNING)
    log.info("Horovod: %d processes (%d on this host), %s", world.size, world.local_size,
             f"{len(gpus)} GPU(s) visible" if gpus else "CPU")
    return world


__all__ = ["World", "init_world", "launch", "launched_by_horovod", "horovodrun_command"]
