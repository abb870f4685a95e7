"""A `qatpipe run --local` output folder, read: which folder holds each stage's output, found by the stage records.

kfp.local writes OUTPUT/kfp/<pipeline>-<time>/<task>/<output>/...; a task folder is named by its task (export,
export-2, ...), so its name does not say which variant's export or evaluation it holds. Every stage writes a
tracking.json (qatpipe.tracking.records) into its output whose `stage` names it, per variant (export_qat,
validate_ptq_partial, ...): this reads those. A re-run into the same folder executes what the cache cannot serve
into a new pipeline run, so where a stage has outputs in several, the newest pipeline run's wins.

The local run's summary and the bench scripts read run folders only through this.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.tracking.records import RECORD_FILE, StageRecord

PIPELINE_ROOT = "kfp"  # OUTPUT/kfp: kfp.local's pipeline_root
SUMMARY_FILE = "summary.json"  # OUTPUT/summary.json: the local run's summary (local_run.py writes it)
RESOLVE_SPEC_TASK = "resolve-spec"  # its outputs are parameters (executor_output.json), no record
MODEL_FILE = "model.onnx"  # a variant's ONNX model in its output folder
# the stage that makes each variant's ONNX model, by its record (stage_table.ONNX's tasks), in the table's order
MODEL_STAGES = {"fp32": "export_fp32", "ptq": "ptq", "ptq-partial": "ptq_partial", "qat": "export_qat"}
# kfp.local's pipeline-run folder suffix (executor_input_utils.get_local_pipeline_resource_name)
_RUN_TIME = re.compile(r"\d{4}(?:-\d{2}){5}-\d{6}$")


def variant_stage(kind: str, variant: str) -> str:
    """The record name of a per-variant stage: ("validate", "ptq-partial") -> validate_ptq_partial."""
    return f"{kind}_{variant.replace('-', '_')}"


@dataclass(frozen=True)
class StageOutput:
    """One stage's output folder (holding its tracking.json) in one pipeline run."""
    stage: str
    folder: Path
    pipeline_run: str


@dataclass(frozen=True)
class Variant:
    """A variant (fp32, ptq, ptq-partial, qat) of the run: its ONNX model, the engine built from it and the
    validate stage's folder that scored that engine (validation.json, metrics.json, detections.json); None where
    the folder holds no finished stage of it."""
    name: str
    onnx: Path | None
    engine: Path | None
    validation: Path | None


class RunFolder:
    """OUTPUT of `qatpipe run --local` (or of run_local): its stages' outputs by stage record."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.pipeline_root = self.path / PIPELINE_ROOT
        if not self.pipeline_root.is_dir():
            raise QatpipeError(f"{self.path}: not a `qatpipe run --local` folder (no {PIPELINE_ROOT}/ in it)")

    def pipeline_runs(self) -> list[Path]:
        """The pipeline-run folders, oldest first (by the time kfp.local names them with)."""
        return sorted((p for p in self.pipeline_root.iterdir() if p.is_dir()), key=_run_order)

    def outputs(self) -> list[StageOutput]:
        """Every stage output (a task's output folder with a tracking record), oldest pipeline run first. Records
        nested deeper (validate's own emulation records) belong to their stage's output, not listed."""
        return [StageOutput(StageRecord.read(record.parent).stage, record.parent, run.name)
                for run in self.pipeline_runs() for record in sorted(run.glob(f"*/*/{RECORD_FILE}"))]

    def find(self, *stages: str) -> Path | None:
        """The newest output folder of the first of `stages` (record names: train, export_qat, ...) that has
        one; None where none has."""
        outputs = self.outputs()
        for stage in stages:
            found = [output.folder for output in outputs if output.stage == stage]
            if found:
                return found[-1]
        return None

    def stage(self, *stages: str) -> Path:
        """find(), or an error naming the run folder and the stages."""
        found = self.find(*stages)
        if found is None:
            raise QatpipeError(f"{self.path}: no finished {' or '.join(stages)} stage")
        return found

    def variants(self) -> dict[str, Variant]:
        """Each variant that has a model, engine or validation in the folder, in the pipeline's order."""
        outputs = self.outputs()
        newest = {output.stage: output.folder for output in outputs}  # later runs overwrite earlier ones
        names = list(MODEL_STAGES)
        for output in outputs:
            for kind in ("build_engine", "validate"):
                if output.stage.startswith(kind + "_"):
                    name = output.stage[len(kind) + 1:].replace("_", "-")
                    if name not in names:
                        names.append(name)
        found = {}
        for name in names:
            model = newest.get(MODEL_STAGES[name]) if name in MODEL_STAGES else None
            engine, validation = (newest.get(variant_stage(kind, name)) for kind in ("build_engine", "validate"))
            variant = Variant(name, model / MODEL_FILE if model else None, engine, validation)
            if variant.onnx or variant.engine or variant.validation:
                found[name] = variant
        return found

    def variant(self, name: str) -> Variant:
        """variants()[name], or an error naming the run folder."""
        found = self.variants()
        if name not in found:
            raise QatpipeError(f"{self.path}: no variant {name!r} (found: {', '.join(found) or 'none'})")
        return found[name]

    def spec(self):
        """The spec the newest pipeline run resolved (the spec, its overrides and the data parameters), as
        resolve-spec handed it to the stages: its dataset paths are the spec's, not the prepared data set's
        (qatpipe.data.prepare.spec_with_prepared_dataset(spec, run.stage("prepare_data")) gives those)."""
        from qatpipe.spec import load_spec_text

        outputs = [run / RESOLVE_SPEC_TASK / "executor_output.json" for run in self.pipeline_runs()]
        outputs = [path for path in outputs if path.is_file()]
        if not outputs:
            raise QatpipeError(f"{self.path}: no finished {RESOLVE_SPEC_TASK} task")
        try:
            text = json.loads(outputs[-1].read_text(encoding="utf-8"))["parameterValues"]["spec"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise QatpipeError(f"{outputs[-1]}: no resolved spec in it ({exc})") from None
        return load_spec_text(text, source=str(outputs[-1]))

    def summary(self) -> dict:
        """OUTPUT/summary.json, the local run's summary."""
        path = self.path / SUMMARY_FILE
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise QatpipeError(f"{path}: no summary; the local run did not finish") from None
        except (OSError, ValueError) as exc:
            raise QatpipeError(f"{path}: unreadable summary: {exc}") from None


def _run_order(folder: Path) -> tuple[str, str]:
    stamp = _RUN_TIME.search(folder.name)
    return (stamp.group(0) if stamp else "", folder.name)


__all__ = ["MODEL_STAGES", "PIPELINE_ROOT", "SUMMARY_FILE", "RunFolder", "StageOutput", "Variant", "variant_stage"]
