"""The package's layering, read from its import statements (those inside functions included):
ops -> layers -> models -> engine -> tasks -> cli, backends beside ops, no import circle anywhere, the tasks
siblings, and docs/architecture.md's graph equal to the imports between the package's top-level parts."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "polaformer"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path):
    """(imported module of this package, imported name or None) for every import statement in the file."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                candidate = f"{prefix}.{alias.name}"
                yield (candidate, None) if candidate in MODULES else (prefix, alias.name)


def _owner(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target if target.startswith("polaformer") else None


def _graph():
    edges, names = {m: set() for m in MODULES}, []
    for module, path in MODULES.items():
        for target, imported in _imports(module, path):
            owner = _owner(target)
            if owner and owner != module:
                edges[module].add(owner)
                names.append((module, owner, imported))
    return edges, names


EDGES, IMPORTED_NAMES = _graph()


def _circles(edges):
    """Strongly connected components of more than one module (Tarjan), less the usual pattern of a package
    ``__init__`` importing its own children while they import it."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return [c for c in found if not all(m.startswith(min(c, key=len)) for m in c)]


def test_the_reader_can_find_the_layers_this_test_reads():
    for name in ("polaformer.ops.dispatch", "polaformer.backends.cpu.accelerate", "polaformer.layers.pola_attention",
                 "polaformer.models.polapp"):
        assert name in MODULES
    assert "polaformer.backends.cpu.accelerate" in EDGES["polaformer"]  # the graph sees relative imports


def test_no_import_circle():
    assert _circles(EDGES) == []


def test_the_circle_finder_finds_a_circle():
    edges = {"polaformer.a": {"polaformer.b"}, "polaformer.b": {"polaformer.c"}, "polaformer.c": {"polaformer.a"}}
    assert _circles(edges) == [["polaformer.a", "polaformer.b", "polaformer.c"]]


@pytest.mark.parametrize("layer", ["polaformer.models", "polaformer.layers"])
def test_models_and_layers_use_neither_backends_nor_private_ops(layer):
    offending = [(module, owner, imported) for module, owner, imported in IMPORTED_NAMES
                 if module.startswith(layer) and (owner.startswith("polaformer.backends") or (
                     owner.startswith("polaformer.ops") and imported and imported.startswith("_")))]
    assert offending == []


def test_no_layer_reaches_up():
    order = ["polaformer.ops", "polaformer.layers", "polaformer.models", "polaformer.engine", "polaformer.tasks",
             "polaformer.cli"]
    upward = {low: tuple(order[i + 1:]) for i, low in enumerate(order[:-1])}
    offending = [(module, owner) for module, owner, _ in IMPORTED_NAMES for low, highs in upward.items()
                 if module.startswith(low) and owner.startswith(highs)]
    assert offending == []


def test_tasks_are_siblings_over_the_engine():
    tasks = {f"polaformer.tasks.{p.name}" for p in (PACKAGE / "tasks").iterdir() if (p / "__init__.py").exists()}
    assert tasks <= set(MODULES)
    crossing = [(module, owner) for module, owner, _ in IMPORTED_NAMES for task in tasks
                if module.startswith(task) and owner.startswith("polaformer.tasks.") and not owner.startswith(task)]
    assert crossing == []


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
_LEFT_OUT = {"polaformer", "_startup", "__main__"}  # the package root, the entry point and its start-up


def _part(module: str) -> str:
    """The top-level part a module belongs to: ``ops``, ``engine``, ``backends.cpu``, ``checkpoint``, ..."""
    parts = module.split(".")[1:]
    if not parts:
        return "polaformer"
    return ".".join(parts[:2]) if parts[0] == "backends" and len(parts) > 1 else parts[0]


def _drawn_graph() -> dict[str, set[str]]:
    """The arrows of docs/architecture.md's graph block (``A ──► B, C`` lines)."""
    text = ARCHITECTURE.read_text()
    drawn = {}
    for line in text.splitlines():
        left, arrow, right = line.partition("──►")
        if arrow and left.strip() and " " not in left.strip() and "`" not in line:
            targets = right.strip()
            drawn[left.strip()] = set() if targets == "(nothing)" else {t.strip() for t in targets.split(",")}
    return drawn


def _real_graph() -> dict[str, set[str]]:
    graph = {_part(m): set() for m in MODULES if _part(m) not in _LEFT_OUT and _part(m) != "backends"}
    for module, targets in EDGES.items():
        for target in targets:
            a, b = _part(module), _part(target)
            if a != b and not {a, b} & (_LEFT_OUT | {"backends"}):
                graph[a].add(b)
    return graph


def test_the_architecture_graph_is_the_import_graph():
    drawn, real = _drawn_graph(), _real_graph()
    assert sorted(drawn) == sorted(real), "every top-level package and module has one line in the graph"
    wrong = {part: (sorted(drawn[part] - real[part]), sorted(real[part] - drawn[part]))
             for part in real if drawn[part] != real[part]}
    assert wrong == {}, "per part: (arrows drawn but not imported, imports not drawn)"


def test_the_architecture_page_names_every_task():
    tasks = sorted(p.name for p in (PACKAGE / "tasks").iterdir() if (p / "__init__.py").exists())
    text = ARCHITECTURE.read_text()
    assert len(tasks) >= 6
    assert [task for task in tasks if f"`{task}`" not in text and f"`{task}/`" not in text] == []


def test_the_graph_reader_sees_a_missing_arrow():
    real = _real_graph()
    assert "ops" in real["layers"] and "backends.cpu" in real["ops"]
