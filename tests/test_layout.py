"""The import layout: which package may import which, read from the source with `ast` (lazy
imports inside functions count too: they are dependencies all the same).

- Everything installs under the one `duet` namespace: duet/ links each product folder.
- No module imports a product folder by its bare name (`engine.x`): that would load a second
  copy of the module beside `duet.engine.x`.
- The product (what pyproject installs) never imports `benchmarks/`.
- Imports between the product's packages form no cycle.
- Inside every product package no module imports itself back through others.
- Every package under a product folder is found by pyproject's package discovery.
"""

from __future__ import annotations

import ast
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
from setuptools import find_namespace_packages

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FIND = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
NAMESPACE = ROOT / "duet"
NOT_PRODUCT = ("benchmarks", "tests")


def product_links() -> dict[str, Path]:
    """duet/'s links: package name under `duet` -> the folder it links to."""
    return {p.name: p.resolve() for p in sorted(NAMESPACE.iterdir()) if p.is_symlink()}


def top_level_packages() -> dict[str, Path]:
    """Every importable package of the repository by the name code imports it with:
    `duet.<folder>` for the product, the bare name for benchmarks/ and tests/."""
    found = {f"duet.{name}": folder for name, folder in product_links().items()}
    found.update({name: ROOT / name for name in NOT_PRODUCT})
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
    """Dotted names `path` imports: `from a.b import c` yields a.b.c when that is a module of
    the repository (importing a submodule depends on it, not on what its package's
    `__init__` imports), else a.b and a.b.c; relative imports are resolved against `module`."""
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
            submodules = {f"{source}.{alias.name}" for alias in node.names}
            names.update(submodules)
            if not submodules <= ALL_MODULES:
                names.add(source)
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
ALL_MODULES = {
    name for package, folder in PACKAGES.items() for name in module_files(package, folder)
}
MODULES = {
    name: path
    for package, folder in PACKAGES.items()
    if package != "tests"
    for name, path in module_files(package, folder).items()
}


def package_of(module: str) -> str:
    """The package of `module` as the graph counts them: duet.engine, duet.v1, benchmarks."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "duet" else parts[0]


def package_graph() -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    graph: dict[str, set[str]] = {package: set() for package in PACKAGES if package != "tests"}
    for module, path in MODULES.items():
        here = package_of(module)
        for name in imported_names(path, module):
            there = package_of(name)
            if there in graph and there != here:
                graph[here].add(there)
    return graph


def module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        if package_of(module) == package:
            names = imported_names(path, module)
            graph[module] = {n for n in names if n in MODULES and n != module}
    return graph


def test_the_graph_sees_the_known_edges():
    """Guards the parser: an empty graph would pass every check below."""
    graph = package_graph()
    assert {"duet.engine", "duet.kv_transfer"} <= graph["duet.prefill_worker"]
    assert "duet.engine" in graph["duet.cli"]
    assert "duet.v1" in graph["duet.router"]
    runner = module_graph("duet.engine")["duet.engine.model_runner"]
    assert "duet.engine.kernels.triton_runtime" in runner


def test_the_namespace_links_every_product_folder():
    """duet/ holds its __init__.py and one relative link per product folder, each a package at
    the repository root (the generated gRPC modules: proto/duet/v1)."""
    links = {p.name: os.readlink(p) for p in NAMESPACE.iterdir() if p.is_symlink()}
    assert all(target == f"../{name}" for name, target in links.items() if name != "v1")
    assert links["v1"] == "../proto/duet/v1"
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - set(NOT_PRODUCT) - {"duet"}
    assert sorted(folders ^ (set(links) - {"v1"})) == []
    others = sorted(p.name for p in NAMESPACE.iterdir() if not p.is_symlink())
    assert others in (["__init__.py"], ["__init__.py", "__pycache__"])


def test_no_module_imports_a_product_folder_by_its_bare_name():
    bare = {name for name in product_links()}
    offenders = sorted(
        f"{module}: {name}"
        for module, path in MODULES.items()
        for name in imported_names(path, module)
        if name.split(".")[0] in bare
    )
    for test in sorted((ROOT / "tests").rglob("*.py")):
        module = "tests." + ".".join(test.relative_to(ROOT / "tests").with_suffix("").parts)
        offenders += [
            f"{module}: {name}"
            for name in sorted(imported_names(test, module))
            if name.split(".")[0] in bare
        ]
    assert offenders == []


def test_the_product_never_imports_benchmarks():
    graph = package_graph()
    offenders = sorted(p for p in graph if p.startswith("duet.") and "benchmarks" in graph[p])
    assert offenders == [], f"product packages importing benchmarks/: {offenders}"


def test_product_packages_import_no_cycle():
    cycle = find_cycle(package_graph())
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("package", sorted(p for p in PACKAGES if p.startswith("duet.")))
def test_no_product_package_imports_itself_in_a_cycle(package):
    cycle = find_cycle(module_graph(package))
    assert cycle is None, f"import cycle inside {package}: " + " -> ".join(cycle or [])


def test_importing_a_submodule_is_no_edge_to_its_package():
    """`from duet.kv_transfer import sockio` inside kv_transfer/factory.py (a lazy import in
    a function) depends on sockio, not on the package's `__init__` (which imports factory)."""
    names = imported_names(ROOT / "kv_transfer" / "factory.py", "duet.kv_transfer.factory")
    assert "duet.kv_transfer.sockio" in names
    assert "duet.kv_transfer" not in names
    router = module_graph("duet.router")
    assert "duet.router.serving_chat" not in router["duet.router.batch_runner"]
    assert "duet.router.batch_runner" not in router["duet.router.background"]


def test_find_cycle_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_product_package_is_installed():
    """Every folder holding Python under a product folder is a package pyproject's discovery
    finds (else the wheel and the Docker image would leave it out without an error)."""
    expected = {"duet"}
    for name, folder in product_links().items():
        for source in folder.rglob("*.py"):
            rel = source.parent.relative_to(folder).parts
            expected.add(".".join(["duet", name, *rel]))
    found = set(
        find_namespace_packages(str(ROOT), include=FIND["include"], exclude=FIND["exclude"])
    )
    assert sorted(expected - found) == []
