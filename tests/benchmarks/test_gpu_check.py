"""`make gpu-check` (benchmarks.gpu_check): without CUDA it refuses with "no CUDA device" and a
non-zero exit, writing nothing; pytest's junit report is read into exact outcomes."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_cuda_refuses_with_a_clear_message(capsys, tmp_path):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu-check: no CUDA device: torch ")
    assert "nothing was run" in err
    assert not out.exists()


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4">
<testcase classname="tests.engine.test_cuda_sampling" name="test_matches_cpu" time="1.0"/>
<testcase classname="tests.engine.test_triton_kernels.TestOnCuda" name="test_graph" time="2.0">
<failure message="AssertionError: tokens differ">long traceback</failure></testcase>
<testcase classname="tests.deploy.test_gpu_disaggregated"
 name="test_disaggregated_over_nccl_equals_aggregated" time="0.0">
<skipped type="pytest.skip" message="the disaggregated NCCL run needs two GPUs (found 1)">
</skipped></testcase>
<testcase classname="tests.x" name="test_setup_broke" time="0.0">
<error message="failed on setup with &quot;OSError&quot;">trace</error></testcase>
</testsuite></testsuites>"""


def test_junit_outcomes_and_summary():
    outcomes = gpu_check.junit_outcomes(JUNIT)
    assert outcomes == {
        "tests.engine.test_cuda_sampling::test_matches_cpu": {"outcome": "passed", "detail": ""},
        "tests.engine.test_triton_kernels.TestOnCuda::test_graph": {
            "outcome": "failed",
            "detail": "AssertionError: tokens differ",
        },
        "tests.deploy.test_gpu_disaggregated::test_disaggregated_over_nccl_equals_aggregated": {
            "outcome": "skipped",
            "detail": "the disaggregated NCCL run needs two GPUs (found 1)",
        },
        "tests.x::test_setup_broke": {
            "outcome": "error",
            "detail": 'failed on setup with "OSError"',
        },
    }
    assert gpu_check.summarize(outcomes) == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}


def test_device_slug():
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert gpu_check.device_slug("???") == "gpu"
