"""The bench scripts stay runnable as the library changes: each one's --help runs, each imports as a module without
TensorFlow, every name one imports from qatpipe (or from another bench script), also inside a function, still exists
there, and no script imports another's private names. No bench experiment runs here (they take minutes to hours)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))
# where the first-party packages' sources are (pyproject.toml's packages.find `where`), and the bench's own
PACKAGE_ROOTS = {"qatpipe": ROOT / "components", "qatpipe_kfp": ROOT / "components",
                 "qatpipe_pipelines": ROOT / "pipelines"}
HEAVY = ("tensorflow", "tf_keras", "onnxruntime", "tensorrt", "torch")  # none of these for --help


def _environment() -> dict[str, str]:
    path = [str(ROOT / "components"), str(ROOT / "pipelines"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def _is_script(path: Path) -> bool:
    return 'if __name__ == "__main__":' in path.read_text()


def test_there_are_bench_scripts():
    assert len([p for p in SCRIPTS if _is_script(p)]) >= 20


@pytest.mark.parametrize("script", [p for p in SCRIPTS if _is_script(p)], ids=lambda p: p.name)
def test_help_runs(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                          env=_environment(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]


def test_every_script_imports_as_a_module_without_tensorflow():
    """All in one interpreter, as `python bench/x.py` would find them (bench/ first on sys.path)."""
    code = (f"import importlib, json, sys; sys.path.insert(0, {str(BENCH)!r}); "
            f"[importlib.import_module(name) for name in {[p.stem for p in SCRIPTS]!r}]; "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=_environment(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def _module_file(name: str) -> Path | None:
    """The source of a first-party or bench module, or None for another package's."""
    top = name.split(".")[0]
    if top in PACKAGE_ROOTS:
        base = PACKAGE_ROOTS[top].joinpath(*name.split("."))
    elif (BENCH / f"{top}.py").is_file() and "." not in name:
        base = BENCH / top
    else:
        return None
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return base  # first-party but missing: named in the failure


def _defined(path: Path) -> set[str]:
    """The names a module defines at its top level (also under if / try), as `from module import name` finds them."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            body += [statement for handler in getattr(node, "handlers", []) for statement in handler.body]
    return names


def _broken_imports(script: Path) -> list[str]:
    problems = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                source = _module_file(alias.name)
                if source is not None and not source.is_file():
                    problems.append(f"{script.name}:{node.lineno}: no module {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            source = _module_file(node.module)
            if source is None:
                continue
            if not source.is_file():
                problems.append(f"{script.name}:{node.lineno}: no module {node.module}")
                continue
            defined = _defined(source)
            for alias in node.names:
                submodule = _module_file(f"{node.module}.{alias.name}")
                if alias.name not in defined and not (submodule and submodule.is_file()):
                    problems.append(f"{script.name}:{node.lineno}: {node.module} has no {alias.name}")
                if source.parent == BENCH and alias.name.startswith("_"):
                    problems.append(f"{script.name}:{node.lineno}: imports {node.module}'s private {alias.name}")
    return problems


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_name_imported_from_the_library_or_another_script_exists(script):
    assert _broken_imports(script) == []


def test_the_import_check_names_a_renamed_library_function_and_a_private_import(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("def main():\n    from qatpipe.stages.retrain_plan import plan_the_retrain\n"
                      "    from qatpipe.stages import export\n    from runs import _read\n    import qatpipe.nowhere\n")
    assert _broken_imports(script) == [
        "probe.py:2: qatpipe.stages.retrain_plan has no plan_the_retrain",
        "probe.py:4: runs has no _read",
        "probe.py:4: imports runs's private _read",
        "probe.py:5: no module qatpipe.nowhere"]
