#!/usr/bin/env python3
"""Writes the images' lock files: images/<kind>/requirements.lock, every Python package an image installs,
pinned to one version and one file (sha256), the whole dependency closure, resolved by pip for that image's
Python and platform. The Dockerfiles install exactly these files (`pip install --require-hashes --no-deps`).

    python images/lock.py [KIND ...]        # `make lock`: all three images, or the ones named

Top-level requirements of an image: qatpipe's own ([project].dependencies and [build-system].requires of
pyproject.toml) where the image installs qatpipe, plus images/<kind>/requirements.in (what the image adds:
TensorFlow's CUDA wheels, Polygraphy, the MLflow server...). pip resolves them with `install --dry-run
--ignore-installed --report` for the image's interpreter: wheels only (--only-binary=:all:) for its CPython
version and glibc (--python-version, --platform manylinux_2_<N>_x86_64 and older), and environment markers
evaluated for that interpreter too; pip's --python-version alone leaves them to the running one, so the pip
this script runs has its marker environment replaced (`_pip` below) and the report's `environment` must show it.
Packages published only as source distributions (SDISTS) are allowed as sdists, still hashed, and built in the
image. Where an image installs part of its lock first (Target.first_layer), images/<kind>/requirements-base.lock
holds that part: those packages with their dependencies, the same lines as requirements.lock.

Wheel metadata: pip reads each candidate's METADATA from the file an index serves beside the wheel (PEP 658)
where the index advertises it, else (--use-feature=fast-deps) out of the wheel through HTTP range requests; it
downloads no wheel whole, so a lock costs the index pages and some MB of metadata, not the GBs of TensorFlow and
its CUDA wheels.

Only the standard library, pip and packaging (pip's own copy when not installed) are used; Python >= 3.11.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import tomllib
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
INDEX_URL = "https://pypi.org/simple"


@dataclass(frozen=True)
class Target:
    """An image's Python: what pip resolves for."""

    kind: str
    python: str  # the interpreter's full version
    glibc: str  # its C library: wheels for manylinux_<glibc> and older run there
    interpreter: str  # where that interpreter comes from (for the lock's header)
    project: bool  # the image installs qatpipe: its dependencies and build requirements are top-level
    first_layer: tuple[str, ...] = ()  # installed first, with their dependencies: requirements-base.lock
    venvs: tuple[str, ...] = ()  # other targets whose locks the image installs, each into a venv of its own
    machine: str = "x86_64"

    @property
    def lock(self) -> Path:
        return IMAGES / self.kind / "requirements.lock"

    @property
    def base_lock(self) -> Path | None:
        return IMAGES / self.kind / "requirements-base.lock" if self.first_layer else None

    @property
    def requirements_in(self) -> Path:
        return IMAGES / self.kind / "requirements.in"

    def environment(self) -> dict[str, str]:
        """PEP 508 marker values of the image's interpreter. The kernel's are unknown (the container runs on the
        node's) and left empty."""
        return {
            "implementation_name": "cpython",
            "implementation_version": self.python,
            "os_name": "posix",
            "platform_machine": self.machine,
            "platform_python_implementation": "CPython",
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": self.python,
            "python_version": ".".join(self.python.split(".")[:2]),
            "sys_platform": "linux",
        }

    def platforms(self) -> list[str]:
        """manylinux platform tags the image's glibc runs, best first, as pip orders its own (pip's --platform
        takes them literally: manylinux_2_39 alone would leave out every manylinux2014 wheel)."""
        major, minor = (int(part) for part in self.glibc.split("."))
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        tags = []
        for glibc_minor in range(minor, 4, -1):
            tags.append(f"manylinux_{major}_{glibc_minor}_{self.machine}")
            if glibc_minor in legacy:
                tags.append(f"{legacy[glibc_minor]}_{self.machine}")
        return tags

    def pip_options(self) -> list[str]:
        """pip's options for this target: its tags, wheels only, metadata without whole wheels."""
        options = ["--only-binary=:all:", "--python-version", self.python, "--implementation", "cp",
                   "--use-feature=fast-deps"]
        for platform in self.platforms():
            options += ["--platform", platform]
        return options

    def describe(self) -> str:
        return (f"CPython {self.python}, Linux {self.machine}, glibc {self.glibc} ({self.platforms()[0]} wheels "
                f"and older): {self.interpreter}")


