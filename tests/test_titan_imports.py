"""torchtitan_ext's module structure: its modules import each other one way only, and the modules
that do not depend on torchtitan's version import no torchtitan (so a later torchtitan's adapter
can reuse them as they are)."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_ext"

VERSION_FREE = ("_cpu", "compile_cache", "config", "ticks", "clock", "planning", "pipeline", "data", "report", "ca_mesh", "_version")
"""Modules that work with any torchtitan: they import none at module level (``ca_mesh`` reads
``ParallelDims`` attributes that 0.2.2 and 0.3.0 share)."""

TORCHTITAN_0_2_2 = ("_compat", "converter", "layers", "validate", "train")
"""Modules written against torchtitan 0.2.2's internals (its trainer, validator, llama3 model)."""

TORCHTITAN_0_3 = tuple(
    f"titan03{'.' + m if m else ''}" for m in ("", "_compat", "model", "data", "pipeline", "validate", "trainer", "config_registry", "train")
)
"""The torchtitan 0.3.0 adapter (``torchtitan_ext.titan03``): it may import the version-free modules only."""


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Module name (relative to the package, dotted) -> file, ``__init__`` as the package's own name ""."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path], package: str = "torchtitan_ext") -> list[tuple[str, int, bool]]:
    """(module imported, line, at module level) for every import of a package module in ``path``,
    module-level and inside functions alike."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []

    def named(dotted: str) -> str | None:
        if dotted == package:
            return ""
        if dotted.startswith(package + "."):
            name = dotted[len(package) + 1 :]
            while name and name not in modules:  # `import torchtitan_ext.a.b` where b is not a module
                name = name.rpartition(".")[0]
            return name
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [named(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            base = named(node.module)
            if base is None:
                continue
            # `from torchtitan_ext import data` imports the module data; `from torchtitan_ext.x import f`, x.
            sub = [f"{base}.{a.name}".lstrip(".") for a in node.names]
            targets = [s for s in sub if s in modules] or [base]
        else:
            continue
        found += [(t, node.lineno, id(node) in top) for t in targets if t is not None]
    return found


def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module level or in a function), itself left out."""
    modules = _modules(package)
    return {m: {t for t, _, _ in _imports(p, modules)} - {m} for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as [a, b, ..., a], or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_imports_between_modules_form_no_cycle():
    graph = _graph()
    assert {"planning", "pipeline", "layers"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, "torchtitan_ext imports in a cycle (module-level or in a function): " + " -> ".join(cycle)


def test_modules_import_each_other_at_module_level():
    """An import of a sibling module inside a function hides an arrow of the graph; the one exception
    would be a dodge of a cycle, and there is none to dodge."""
    modules = _modules()
    hidden = [f"{m or '__init__'}:{line} imports {t}" for m, p in modules.items()
              for t, line, top in _imports(p, modules) if not top]  # fmt: skip
    assert not hidden, hidden


def test_every_module_is_on_one_side_of_the_torchtitan_boundary():
    modules = set(_modules()) - {""}
    sides = (set(VERSION_FREE), set(TORCHTITAN_0_2_2), set(TORCHTITAN_0_3))
    assert not (sides[0] & sides[1] or sides[0] & sides[2] or sides[1] & sides[2])
    known = set().union(*sides)
    assert modules == known, (
        "classify every torchtitan_ext module as version-free, torchtitan-0.2.2 or torchtitan-0.3 in "
        f"tests/test_titan_imports.py: unclassified {sorted(modules - known)}, gone {sorted(known - modules)}"
    )


def test_the_two_adapters_share_only_version_free_modules():
    """Neither adapter imports the other: each runs in a venv that holds only its torchtitan."""
    graph = _graph()
    for side, other in ((TORCHTITAN_0_3, TORCHTITAN_0_2_2), (TORCHTITAN_0_2_2, TORCHTITAN_0_3)):
        for m in side:
            crossing = graph[m] & set(other)
            assert not crossing, f"torchtitan_ext.{m} imports the other adapter's {sorted(crossing)}"
    for m in VERSION_FREE:
        assert not graph[m] - set(VERSION_FREE) - {""}, (m, graph[m])


def test_version_free_modules_import_no_torchtitan():
    """Each version-free module (and the package) imported in a fresh interpreter leaves torchtitan out
    of ``sys.modules``; checked after each import, so one module cannot hide another's."""
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "    tt = sorted(m for m in sys.modules if m == 'torchtitan' or m.startswith('torchtitan.'))\n"
        "    assert not tt, f'{name} imports torchtitan: {tt[:5]}'\n"
    )
    names = ["torchtitan_ext", *(f"torchtitan_ext.{m}" for m in VERSION_FREE)]
    r = subprocess.run([sys.executable, "-c", code, *names], cwd=PACKAGE.parent, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
