"""Benchmark: `mlflow models serve` of a qatpipe model in a fresh environment, as on a machine without qatpipe.

    python bench/mlflow_serve.py --onnx MODEL.onnx --spec SPEC.yaml [--image IMAGE] [--work DIR]
    python bench/mlflow_serve.py --model MODEL_URI_OR_FOLDER [--tracking-uri URI] [--image IMAGE] [--work DIR]

The model: saved here from an ONNX file and its spec (deploy/mlflow_model.py, as the register stage logs it), or
downloaded (`models:/<name>@champion` with --tracking-uri, or a folder). Then `mlflow models serve
--env-manager virtualenv` (or uv) builds the model's environment from nothing: a new venv under WORK/envs
(MLFLOW_ENV_ROOT), pip configuration and find-links switched off (PIP_CONFIG_FILE=/dev/null) and pip's cache in
WORK/pip-cache, empty, so every package comes from PyPI but qatpipe, which comes from the wheel the model
carries. When /ping answers, one image is POSTed to /invocations as a uint8 (1, H, W, 3) tensor. It prints the
detections, the minutes until the server answered (the environment's build, nearly all of it), the size of the
environment, and the CPU; writes WORK/bench_mlflow_serve.json and the server's log WORK/serve.log. The
environment is removed at the end unless --keep. `--env-manager local` serves from this Python (no environment
built): a check of the request only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

log = logging.getLogger("bench")


def prepare_model(args, work: Path) -> Path:
    """The MLflow model folder to serve, under WORK/model."""
    folder = work / "model"
    if folder.exists():
        shutil.rmtree(folder)
    if args.model:
        import mlflow.artifacts

        if args.tracking_uri:
            import mlflow

            mlflow.set_tracking_uri(args.tracking_uri)
        return Path(mlflow.artifacts.download_artifacts(args.model, dst_path=str(folder)))
    from qatpipe.deploy.mlflow_model import save_detector_model
    from qatpipe.spec import load_spec

    return save_detector_model(folder, args.onnx, load_spec(args.spec))


def test_image(args, model: Path):
    """uint8 (1, H, W, 3): --image, else the first image of the spec's val set, else the model's input example."""
    import numpy as np
    from PIL import Image

    path = args.image
    if path is None:
        from qatpipe.spec import load_spec

        val = Path(load_spec(model / "artifacts" / "spec.yaml").dataset.val)
        path = next((p for p in sorted(val.rglob("*")) if p.suffix.lower() in (".jpg", ".jpeg", ".png")), None)
    if path is None:
        return "the input example", np.full((1, 32, 48, 3), 128, np.uint8)
    return str(path), np.asarray(Image.open(path).convert("RGB"), np.uint8)[None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def du(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def downloaded(server_log: Path) -> int:
    """The bytes pip reported downloading ("Downloading NAME (12.3 MB)") in the server's log."""
    import re

    units = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9}
    return int(sum(float(size) * units[unit] for size, unit in re.findall(
        r"Downloading \S+ \(([0-9.]+) ([kMG]?)B\)", server_log.read_text(errors="replace"))))


