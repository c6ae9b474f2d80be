"""Regenerate the Python modules beside each .proto: `python proto/generate.py [OUT_DIR]`.

With OUT_DIR the modules go there instead (the freshness test compares the two)."""

from __future__ import annotations

import glob
import os
import sys

from grpc_tools import protoc

ROOT = os.path.dirname(os.path.abspath(__file__))


def generate(out_dir: str = ROOT) -> list[str]:
    protos = sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "duet", "v1", "*.proto"))
    )
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    for proto in protos:
        args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}", proto]  # fmt: skip
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    return protos


if __name__ == "__main__":
    generate(sys.argv[1] if len(sys.argv) > 1 else ROOT)
