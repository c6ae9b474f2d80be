"""`duet` itself: `--version` prints the installed package's version (pyproject's) and exits 0,
before any subcommand is needed."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from duet.cli.main import build_parser, main


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_version(flag: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main([flag])
    assert info.value.code == 0
    version = importlib.metadata.version("duet-serve")
    assert capsys.readouterr().out == f"duet {version}\n"
    pyproject = tomllib.loads(Path("pyproject.toml").read_text())
    assert version == pyproject["project"]["version"]


def test_version_as_a_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "duet.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"duet {importlib.metadata.version('duet-serve')}\n"


def test_version_from_a_checkout_that_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A lent GPU machine runs the tree from PYTHONPATH without installing it (docs/gpu.md):
    there `duet serve` started (the parser builds the version string) only once the version
    came from the checkout's pyproject.toml instead of the missing distribution."""

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    pyproject = tomllib.loads(Path("pyproject.toml").read_text())
    parser = build_parser()
    assert parser.format_usage()  # built without the distribution
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"duet {pyproject['project']['version']}\n"
