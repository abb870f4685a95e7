"""The layers of the code, read from its imports (AST only: nothing is imported, TensorFlow never loads).

    qatpipe_pipelines (the pipeline)  >  qatpipe_kfp (its components)  >  qatpipe.stages.*  >  the library (the
    rest of qatpipe)

Each layer imports only the layers below it (the CLI, qatpipe.cli, fronts them all and may import any), and the
modules of qatpipe import one another without a cycle. An import inside a function counts as much as one at the
top of a module: it is the same dependency, only later.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the folders the packages live in (pyproject.toml's packages.find `where`)
SOURCE_ROOTS = (ROOT / "components", ROOT / "pipelines")
PACKAGES = ("qatpipe", "qatpipe_kfp", "qatpipe_pipelines")
# who (a module name prefix; the first that matches) may not import what
RULES = (
    ("qatpipe.cli", ()),
    ("qatpipe.stages", ("qatpipe.cli", "qatpipe_kfp", "qatpipe_pipelines")),
    ("qatpipe", ("qatpipe.stages", "qatpipe.cli", "qatpipe_kfp", "qatpipe_pipelines")),
    ("qatpipe_kfp", ("qatpipe_pipelines",)),
)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a submodule where `from package import name` names one)
    where: str  # file:line of the import statement

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(roots, packages=PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py file of `packages` under `roots`."""
    modules = {}
    for root in roots:
        for package in packages:
            for path in sorted((Path(root) / package).rglob("*.py")):
                modules[_module_name(path, Path(root))] = path
    return modules


def _in(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that `import name` loads last (its longest known prefix), or None for a third party."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def find_imports(modules: dict[str, Path], base: Path = ROOT) -> list[Import]:
    """Every import of one of `modules` by one of them, wherever in the file it is written (files named
    relative to `base`)."""
    found = []
    for source, path in modules.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                origin = node.module or ""
                if node.level:  # relative: `from ..x import y` inside `package`
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    origin = ".".join([*anchor, origin] if origin else anchor)
                # `from package import submodule` imports the submodule; `from module import name` the module
                targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                           for alias in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != source:
                    found.append(Import(source, resolved, f"{path.relative_to(base)}:{node.lineno}"))
    return found


def layer_violations(imports: list[Import]) -> list[str]:
    """The imports that reach up a layer (RULES)."""
    bad = []
    for imp in imports:
        forbidden = next((rule for who, rule in RULES if _in(imp.source, who)), ())
        if any(_in(imp.target, above) for above in forbidden):
            bad.append(str(imp))
    return bad


def import_cycles(imports: list[Import], within: str = "qatpipe") -> list[str]:
    """One cycle (as its chain of imports) for each strongly connected group of modules under `within`."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if _in(imp.source, within) and _in(imp.target, within):
            graph.setdefault(imp.source, {}).setdefault(imp.target, imp)
    # Tarjan's strongly connected components, iteratively (no recursion limit on a deep graph)
    index, low, on_stack, stack, groups, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return [_cycle_in(sorted(group), graph) for group in groups]


def _cycle_in(group: list[str], graph: dict[str, dict[str, Import]]) -> str:
    """The shortest cycle through the group's first module, as the imports that make it."""
    start, members = group[0], set(group)
    previous = {start: None}
    queue, back = [start], None
    while queue and back is None:
        node = queue.pop(0)
        for child in sorted(graph.get(node, {})):
            if child == start:
                back = node
                break
            if child in members and child not in previous:
                previous[child] = node
                queue.append(child)
    chain, node = [graph[back][start]], back
    while previous[node] is not None:
        chain.append(graph[previous[node]][node])
        node = previous[node]
    return "cycle " + " -> ".join([start, *(imp.target for imp in reversed(chain))]) + "\n    " + \
        "\n    ".join(str(imp) for imp in reversed(chain))


@pytest.fixture(scope="module")
def imports():
    modules = find_modules(SOURCE_ROOTS)
    assert {"qatpipe.stages.evaluate", "qatpipe_kfp.runtime", "qatpipe_pipelines.qat_pipeline"} <= set(modules)
    return find_imports(modules)


def test_no_module_imports_a_layer_above_it(imports):
    bad = layer_violations(imports)
    assert not bad, "imports of a layer above:\n" + "\n".join(bad)


def test_the_library_has_no_import_cycle(imports):
    cycles = import_cycles(imports)
    assert not cycles, "\n".join(cycles)


def _tree(root: Path, files: dict[str, str]) -> list[Import]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return find_imports(find_modules([root]), root)


def test_the_checks_catch_an_upward_import_and_a_cycle(tmp_path):
    imports = _tree(tmp_path, {
        "qatpipe/__init__.py": "",
        "qatpipe/cli.py": "from qatpipe.stages import run\n",
        "qatpipe/stages/__init__.py": "",
        "qatpipe/stages/run.py": "from qatpipe.models import net\nfrom qatpipe_kfp import comp\n",
        "qatpipe/models/__init__.py": "def get():\n    from . import net\n",
        # imports inside functions and relative ones count: an upward import, and the cycle net -> base -> net
        "qatpipe/models/net.py": "from .base import B\n\ndef f():\n    from qatpipe.stages.run import x\n",
        "qatpipe/models/base.py": "import numpy\n\ndef g():\n    import qatpipe.models.net\n",
        "qatpipe_kfp/__init__.py": "",
        "qatpipe_kfp/comp.py": "import qatpipe_pipelines.p\n",
        "qatpipe_pipelines/__init__.py": "",
        "qatpipe_pipelines/p.py": "from qatpipe_kfp import comp\nfrom qatpipe.cli import main\n",
    })
    assert sorted(layer_violations(imports)) == sorted([
        "qatpipe/models/net.py:4: qatpipe.models.net imports qatpipe.stages.run",
        "qatpipe/stages/run.py:2: qatpipe.stages.run imports qatpipe_kfp.comp",
        "qatpipe_kfp/comp.py:1: qatpipe_kfp.comp imports qatpipe_pipelines.p"])
    assert import_cycles(imports) == [
        "cycle qatpipe.models.base -> qatpipe.models.net -> qatpipe.models.base\n"
        "    qatpipe/models/base.py:4: qatpipe.models.base imports qatpipe.models.net\n"
        "    qatpipe/models/net.py:1: qatpipe.models.net imports qatpipe.models.base"]
    # the package importing its own module in __init__ is no cycle by itself
    assert not import_cycles(_tree(tmp_path / "ok", {"qatpipe/__init__.py": "", "qatpipe/models/__init__.py":
                                                     "from qatpipe.models.base import B\n",
                                                     "qatpipe/models/base.py": "B = 1\n"}))