TARGETS = {
    target.kind: target for target in (
        # Ubuntu 24.04's python3.12 (python3.12=3.12.3-* in the Dockerfile), in a venv; glibc 2.39
        Target("training", "3.12.3", "2.39", "Ubuntu 24.04's python3.12 in nvidia/cuda:12.5.1-*-ubuntu24.04",
               project=True, venvs=("modelopt",),
               # TensorFlow and the build tools, in the layer Horovod is built against: a change elsewhere in the
               # lock leaves that layer, and Horovod's long build, cached
               first_layer=("pip", "setuptools", "wheel", "packaging", "tensorflow")),
        # NVIDIA's TensorRT 25.06 image: Ubuntu 24.04 with its python3 (3.12.3), glibc 2.39; TensorRT is the
        # image's own and stays out of the lock (nothing in it depends on `tensorrt`)
        Target("engine", "3.12.3", "2.39",
               "the system Python 3.12 of nvcr.io/nvidia/tensorrt:25.06-py3 (Ubuntu 24.04)", project=True,
               # the build backend first: the rest of the lock (its sdists) and qatpipe are built with it
               first_layer=("setuptools", "wheel")),
        Target("mlflow", "3.11.14", "2.36", "python:3.11.14-slim-bookworm (Debian 12)", project=False),
        # NVIDIA Model Optimizer (ptq.tool: modelopt) in a venv of its own in the training image, /opt/venv-modelopt:
        # it pins onnxruntime-gpu and torch, which qatpipe's venv must not get. No Dockerfile of its own.
        Target("modelopt", "3.12.3", "2.39", "Ubuntu 24.04's python3.12 in the training image, /opt/venv-modelopt",
               project=False, first_layer=("setuptools",)),
    )
}

# Published only as source distributions (no wheel on PyPI): allowed as sdists, still pinned and hashed, and built
# in the image. All pure Python, so their metadata, prepared on this machine, is the image's too.
SDISTS = frozenset({"kfp-server-api", "cppimport"})

WIDTH = 116
HEADER_RULE = "#" + "-" * (WIDTH - 1)


# --- top-level requirements ---------------------------------------------------------------------------------

def read_requirements_in(path: Path) -> list[str]:
    """Requirement lines of a requirements.in: no options, comments and blank lines dropped."""
    lines = []
    if not path.is_file():
        return lines
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            raise SystemExit(f"{path}: options are not supported here: {line}")
        Requirement(line)  # fails early on a typo
        lines.append(line)
    return lines


def top_level(target: Target) -> list[str]:
    """The image's top-level requirements, as written (pyproject.toml's first)."""
    requirements = []
    if target.project:
        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
        requirements += pyproject["project"]["dependencies"]
        requirements += pyproject["build-system"]["requires"]
    requirements += read_requirements_in(target.requirements_in)
    return requirements


# --- the lock file format -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str
    sha256: str
    extras: tuple[str, ...] = ()
    sdist: bool = False

    def line(self) -> str:
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        comment = "  # sdist: no wheel published; built in the image" if self.sdist else ""
        return f"{self.name}{extras}=={self.version} --hash=sha256:{self.sha256}{comment}"


LINE = re.compile(r"(?P<name>[A-Za-z0-9._-]+)(?:\[(?P<extras>[^\]]*)\])?==(?P<version>\S+)"
                  r" --hash=sha256:(?P<sha256>[0-9a-f]{64})(?P<comment>\s+#.*)?")


def read_lock(path: Path) -> list[Pin]:
    """The pins of a lock file (one `name[extras]==version --hash=sha256:...` per line, comments aside)."""
    pins = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip() or raw.startswith("#"):
            continue
        match = LINE.fullmatch(raw.strip())
        if not match:
            raise ValueError(f"{path}:{number}: not a `name==version --hash=sha256:...` line: {raw!r}")
        extras = tuple(e.strip() for e in (match["extras"] or "").split(",") if e.strip())
        pins.append(Pin(canonicalize_name(match["name"]), match["version"], match["sha256"], extras,
                        sdist="sdist" in (match["comment"] or "")))
    return pins


def _comment(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent="# ", subsequent_indent="# " + indent,
                         break_on_hyphens=False, break_long_words=False)


