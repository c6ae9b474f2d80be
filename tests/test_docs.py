"""The docs stay true by construction: docs/ARCHITECTURE.md's file tables name every file of the
product and nothing that is gone, and no module docstring cites a file that does not exist."""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".proto", ".html", ".js", ".css")
SECTION = re.compile(r"^### `([^`]+/)`$")
TICKED = re.compile(r"`([^`\s]+)`")


def product_folders() -> list[str]:
    """The folders the product installs (duet/'s links), as repository paths."""
    links = sorted(p for p in (ROOT / "duet").iterdir() if p.is_symlink())
    return sorted(str(p.resolve().relative_to(ROOT)) for p in links)


def files_on_disk(folder: str) -> set[str]:
    """Source files directly in `folder` and in its subfolders that have no section of their
    own, relative to `folder`."""
    base = ROOT / folder
    return {
        str(p.relative_to(base))
        for p in base.rglob("*")
        if p.is_file()
        and (p.suffix in SOURCE_SUFFIXES or p.name.startswith("Dockerfile"))
        and "__pycache__" not in p.parts
        and not p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
    }


def documented_files() -> dict[str, set[str]]:
    """Section folder -> the files its table names, relative to that folder. A row whose first
    cell is a subfolder (`spec_decode/`) names its files in the second cell."""
    sections: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in ARCHITECTURE.read_text().splitlines():
        if line.startswith("#"):
            match = SECTION.match(line)
            current = sections.setdefault(match[1].rstrip("/"), set()) if match else None
            continue
        if current is None or not line.startswith("| `"):
            continue
        cells = line.split("|")
        first, second = cells[1], cells[2] if len(cells) > 2 else ""
        for name in TICKED.findall(first):
            if name.endswith("/"):
                current.update(
                    f"{name}{inner}"
                    for inner in TICKED.findall(second)
                    if inner.endswith(SOURCE_SUFFIXES) and "/" not in inner
                )
            else:
                current.add(name)
    return sections


def expected_files() -> dict[str, set[str]]:
    """Section folder -> its files on disk, each file in the deepest folder with a section."""
    sections = documented_files()
    out: dict[str, set[str]] = {}
    for folder in product_folders():
        for rel in files_on_disk(folder):
            path = f"{folder}/{rel}"
            owner = max((s for s in sections if path.startswith(s + "/")), key=len, default=folder)
            out.setdefault(owner, set()).add(path[len(owner) + 1 :])
    return out


def test_every_product_folder_has_a_file_table():
    """Its own section, or its parent's (proto/ holds proto/duet/v1)."""
    sections = documented_files()
    orphans = [
        f for f in product_folders() if not any(f == s or f.startswith(s + "/") for s in sections)
    ]
    assert orphans == []


def test_the_file_tables_name_every_product_file_and_none_that_is_gone():
    documented, expected = documented_files(), expected_files()
    missing = sorted(f"{s}/{f}" for s, files in expected.items() for f in files - documented[s])
    gone = sorted(
        f"{s}/{f}"
        for s, files in documented.items()
        if any(s == p or s.startswith(p + "/") for p in product_folders())
        for f in files - expected.get(s, set())
    )
    assert missing == [], "files docs/ARCHITECTURE.md does not list"
    assert gone == [], "files docs/ARCHITECTURE.md lists that do not exist"


def cited_paths(text: str) -> set[str]:
    """Files of the repository a docstring cites: paths (`docs/x.md`, `engine/loader.py`) and
    bare names of its own kinds (`DESIGN.md`, `inbox.py`, `worker.proto`). A model's files
    (`config.json`) and other projects (`llama.cpp`) are not the repository's."""
    pattern = r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:md|py|proto|cpp|h|yaml|json))(?![\w/])"
    return {
        path
        for path in re.findall(pattern, text)
        if "/" in path or path.endswith((".md", ".py", ".proto"))
    }


def exists_in_repository(cited: str, source: Path) -> bool:
    """A path relative to the root, the citing module or docs/; a bare name anywhere."""
    if "/" in cited:
        return any(p.exists() for p in (ROOT / cited, source.parent / cited, ROOT / "docs" / cited))
    return (source.parent / cited).exists() or cited in repository_file_names()


@functools.cache
def repository_file_names() -> frozenset[str]:
    names = set()
    for _folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        names.update(files)
    return frozenset(names)


def test_module_docstrings_cite_only_files_that_exist():
    offenders = []
    for folder in product_folders():
        for source in sorted((ROOT / folder).rglob("*.py")):
            if source.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            doc = ast.get_docstring(ast.parse(source.read_text())) or ""
            offenders += [
                f"{source.relative_to(ROOT)}: {cited}"
                for cited in sorted(cited_paths(doc))
                if not exists_in_repository(cited, source)
            ]
    assert offenders == []


def product_members() -> tuple[dict[str, set[str]], set[str]]:
    """Every product class -> the names defined on it (methods, class attributes, `self.x`
    assignments), and every function and method name."""
    classes: dict[str, set[str]] = {}
    functions: set[str] = set()
    for folder in product_folders():
        for source in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    functions.add(node.name)
                if not isinstance(node, ast.ClassDef):
                    continue
                members = classes.setdefault(node.name, set())
                for item in ast.walk(node):
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        members.add(item.name)
                    elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                        members.add(item.id)
                    elif (
                        isinstance(item, ast.Attribute)
                        and isinstance(item.ctx, ast.Store)
                        and isinstance(item.value, ast.Name)
                        and item.value.id == "self"
                    ):
                        members.add(item.attr)
    return classes, functions


def test_architecture_names_only_code_that_exists():
    """`Class.member` of a product class and private `_names` in docs/ARCHITECTURE.md name
    code that exists (a rename leaves no stale reference behind)."""
    classes, functions = product_members()
    text = ARCHITECTURE.read_text()
    stale = sorted(
        {
            f"{cls}.{member}"
            for cls, member in re.findall(r"`([A-Z][A-Za-z0-9]+)\.([a-z_][a-z_0-9]*)`", text)
            if cls in classes and member not in classes[cls]
        }
        | {
            name
            for name in re.findall(r"`(_[a-z][a-z_0-9]*)(?:\(\))?`", text)
            if name not in functions and not any(name in m for m in classes.values())
        }
    )
    assert stale == []
