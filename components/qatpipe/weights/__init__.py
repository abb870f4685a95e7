"""Pretrained backbone starts shipped with the package, as TAO ships its `pretrained_model_file`s:
`model.pretrained: qatpipe:<name>`.

Each start is `<name>.keras` beside its card `<name>.json`: what it is, the exact commands that made it (the
project's own `qatpipe pretrain` on its own synthetic sets; nothing downloaded), the backbone it fits, its
held-back top-1 and the file's SHA-256. No TensorFlow here: the spec checks a name at load time with this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from qatpipe.errors import ModelFileError, SpecError
from qatpipe.fileio import file_sha256 as sha256

PREFIX = "qatpipe:"
KEY = "model.pretrained"
FOLDER = Path(__file__).parent
# the backbone fields that decide a backbone's weight shapes: a start fits only the backbone it was made for
FIT_FIELDS = ("name", "depth", "width", "all_projections")


@dataclass(frozen=True)
class PackagedStart:
    """One packaged start: its card (a dict, as written) and where its weights lie."""

    name: str
    card: dict

    @property
    def path(self) -> Path:
        return FOLDER / self.card["file"]

    @property
    def backbone(self) -> dict:
        return self.card["backbone"]

    def fits(self, backbone_spec) -> str | None:
        """None where the start fits the spec's backbone, else what differs (for the error)."""
        theirs = {name: getattr(backbone_spec, name) for name in FIT_FIELDS}
        mine = {name: self.backbone.get(name) for name in FIT_FIELDS}
        if theirs["name"] != "resnet":  # depth and all_projections are resnet's own
            theirs.pop("depth"), theirs.pop("all_projections"), mine.pop("depth"), mine.pop("all_projections")
        differ = [f"{name} {mine[name]!r} (the spec has {theirs[name]!r})" for name in mine if mine[name] != theirs[name]]
        return "; ".join(differ) or None

    def verified_path(self) -> Path:
        """The weights file, once its SHA-256 matches the card's: a file changed since the card was written
        (a bad checkout, a Git LFS pointer, an edit) is refused, naming it."""
        path = self.path
        if not path.is_file():
            raise ModelFileError(f"{KEY}: {PREFIX}{self.name}: its weights file {path} is missing from the "
                                 "installed package (reinstall qatpipe)")
        digest = sha256(path)
        if digest != self.card["sha256"]:
            raise ModelFileError(f"{KEY}: {PREFIX}{self.name}: {path} has SHA-256 {digest}, but its card "
                                 f"{path.with_suffix('.json').name} says {self.card['sha256']}: the file is not the "
                                 "one the card describes (reinstall qatpipe, or re-make it: docs/pretrained.md)")
        return path


@cache
def catalogue() -> dict[str, PackagedStart]:
    """Every packaged start by name, read from the cards beside this module."""
    starts = {}
    for card_path in sorted(FOLDER.glob("*.json")):
        card = json.loads(card_path.read_text())
        starts[card["name"]] = PackagedStart(card["name"], card)
    return starts


def is_packaged(source: str | None) -> bool:
    return bool(source) and source.startswith(PREFIX)


def lookup(source: str, backbone_spec=None) -> PackagedStart:
    """The packaged start `source` (qatpipe:<name>) names, checked against the spec's backbone where given.
    An unknown name lists the packaged ones; a start for another backbone says which one it fits."""
    name = source[len(PREFIX):]
    starts = catalogue()
    if name not in starts:
        known = ", ".join(f"{PREFIX}{known}" for known in starts) or "none"
        raise SpecError(f"{KEY}: {source!r} is not a packaged start; the package has {known} "
                        "(their cards: docs/pretrained.md)")
    start = starts[name]
    if backbone_spec is not None and (differs := start.fits(backbone_spec)):
        fit = ", ".join(f"{field} {start.backbone[field]}" for field in FIT_FIELDS if field in start.backbone)
        raise SpecError(f"{KEY}: {source} fits the backbone {fit}, not this spec's model.backbone: {differs}. "
                        f"Set {KEY} to another source, or to null for random weights")
    return start


__all__ = ["PREFIX", "PackagedStart", "catalogue", "is_packaged", "lookup", "sha256"]
