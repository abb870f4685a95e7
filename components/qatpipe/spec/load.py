"""Spec files in and out: the bundled specs, reading YAML (duplicate keys refused), `--set` overrides,
validation with errors naming the file and key, and writing a resolved spec."""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from qatpipe.errors import SpecError
from qatpipe.spec.errors import format_validation_error
from qatpipe.spec.experiment import ExperimentSpec


def bundled_spec_path(name: str) -> Path:
    """Path of a spec shipped with the package (`default`, `full`, `tiny`)."""
    folder = Path(str(resources.files("qatpipe") / "specs"))
    path = folder / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        raise SpecError(f"no bundled spec named {name!r}: the bundled ones are {names} (or give a spec file's path)")
    return path


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise SpecError(f"--set {item!r}: expected KEY.PATH=VALUE")
    key, raw = item.split("=", 1)
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise SpecError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw)  # '3' -> 3, 'true' -> True, '[a, b]' -> list
    except yaml.YAMLError as exc:
        raise SpecError(f"--set {item!r}: value is not valid YAML: {exc}") from exc
    return keys, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with `a.b.c=value` overrides applied."""
    data = copy.deepcopy(data)
    for item in overrides:
        keys, value = _parse_override(item)
        node = data
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise SpecError(f"--set {item!r}: {'.'.join(keys[: depth + 1])} is not a section")
            node = child
        node[keys[-1]] = value
    return data


def parse_spec(data: dict[str, Any], source: str = "<spec>", overrides: list[str] | None = None) -> ExperimentSpec:
    """Validate spec data; errors name `source`, or the one of `overrides` (already applied) that set the key."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the spec must be a YAML mapping, got {type(data).__name__}")
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, source, overrides or (), schema=ExperimentSpec)) from None


class _DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"duplicate key {key!r} at line {line}")
        self.key, self.line, self.first_line = key, line, first_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys, which plain YAML lets silently override."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            # `<<` merge keys are allowed to be overridden by explicit keys: checked before merging
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1  # marks count from 0
            if key in first_lines:
                raise _DuplicateKeyError(key, line, first_lines[key])
            first_lines[key] = line
        return super().construct_mapping(node, deep=deep)


def load_spec(path: str | Path, overrides: list[str] | None = None) -> ExperimentSpec:
    """Read, override and validate a spec file. Errors name the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: spec file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a UTF-8 text file") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the spec file: {exc.strerror or exc}") from None
    return load_spec_text(text, overrides, source=str(path))


def load_spec_text(text: str, overrides: list[str] | None = None, source: str = "<spec>") -> ExperimentSpec:
    """Parse, override and validate spec YAML text; `source` names it in errors."""
    path = source
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKeyError as exc:
        raise SpecError(
            f"{path}:{exc.line}: duplicate key {exc.key!r} (first at line {exc.first_line})"
        ) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    if data is None:  # an empty file: parse_spec names the missing keys
        data = {}
    if overrides and isinstance(data, dict):  # a non-mapping is reported by parse_spec
        data = apply_overrides(data, overrides)
    return parse_spec(data, source=str(path), overrides=overrides)


def dump_spec(spec: ExperimentSpec, path: str | Path) -> None:
    from qatpipe.fileio import atomic_write_text

    atomic_write_text(path, spec_to_yaml(spec))


def spec_to_yaml(spec: ExperimentSpec) -> str:
    return yaml.safe_dump(spec.to_dict(), sort_keys=False)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: for experiment trackers' flat params."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
