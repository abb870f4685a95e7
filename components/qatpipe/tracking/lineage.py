"""Where a run came from, in MLflow's own terms: the source tags (`mlflow.source.*`, `mlflow.user`, the git
commit) every qatpipe run carries, and the prepared data set as MLflow dataset inputs.

The commit comes from $QATPIPE_GIT_COMMIT (the images set it from their build metadata, images/*/Dockerfile),
else from `git` when the package runs from a checkout. Runs made by MlflowClient.create_run get none of these
on their own (only the fluent API fills them in), so the tracker adds them.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import subprocess
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

GIT_COMMIT_ENV = "QATPIPE_GIT_COMMIT"
USER_ENV = "QATPIPE_USER"  # who a run is for (the KFP run's owner; submit sets it); else the process's user
SOURCE_NAME_TAG, SOURCE_TYPE_TAG = "mlflow.source.name", "mlflow.source.type"
GIT_COMMIT_TAG, USER_TAG = "mlflow.source.git.commit", "mlflow.user"
DATASET_CONTEXT_TAG = "mlflow.data.context"


@lru_cache(maxsize=1)
def git_commit() -> str:
    """The code's git commit, or "" when neither the image nor a checkout says."""
    commit = os.environ.get(GIT_COMMIT_ENV, "").strip()
    if commit:
        return commit
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return found.stdout.strip() if found.returncode == 0 else ""


def source_tags(source_name: str) -> dict[str, str]:
    """The tags MLflow's UI shows as a run's source, user and commit."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        name = f"{source_name} (qatpipe {version('qatpipe')})"
    except PackageNotFoundError:  # pragma: no cover
        name = source_name
    tags = {SOURCE_NAME_TAG: name, SOURCE_TYPE_TAG: "JOB"}
    user = os.environ.get(USER_ENV, "").strip()
    if not user:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no passwd entry for the pod's uid
            user = ""
    if user:
        tags[USER_TAG] = user
    if git_commit():
        tags[GIT_COMMIT_TAG] = git_commit()
    return tags


def dataset_entities(manifest: dict) -> dict:
    """{"train"/"val": mlflow.entities.Dataset} from a prepared data set's dataset.json: name, source URI,
    digest of the files' bytes, counts as the profile."""
    from mlflow.entities import Dataset

    found = {}
    for split in ("train", "val"):
        where = str(manifest.get(split, ""))
        if not where:
            continue
        counts = manifest.get("counts", {}).get(split, {})
        objects = counts.get("objects", {})
        profile = {"images": counts.get("images"), "objects": sum(objects.values()), "per_class": objects}
        digest = manifest.get("digests", {}).get(split) or "unknown"
        name = "/".join(Path(where.split("://", 1)[-1]).parts[-2:]) if manifest.get("source") == "spec" \
            else f"synthetic/{split}"
        found[split] = Dataset(name=name, digest=digest, source_type="s3" if where.startswith("s3://") else "local",
                               source=json.dumps({"uri": where}), profile=json.dumps(profile))
    return found


def dataset_inputs(manifest: dict, splits=("train", "val")) -> list:
    """MLflow DatasetInputs of the data set's splits, tagged with their context (training / evaluation)."""
    from mlflow.entities import DatasetInput, InputTag

    contexts = {"train": "training", "val": "evaluation"}
    entities = dataset_entities(manifest)
    return [DatasetInput(entities[split], tags=[InputTag(DATASET_CONTEXT_TAG, contexts[split])])
            for split in splits if split in entities]


__all__ = ["dataset_entities", "dataset_inputs", "git_commit", "source_tags"]
