"""`qatpipe run --local --runner docker`: each stage in its image (kfp.local's DockerRunner), MLflow in its own.

The images are those `make images` builds, under the names of qatpipe_kfp.settings. Docker or podman
(`podman system service`, with DOCKER_HOST pointing at its socket) both serve: the Docker SDK talks to either.
The containers share the host's network (the stages reach the MLflow server at 127.0.0.1) and run as the
calling user, so that what they write into the output folder, bind-mounted at its own path, belongs to that user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from qatpipe.errors import QatpipeError

log = logging.getLogger(__name__)

CONTAINER_LOG_FILE = "containers.log"  # every container's output, kept beside summary.json
MLFLOW_START_TIMEOUT = 120.0  # seconds for the MLflow server to answer (a cold start on 2 busy cores: ~20 s)


def docker_client():
    """The Docker SDK's client for $DOCKER_HOST (Docker, or podman's Docker-compatible service)."""
    try:
        import docker
    except ImportError:
        raise QatpipeError("--runner docker needs the Docker SDK: pip install docker") from None
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # noqa: BLE001 - the SDK raises several kinds for "no engine"
        raise QatpipeError(
            f"--runner docker: no container engine answers ({type(exc).__name__}): install podman (apt-get install "
            "podman runc; then `podman system service --time=0 unix:///run/podman.sock &` and "
            "DOCKER_HOST=unix:///run/podman.sock) or Docker") from None
    return client


@contextlib.contextmanager
def engine_socket():
    """$DOCKER_HOST for the run: as set, or Docker's socket, or else a podman service started for the run's length
    on a socket of its own (podman has no daemon; a short /tmp path: sockets' paths are limited to 107 bytes)."""
    if os.environ.get("DOCKER_HOST") or Path("/var/run/docker.sock").exists() or not shutil.which("podman"):
        yield os.environ.get("DOCKER_HOST")
        return
    folder = Path(tempfile.mkdtemp(prefix="qatpipe-podman-"))
    sock = folder / "podman.sock"
    service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and service.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if not sock.exists():
            raise QatpipeError(f"`podman system service` did not start (exit {service.poll()}): run it yourself and "
                               "set DOCKER_HOST to its socket")
        saved = os.environ.get("DOCKER_HOST")
        os.environ["DOCKER_HOST"] = f"unix://{sock}"
        try:
            yield os.environ["DOCKER_HOST"]
        finally:
            if saved is None:
                os.environ.pop("DOCKER_HOST", None)
            else:
                os.environ["DOCKER_HOST"] = saved
    finally:
        service.terminate()
        try:
            service.wait(timeout=20)
        except subprocess.TimeoutExpired:
            service.kill()
        shutil.rmtree(folder, ignore_errors=True)


def check_images(client, images: dict[str, str]) -> None:
    """Fail before any work when an image is missing, rather than have kfp.local try to pull it."""
    import docker

    for kind, image in images.items():
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            raise QatpipeError(f"--runner docker: no image {image} ({kind}): build the images with `make images` "
                               "(or set QATPIPE_IMAGE_REPOSITORY / QATPIPE_IMAGE_TAG to those you built)") from None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def user() -> str:
    return f"{os.getuid()}:{os.getgid()}"


@contextlib.contextmanager
def mlflow_server(client, image: str, out: Path):
    """An MLflow tracking server from the MLflow image for the length of the run, its SQLite store and its
    artifacts in OUT (the same files as the subprocess run's local store). Yields its URI."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    (out / "mlartifacts").mkdir(parents=True, exist_ok=True)
    command = ["server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{out / 'mlflow.db'}",
               "--artifacts-destination", str(out / "mlartifacts")]
    container = client.containers.run(image, command, detach=True, network_mode="host", user=user(),
                                      environment={"HOME": "/tmp"}, volumes={str(out): {"bind": str(out),
                                                                                         "mode": "rw"}},
                                      name=f"qatpipe-mlflow-{port}")
    try:
        _wait_until_up(container, uri)
        log.info("MLflow server %s (container %s) at %s", image, container.short_id, uri)
        yield uri
    finally:
        logs = container.logs().decode(errors="replace")
        (out / "mlflow-server.log").write_text(logs)
        with contextlib.suppress(Exception):
            container.stop(timeout=10)
        with contextlib.suppress(Exception):
            container.remove(force=True)


def _wait_until_up(container, uri: str) -> None:
    deadline = time.monotonic() + MLFLOW_START_TIMEOUT
    while time.monotonic() < deadline:
        container.reload()
        if container.status in ("exited", "dead"):
            logs = container.logs().decode(errors="replace")[-2000:]
            raise QatpipeError(f"the MLflow server container exited: {logs}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise QatpipeError(f"the MLflow server container did not answer at {uri} within {MLFLOW_START_TIMEOUT:.0f} s")


def docker_runner(out: Path, environment: dict[str, str]):
    """kfp.local's DockerRunner: host network, the calling user, OUT mounted at its own path and the working
    directory (stage logs, the run folder and the dataset cache live there, beside kfp.local's pipeline root),
    and `environment` in every container: kfp.local adds it to the tasks' own variables when it starts one, but
    leaves it out of its cache key, so a re-run's new MLflow port still finds the finished stages."""
    import kfp.local
    from docker.types import Mount

    return kfp.local.DockerRunner(network_mode="host", user=user(), working_dir=str(out), environment=environment,
                                  mounts=[Mount(target=str(out), source=str(out), type="bind")])


def home_env(out: Path) -> dict[str, str]:
    """HOME for every container, a folder in the run's output: the calling user may have no home in the image, and
    Keras and MLflow write there (the caller's environment does not reach the containers)."""
    home = out / ".home"
    home.mkdir(parents=True, exist_ok=True)
    return {"HOME": str(home)}


def run_container(client, image: str, command: list[str], volumes: dict, **run_args) -> int:
    """kfp.local's run_docker_container without its race: it runs the container with auto_remove and, when the
    container is gone before it asks for the exit status (podman removes it at once), assumes success, so a stage
    that failed fast passed and the next one failed on a missing output. Here the container is removed only after
    its status is read."""
    container = client.containers.run(image=image, command=command, detach=True, stdout=True, stderr=True,
                                      volumes=volumes, **run_args)
    print(f"image {image}: container {container.short_id}\n")
    try:
        for line in container.logs(stream=True, follow=True):
            print(line.decode(errors="replace"), end="")
        status = container.wait()["StatusCode"]
        if status:  # 137: killed (SIGKILL, as `podman kill` or the OOM killer ends it)
            print(f"image {image}: container {container.short_id} exited with status {status}\n")
        return status
    finally:
        with contextlib.suppress(Exception):
            container.remove(force=True)


@contextlib.contextmanager
def exit_status_kept():
    """kfp.local's DockerRunner with run_container above in place of its own, for the run's length."""
    from kfp.local import docker_task_handler

    original = docker_task_handler.run_docker_container
    docker_task_handler.run_docker_container = run_container
    try:
        yield
    finally:
        docker_task_handler.run_docker_container = original


class Tee:
    """sys.stdout, also written to a file: kfp.local prints each container's output, then removes it."""

    def __init__(self, stream, path: Path):  # line-buffered: the file follows the run (`tail -f` it)
        self.stream, self.file = stream, path.open("a", encoding="utf-8", buffering=1)

    def write(self, text):
        self.file.write(text)
        return self.stream.write(text)

    def flush(self):
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def container_logs(out: Path):
    """Keep every container's output in OUT/containers.log (kfp.local removes the containers)."""
    path = out / CONTAINER_LOG_FILE
    path.unlink(missing_ok=True)
    saved = sys.stdout
    sys.stdout = tee = Tee(saved, path)
    try:
        yield path
    finally:
        sys.stdout = saved
        tee.file.close()
