"""One contract per detector architecture (issue 57): outside qatpipe.models (the architectures) and qatpipe.spec
(their sections and the registry, spec.ARCHITECTURES), no code decides anything by an architecture's name. What
varies by architecture is asked of it (models/base.py's DetectorArchitecture) or read from its export's decoding
record (models/decoding.py), so a new detector is its module and its registry row.

Read from the source (AST only: nothing is imported but the spec's registry, TensorFlow never loads): a comparison
with an architecture's name or with an `.arch` attribute, a dict keyed by an architecture's name, a table indexed
by an `.arch` attribute (`table[spec.model.arch]`, `table.get(spec.model.arch)`), a `case "ssd":`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from qatpipe.spec import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (ROOT / "components" / "qatpipe", ROOT / "components" / "qatpipe_kfp", ROOT / "pipelines")
# where architectures are named: their implementations, and the spec's sections and registry
EXEMPT = (ROOT / "components" / "qatpipe" / "models", ROOT / "components" / "qatpipe" / "spec")


def _is_arch_attribute(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "arch"


def _names_in(node, names) -> bool:
    """A string constant that is an architecture's name, alone or in a tuple, list or set."""
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_in(item, names) for item in node.elts)
    return False


def arch_decisions(path: Path, names, base: Path = ROOT) -> list[str]:
    """file:line and source of each place in `path` that decides by an architecture's name (see the docstring)."""
    text = path.read_text()
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            hit = any(_names_in(o, names) or _is_arch_attribute(o) for o in operands)
        elif isinstance(node, ast.Dict):
            hit = any(key is not None and _names_in(key, names) for key in node.keys)
        elif isinstance(node, ast.Subscript):
            hit = _is_arch_attribute(node.slice)
        elif isinstance(node, ast.Call):
            hit = (isinstance(node.func, ast.Attribute) and node.func.attr == "get" and bool(node.args)
                   and _is_arch_attribute(node.args[0]))
        elif isinstance(node, ast.MatchValue):
            hit = _names_in(node.value, names)
        else:
            continue
        if hit:
            found.append((node.lineno, f"{path.relative_to(base)}:{node.lineno}: {ast.get_source_segment(text, node).splitlines()[0]}"))
    return [hit for _, hit in sorted(found)]


def scanned_files(roots=SCANNED, exempt=EXEMPT) -> list[Path]:
    return [path for root in roots for path in sorted(root.rglob("*.py"))
            if not any(path.is_relative_to(folder) for folder in exempt)]


def test_nothing_outside_models_and_spec_decides_by_an_architectures_name():
    files = scanned_files()
    assert any(path.name == "tensorrt_backend.py" for path in files)  # the library, its stages and the pipeline
    found = [hit for path in files for hit in arch_decisions(path, set(ARCHITECTURES))]
    assert not found, ("decided by an architecture's name (ask the architecture: models/base.py's "
                       "DetectorArchitecture):\n" + "\n".join(found))


def test_the_check_finds_each_form(tmp_path):
    path = tmp_path / "stage.py"
    path.write_text(
        'def f(spec, arch):\n'
        '    if spec.model.arch == "detectnet_v2":\n'  # 2: compares .arch (and a name)
        '        pass\n'
        '    if "ssd" in (arch, "x"):\n'  # 4: a name
        '        pass\n'
        '    table = {"ssd": 1, "other": 2}\n'  # 6: keyed by a name
        '    table[spec.model.arch]\n'  # 7: indexed by .arch
        '    table.get(spec.model.arch)\n'  # 8
        '    match arch:\n'
        '        case "detectnet_v2":\n'  # 10
        '            pass\n'
        '    return f"qatpipe {spec.model.arch}", {"arch": spec.model.arch}, arch.decoding() is None\n')  # none
    found = arch_decisions(path, {"ssd", "detectnet_v2"}, tmp_path)
    assert [hit.split(":")[1] for hit in found] == ["2", "4", "6", "7", "8", "10"], found
    assert found[0] == 'stage.py:2: spec.model.arch == "detectnet_v2"'


def test_every_registry_row_names_a_detector_architecture():
    """spec.ARCHITECTURES names each implementation as module:class (the spec stands below models): each one
    imports and implements the contract; an unknown name is a spec error naming the choices."""
    import pytest

    from qatpipe.errors import SpecError
    from qatpipe.models import DetectorArchitecture, architecture_class

    for name in ARCHITECTURES:
        assert issubclass(architecture_class(name), DetectorArchitecture), name
    with pytest.raises(SpecError, match="model.arch: 'yolo' is not an architecture: one of detectnet_v2, ssd"):
        architecture_class("yolo")
