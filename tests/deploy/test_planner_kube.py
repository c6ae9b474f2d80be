"""The planner against a local fake Kubernetes API server, through the official `kubernetes`
client: the exact requests it sends (paths, content types, PATCH bodies), the control loop
end to end with routers serving real /metrics, dry-run, and the `duet-planner` CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from duet.deploy.planner.cli import _apply_env, build_parser, config_from_args, main
from duet.deploy.planner.config import PlannerConfig, PoolConfig
from duet.deploy.planner.controller import Controller, PoolTargets, RouterScraper
from duet.deploy.planner.kube import DeploymentScaler, RouterEndpoints, api_client
from duet.deploy.planner.policy import ScalingPolicy
from duet.deploy.stop_signal import StopSignal
from tests.deploy.fake_kube_api import FakeKubeAPI, Recorded, endpoint_slice
from tests.deploy.router_metrics import MetricsServer, RouterMetrics
from tests.net import free_port
from tests.waiting import wait_for

NS = "serving"
TOKEN = "sa-token"
API_KEY = "sk-metrics"
PREFILL_SCALE = f"/apis/apps/v1/namespaces/{NS}/deployments/duet-prefill/scale"
DECODE_SCALE = f"/apis/apps/v1/namespaces/{NS}/deployments/duet-decode/scale"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
CONFIG = PlannerConfig(
    prefill=PoolConfig("prefill", min_replicas=1, max_replicas=8, gpus_per_replica=1),
    decode=PoolConfig("decode", min_replicas=1, max_replicas=8, gpus_per_replica=1),
    gpu_budget=16,
    ttft_p90_target_s=1.0,
    tpot_p90_target_s=0.1,
)


def _get(path: str, query: dict | None = None) -> Recorded:
    return Recorded("GET", path, query or {}, None, f"Bearer {TOKEN}", None)


@pytest.fixture
def kube():
    with FakeKubeAPI(NS, {"duet-prefill": 2, "duet-decode": 3}) as api:
        yield api


def test_scaler_reads_and_merge_patches_the_scale_subresource(kube):
    scaler = DeploymentScaler(api_client(kube.url, TOKEN), NS)
    assert scaler.get_replicas("duet-prefill") == 2
    scaler.set_replicas("duet-prefill", 5)
    assert kube.requests == [
        _get(PREFILL_SCALE),
        Recorded(
            "PATCH",
            PREFILL_SCALE,
            {},
            "application/merge-patch+json",
            f"Bearer {TOKEN}",
            {"spec": {"replicas": 5}},
        ),
    ]
    assert kube.replicas == {"duet-prefill": 5, "duet-decode": 3}


def test_router_endpoints_are_the_ready_ones_of_the_service(kube):
    kube.endpoint_slices["duet-router"] = [
        endpoint_slice("duet-router", NS, 8000, [("10.0.0.7", True), ("10.0.0.8", False)]),
        endpoint_slice("duet-router", NS, 8000, [("10.0.1.9", None)]),  # unset: ready
        endpoint_slice("duet-router", NS, 8000, [("fd00::5", True)]),
    ]
    kube.endpoint_slices["other"] = [endpoint_slice("other", NS, 9999, [("10.9.9.9", True)])]
    urls = RouterEndpoints(api_client(kube.url, TOKEN), NS, "duet-router").metrics_urls()
    assert urls == [
        "http://10.0.0.7:8000/metrics",
        "http://10.0.1.9:8000/metrics",
        "http://[fd00::5]:8000/metrics",
    ]
    assert kube.requests == [
        _get(SLICES, {"labelSelector": ["kubernetes.io/service-name=duet-router"]})
    ]


class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _routers(kube: FakeKubeAPI, *servers: MetricsServer) -> None:
    kube.endpoint_slices["duet-router"] = [
        endpoint_slice("duet-router", NS, s.port, [("127.0.0.1", True)]) for s in servers
    ]


def _controller(kube: FakeKubeAPI, dry_run: bool, clock: _Clock) -> Controller:
    api = api_client(kube.url, TOKEN)
    return Controller(
        ScalingPolicy(CONFIG),
        DeploymentScaler(api, NS),
        RouterScraper(RouterEndpoints(api, NS, "duet-router").metrics_urls, API_KEY, 5.0),
        PoolTargets("duet-prefill", "duet-decode"),
        dry_run=dry_run,
        clock=clock,
    )


def _steady(r: RouterMetrics) -> None:
    r.prefill_queued_tokens.set(1000)
    r.decode_batch_occupancy.set(0.6)
    r.num_prefill_workers.set(2)
    r.num_decode_workers.set(3)


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_ttft_miss_patches_exactly_the_prefill_scale(kube, dry_run):
    r1, r2 = RouterMetrics(), RouterMetrics()
    _steady(r1)
    _steady(r2)
    clock = _Clock()
    with MetricsServer(r1, API_KEY) as s1, MetricsServer(r2, API_KEY) as s2:
        _routers(kube, s1, s2)
        controller = _controller(kube, dry_run, clock)
        first = controller.step()  # the baseline scrape: no latency percentiles yet
        assert (first.sizes.prefill, first.sizes.decode) == (2, 3)
        # In the next 15 s the routers see slow first tokens (p90 between 2.5 and 5 s)
        # and fast decode.
        r1.observe_ttft(3.0, 30)
        r2.observe_ttft(3.0, 20)
        r1.observe_itl(0.02, 500)
        clock.now_s += 15
        second = controller.step()
        assert s1.auth_headers == s2.auth_headers == [f"Bearer {API_KEY}"] * 2
    assert (second.sizes.prefill, second.sizes.decode) == (4, 3)  # doubled, capped at 2x
    assert second.reasons["prefill"].startswith("TTFT p90 ")
    one_round = [
        _get(SLICES, {"labelSelector": ["kubernetes.io/service-name=duet-router"]}),
        _get(PREFILL_SCALE),
        _get(DECODE_SCALE),
    ]
    patch = Recorded(
        "PATCH", PREFILL_SCALE, {}, "application/merge-patch+json", f"Bearer {TOKEN}",
        {"spec": {"replicas": 4}},
    )  # fmt: skip
    if dry_run:
        assert kube.requests == one_round * 2
        assert kube.replicas == {"duet-prefill": 2, "duet-decode": 3}
    else:
        assert kube.requests == [*one_round, *one_round, patch]
        assert kube.replicas == {"duet-prefill": 4, "duet-decode": 3}


def test_unreachable_routers_hold_the_pools(kube):
    r = RouterMetrics()
    _steady(r)
    with MetricsServer(r, api_key="another-key") as server:  # 401 for the planner's key
        _routers(kube, server)
        controller = _controller(kube, False, _Clock())
        decision = controller.step()
    assert (decision.sizes.prefill, decision.sizes.decode) == (2, 3)
    assert decision.reasons["prefill"] == "no metrics: hold"
    assert kube.patches() == []


def test_env_fills_flags_and_an_explicit_flag_wins(monkeypatch):
    monkeypatch.setenv("DUET_PLANNER_GPU_BUDGET", "16")
    monkeypatch.setenv("DUET_PLANNER_HYSTERESIS", "0.3")
    monkeypatch.setenv("DUET_PLANNER_DRY_RUN", "true")
    monkeypatch.setenv("DUET_PLANNER_DECODE_GPUS_PER_REPLICA", "2")
    parser = build_parser()
    args = parser.parse_args(
        _apply_env(parser, ["--prefill-deployment=p", "--decode-deployment=d", "--hysteresis=0.1"])
    )
    config = config_from_args(args)
    assert (config.gpu_budget, config.hysteresis, config.decode.gpus_per_replica) == (16, 0.1, 2)
    assert args.dry_run is True


def test_cli_rejects_a_budget_below_the_minimums(capsys):
    code = main([
        "--namespace=serving", "--prefill-deployment=p", "--decode-deployment=d",
        "--metrics-url=http://127.0.0.1:1/metrics", "--gpu-budget=3",
        "--prefill-min-replicas=1", "--prefill-gpus-per-replica=2", "--decode-min-replicas=2",
    ])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err == (
        "duet-planner: error: gpu_budget: must be >= the 4 GPUs the pools' min_replicas "
        "need; got 3\n"
    )


def test_duet_planner_process_scales_and_reports_health(kube, tmp_path: Path):
    r = RouterMetrics()
    _steady(r)
    r.decode_batch_occupancy.set(0.99)  # decode is full: it needs ceil(3 x 0.99/0.75) = 4
    token_file, keys_file = tmp_path / "token", tmp_path / "keys.txt"
    token_file.write_text(TOKEN + "\n")
    keys_file.write_text(f"# duet keys\n\n{API_KEY}\nsk-other\n")
    health_port = free_port()
    with MetricsServer(r, API_KEY) as server:
        _routers(kube, server)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "duet.deploy.planner",
                f"--kube-api={kube.url}",
                f"--kube-token-file={token_file}",
                f"--api-key-file={keys_file}",
                "--metrics-service=duet-router",
                "--interval-s=0.2",
                f"--health-port={health_port}",
                "--prefill-deployment=duet-prefill",
                "--decode-deployment=duet-decode",
            ],
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "POD_NAMESPACE": NS, "DUET_PLANNER_GPU_BUDGET": "16"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_for(lambda: kube.patches(), 30, "the planner's PATCH")
            with urllib.request.urlopen(
                f"http://127.0.0.1:{health_port}/healthz", timeout=5
            ) as response:
                assert response.status == 200
                assert response.read().decode().startswith("ok: last step")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate(timeout=20)
                pytest.fail(f"the planner did not stop on SIGTERM within 20 s:\n{out}")
    assert proc.returncode == 0, out
    (patch,) = kube.patches()
    assert (patch.path, patch.content_type, patch.body) == (
        DECODE_SCALE, "application/merge-patch+json", {"spec": {"replicas": 4}},
    )  # fmt: skip
    assert patch.authorization == f"Bearer {TOKEN}"
    assert "decode: scaling 3 -> 4 (occupancy 0.99 > 0.75)" in out
    assert out.rstrip().endswith("INFO duet.planner: stopped")
    assert server.auth_headers and set(server.auth_headers) == {f"Bearer {API_KEY}"}


def test_a_stop_signal_inside_a_step_ends_the_loop_after_it(kube, monkeypatch):
    """The handler only sets a flag (setting an Event from a handler can deadlock on its lock;
    raising can be swallowed by a library call in flight): the step finishes, then the loop
    ends."""
    controller = _controller(kube, dry_run=True, clock=_Clock())
    steps = []

    def step():
        os.kill(os.getpid(), signal.SIGTERM)
        steps.append(1)  # the signal did not cut the step short

    monkeypatch.setattr(controller, "step", step)
    stop = StopSignal()
    try:
        controller.run(0.01, stop)
    finally:
        stop.restore()
    assert steps == [1]


def test_a_stop_signal_ends_the_wait_between_steps_at_once(kube, monkeypatch):
    controller = _controller(kube, dry_run=True, clock=_Clock())
    monkeypatch.setattr(controller, "step", lambda: None)
    stop = StopSignal()
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    try:
        timer.start()
        controller.run(60.0, stop)  # one step, then a 60 s wait that the signal ends
    finally:
        timer.cancel()
        stop.restore()
    assert time.monotonic() - started < 5
