"""The import layout: which top-level package may import which, read from the source with `ast`
(lazy imports inside functions count too: they are dependencies all the same).

- The product (what pyproject installs) never imports `benchmarks/`.
- Imports between top-level packages form no cycle.
- Inside `engine/` no module imports itself back through others.
- Every package under a product folder is in pyproject's package list (else it is not installed).
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS.get("package-dir", {})  # {"duet": "proto/duet"}
INSTALLED: list[str] = SETUPTOOLS["packages"]
PRODUCT = sorted({name.split(".")[0] for name in INSTALLED})
NOT_PRODUCT = ("benchmarks", "tests")


def top_level_packages() -> dict[str, Path]:
    """Every importable top-level package of the repository: name -> folder."""
    found = {p.parent.name: p.parent for p in ROOT.glob("*/__init__.py")}
    found.update({name: ROOT / folder for name, folder in PACKAGE_DIR.items()})
    return found


def module_files(package: str, folder: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `folder` (generated gRPC stubs
    included: they import each other as `duet.v1.*`)."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


def imported_names(path: Path, module: str) -> set[str]:
    """Dotted names `path` imports: `from a.b import c` yields a.b and a.b.c (c may be a
    submodule); relative imports are resolved against `module`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: None if is_package else -1]
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


PACKAGES = top_level_packages()
MODULES = {
    name: path
    for package, folder in PACKAGES.items()
    if package != "tests"
    for name, path in module_files(package, folder).items()
}


def package_graph() -> dict[str, set[str]]:
    """Top-level package -> the other top-level packages its modules import."""
    graph: dict[str, set[str]] = {package: set() for package in PACKAGES if package != "tests"}
    for module, path in MODULES.items():
        here = module.split(".")[0]
        for name in imported_names(path, module):
            there = name.split(".")[0]
            if there in graph and there != here:
                graph[here].add(there)
    return graph


def module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same top-level package it imports."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        if module.split(".")[0] == package:
            names = imported_names(path, module)
            graph[module] = {n for n in names if n in MODULES and n != module}
    return graph


def test_the_graph_sees_the_known_edges():
    """Guards the parser: an empty graph would pass every check below."""
    graph = package_graph()
    assert {"engine", "kv_transfer"} <= graph["prefill_worker"]
    assert "engine" in graph["cli"]
    assert "duet" in graph["router"]
    assert "engine.kernels.triton_runtime" in module_graph("engine")["engine.model_runner"]


def test_the_product_never_imports_benchmarks():
    graph = package_graph()
    assert "benchmarks" not in PRODUCT
    offenders = sorted(p for p in PRODUCT if "benchmarks" in graph[p])
    assert offenders == [], f"product packages importing benchmarks/: {offenders}"


def test_top_level_packages_import_no_cycle():
    cycle = find_cycle(package_graph())
    assert cycle is None, "import cycle between top-level packages: " + " -> ".join(cycle or [])


def test_engine_modules_import_no_cycle():
    cycle = find_cycle(module_graph("engine"))
    assert cycle is None, "import cycle inside engine/: " + " -> ".join(cycle or [])


def test_find_cycle_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_product_package_is_installed():
    """A folder with an __init__.py under a product package, missing from pyproject's list,
    would be left out of the wheel (and the Docker image) without any error."""
    expected = set()
    for package in PRODUCT:
        folder = PACKAGES[package]
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            expected.add(".".join([package, *rel]))
    assert sorted(expected - set(INSTALLED)) == []
    assert sorted(set(INSTALLED) - expected) == []
    assert sorted(p for p in PACKAGES if p not in (*PRODUCT, *NOT_PRODUCT)) == []
