"""The wheelhouse of an offline image build: every file the images' lock files pin, downloaded on the host.

    python images/wheelhouse.py [--cpu] [--dest .cache/wheelhouse] [KIND ...]   # default: every image
    python images/wheelhouse.py --check [--cpu] [--dest ...] [KIND ...]        # only check it is complete

The builds of `images/build.sh --cpu` have no network: the Dockerfiles install from this folder (`pip install
--no-index --find-links`, still --require-hashes against the same locks). pip downloads each pin for the image's
Python and platform (images/lock.py's targets) with its hash checked; only the pins whose file is missing are
downloaded, so a complete wheelhouse needs no network (fresh clones can share one: --dest, or images/build.sh's
QATPIPE_CACHE). --cpu leaves out what only a GPU uses: NVIDIA's CUDA wheels (the training lock's nvidia-* pins,
TensorFlow's [and-cuda]) and the Model Optimizer venv (its torch and CUDA wheels). Also the Horovod sdist, which
the training image builds. --check names the first pin without its file (the lock changed since the wheelhouse
was made) and exits 2.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
import tempfile
from pathlib import Path

IMAGES = Path(__file__).resolve().parent
ROOT = IMAGES.parent
DEFAULT_DEST = ROOT / ".cache" / "wheelhouse"
HOROVOD_VERSION = "0.28.1"  # the training Dockerfile's HOROVOD_VERSION


def _lock_module():
    spec = importlib.util.spec_from_file_location("qatpipe_images_lock", IMAGES / "lock.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


LOCK = _lock_module()


def gpu_only(name: str) -> bool:
    """CUDA wheels: installed only by the GPU build (the Dockerfiles skip the same names with VARIANT=cpu)."""
    return name.startswith("nvidia-")


def locks(kind: str, cpu: bool) -> list[tuple[object, Path]]:
    """(target, lock file) the image installs: its base lock, its lock, and its venvs' (none for --cpu)."""
    targets = [LOCK.TARGETS[kind]]
    if not cpu:
        targets += [LOCK.TARGETS[venv] for venv in LOCK.TARGETS[kind].venvs]
    return [(target, path) for target in targets for path in (target.base_lock, target.lock) if path]


def pins(path: Path, cpu: bool) -> list:
    return [pin for pin in LOCK.read_lock(path) if not (cpu and gpu_only(pin.name))]


def _hashes(dest: Path) -> set[str]:
    found = set()
    for path in dest.iterdir():
        if path.is_file() and path.suffix in (".whl", ".gz", ".zip"):
            found.add(hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def _horovod_sdist(dest: Path) -> bool:
    return bool(list(dest.glob(f"horovod-{HOROVOD_VERSION}.tar.gz")))


def check(kinds: list[str], cpu: bool, dest: Path) -> str | None:
    """The first pin whose file is not in DEST, as a message; None when every one is there."""
    if not dest.is_dir():
        return f"no wheelhouse at {dest}: run `python images/wheelhouse.py{' --cpu' if cpu else ''}`"
    present = _hashes(dest)
    for kind in kinds:
        for _, path in locks(kind, cpu):
            for pin in pins(path, cpu):
                if pin.sha256 not in present:
                    return (f"{path.relative_to(ROOT)}: {pin.name}=={pin.version} (sha256 {pin.sha256[:12]}...) is "
                            f"not in the wheelhouse {dest}: run `python images/wheelhouse.py"
                            f"{' --cpu' if cpu else ''}` (the lock changed since it was made)")
    if "training" in kinds and not _horovod_sdist(dest):
        return f"horovod-{HOROVOD_VERSION}.tar.gz is not in the wheelhouse {dest}"
    return None


def download(kinds: list[str], cpu: bool, dest: Path) -> None:
    """pip downloads the pins whose file is not in DEST yet (none: pip is not run, nothing goes to the network)."""
    dest.mkdir(parents=True, exist_ok=True)
    present = _hashes(dest)
    with tempfile.TemporaryDirectory(prefix="qatpipe-wheelhouse-") as tmp:
        for kind in kinds:
            for target, path in locks(kind, cpu):
                pinned = pins(path, cpu)
                missing = [pin for pin in pinned if pin.sha256 not in present]
                if not missing:
                    continue
                requirements = Path(tmp) / f"{kind}-{path.name}"
                requirements.write_text("".join(pin.line().split("  #")[0] + "\n" for pin in missing))
                options = [o for o in target.pip_options() if o != "--use-feature=fast-deps"]
                print(f"{kind}: {path.relative_to(ROOT)}: {len(missing)} of its {len(pinned)} files -> {dest}",
                      file=sys.stderr)
                LOCK.run_pip(target, ["download", "--quiet", "--no-deps", "--require-hashes", "--dest", str(dest),
                                      "-r", str(requirements), *options], check=True)
                present.update(pin.sha256 for pin in missing)  # the next lock's copies of the same files
        if "training" in kinds and not _horovod_sdist(dest):
            LOCK.run_pip(LOCK.TARGETS["training"], ["download", "--quiet", "--no-deps", "--no-binary", ":all:",
                                                    "--dest", str(dest), f"horovod=={HOROVOD_VERSION}"], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kinds", nargs="*", metavar="KIND", help="training, engine, mlflow (default: all three)")
    parser.add_argument("--cpu", action="store_true", help="leave out the GPU-only wheels")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"the folder (default: {DEFAULT_DEST})")
    parser.add_argument("--check", action="store_true", help="only check that every pinned file is there")
    options = parser.parse_args(argv)
    kinds = options.kinds or ["training", "engine", "mlflow"]
    for kind in kinds:
        if kind not in ("training", "engine", "mlflow"):
            parser.error(f"no image {kind!r}: training, engine, mlflow")
    if not options.check:
        download(kinds, options.cpu, options.dest)
    problem = check(kinds, options.cpu, options.dest)
    if problem:
        print(f"images/wheelhouse.py: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
