"""make gpu-carry: which wheels travel to a lent GPU machine, and the nixl wheel slimmed to fit
the device tool's 64 MiB (benchmarks/gpu_check/carry.py)."""

from __future__ import annotations

import zipfile

from benchmarks.gpu_check import carry


def test_only_what_the_image_lacks_travels_plus_the_stubs_versions():
    pins = carry.to_carry(carry.REQUIREMENTS.read_text())
    names = {carry.normalize(p.split("==")[0]) for p in pins}
    assert {"nixl-cu12", "xgrammar", "fastapi", "pydantic-core", "gguf", "redis"} <= names
    assert not names & carry.IMAGE_HAS  # transformers, tokenizers, pytest... are the image's
    assert pins[-2:] == ["grpcio==1.85.3", "protobuf==7.36.2"]
    assert all("==" in p for p in pins)  # pinned: --no-deps fetches exactly these


def test_the_nixl_wheel_loses_only_what_the_check_never_loads(tmp_path):
    wheel = tmp_path / "nixl_cu12-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    keep = [
        "nixl_cu12/_api.py",
        "nixl_cu12.libs/ucx/libuct_cuda.so.0.0.0",
        "nixl_cu12.libs/libucs-14c218c5.so.0.0.0",
        "nixl_ep_cu12/__init__.py",
        "nixl_cu12-1.5.1.dist-info/RECORD",
    ]
    drop = [
        "nixl_ep_cu12/nixl_ep_cpp_torch213.cpython-312-x86_64-linux-gnu.so",
        "nixl_cu12.libs/ucx/libucx_perftest_cuda.so.0.0.0",
        "nixl_cu12-1.5.1.data/headers/asio/asio.hpp",
    ]
    with zipfile.ZipFile(wheel, "w") as z:
        for name in keep + drop:
            z.writestr(name, name * 1000)
    saved = carry.slim_wheel(wheel)
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == sorted(keep)
        assert z.read("nixl_cu12/_api.py") == b"nixl_cu12/_api.py" * 1000
    assert saved > 0
