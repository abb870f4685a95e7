"""The qatpipe wheel an MLflow model carries (deploy/mlflow_model.py), so that `mlflow models serve` on another
machine installs the code that logged the model: no package index holds qatpipe.

`qatpipe_wheel()` gives the wheel of the qatpipe code running now:
- from a source tree (a checkout, an editable install, or PYTHONPATH pointing into one): built from a copy of the
  tree's pyproject.toml, readme and package folders with `pip wheel --no-deps --no-build-isolation --no-index`,
  offline, leaving the tree untouched;
- from a regular install (the images install the wheel built from the repository): the installed files, checked
  against the distribution's RECORD, zipped back into a wheel with the same file set.
Either way once per code version (a digest of the files) in a process: registering four variants builds once.
The model keeps the wheel under wheels/<digest>/: MLflow names the environment it builds for a model after its
requirement strings, so two models of different code (both qatpipe 0.1.0) must not name the same path.
"""

from __future__ import annotations

import atexit
import base64
import csv
import hashlib
import io
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from qatpipe.errors import ModelFileError

log = logging.getLogger(__name__)

WHEELS_DIR = "wheels"  # in the model folder, as mlflow.models.utils.add_libraries_to_model lays it out
DISTRIBUTION = "qatpipe"
# pip writes these at install time: not part of the wheel
_INSTALL_ONLY = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}
_SKIP_DIRS = {"__pycache__", "build", "dist"}
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed: a rebuilt wheel of the same files is the same bytes

_built: dict[str, Path] = {}  # code digest -> wheel, for this process
_cache: Path | None = None


def qatpipe_wheel() -> Path:
    """The wheel of the running qatpipe (see the module docstring), in a folder named after the code's digest; a
    ModelFileError saying what is missing when it cannot be made."""
    import qatpipe

    package = Path(qatpipe.__file__).resolve().parent
    dist = _installed_distribution(package)
    if dist is not None:
        key = "record-" + hashlib.sha256(dist.read_text("RECORD").encode()).hexdigest()[:16]
        if key not in _built:
            _built[key] = _rewheel(dist, _cache_dir() / key)
    else:
        root, files = _source_tree(package)
        key = "tree-" + _files_digest(root, files)
        if key not in _built:
            _built[key] = _build_from_source(root, files, _cache_dir() / key)
    return _built[key]


def _cache_dir() -> Path:
    global _cache
    if _cache is None:
        _cache = Path(tempfile.mkdtemp(prefix="qatpipe-wheels-"))
        atexit.register(shutil.rmtree, _cache, True)
    return _cache


# ---- a source tree -------------------------------------------------------------------------------------------

def _source_tree(package: Path) -> tuple[Path, list[str]]:
    """(the tree's root, the files a wheel is built from, relative to it) for a package imported from a tree
    whose pyproject.toml names qatpipe."""
    import tomllib

    for root in package.parents:
        pyproject = root / "pyproject.toml"
        if not pyproject.is_file():
            continue
        config = tomllib.loads(pyproject.read_text())
        if config.get("project", {}).get("name") != DISTRIBUTION:
            break
        where = config.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get("where", ["."])
        readme = config["project"].get("readme")
        readme = readme.get("file") if isinstance(readme, dict) else readme
        files = ["pyproject.toml"] + [name for name in (readme, "setup.py", "setup.cfg", "MANIFEST.in", "LICENSE")
                                      if name and (root / name).is_file()]
        for folder in where:
            files += [str(p.relative_to(root)) for p in sorted((root / folder).rglob("*"))
                      if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts)
                      and not any(part.endswith(".egg-info") for part in p.relative_to(root).parts)
                      and p.suffix != ".pyc"]
        return root, files
    raise ModelFileError(
        f"cannot put qatpipe in the MLflow model: {package} is neither a regular install (no qatpipe dist-info "
        f"whose RECORD lists its files) nor in a source tree (no pyproject.toml of {DISTRIBUTION!r} above it)")


