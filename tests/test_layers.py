"""The library's layering, read from the source (no import runs): packages depend downwards only
(envs < rollout < rewards < learner < cluster, and inside cluster fleet < jobs < recipes < tools <
cli), no module imports itself back through others (every import counts: top-level, inside a
function, or under ``TYPE_CHECKING``), and the library imports no recipe: only the ``build-model``
command runs the warm-start recipe."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("envs", "rollout", "rewards", "learner", "cluster")  # the folders, installed as turnstile.<folder>
LAYERS = tuple(f"turnstile.{name}" for name in ("envs", "rollout", "rewards", "learner", "cluster.fleet",
                                                "cluster.jobs", "cluster.recipes", "cluster.tools", "cluster.cli"))
RECIPES = "turnstile.cluster.recipes"
RUNS_RECIPES = {"turnstile.cluster.cli.commands.build_model"}  # the command that builds a model by its recipe


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(("turnstile", *path.relative_to(ROOT).with_suffix("").parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> Iterator[str]:
    """Every library module ``path`` imports, wherever the import statement stands."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            while name and name not in known:  # a name imported from a module: the module
                name = name.rpartition(".")[0]
            if name:
                yield name


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {target for target in imports(path, known) if target != name} for name, path in known.items()}


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of the layer ``module`` belongs to."""
    found = [i for i, name in enumerate(LAYERS) if module == name or module.startswith(f"{name}.")]
    assert found or module == "turnstile.cluster", f"{module} is in no layer: give its folder a place in LAYERS"
    return found[0] if found else LAYERS.index("turnstile.cluster.fleet")


def test_every_cluster_module_has_a_role() -> None:
    loose = [path.name for path in modules().values() if path.parent == ROOT / "cluster" and path.name != "__init__.py"]
    assert not loose, f"modules directly in cluster/, outside a role's folder: {loose}"


def test_packages_depend_downwards_only() -> None:
    upward = [f"{source} -> {target}" for source, targets in graph().items() for target in targets
              if layer(target) > layer(source)]
    assert not upward, upward


def test_no_module_imports_itself_back() -> None:
    edges = graph()
    cycles = []
    for start in edges:  # a path from a module's imports back to it
        seen, stack = set(), [(target, [start, target]) for target in edges[start]]
        while stack:
            node, path = stack.pop()
            if node == start:
                cycles.append(" -> ".join(path))
                break
            if node not in seen:
                seen.add(node)
                stack.extend((target, [*path, target]) for target in edges.get(node, ()))
    assert not cycles, cycles


def test_the_library_imports_no_recipe() -> None:
    importers = sorted(source for source, targets in graph().items()
                       if any(target.startswith(RECIPES) for target in targets)
                       and source not in RUNS_RECIPES and not source.startswith(RECIPES))
    assert not importers, importers
