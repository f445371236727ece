"""The library's layers, read from its imports: no import loops, no upward imports, and the order
docs/architecture.md draws.

A module directly under ``platform/speed/`` is a foundation; every folder is one layer, and a layer imports
only the foundations and the layers before it in ``LAYERS`` (its own modules among each other too).
Imports inside functions and under ``TYPE_CHECKING`` count as well: a lazy import hides a loop, it does not
remove it. ``speed/__init__.py`` is the public front (``from speed import ...``) and stands above all.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from speed.paths import repo_root

LAYERS = (
    "foundations",
    "engine",
    "data",
    "models",
    "decode",
    "eval",
    "train",
    "serve",
    "loadtest",
    "benchmarks",
    "sweep",
    "analysis",
)
ROOT = repo_root() / "platform" / "speed"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "front"
    return parts[1] if (ROOT / parts[1]).is_dir() else "foundations"


def _known(module: str, modules: set[str]) -> str | None:
    """The library module an imported name refers to (``speed.engine.Engine`` -> ``speed.engine``)."""
    while module and module not in modules:
        module = module.rpartition(".")[0]
    return module or None


def import_graph() -> dict[str, set[str]]:
    """Every library module -> the library modules it imports, anywhere in its text."""
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "speed":
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "speed"]
            else:
                continue
            for name in names:
                target = _known(name, set(files))
                if target and target != module:
                    graph[module].add(target)
        graph.setdefault(module, set())
    return graph


def _package_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing ``speed.a.b`` runs ``speed/a/__init__.py`` first: a module imports its packages too."""
    out = {m: set(ts) for m, ts in graph.items()}
    for m, targets in graph.items():
        for t in targets:
            parent = t.rpartition(".")[0]
            while parent.count(".") >= 1:
                if parent in graph and parent != m and not m.startswith(parent + "."):
                    out[m].add(parent)
                parent = parent.rpartition(".")[0]
    return out


def test_every_folder_of_the_library_is_a_layer():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS) - {"foundations"}, "add the folder to LAYERS here and to docs/architecture.md"


def test_no_module_imports_a_later_layer():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(
        f"{m} ({_layer(m)}) imports {t} ({_layer(t)})"
        for m, targets in import_graph().items()
        if _layer(m) != "front"
        for t in targets
        if _layer(t) == "front" or rank[_layer(t)] > rank[_layer(m)]
    )
    assert not upward, "\n".join(upward)


def test_there_is_no_import_loop():
    graph = _package_parents(import_graph())
    for m in graph:  # a package's __init__ importing its own modules is how a package is made, not a loop
        graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    state: dict[str, int] = {}
    loops: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                loops.append([*path[path.index(t) :], t] if t in path else [m, t])
            elif t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not loops, "\n".join(" -> ".join(loop) for loop in loops)


def test_the_architecture_page_draws_these_layers_in_this_order():
    text = (repo_root() / "docs" / "architecture.md").read_text()
    drawn = re.findall(r"^\| (\w+) \|", text.split("## Layers", 1)[1].split("\n## ", 1)[0], re.M)
    assert tuple(d for d in drawn if d != "layer") == LAYERS


def _family_comparisons(path: Path, names: set[str]) -> list[str]:
    """``family == "lm"`` and its kin in one file: a comparison (``==``, ``!=``, ``in``, ``not in``) of a family's
    name as a literal with an expression that names a family (``spec.family``, ``family_of(m).name``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = set()
        for operand in operands:
            values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            literals |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
        if literals & names and any("family" in ast.unparse(o).lower() for o in operands):
            found.append(f"{path.relative_to(repo_root())}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_models_layer_asks_which_family_a_model_is():
    """What differs between families is a ``Family``'s to say (``speed.models.family``): a comparison of a family's
    name anywhere else (the library outside ``models/``, the jobs) is a switch that a new family would miss."""
    from speed.models.family import FAMILIES

    files = [p for p in ROOT.rglob("*.py") if not p.is_relative_to(ROOT / "models")]
    files += sorted((repo_root() / "jobs").rglob("*.py"))
    found = [line for path in files for line in _family_comparisons(path, set(FAMILIES))]
    assert not found, "ask the Family instead:\n" + "\n".join(found)
