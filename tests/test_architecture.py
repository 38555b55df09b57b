"""The folder layering of the architecture guide ("each arrow is 'may import'; nothing points back up, and no
two files import each other"), checked on the source with ``ast``: no module is imported, so the test
is fast and sees function-level (lazy) and ``TYPE_CHECKING`` imports as well as module-level ones.

An edge ``a -> b`` is one ``import b`` / ``from b import x`` written in ``a`` (relative imports resolved;
``from pkg import mod`` is an edge to ``pkg.mod`` when that is a module). The parent packages that
Python initialises on the way (``megazero.training/__init__`` for ``megazero.config.train_config``) are not
counted: they are not a dependency the author wrote.
"""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megazero"

# Which top-level packages of megazero each package must not import.
FORBIDDEN = {
    "utils": {"mpu", "model", "zero", "pipeline", "data", "checkpoint", "config", "training", "observe"},  # lowest
    "mpu": {"model", "zero", "pipeline", "data", "checkpoint", "config", "training", "observe"},  # knows nothing above
    "model": {"data", "zero", "pipeline", "checkpoint", "config", "training", "observe"},
    "zero": {"model", "data", "pipeline", "checkpoint", "config", "training", "observe"},
    "data": {"model", "zero", "pipeline", "checkpoint", "config", "training", "observe"},
    "pipeline": {"data", "zero", "checkpoint", "config", "training", "observe"},
    "checkpoint": {"config", "training", "observe"},  # formats read and write what the engine and model own
    "config": {"training", "observe"},  # typed configuration, read by the loop, the programs and the planner
    "training": {"observe"},  # measurement sits above the mechanism it measures
}

# No import circle is allowed.
ALLOWED_CIRCLES: set[frozenset] = set()


def _allowed(a: str, b: str) -> bool:
    return frozenset({a, b}) in ALLOWED_CIRCLES


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    found = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return found


def _absolute(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


@functools.lru_cache(maxsize=None)
def imports() -> dict[str, dict[str, int]]:
    """Module -> {imported megazero module: first line importing it}, at any nesting level."""
    mods = modules()
    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_pkg) in mods.items():
        out = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, is_pkg, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                if target == "megazero" or target.startswith("megazero."):
                    out.setdefault(target, node.lineno)
    return graph


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _where(a: str, b: str) -> str:
    return f"{modules()[a][0].relative_to(ROOT)}:{imports()[a][b]} imports {b}"


def test_graph_sees_the_imports() -> None:
    """The parser finds module-level, function-level and relative imports (a broken walker passes everything)."""
    graph = imports()
    assert len(modules()) > 50
    assert "megazero.mpu.utils" in graph["megazero.model.config"]  # module level, absolute
    assert "megazero.model.gpt" in graph["megazero.model.pipeline_split"]  # function level, relative
    unknown = sorted({f"{a} -> {b}" for a, out in graph.items() for b in out if b not in modules()})
    assert not unknown, "imports of megazero modules that do not exist:\n  " + "\n  ".join(unknown)


def test_layering() -> None:
    bad = []
    for a, out in imports().items():
        forbidden = FORBIDDEN.get(_package(a), set())
        bad += [_where(a, b) for b in out if _package(b) in forbidden and not _allowed(a, b)]
    assert not bad, ("imports against the layering (megazero/{mpu <- model, zero, pipeline <- training}, data "
                     "beside them; see the architecture guide):\n  " + "\n  ".join(sorted(bad)))


def test_nothing_imports_the_programs() -> None:
    """megazero/cli (the programs behind pretrain_gpt.py, tools/*.py and the console scripts) sits on top of
    every layer: no module outside it imports it."""
    assert any(m.startswith("megazero.cli.") for m in modules()), "megazero/cli not found"
    bad = [_where(a, b) for a, out in imports().items() if _package(a) != "cli"
           for b in out if _package(b) == "cli"]
    assert not bad, "imports of megazero/cli from below it:\n  " + "\n  ".join(sorted(bad))


def test_no_two_modules_import_each_other() -> None:
    graph = imports()
    pairs = sorted({f"{_where(a, b)}\n    and {_where(b, a)}" for a, out in graph.items() for b in out
                    if a < b and a in graph.get(b, {}) and not _allowed(a, b)})
    assert not pairs, "modules importing each other:\n  " + "\n  ".join(pairs)


def _cycle_from(start: str, graph: dict[str, list[str]]) -> list[str] | None:
    """A shortest import cycle through ``start`` (breadth-first), or None."""
    parent = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph.get(v, ()):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return None


def test_no_import_cycles() -> None:
    graph = {a: [b for b in out if b != a and not _allowed(a, b)] for a, out in imports().items()}
    seen: set[str] = set()
    cycles = []
    for module in sorted(graph):
        if module in seen:
            continue
        cycle = _cycle_from(module, graph)
        if cycle:
            seen.update(cycle)
            cycles.append("\n    ".join(_where(a, b) for a, b in zip(cycle, cycle[1:])))
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)