def render(target: Target, pins: list[Pin], pip_version: str, index_url: str, base: bool = False) -> str:
    """A lock file's text: a header saying how it was made, then the pins sorted by name."""
    rel = f"images/{target.kind}"
    name = "requirements-base.lock" if base else "requirements.lock"
    sdists = sorted(p.name for p in pins if p.sdist)
    if base:
        what = (f"{rel}/{name}: the part of {rel}/requirements.lock that the image installs first, "
                f"{', '.join(target.first_layer)} and their dependencies: the same lines as there.")
    else:
        what = (f"{rel}/{name}: every Python package of the {target.kind} image, pinned and hashed: the whole "
                "dependency closure, one file each.")
    sources = ["pyproject.toml's [project].dependencies and [build-system].requires"] if target.project else []
    fields = {
        "resolver": f"pip {pip_version}, `pip install --dry-run --ignore-installed --report`, wheels only"
                    + (f" but for {', '.join(sdists)} (sdist: no wheel published; built in the image)"
                       if sdists else ""),
        "index": index_url,
        "target": target.describe(),
        "top level": ", ".join([*sources, f"{rel}/requirements.in"]),
        "install": f"pip install --require-hashes --no-deps -r {name} ({rel}/Dockerfile)",
        "packages": str(len(pins)),
    }
    lines = _comment(f"{what} Generated by `make lock` (python images/lock.py {target.kind}); do not edit: run it "
                     f"again after changing pyproject.toml's dependencies, {rel}/requirements.in or the base image.")
    lines.append("#")
    for key, value in fields.items():
        lines += _comment(f"{key + ':':<11}{value}", indent=" " * 11)
    lines.append(HEADER_RULE)
    lines += [pin.line() for pin in sorted(pins, key=lambda p: p.name)]
    return "\n".join(lines) + "\n"


# --- dependency closure from pip's report --------------------------------------------------------------------

def closure(roots: list[str], requires: dict[str, list[str]], environment: dict[str, str]) -> set[str]:
    """Canonical names reachable from the requirement strings `roots` through `requires` (canonical name ->
    Requires-Dist strings), markers evaluated in `environment`, extras followed. Raises KeyError on a dependency
    that `requires` lacks."""
    extras_of: dict[str, set[str]] = {}
    todo = [requirement for requirement in map(Requirement, roots)
            if requirement.marker is None or _evaluate(requirement.marker, environment, "")]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        new = {canonicalize_name(e) for e in requirement.extras} | {""}
        if name in extras_of and new <= extras_of[name]:
            continue
        extras_of.setdefault(name, set()).update(new)
        if name not in requires:
            raise KeyError(name)
        for text in requires[name]:
            dependency = Requirement(text)
            if dependency.marker is None or any(
                    _evaluate(dependency.marker, environment, extra) for extra in extras_of[name]):
                todo.append(dependency)
    return set(extras_of)


def _evaluate(marker: Marker, environment: dict[str, str], extra: str) -> bool:
    return marker.evaluate({**environment, "extra": extra})


def _report_requires(report: dict) -> dict[str, list[str]]:
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"].get("requires_dist") or []
            for item in report["install"]}


def pins_from_report(report: dict, requested: list[str]) -> list[Pin]:
    """One Pin per package pip would install; extras as the top-level requirements ask for them."""
    extras: dict[str, set[str]] = {}
    for text in requested:
        requirement = Requirement(text)
        extras.setdefault(canonicalize_name(requirement.name), set()).update(requirement.extras)
    pins = []
    for item in report["install"]:
        name = canonicalize_name(item["metadata"]["name"])
        info = item["download_info"]
        hashes = info.get("archive_info", {}).get("hashes") or {}
        if "sha256" not in hashes:
            raise SystemExit(f"{name}: the index gives no sha256 for {info.get('url')}")
        filename = urllib.parse.unquote(info["url"].rsplit("/", 1)[-1].split("#")[0])
        sdist = not filename.endswith(".whl")
        if sdist and name not in SDISTS:
            raise SystemExit(f"{name}: pip chose the source distribution {filename}; add it to SDISTS in "
                             "images/lock.py only if it has no wheel and is pure Python")
        pins.append(Pin(name, item["metadata"]["version"], hashes["sha256"],
                        tuple(sorted({canonicalize_name(e) for e in extras.get(name, ())})),
                        sdist))
    return pins


# --- running pip for a target --------------------------------------------------------------------------------

# pip settings that only say how to reach the network; every other one (index, find-links, constraints, a
# machine's pip.conf) stays out, so a lock depends on its inputs and the index alone
_TRANSPORT = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_TIMEOUT", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES",
              "PIP_CACHE_DIR", "PIP_NO_CACHE_DIR"}


def pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in _TRANSPORT}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PYTHONWARNINGS="ignore")
    return env


def pip_command(target: Target, args: list[str]) -> list[str]:
    """The command line of `pip ARGS` as it would run on the image's interpreter (see _pip), with pip_env() for
    its environment; add target.pip_options() to ARGS for the image's tags."""
    return [sys.executable, str(Path(__file__).resolve()), "_pip", target.kind, *args]


