"""Generated KITTI data sets, the embedded data of the main job and its tests: `shapes` (shapes.py), whose three
classes differ in outline, `glyphs` and `photos` (detail.py), whose ten classes differ only in internal
detail, `traffic` (traffic.py), crowded street scenes of ten imbalanced vehicle-like classes with occlusion
and truncation, and `traffic_night` (night.py), those scenes at night. writer.py writes any of them (KINDS)
reproducibly; background.py holds the cluttered backgrounds that shapes, glyphs and traffic share, so that no
data set imports another for them."""

from qatpipe.data.synth.shapes import DEFAULT_OBJECT_HEIGHT_PX, SYNTH_CLASSES
from qatpipe.data.synth.writer import KINDS, SyntheticKind, write_synthetic_dataset

__all__ = ["DEFAULT_OBJECT_HEIGHT_PX", "KINDS", "SYNTH_CLASSES", "SyntheticKind", "write_synthetic_dataset"]
