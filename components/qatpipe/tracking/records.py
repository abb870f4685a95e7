"""What a stage hands to experiment tracking: a `tracking.json` written next to its results.

Stage functions never talk to MLflow. They write a StageRecord into their output folder; the component's
runtime logs it when the stage ends, and log-stages at the pipeline's end when the stage was served from the
cache (tracking/stage_logging.py). So a stage's cache key never includes a per-run MLflow id (KFP caching keeps
working), and the stage's results are on disk before any network call can fail.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qatpipe.errors import QatpipeError
from qatpipe.fileio import write_json
from qatpipe.spec import flatten

RECORD_FILE = "tracking.json"
# a stage's human-readable report beside its record: the KFP UI shows it (Markdown output) and MLflow keeps it
REPORT_MARKDOWN = "report.md"


@dataclass
class StageRecord:
    stage: str
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    # metric name -> [[step, value], ...], e.g. per-epoch losses
    history: dict[str, list[list[float]]] = field(default_factory=dict)
    # files or folders, relative to the record's folder, to upload as run artifacts
    artifacts: list[str] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)

    def write(self, folder: str | Path) -> Path:
        return write_json(Path(folder) / RECORD_FILE, asdict(self))

    @classmethod
    def read(cls, folder: str | Path) -> "StageRecord":
        path = Path(folder) / RECORD_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**data)
        except FileNotFoundError:
            raise QatpipeError(f"{path}: no tracking record; the stage did not finish") from None
        except (OSError, ValueError, TypeError) as exc:
            raise QatpipeError(f"{path}: unreadable tracking record: {exc}") from None


def history_from_csv(path: str | Path, step_column: str = "epoch") -> dict[str, list[list[float]]]:
    """Keras CSVLogger output -> {metric: [[epoch, value], ...]} (epochs counted from 1, like the logs)."""
    path = Path(path)
    if not path.is_file():
        return {}
    history: dict[str, list[list[float]]] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            step = int(row[step_column]) + 1
            for name, value in row.items():
                if name == step_column:
                    continue
                try:
                    number = float(value)
                except (TypeError, ValueError):  # CSVLogger writes "NA" for values it does not have
                    continue
                history.setdefault(name, []).append([step, number])
    return history


def numeric_leaves(data: dict[str, Any]) -> dict[str, float]:
    """{'a': {'b': 1.0}, 'c': 'x'} -> {'a.b': 1.0}: the numbers of a nested result, for metrics."""
    return {key: float(value) for key, value in flatten(data).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}