def serve(model: Path, work: Path, env_manager: str, image, timeout_min: float) -> dict:
    envs, cache = work / "envs", work / "pip-cache"
    for folder in (envs, cache):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHONPATH", "VIRTUAL_ENV", "UV_"))}
    env.update(MLFLOW_ENV_ROOT=str(envs), PIP_CONFIG_FILE=os.devnull, PIP_CACHE_DIR=str(cache),
               UV_CACHE_DIR=str(cache), PIP_DISABLE_PIP_VERSION_CHECK="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))  # local: uvicorn
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(model), "--env-manager", env_manager,
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log.info("%s", " ".join(command))
    started, env_built = time.monotonic(), None
    with open(work / "serve.log", "wb") as server_log:
        server = subprocess.Popen(command, env=env, cwd=work, stdout=server_log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            while True:
                if server.poll() is not None:
                    tail = (work / "serve.log").read_text(errors="replace").strip().splitlines()[-5:]
                    raise SystemExit(f"mlflow models serve exited ({server.returncode}) before answering; "
                                     f"{work / 'serve.log'} ends:\n" + "\n".join(tail))
                if time.monotonic() - started > timeout_min * 60:
                    raise SystemExit(f"no answer on /ping after {timeout_min} minutes: see {work / 'serve.log'}")
                if env_built is None and "exec uvicorn" in (work / "serve.log").read_text(errors="replace"):
                    env_built = time.monotonic() - started  # mlflow starts the scoring server in the new env
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    time.sleep(5)
            ready = time.monotonic() - started
            body = json.dumps({"inputs": {"images": image.tolist()}}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body,
                                             {"Content-Type": "application/json"})
            posted = time.monotonic()
            with urllib.request.urlopen(request, timeout=300) as answer:
                predictions = json.loads(answer.read())["predictions"]
            first_call = time.monotonic() - posted
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(60)
    python = next(envs.glob("*/bin/python"), Path(sys.executable))
    freeze = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True).stdout.splitlines()
    return {"env_minutes": (env_built or ready) / 60, "ready_minutes": ready / 60, "first_call_seconds": first_call,
            "predictions": predictions, "env_bytes": du(envs), "env_packages": len(freeze),
            "downloaded_bytes": downloaded(work / "serve.log"),
            "qatpipe_in_env": [line for line in freeze if line.lower().startswith("qatpipe")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="an MLflow model URI or folder")
    source.add_argument("--onnx", type=Path, help="a qatpipe ONNX model (with --spec)")
    parser.add_argument("--spec", type=Path, help="the spec the ONNX model was made with")
    parser.add_argument("--tracking-uri")
    parser.add_argument("--image", type=Path)
    parser.add_argument("--work", type=Path, default=Path("mlflow_serve_bench"))
    parser.add_argument("--env-manager", default="uv" if shutil.which("uv") else "virtualenv",
                        choices=("virtualenv", "uv", "local"),
                        help="local: this Python's packages, no environment built (a check of the request only)")
    parser.add_argument("--timeout-min", type=float, default=60)
    parser.add_argument("--keep", action="store_true", help="keep the environment and pip cache")
    args = parser.parse_args()
    if args.onnx and not args.spec:
        parser.error("--onnx needs --spec")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)

    model = prepare_model(args, work)
    wheels = sorted(p.relative_to(model).as_posix() for p in (model / "wheels").rglob("*.whl"))
    where, image = test_image(args, model)
    result = serve(model, work, args.env_manager, image, args.timeout_min)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    summary = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
               "env_manager": args.env_manager, "model": str(model), "carried_wheels": wheels,
               "image": where, "image_shape": list(image.shape), **result}
    (work / "bench_mlflow_serve.json").write_text(json.dumps(summary, indent=2))
    print(f"CPU: {cpu} ({os.cpu_count()} cores), env manager {args.env_manager}, the model carries {wheels}")
    print(f"environment built in {result['env_minutes']:.1f} min, server answering after "
          f"{result['ready_minutes']:.1f} min; {result['env_packages']} packages, "
          f"{result['env_bytes'] / 2**30:.2f} GiB "
          f"(downloaded {result['downloaded_bytes'] / 2**30:.2f} GiB); qatpipe there: {result['qatpipe_in_env']}")
    print(f"POST /invocations with {where} {tuple(image.shape)}: {len(result['predictions'])} detections in "
          f"{result['first_call_seconds']:.1f} s (first call)")
    for row in result["predictions"][:5]:
        print("  ", row)
    if not args.keep:
        shutil.rmtree(work / "envs", ignore_errors=True)
        shutil.rmtree(work / "pip-cache", ignore_errors=True)


if __name__ == "__main__":
    main()
