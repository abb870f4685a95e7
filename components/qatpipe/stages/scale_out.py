"""Run the train / retrain stage at the scale asked for: one process, N Horovod processes on this host, or an
MPIJob or TrainJob across nodes (what the KFP train and retrain components call).

- 1 node, 1 process: the stage function, in this process.
- 1 node, N processes: `qatpipe train|retrain ... --gpus N` (horovodrun in this pod).
- W nodes (W > 1): a job of W workers with N processes each: an MPIJob (mpi-operator, `kubeflow.org/v2beta1`,
  or the Training Operator's `v1`) or a Kubeflow Trainer v2 TrainJob (`launcher` "trainjob"), the same pods
  either way. Its pods cannot see this pod's files, so the job works in a folder of the shared
  dataset-cache volume (ReadWriteMany): the spec, the data set when it is a local folder, the pruned model and
  the results go there, and the results come back to `results_dir` when the job succeeded. The folder is named
  after the job's inputs: a retried pipeline task resumes from the checkpoints the failed job left.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.spec import ExperimentSpec, dump_spec, spec_to_yaml

log = logging.getLogger(__name__)

LAUNCHERS = ("mpijob", "trainjob")


@dataclass
class ClusterSettings:
    """Where and how a multi-node job runs (pipeline parameters, not experiment settings)."""

    image: str
    shared_pvc: str  # claim name of the ReadWriteMany volume mounted at shared_mount in this pod too
    shared_mount: str
    api_version: str = "v2beta1"
    namespace: str | None = None  # None: this pod's namespace
    secret_env: str | None = None  # the credentials Secret, given to the job's containers
    secret_env_keys: list = field(default_factory=list)  # its keys: mpirun forwards them by name
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)
    timeout_seconds: int = 24 * 3600
    launcher: str = "mpijob"  # or "trainjob": Kubeflow Trainer v2 (api_version is then not used)
    # the job's pods' ServiceAccount. None: this pod's own, so that the job's pods have the pipeline's identity
    # (Istio's AuthorizationPolicy for MLflow names it; manifests/overlays/kubeflow), not the namespace's default
    service_account: str | None = None

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise QatpipeError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")


def run_training_stage(stage: str, spec: ExperimentSpec, results_dir: str | Path, *, pruned_model: Path | None = None,
                       processes_per_node: int = 1, nodes: int = 1, cluster: ClusterSettings | None = None,
                       use_mpijob: bool = False, work_root: str | Path | None = None,
                       tensorboard_dir: str | Path | None = None, stage_name: str | None = None,
                       resume_uri: str | None = None) -> dict:
    """Train (`stage` "train") or retrain (`stage` "retrain", from `pruned_model`) into `results_dir`;
    returns the training summary. `use_mpijob`: an MPIJob even for one node (this process only follows it).

    On this host the training works in a folder of `work_root` (the KFP components pass this run's folder on
    the cache volume) named after the stage's inputs: a retried task (pre-emption, eviction) resumes from the
    last checkpoint there. Without `work_root` the folder is temporary; with `resume_uri` (s3://, the pipeline's
    checkpoint_uri and run id) its resume state is mirrored there after every checkpoint and restored by a
    retry (training/resume_store.py). Only the model and its records come to
    `results_dir` (the Model artifact every later stage downloads), never the checkpoints; the TensorBoard
    event files go to `tensorboard_dir` when it is given (the KFP components' own artifact), else with them.
    `stage_name` names the tracking record and the live curves (default: the stage's own, e.g. retrain_qat)."""
    if stage not in ("train", "retrain"):
        raise ValueError(stage)
    if processes_per_node < 1 or nodes < 1:
        raise QatpipeError(f"need at least 1 process and 1 node, got {processes_per_node} and {nodes}")
    results_dir = Path(results_dir)
    if nodes == 1 and not use_mpijob:
        with _work_folder(stage, spec, pruned_model, processes_per_node, work_root, resume_uri) as work:
            if processes_per_node == 1:
                _in_process(stage, spec, work, pruned_model, stage_name)
            else:
                _on_this_host(stage, spec, work, pruned_model, processes_per_node, stage_name)
            return _keep_results(work, results_dir, tensorboard_dir)
    if cluster is None or not cluster.shared_pvc:
        raise QatpipeError(f"{nodes} node(s) as a cluster job: it needs a shared ReadWriteMany volume for its data and "
                           "results; compile the pipeline with --cache-pvc NAME (manifests/ makes qatpipe-cache)")
    return _on_mpijob(stage, spec, results_dir, pruned_model, processes_per_node, nodes, cluster, tensorboard_dir,
                      stage_name)


# what stays in the work folder and never reaches the Model artifact: resume state
RESUME_STATE = ("checkpoints", "best")


@contextlib.contextmanager
def _work_folder(stage, spec, pruned_model, processes, work_root, resume_uri=None):
    """The training's working folder (see run_training_stage); removed once the results are kept. Without a
    durable root, a temporary one: mirrored to S3 under `resume_uri` when given, else nothing to resume from."""
    if work_root is None:
        with tempfile.TemporaryDirectory(prefix=f"qatpipe-{stage}-") as tmp:
            if not resume_uri:
                yield Path(tmp)
                return
            from qatpipe.training import resume_store

            mirror = f"{resume_uri.rstrip('/')}/{_job_folder_name(stage, spec, pruned_model, f'1x{processes}')}"
            if resume_store.restore(mirror, tmp):
                log.info("%s: resuming from the resume state an earlier attempt mirrored to %s", stage, mirror)
            previous = os.environ.get(resume_store.RESUME_URI_ENV)
            os.environ[resume_store.RESUME_URI_ENV] = mirror  # the training processes upload there
            try:
                yield Path(tmp)
            finally:
                if previous is None:
                    os.environ.pop(resume_store.RESUME_URI_ENV, None)
                else:
                    os.environ[resume_store.RESUME_URI_ENV] = previous
            resume_store.clear(mirror)  # done: the model is kept
        return
    folder = Path(work_root) / _job_folder_name(stage, spec, pruned_model, f"1x{processes}")
    if (folder / "checkpoints").is_dir():
        log.info("%s: resuming in %s (an earlier attempt of this task left checkpoints)", stage, folder)
    folder.mkdir(parents=True, exist_ok=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)  # done: only an interrupted training's folder stays, for the retry


def _keep_results(work: Path, results_dir: Path, tensorboard_dir: str | Path | None = None) -> dict:
    """Copy the trained model and its records (not the resume state) to `results_dir`, the TensorBoard event
    files to `tensorboard_dir` when given; returns the training summary, its model path pointing there."""
    from qatpipe.fileio import write_json
    from qatpipe.stages.train import SUMMARY_FILE, TENSORBOARD_DIR

    summary = _summary(work)
    results_dir.mkdir(parents=True, exist_ok=True)
    for path in work.iterdir():
        if path.name in RESUME_STATE:
            continue
        if path.name == TENSORBOARD_DIR and tensorboard_dir is not None:
            shutil.copytree(path, Path(tensorboard_dir), dirs_exist_ok=True)
        elif path.is_dir():
            shutil.copytree(path, results_dir / path.name, dirs_exist_ok=True)
        else:
            shutil.copy2(path, results_dir / path.name)
    summary["model"] = str(results_dir / Path(summary["model"]).name)
    write_json(results_dir / SUMMARY_FILE, summary)
    return summary


def _in_process(stage, spec, results_dir, pruned_model, stage_name=None) -> dict:
    if stage == "train":
        from qatpipe.stages.train import train

        return train(spec, results_dir, **({"stage_name": stage_name} if stage_name else {}))
    from qatpipe.stages.retrain import retrain

    return retrain(spec, pruned_model, results_dir, stage_name=stage_name)


def _command(stage: str, spec_path: Path, results_dir: Path, pruned_model: Path | None,
             stage_name: str | None = None) -> list[str]:
    args = [stage, "-e", str(spec_path), "-r", str(results_dir)]
    if stage == "retrain":
        args += ["-m", str(pruned_model)]
    return args + ["--stage-name", stage_name] if stage_name else args


def _summary(results_dir: Path) -> dict:
    from qatpipe.stages.train import SUMMARY_FILE

    path = results_dir / SUMMARY_FILE
    if not path.is_file():
        raise QatpipeError(f"{results_dir}: the training processes ended without writing {SUMMARY_FILE}")
    return json.loads(path.read_text())


def _on_this_host(stage, spec, results_dir, pruned_model, processes, stage_name=None) -> dict:
    from qatpipe.training.distributed import launch

    results_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qatpipe-spec-") as folder:
        spec_path = Path(folder) / "spec.yaml"  # qat.enabled and the resolved data paths travel in it
        dump_spec(spec, spec_path)
        code = launch(processes, _command(stage, spec_path, results_dir, pruned_model, stage_name)
                      + ["--gpus", str(processes)])
    if code != 0:
        raise QatpipeError(f"{stage} on {processes} Horovod processes failed (exit code {code}); the log above "
                           "shows each process's output")
    return _summary(results_dir)


def _job_folder_name(stage: str, spec: ExperimentSpec, pruned_model: Path | None, layout: str) -> str:
    digest = hashlib.sha256(spec_to_yaml(spec).encode() + layout.encode())
    if pruned_model is not None:
        digest.update(Path(pruned_model).read_bytes())
    return f"qatpipe-{stage}-{'qat-' if spec.qat.enabled else ''}{digest.hexdigest()[:10]}"


def _stage_local_data(spec: ExperimentSpec, shared: Path) -> ExperimentSpec:
    """Local train/val folders are copied next to the job (its pods mount only the shared volume); s3://
    data stays where it is and the job's pods cache it on the shared volume."""
    spec = spec.model_copy(deep=True)
    for split in ("train", "val"):
        where = getattr(spec.dataset, split)
        if where is None or "://" in where:
            continue
        target = shared / "dataset" / split
        if not target.is_dir():
            shutil.copytree(where, target.with_name(f".{split}.partial"), dirs_exist_ok=True)
            target.with_name(f".{split}.partial").rename(target)
        setattr(spec.dataset, split, str(target))
    spec.dataset.cache_dir = str(shared.parent / "dataset-cache")
    pretrained = spec.model.pretrained
    if pretrained and ":" not in pretrained and Path(pretrained).is_file():  # a local weights file goes along too
        target = shared / f"pretrained{Path(pretrained).suffix}"
        shutil.copyfile(pretrained, target)
        spec.model.pretrained = str(target)
    return spec


def worker_resources(processes: int):
    """A worker's requests and limits for `processes` Horovod processes (one per GPU): per process 2 CPUs
    and 8 GiB requested (16 GiB at least), the memory limit twice that; no CPU limit, since CFS throttling
    starves the tf.data input pipeline."""
    from qatpipe.cluster.mpijob import Resources

    memory = max(16, 8 * processes)
    return Resources(cpu_request=str(2 * processes), memory_request=f"{memory}Gi",
                     memory_limit=f"{2 * memory}Gi")


def _on_mpijob(stage, spec, results_dir, pruned_model, processes, nodes, cluster: ClusterSettings,
               tensorboard_dir=None, stage_name=None) -> dict:
    from qatpipe.cluster.kube_client import pod_namespace, pod_service_account
    from qatpipe.cluster.mpijob import MpiJobRequest, PvcMount, job_name

    name = _job_folder_name(stage, spec, pruned_model, f"{nodes}x{processes}")
    shared = Path(cluster.shared_mount) / "jobs" / name
    shared.mkdir(parents=True, exist_ok=True)
    job_spec = _stage_local_data(spec, shared)
    dump_spec(job_spec, shared / "spec.yaml")
    job_model = None
    if pruned_model is not None:
        job_model = shared / "pruned.keras"
        shutil.copyfile(pruned_model, job_model)
    job_results = shared / "results"
    namespace = cluster.namespace or pod_namespace()
    if not namespace:
        raise QatpipeError("multi-node job: no namespace given and this pod's service account namespace is unreadable")
    request = MpiJobRequest(
        worker_resources=worker_resources(processes),
        name=job_name(name, ""), namespace=namespace, image=cluster.image,
        command=["qatpipe", *_command(stage, shared / "spec.yaml", job_results, job_model, stage_name)],
        workers=nodes, gpus_per_worker=processes,
        # a TrainJob's workers serve SSH, as mpi-operator's (v2beta1) do
        api_version="v2beta1" if cluster.launcher == "trainjob" else cluster.api_version,
        secret_env=cluster.secret_env, secret_env_keys=list(cluster.secret_env_keys),
        pvc=PvcMount(cluster.shared_pvc, cluster.shared_mount),
        node_selector=dict(cluster.node_selector), tolerations=list(cluster.tolerations),
        timeout_seconds=cluster.timeout_seconds, env={"TF_USE_LEGACY_KERAS": "1", **_live_curves_env()},
        service_account=cluster.service_account or pod_service_account(),
    )
    launcher, manifest = _launcher(request, cluster, namespace)
    log.info("%s: %s %s/%s, %d workers x %d processes, working in %s", stage, manifest["kind"], namespace,
             request.name, nodes, processes, shared)
    with _sigterm_as_exit():  # a cancelled or evicted task still deletes its job (the launcher's `finally`)
        # the job's name is its folder's: a job left by an earlier attempt of this work is replaced, and the
        # new one resumes from the checkpoints in the folder
        launcher.run(manifest, timeout_seconds=cluster.timeout_seconds, replace_existing=True)
    summary = _keep_results(job_results, results_dir, tensorboard_dir)
    shutil.rmtree(shared, ignore_errors=True)  # done: only a failed job's folder stays, for the retry
    log.info("%s: results of %s %s copied to %s", stage, manifest["kind"], request.name, results_dir)
    return summary


def _launcher(request, cluster: ClusterSettings, namespace: str):
    """(the launcher, the job's manifest) for `cluster.launcher`."""
    from qatpipe.cluster.launcher import MpiJobLauncher, TrainJobLauncher
    from qatpipe.cluster.mpijob import mpijob_manifest
    from qatpipe.cluster.trainjob import training_runtime_manifest, trainjob_manifest

    if cluster.launcher == "trainjob":
        return (TrainJobLauncher(namespace=namespace, runtime=training_runtime_manifest(request)),
                trainjob_manifest(request))
    return MpiJobLauncher(namespace=namespace, api_version=cluster.api_version), mpijob_manifest(request)


@contextlib.contextmanager
def _sigterm_as_exit():
    """Kubernetes stops a pod with SIGTERM: turn it into SystemExit so `finally` blocks run."""
    def stop(signum, frame):
        raise SystemExit(f"stopped by signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _live_curves_env() -> dict[str, str]:
    """The pipeline's MLflow run, for the job's rank 0 to log its curves to (tracking/live.py)."""
    from qatpipe.tracking.live import PARENT_RUN_ENV

    return {PARENT_RUN_ENV: os.environ[PARENT_RUN_ENV]} if os.environ.get(PARENT_RUN_ENV) else {}


__all__ = ["ClusterSettings", "run_training_stage"]