def run_pip(target: Target, args: list[str], timeout: float = 1800, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(pip_command(target, args), env=pip_env(), timeout=timeout, **kwargs)


def _pip(kind: str, args: list[str]) -> int:
    """pip, in this process, with the image's marker environment and SDISTS allowed as sdists (and, for a dry run
    in hash-checking mode, wheel metadata without the wheels).

    pip evaluates the environment markers of requirements (`; python_version < "3.12"`) with the interpreter it
    runs on, --python-version or not; here they see the image's. --only-binary=:all: (which pip requires with
    --platform) is relaxed for SDISTS only."""
    import pip._vendor.packaging.markers as markers
    from pip._internal.cli.main import main
    from pip._internal.models.format_control import FormatControl

    environment = TARGETS[kind].environment()
    host_environment = markers.default_environment

    def image_environment():
        return {**host_environment(), **environment}

    markers.default_environment = image_environment
    only_formats = FormatControl.get_allowed_formats

    def allowed_formats(self, canonical_name):
        if canonical_name in SDISTS:
            return frozenset({"binary", "source"})
        return only_formats(self, canonical_name)

    FormatControl.get_allowed_formats = allowed_formats

    if "--dry-run" in args:
        # In hash-checking mode pip reads a wheel's metadata out of the whole wheel, downloaded to check its hash:
        # GBs for a lock with TensorFlow's CUDA wheels. A dry run installs nothing, so here it reads the metadata as
        # it does without hashes (PEP 658 file, else ranges of the wheel). The candidates are still only the files
        # whose sha256, as the index gives it, is a pinned one; the report says which file pip took.
        from pip._internal.operations.prepare import RequirementPreparer

        fetch_metadata_only = RequirementPreparer._fetch_metadata_only

        def metadata_only(self, req):
            require_hashes, self.require_hashes = self.require_hashes, False
            try:
                return fetch_metadata_only(self, req)
            finally:
                self.require_hashes = require_hashes

        RequirementPreparer._fetch_metadata_only = metadata_only
    return main(args)


def resolve(target: Target, requirements: list[str], index_url: str, workdir: Path) -> dict:
    """pip's report of installing `requirements` afresh on the image's interpreter."""
    top = workdir / f"{target.kind}.in"
    top.write_text("\n".join(requirements) + "\n")
    report = workdir / f"{target.kind}.json"
    result = run_pip(target, ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                              "--index-url", index_url, *target.pip_options(),
                              "-r", str(top)])
    if result.returncode != 0:
        raise SystemExit(f"pip could not resolve the {target.kind} image's requirements (exit {result.returncode})")
    data = json.loads(report.read_text())
    if data["environment"].get("python_full_version") != target.python:
        raise SystemExit(f"pip resolved for Python {data['environment'].get('python_full_version')}, not "
                         f"{target.python}: the marker environment was not replaced (pip {data['pip_version']})")
    return data


def lock(target: Target, index_url: str, workdir: Path) -> list[Path]:
    requirements = top_level(target)
    report = resolve(target, requirements, index_url, workdir)
    pins = pins_from_report(report, requirements)
    written = [target.lock]
    target.lock.write_text(render(target, pins, report["pip_version"], index_url))
    if target.base_lock:
        roots = [r for r in requirements if canonicalize_name(Requirement(r).name) in target.first_layer]
        missing = set(target.first_layer) - {canonicalize_name(Requirement(r).name) for r in requirements}
        if missing:
            raise SystemExit(f"{target.kind}: first_layer names {sorted(missing)}, not top-level requirements")
        names = closure(roots, _report_requires(report), target.environment())
        base = [pin for pin in pins if pin.name in names]
        target.base_lock.write_text(render(target, base, report["pip_version"], index_url, base=True))
        written.append(target.base_lock)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_pip"]:
        return _pip(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kinds", nargs="*", metavar="KIND",
                        help=f"images to lock: {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--index-url", default=INDEX_URL, help=f"the index (default: {INDEX_URL})")
    options = parser.parse_args(argv)
    kinds = options.kinds or list(TARGETS)
    for kind in kinds:
        if kind not in TARGETS:
            parser.error(f"no image {kind!r}: {', '.join(TARGETS)}")
    with tempfile.TemporaryDirectory(prefix="qatpipe-lock-") as tmp:
        for kind in kinds:
            target = TARGETS[kind]
            print(f"{kind}: resolving for {target.describe()}", file=sys.stderr)
            written = lock(target, options.index_url, Path(tmp))
            for path in written:
                count = len(read_lock(path))
                print(f"{kind}: wrote {path.relative_to(ROOT)} ({count} packages)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
