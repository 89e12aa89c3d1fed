"""The package's layering, read from its import statements (those inside functions included):
backends (kernels) -> ops -> layers -> models -> engine -> tasks -> cli, the module swaps (acceleration) above the
models, no import circle anywhere, the tasks siblings, one folder per op holding all its forms, and
docs/architecture.md's graph equal to the imports between the package's top-level parts."""
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

# Old module paths kept for old imports: each only re-exports its names from their new home, and stands outside
# the layering (its arrow runs from the old place to the new one).
MOVED = {
    "polaformer.ops.pola_attention": "polaformer.ops.pola",
    "polaformer.ops.pacs_attention": "polaformer.ops.pacs",
    "polaformer.ops.naive": "polaformer.ops",
    "polaformer.backends.triton.pola": "polaformer.ops.pola.triton",
    "polaformer.backends.triton.pacs": "polaformer.ops.pacs.triton",
    "polaformer.backends.triton.causal": "polaformer.ops.causal.triton",
}


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
        if module in MOVED:
            continue
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
    for name in ("polaformer.ops.dispatch", "polaformer.acceleration", "polaformer.capture",
                 "polaformer.layers.pola_attention", "polaformer.models.polapp", *MOVED):
        assert name in MODULES
    assert "polaformer.acceleration" in EDGES["polaformer"]  # the graph sees relative imports


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_only_re_exports_its_new_home(old):
    """An old path holds a docstring and imports from where its names live now, nothing else."""
    tree = ast.parse(MODULES[old].read_text())
    body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) else tree.body
    sources = set()
    for node in body:
        if isinstance(node, ast.ImportFrom):
            base = old.split(".")[:-node.level] if node.level else []
            sources.add(".".join(base + [node.module]))
        else:
            assert isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"], ast.dump(node)
    assert sources and all(source.startswith(MOVED[old]) for source in sources)
    assert old not in {owner for _, owner, _ in IMPORTED_NAMES}, "nothing in the package imports an old path"


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


def test_backends_are_kernels_below_the_ops():
    """The kernels (native CPU library, CPU products, the Triton toolkit) import no part above them: the module
    swaps that put them into models live in polaformer.acceleration."""
    above = ("polaformer.ops", "polaformer.layers", "polaformer.models", "polaformer.acceleration",
             "polaformer.engine", "polaformer.tasks", "polaformer.cli")
    offending = [(module, owner) for module, owner, _ in IMPORTED_NAMES
                 if module.startswith("polaformer.backends") and owner.startswith(above)]
    assert offending == []


def test_ops_import_only_kernels_and_common_modules():
    allowed = ("polaformer.ops", "polaformer.backends", "polaformer.capture")
    offending = [(module, owner) for module, owner, _ in IMPORTED_NAMES
                 if module.startswith("polaformer.ops") and not owner.startswith(allowed)]
    assert offending == []


def test_no_layer_reaches_up():
    order = ["polaformer.ops", "polaformer.layers", "polaformer.models", "polaformer.engine", "polaformer.tasks",
             "polaformer.cli"]
    upward = {low: tuple(order[i + 1:]) for i, low in enumerate(order[:-1])}
    offending = [(module, owner) for module, owner, _ in IMPORTED_NAMES for low, highs in upward.items()
                 if module.startswith(low) and owner.startswith(highs)]
    assert offending == []


OPS = ("pola", "pacs", "causal")
# what every op folder holds: its entries and the order of its paths (``_path``), its float64 reference, its
# Triton kernels, its packed (variable-length) form
OP_FORMS = ("op.py", "naive.py", "triton.py", "packed.py")


def _decorated(path: Path):
    """(function name, decorator source) for every decorated function of a file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                yield node.name, ast.unparse(decorator)


@pytest.mark.parametrize("op", OPS)
def test_each_op_folder_holds_its_forms(op):
    folder = PACKAGE / "ops" / op
    assert sorted(f for f in OP_FORMS if not (folder / f).exists()) == []
    entry = ast.parse((folder / "op.py").read_text())
    assert "_path" in {n.name for n in entry.body if isinstance(n, ast.FunctionDef)}, "the order of the paths"
    reference = ast.parse((folder / "naive.py").read_text())
    assert any(n.name.startswith("naive_") for n in reference.body if isinstance(n, ast.FunctionDef))
    decorators = list(_decorated(folder / "triton.py"))
    assert any(d.startswith("triton.jit") and name.endswith("_kernel") for name, d in decorators)
    assert any(d.startswith("torch.library.triton_op('polaformer::") for _, d in decorators)


def test_no_module_outside_an_op_folder_defines_its_kernels():
    """Triton programs (``*_kernel``) and the registered ops live in the op folders' ``triton.py`` only; the
    shared toolkit (backends/triton/common.py) holds device functions, no program and no op."""
    homes = {PACKAGE / "ops" / op / "triton.py" for op in OPS}
    stray = [(str(path.relative_to(PACKAGE)), name) for path in MODULES.values() if path not in homes
             for name, decorator in _decorated(path)
             if (decorator.startswith("triton.jit") and name.endswith("_kernel")) or "triton_op(" in decorator
             or "custom_op(" in decorator]
    assert stray == []


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
