"""The layers of the code, read from its imports (AST only: nothing is imported, TensorFlow never loads).

    qatpipe_pipelines (the pipeline)  >  qatpipe_kfp (its components)  >  qatpipe.stages.*  >  the library (the
    rest of qatpipe)

Each layer imports only the layers below it (the CLI, qatpipe.cli, fronts them all and may import any), and the
modules of qatpipe import one another without a cycle. An import inside a function counts as much as one at the
top of a module: it is the same dependency, only later.

The library itself stands on floors (FLOORS, lowest first): a module imports its own floor and the floors below,
never one above, so each floor can be read, tested and reused without the ones above it.
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

# the library's floors, lowest first (a module name prefix each); every module of qatpipe but the stages and the CLI
# stands on one. Order read from the imports: the spec checks names against registry rows on its own floor; the
# data pipeline encodes targets with an architecture's encoder (models.base), metrics score its Detections; pruning and
# quantization rebuild layer graphs (graph.keras_graph); export reads the QAT layers and quantizer kinds; engines
# build from the export; inference runs data through engines; training validates with inference and metrics,
# deploy packages export and inference; tracking registers deploy's model; cluster checks tracking's credentials.
FLOORS = (
    ("ground", ("qatpipe.errors", "qatpipe.tf_log", "qatpipe.logconfig", "qatpipe.fileio", "qatpipe.devices",
                "qatpipe.boxes", "qatpipe.storage", "qatpipe.weights", "qatpipe.onnx_model", "qatpipe.graph",
                "qatpipe.html_report")),
    ("spec", ("qatpipe.spec", "qatpipe.spec_sources")),
    ("models", ("qatpipe.models",)),
    ("data, metrics, pruning, quantization", ("qatpipe.data", "qatpipe.metrics", "qatpipe.pruning",
                                              "qatpipe.quantization")),
    ("export", ("qatpipe.export",)),
    ("engines", ("qatpipe.engines",)),
    ("inference", ("qatpipe.inference",)),
    ("training, deploy", ("qatpipe.training", "qatpipe.deploy")),
    ("tracking", ("qatpipe.tracking",)),
    ("cluster", ("qatpipe.cluster",)),
)
# who (a module name prefix) may import what (a prefix) on a floor above, and why: none now. The spec checks names
# against registry rows on its own floor (spec/registries.py, spec.ARCHITECTURES); a new exception needs its reason.
ABOVE_ALLOWED: tuple[tuple[str, str], ...] = ()
# the library's package itself (its __init__ sets the environment, imports nothing) and what stands above it
LIBRARY, ABOVE_THE_LIBRARY = "qatpipe", ("qatpipe.stages", "qatpipe.cli")


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


def floor_of(module: str) -> int | None:
    """The index in FLOORS of `module`'s floor (its longest matching prefix); None for the package itself, the
    stages, the CLI, other packages, and a library module on no floor."""
    if module == LIBRARY or not _in(module, LIBRARY) or any(_in(module, top) for top in ABOVE_THE_LIBRARY):
        return None
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes
               if _in(module, prefix)]
    return max(matches)[1] if matches else None


def unplaced_modules(modules) -> list[str]:
    """The library's modules that stand on no floor (a new one must be placed in FLOORS)."""
    return sorted(m for m in modules if m != LIBRARY and _in(m, LIBRARY) and floor_of(m) is None
                  and not any(_in(m, top) for top in ABOVE_THE_LIBRARY))


def floor_violations(imports: list[Import]) -> list[str]:
    """The imports inside the library that reach a floor above the importer's (ABOVE_ALLOWED aside)."""
    bad = []
    for imp in imports:
        source, target = floor_of(imp.source), floor_of(imp.target)
        if source is None or target is None or target <= source:
            continue
        if any(_in(imp.source, who) and _in(imp.target, what) for who, what in ABOVE_ALLOWED):
            continue
        bad.append(f"{imp} (floor {FLOORS[source][0]!r} imports floor {FLOORS[target][0]!r})")
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


def test_the_library_imports_only_its_own_floor_and_below(imports):
    modules = find_modules(SOURCE_ROOTS)
    assert not unplaced_modules(modules), "modules on no floor (place them in FLOORS):\n" + "\n".join(
        unplaced_modules(modules))
    bad = floor_violations(imports)
    assert not bad, "imports of a floor above:\n" + "\n".join(bad)


def test_every_allowed_exception_is_still_taken(imports):
    """An exception nothing takes any more goes from ABOVE_ALLOWED (so it cannot hide a new upward import)."""
    taken = {(who, what) for who, what in ABOVE_ALLOWED for imp in imports
             if _in(imp.source, who) and _in(imp.target, what)}
    assert taken == set(ABOVE_ALLOWED), f"exceptions no import takes: {sorted(set(ABOVE_ALLOWED) - taken)}"


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


def test_the_floor_check_catches_an_upward_import_and_a_module_on_no_floor(tmp_path):
    imports = _tree(tmp_path, {
        "qatpipe/__init__.py": "",
        # a model loader that imports the QAT layers, in a function: an upward import all the same
        "qatpipe/models/__init__.py": "",
        "qatpipe/models/io.py": "import json\n\ndef load():\n    import qatpipe.quantization.layers\n",
        "qatpipe/quantization/__init__.py": "",
        "qatpipe/quantization/layers.py": "from qatpipe.models import io\nfrom qatpipe.spec import QatSpec\n",
        # the spec's look at a table on the models floor and at the data pipeline: both upward
        "qatpipe/spec.py": "def check():\n    from qatpipe.models.backbones import BACKBONES\n"
                           "    from qatpipe.data.pipeline import PARALLEL_CALLS\n",
        "qatpipe/models/backbones.py": "BACKBONES = {}\n",
        "qatpipe/data/__init__.py": "",
        "qatpipe/data/pipeline.py": "from qatpipe.models import io\n",
        # the stages stand above every floor
        "qatpipe/stages/__init__.py": "",
        "qatpipe/stages/run.py": "from qatpipe.quantization import layers\n",
        "qatpipe/newthing.py": "from qatpipe.errors import E\n",
        "qatpipe/errors.py": "class E(Exception):\n    pass\n",
    })
    assert sorted(floor_violations(imports)) == sorted([
        "qatpipe/models/io.py:4: qatpipe.models.io imports qatpipe.quantization.layers "
        "(floor 'models' imports floor 'data, metrics, pruning, quantization')",
        "qatpipe/spec.py:2: qatpipe.spec imports qatpipe.models.backbones (floor 'spec' imports floor 'models')",
        "qatpipe/spec.py:3: qatpipe.spec imports qatpipe.data.pipeline "
        "(floor 'spec' imports floor 'data, metrics, pruning, quantization')"])
    assert unplaced_modules(find_modules([tmp_path])) == ["qatpipe.newthing"]
