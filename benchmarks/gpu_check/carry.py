"""`make gpu-carry`: the wheels a lent GPU machine needs for `make gpu-check`, small enough to
travel with the tree.

    python -m benchmarks.gpu_check.carry [--dest .whl] [--python-version 3.12]

The device tool sends the checkout and the paths named in `carry`, 64 MiB in all; the whole
closure in requirements.txt is about 106 MB. So this downloads (with `pip download --no-deps`,
for the GPU machine's Python and platform) only the wheels its image lacks (`IMAGE_HAS`: what
the image's package list names, whose versions served the first whole run on an H200 on
2026-11-28), plus grpcio and protobuf, whose versions duet's generated stubs require, and
repacks nixl-cu12 without what the check never loads (`SLIM_NIXL`): the expert-parallel
extension's three builds (104 MB unpacked), UCX's CUDA perftest and the C++ headers. About
43 MB. On the GPU machine (docs/gpu.md):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \\
      && PYTHONPATH=/tmp/site:$PWD timeout 540 python3 -m benchmarks.gpu_check
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REQUIREMENTS = Path(__file__).with_name("requirements.txt")

IMAGE_HAS = frozenset(
    {
        "annotated-doc", "anyio", "attrs", "certifi", "charset-normalizer", "click", "h11",
        "hf-xet", "huggingface-hub", "idna", "iniconfig", "markdown-it-py", "mdurl", "ninja",
        "packaging", "pluggy", "prometheus-client", "pygments", "pytest", "pytest-timeout",
        "pyyaml", "regex", "requests", "rich", "safetensors", "shellingham", "tokenizers",
        "tqdm", "transformers", "typer", "urllib3",
    }
)  # fmt: skip
"""Requirements the GPU machine's image already holds (device tool's KINDS.md, 2026-11-17)."""

ALSO_CARRY = ("grpcio==1.85.3", "protobuf==7.36.2")
"""Beyond requirements.txt: the versions the generated stubs in proto/ were made with
(`GRPC_GENERATED_VERSION` 1.85.1 refuses an older grpcio), as in constraints.txt."""

SLIM_NIXL = (
    re.compile(r"^nixl_ep_cu1\d/.*\.so$"),
    re.compile(r"^nixl_cu1\d\.libs/ucx/libucx_perftest_cuda\.so"),
    re.compile(r"^nixl_cu1\d-[^/]+\.data/headers/"),
)
"""Members of the nixl wheel the check never loads."""

PLATFORMS = (
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any",
)  # fmt: skip


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def to_carry(requirements: str) -> list[str]:
    """The pinned requirements (`name==version`) the image lacks, then `ALSO_CARRY`."""
    pins = []
    for line in requirements.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and normalize(line.split("==", 1)[0]) not in IMAGE_HAS:
            pins.append(line)
    return pins + list(ALSO_CARRY)


def slim_wheel(wheel: Path, drop: tuple[re.Pattern[str], ...] = SLIM_NIXL) -> int:
    """Rewrite `wheel` without the members `drop` matches; the bytes saved. (pip installs a
    wheel whose RECORD names files it lacks: it checks no hashes of a local install.)"""
    before = wheel.stat().st_size
    with tempfile.NamedTemporaryFile(dir=wheel.parent, suffix=".whl", delete=False) as tmp:
        out = Path(tmp.name)
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:  # fmt: skip
        for item in src.infolist():
            if not any(p.search(item.filename) for p in drop):
                dst.writestr(item, src.read(item))
    out.replace(wheel)
    return before - wheel.stat().st_size


def download(pins: list[str], dest: Path, python_version: str) -> None:
    platforms = [f for p in PLATFORMS for f in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--implementation", "cp", "--python-version", python_version,
           *platforms, "--dest", str(dest), *pins]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=900)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check.carry")
    parser.add_argument("--dest", default=".whl", help="folder to fill (default %(default)s)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    download(to_carry(REQUIREMENTS.read_text()), dest, args.python_version)
    for wheel in dest.glob("nixl_cu1*.whl"):
        print(f"{wheel.name}: {slim_wheel(wheel) / 2**20:.1f} MiB left out")
    total = sum(w.stat().st_size for w in dest.glob("*.whl"))
    print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB "
          "(the device tool carries 64 MiB with the tree)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
