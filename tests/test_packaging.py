"""The package claims one name: the top-level folders install as ``turnstile.envs``, ``turnstile.rollout``,
``turnstile.rewards``, ``turnstile.learner`` and ``turnstile.cluster`` (pyproject.toml maps them), and
nothing imports them by their bare folder names, which would load a second copy of a module beside the
installed one (two plugin registries, failing isinstance checks) wherever the repository root is on
``sys.path`` (pytest, Ray workers started from it)."""

from __future__ import annotations

import ast
import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("envs", "rollout", "rewards", "learner", "cluster")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def test_every_package_folder_is_installed_under_turnstile() -> None:
    found = {".".join(("turnstile", *path.parent.relative_to(ROOT).parts))
             for folder in FOLDERS for path in (ROOT / folder).rglob("__init__.py")}
    assert set(SETUPTOOLS["packages"]) == found, "pyproject.toml's packages and the folders differ"
    assert SETUPTOOLS["package-dir"] == {f"turnstile.{folder}": folder for folder in FOLDERS}


def test_no_turnstile_folder_shadows_the_installed_package() -> None:
    assert not (ROOT / "turnstile").exists(), "a turnstile/ folder at the root would hide the installed package"


def test_the_package_data_is_there() -> None:
    for package, patterns in SETUPTOOLS["package-data"].items():
        folder = ROOT.joinpath(*package.split(".")[1:])
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches no file in {folder}"


def test_nothing_imports_a_folder_by_its_bare_name() -> None:
    bare = []
    for path in sorted(ROOT.rglob("*.py")):
        if {".venv", "build", "runs", ".git"} & set(path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            bare += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                     if name.split(".")[0] in FOLDERS]
    assert not bare, bare


def test_the_installed_entry_points_name_the_installed_modules() -> None:
    declared = {group: dict(points) for group, points in PYPROJECT["project"]["entry-points"].items()}
    for group, points in declared.items():
        installed = {point.name: point for point in importlib.metadata.entry_points(group=group)}
        for name, value in points.items():
            assert value.startswith("turnstile."), f"{group} {name} = {value}"
            assert installed[name].value == value, f"{group} {name}: installed {installed[name].value}: reinstall"
            installed[name].load()
    script = PYPROJECT["project"]["scripts"]["turnstile"]
    assert script == "turnstile.cluster.cli:main"