def _files_digest(root: Path, files: list[str]) -> str:
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0" + hashlib.sha256((root / name).read_bytes()).digest())
    return digest.hexdigest()[:16]


def _build_from_source(root: Path, files: list[str], out: Path) -> Path:
    """`pip wheel` on a copy of `files`: an in-tree build would leave build/ and *.egg-info in the checkout."""
    with tempfile.TemporaryDirectory(prefix="qatpipe-src-") as tmp:
        for name in files:
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, Path(tmp) / name)
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                   "--disable-pip-version-check", "--quiet", "--wheel-dir", str(out), tmp]
        done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(out.glob(f"{DISTRIBUTION}-*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel written"]
        raise ModelFileError(f"cannot build the qatpipe wheel from {root} (pip wheel with {sys.executable}, "
                             f"offline, with the installed setuptools and wheel): {tail[0]}")
    log.info("built %s from %s", wheels[0].name, root)
    return wheels[0]


# ---- a regular install ---------------------------------------------------------------------------------------

def _installed_distribution(package: Path):
    """The installed qatpipe distribution when `package` is its files (a wheel installed it), else None (an
    editable install's dist-info lists no package files; PYTHONPATH may shadow an install)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(DISTRIBUTION)
    except PackageNotFoundError:
        return None
    if dist.read_text("RECORD") is None or "qatpipe/__init__.py" not in {str(f) for f in dist.files or ()}:
        return None
    return dist if Path(dist.locate_file("qatpipe/__init__.py")).resolve() == package / "__init__.py" else None


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _zip_info(path: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(path, _ZIP_DATE)
    info.external_attr = 0o644 << 16  # rw-r--r--, as setuptools writes them
    return info


def _rewheel(dist, out: Path) -> Path:
    """The installed distribution's files as a wheel: what its RECORD lists but scripts (pip generates them from
    entry_points.txt), bytecode and the files pip adds at install time."""
    rows = list(csv.reader(io.StringIO(dist.read_text("RECORD"))))
    info_dir = next(Path(row[0]).parts[0] for row in rows if row and row[0].endswith(".dist-info/METADATA"))
    entries, missing, changed = [], [], []
    for path, recorded, *_ in (row for row in rows if row):
        parts = Path(path).parts
        if (path.startswith(("..", "/")) or "__pycache__" in parts or path.endswith(".pyc")
                or (parts[0] == info_dir and parts[-1] in _INSTALL_ONLY)):
            continue
        file = Path(dist.locate_file(path))
        if not file.is_file():
            missing.append(path)
            continue
        data = file.read_bytes()
        if recorded and _record_hash(data) != recorded:
            changed.append(path)
        entries.append((path, data))
    where = Path(dist.locate_file(""))
    if missing:
        raise ModelFileError(f"cannot rebuild the qatpipe wheel from the install in {where}: {len(missing)} of "
                             f"the files its RECORD lists are missing, e.g. {missing[0]}")
    if changed:  # the model runs the files as they are now: carry those, and say so
        log.warning("%d installed qatpipe file(s) differ from the install's RECORD (e.g. %s): the wheel carries "
                    "them as they are", len(changed), changed[0])
    tags = [line.split(":", 1)[1].strip() for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag:")]
    tag = "-".join(".".join(dict.fromkeys(t.split("-")[i] for t in tags)) for i in range(3)) if tags else "py3-none-any"
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"]).lower()
    wheel = out / f"{name}-{dist.version}-{tag}.whl"
    out.mkdir(parents=True, exist_ok=True)
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in sorted(entries):
            archive.writestr(_zip_info(path), data, zipfile.ZIP_DEFLATED)
            writer.writerow([path, _record_hash(data), len(data)])
        writer.writerow([f"{info_dir}/RECORD", "", ""])
        archive.writestr(_zip_info(f"{info_dir}/RECORD"), record.getvalue(), zipfile.ZIP_DEFLATED)
    log.info("rebuilt %s from the install in %s", wheel.name, where)
    return wheel


__all__ = ["WHEELS_DIR", "qatpipe_wheel"]
