"""The files one export writes beside its ONNX: their names in one place, for the export, the engine backends,
validate, the benches and the tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DLA_SUFFIX = "_dla"
REPORT_SUFFIX = "_export.json"


@dataclass(frozen=True)
class ExportBundle:
    """The export `onnx` (<stem>.onnx) and the files named after it in its folder. Which of them exist depends
    on the model and the spec: the QAT ones for a Q/DQ model, fp16 under export.fp16_onnx, the DLA pair under
    export.target dla."""

    onnx: Path

    def __post_init__(self):
        object.__setattr__(self, "onnx", Path(self.onnx))

    def _beside(self, suffix: str) -> Path:
        return self.onnx.with_name(f"{self.onnx.stem}{suffix}")

    @property
    def folder(self) -> Path:
        return self.onnx.parent

    @property
    def report(self) -> Path:
        """The export's report: opset, size, the Q/DQ check, the differences from TensorFlow."""
        return self._beside(REPORT_SUFFIX)

    @property
    def ptq_report(self) -> Path:
        """The PTQ stage's report beside the INT8 model it wrote."""
        return self._beside("_ptq.json")

    @property
    def fp16(self) -> Path:
        """The FP16 form: float regions in FP16 through explicit casts (export.fp16_onnx)."""
        return self._beside("_fp16.onnx")

    @property
    def implicit(self) -> Path:
        """A QAT export's FP32 graph without Q/DQ, for TensorRT <= 10's implicit INT8 with `cache`."""
        return self._beside("_implicit.onnx")

    @property
    def cache(self) -> Path:
        """A QAT export's activation scales as a TAO / TensorRT calibration cache, for `implicit`."""
        return self._beside(".cache")

    @property
    def scales(self) -> Path:
        """The same scales (and amax) as JSON."""
        return self._beside("_scales.json")

    @property
    def dla(self) -> Path:
        """The DLA form (export.target dla): the implicit graph, fixed batch, NCHW input."""
        return self._beside(f"{DLA_SUFFIX}.onnx")

    @property
    def dla_cache(self) -> Path:
        """The DLA form's full-tensor calibration cache."""
        return self._beside(f"{DLA_SUFFIX}.cache")

    @property
    def dla_report(self) -> Path:
        return self.folder / "dla_report.json"

    @property
    def dla_report_markdown(self) -> Path:
        return self.folder / "dla_report.md"

    @classmethod
    def of_report(cls, report: str | Path) -> "ExportBundle":
        """The bundle whose export report is `report` (<stem>_export.json)."""
        report = Path(report)
        return cls(report.with_name(f"{report.name.removesuffix(REPORT_SUFFIX)}.onnx"))

    @classmethod
    def of_dla_form(cls, path: str | Path) -> "ExportBundle | None":
        """The bundle whose DLA form is `path`, None when `path` is no DLA form."""
        path = Path(path)
        if not path.stem.endswith(DLA_SUFFIX):
            return None
        return cls(path.with_name(f"{path.stem.removesuffix(DLA_SUFFIX)}{path.suffix}"))


__all__ = ["DLA_SUFFIX", "REPORT_SUFFIX", "ExportBundle"]
