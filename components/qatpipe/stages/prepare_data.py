"""Stage: the data set every later stage reads: generated (synthetic) or fetched and checked (KITTI folders),
with its manifest, tracking record and a per-class report."""

from __future__ import annotations

from pathlib import Path

from qatpipe.data.prepare import MANIFEST, prepare_dataset
from qatpipe.fileio import atomic_write_text
from qatpipe.spec import ExperimentSpec
from qatpipe.tracking.records import REPORT_MARKDOWN, StageRecord, numeric_leaves


def prepare_data(spec: ExperimentSpec, output: str | Path) -> dict:
    """Prepare the data set into the folder `output` (dataset.json, report.md, tracking.json, and a synthetic
    set's images); returns the manifest."""
    output = Path(output)
    manifest = prepare_dataset(spec, output)
    atomic_write_text(output / REPORT_MARKDOWN, markdown(manifest))
    StageRecord(stage="prepare_data", params={key: manifest[key] for key in ("source", "train", "val")},
                metrics=numeric_leaves(manifest["counts"]), artifacts=[MANIFEST, REPORT_MARKDOWN]).write(output)
    return manifest


def markdown(manifest: dict) -> str:
    """The data set as Markdown: where each split is, and the objects of each class in both."""
    counts = manifest["counts"]
    rows = [f"| {name} | {counts['train']['objects'][name]} | {counts['val']['objects'][name]} |"
            for name in manifest["classes"]]
    return "\n".join([
        f"# Data set ({manifest['source']})", "",
        f"train: `{manifest['train']}` ({counts['train']['images']} images), "
        f"val: `{manifest['val']}` ({counts['val']['images']} images)", "",
        "| class | train objects | val objects |", "|---|---|---|", *rows, ""])


__all__ = ["prepare_data", "markdown"]
