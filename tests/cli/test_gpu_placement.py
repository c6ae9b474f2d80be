"""`duet serve --disaggregated` on a faked GPU host (CPU only): a placement that would put a
prefill rank and a decode worker on one GPU, with their KV over NCCL, is refused before Ray
starts, with a message naming the flags."""

from __future__ import annotations

import pytest
import torch

from duet.cli.engine_flags import given_engine_flags
from duet.cli.main import main
from duet.cli.serve_cluster import check_worker_configs
from duet.router.server import RouterConfig
from tests.cli.test_engine_flags import parse


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """Set the number of GPUs this host seems to have."""

    def have(num_gpus: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: num_gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)

    return have


def accepted(argv: list[str]) -> bool:
    parser, args = parse(["serve", "--disaggregated", "--model", "m", *argv])
    return check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args)) is not None


def test_one_gpu_host_is_refused_naming_the_flags(gpus, capsys: pytest.CaptureFixture[str]) -> None:
    gpus(1)
    assert main(["serve", "--disaggregated", "--model", "m"]) == 2
    err = capsys.readouterr().err
    need = "--prefill-workers 1 x --prefill-tp 1 + --decode-workers 1 x --decode-tp 1 need 2 GPUs"
    assert need in err
    assert "this machine has 1" in err and "--device cpu" in err and "Traceback" not in err


def test_fractional_gpus_are_refused_with_nccl(gpus, capsys: pytest.CaptureFixture[str]) -> None:
    gpus(4)
    argv = ["serve", "--disaggregated", "--model", "m", "--gpus-per-worker", "0.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "--gpus-per-worker: 0.5 lets Ray put a prefill rank and a decode worker on one GPU" in err
    )
    assert main([*argv, "--ray-address", "auto"]) == 2  # a joined cluster too


def test_placements_that_give_each_worker_a_gpu_or_keep_kv_on_the_cpu_pass(gpus) -> None:
    gpus(2)
    assert accepted([])
    with pytest.raises(ValueError, match="need 3 GPUs"):
        accepted(["--decode-workers", "2"])
    with pytest.raises(ValueError, match="x --decode-tp 2 need 3 GPUs"):
        accepted(["--decode-tp", "2"])  # a rank per GPU
    gpus(1)
    assert accepted(["--device", "cpu"])
    assert accepted(["--ray-address", "auto"])  # Ray places the workers across the cluster
    gpus(0)
    assert accepted(["--decode-workers", "3"])  # no GPU: CPU caches
