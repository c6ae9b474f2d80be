"""Faults across network hosts, not only processes: the router, a prefill worker and two decode
workers each in a network namespace of its own on a bridge the test makes (tests/netns.py),
clients and an outsider in one more, and the network between them broken while requests run:
a decode worker partitioned from the prefill worker mid-transfer, from the router mid-stream,
its link down and up again, and a slow lossy KV link. Every request completes exactly once with
the aggregated engine's greedy text (failover or retry; nothing repeated or lost), no request
outlives the router's timeout, the dashboard shows the partition, and the KV blocks of both
sides go back to their pools. A host outside the cluster reaches the workers' ports but cannot
call a worker or open a KV channel (the cluster secret).

Plain processes (`python -m duet.prefill_worker`, `python -m duet.decode_worker`, the router of
tests/cluster/netns_router.py), no Ray; KV over `tcp`. Skipped, with the reason, only where
network namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
import torch

from tests.netns import NetLab, netem_unavailable, remove_orphans, unavailable
from tests.router.rest_server import API_KEY, MODEL_NAME
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
MODEL_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
"""8 KB of KV per token, about 6 ms a decode step of 4 streams on one core."""
ENGINE = dict(dtype="float32", load_progress=False, block_size=8, num_kv_blocks=512,
              kv_backend="tcp", kv_transfer_timeout_s=4.0)  # fmt: skip
REQUEST_TIMEOUT_S = 40.0
CLUSTER = dict(local_prefill_threshold=0, poll_interval_s=0.2, request_timeout_s=REQUEST_TIMEOUT_S,
               kv_wait_s=10.0)  # fmt: skip
LONG_STREAM = 500
"""Tokens of a stream that a fault must cut (`frozen_mid_stream` picks the moment from the
worker's own steps, within its first 300): about 1.5 s at 2 streams a worker. The helper that
freezes polls fast enough to land within a few steps of the window's start under load (a
300-step window polled from this process through a pipe once passed unseen). 4 x (90 + 500)
tokens fit one decode worker's pool (512 blocks of 8), as a migration needs, and the model's
1,024 positions."""
GRPC_PORT, KV_PORT, REST_PORT = 7000, 7100, 8000  # each host has its own ports
DECODE = ("decode0", "decode1")
HEADERS = {"Authorization": f"Bearer {API_KEY}"}

_why_not = unavailable()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=str(_why_not))


@dataclass
class Completion:
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    num_done: int = 0
    errors: list[str] = field(default_factory=list)
    status: int = 0
    elapsed_s: float = 0.0


class Cluster:
    """The lab's processes and a client pool whose threads live in the `outside` host."""

    def __init__(self, lab: NetLab, model: str) -> None:
        self.lab = lab
        self.model = model
        self.url = f"http://{lab.address('router')}:{REST_PORT}"
        self.clients = ThreadPoolExecutor(16, initializer=lab.enter_fn("outside"))
        self.procs: dict[str, Any] = {}
        self.loads: subprocess.Popen[bytes] | None = None  # tests/cluster/netns_loads.py

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        python = [sys.executable, "-m"]
        prefill = {"model": self.model, **ENGINE, "kv_lease_s": 6.0}
        self.procs["prefill"] = self.lab.spawn("prefill", [*python, "duet.prefill_worker",
            "--config", json.dumps(prefill), "--host", self.lab.address("prefill"),
            "--port", str(GRPC_PORT), "--name", "prefill"], "prefill.log", env)  # fmt: skip
        for name in DECODE:
            decode = {"model": self.model, **ENGINE, "kv_host": self.lab.address(name),
                      "kv_port": KV_PORT, "kv_wait_s": 8.0}  # fmt: skip
            self.procs[name] = self.lab.spawn(name, [*python, "duet.decode_worker",
                "--config", json.dumps(decode), "--host", self.lab.address(name),
                "--port", str(GRPC_PORT), "--name", name], f"{name}.log", env)  # fmt: skip
        self.procs["router"] = self.lab.spawn("router", [*python, "tests.cluster.netns_router",
            "--model", self.model, "--host", self.lab.address("router"), "--port", str(REST_PORT),
            "--prefill", f"prefill={self.grpc('prefill')}",
            *(a for d in DECODE for a in ("--decode", f"{d}={self.grpc(d)}")),
            "--cluster", json.dumps(CLUSTER)], "router.log", env)  # fmt: skip
        for name in self.procs:
            wait_for(lambda n=name: self._ready(n), 120, f"{name} ready", 0.1)
        self.loads = self.lab.spawn_piped("outside", [*python, "tests.cluster.netns_loads",
            *(f"{d}={self.grpc(d)}={self.procs[d].pid}" for d in DECODE)], "loads.log", env)  # fmt: skip

    def _ready(self, name: str) -> bool:
        if self.procs[name].poll() is not None:
            raise AssertionError(f"{name} exited: {self.lab.log(f'{name}.log')[-3000:]}")
        return "DUET_READY" in self.lab.log(f"{name}.log")

    def grpc(self, host: str) -> str:
        return f"{self.lab.address(host)}:{GRPC_PORT}"

    def close(self) -> None:
        self.clients.shutdown(wait=False, cancel_futures=True)
        for name in ("router", "prefill", *DECODE):  # the router first: it holds their streams
            if name in self.procs:
                NetLab.stop(self.procs[name])

    # -- the public API, from the outside host ----------------------------------------------

    def submit(self, prompt: list[int], max_tokens: int) -> Future[Completion]:
        return self.clients.submit(self._stream, prompt, max_tokens)

    def _stream(self, prompt: list[int], max_tokens: int) -> Completion:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        out = Completion()
        started = time.monotonic()
        with httpx2.Client(timeout=httpx2.Timeout(REQUEST_TIMEOUT_S + 20)) as http:
            with http.stream("POST", f"{self.url}/v1/completions", json=body,
                             headers=HEADERS) as reply:  # fmt: skip
                out.status = reply.status_code
                for line in reply.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        out.num_done += 1
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        out.errors.append(event["error"].get("message", ""))
                        continue
                    for choice in event["choices"]:
                        out.text += choice["text"]
                        if choice.get("finish_reason"):
                            out.finish_reasons.append(choice["finish_reason"])
        out.elapsed_s = time.monotonic() - started
        return out

    def decode_workers(self, command: dict[str, Any], timeout_s: float = 20) -> dict[str, Any]:
        """The decode workers' own loads, read now over their gRPC ports by a helper in the
        `outside` host (tests/cluster/netns_loads.py: its commands), not the router's poll."""
        assert self.loads is not None and self.loads.stdin and self.loads.stdout
        self.loads.stdin.write((json.dumps(command) + "\n").encode())
        self.loads.stdin.flush()
        ready, _, _ = select.select([self.loads.stdout], [], [], timeout_s)
        assert ready, f"no answer in {timeout_s} s: {self.lab.log('loads.log')[-2000:]}"
        reply = json.loads(self.loads.stdout.readline() or '{"error": "exited"}')
        assert "error" not in reply, (command, reply, self.lab.log("loads.log")[-2000:])
        return dict(reply)

    def dashboard(self) -> dict[str, Any]:
        def get() -> dict[str, Any]:
            reply = httpx2.get(f"{self.url}/v1/dashboard", headers=HEADERS, timeout=10)
            reply.raise_for_status()
            return dict(reply.json())

        return self.clients.submit(get).result(20)

    def states(self) -> dict[str, str]:
        board = self.dashboard()
        return {w["name"]: w["state"] for w in board["prefill"] + board["decode"]}

    def wait_all_healthy(self, timeout_s: float = 30) -> None:
        wait_for(lambda: set(self.states().values()) == {"healthy"}, timeout_s,
                 "every worker healthy on the dashboard", 0.2)  # fmt: skip

    def wait_pools_free(self, timeout_s: float = 30) -> None:
        """Every KV block of every worker back in its pool (the workers' load reports)."""

        def usage() -> dict[str, float]:
            board = self.dashboard()
            return {w["name"]: w["kv_usage"] for w in board["prefill"] + board["decode"]}

        try:
            wait_for(lambda: not any(usage().values()), timeout_s, "every pool free", 0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}: kv usage {usage()}") from None


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def reference(model: str) -> Any:
    from duet.engine import LLM

    return LLM(model, **{k: v for k, v in ENGINE.items() if not k.startswith("kv_")})


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """NOTE: this process shares the cores with the four it started (one thread each); torch's
    default of a thread per core spin-waits against them, 20x slower (60 s, not 3 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def expected(model: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """The aggregated engine's greedy texts."""
    from duet.engine import SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with one_thread():
        return [o.text for o in reference(model).generate(prompts, greedy)]


def assert_each_once(got: list[Completion], want: list[str]) -> None:
    """Every request completed exactly once with the greedy text: no error, one finish, one
    [DONE], nothing repeated or lost across a failover, within the router's timeout."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.status, g.errors, g.num_done, g.finish_reasons) == (200, [], 1, ["length"]), i
        assert g.text == w, f"request {i}: {g.text!r} != {w!r}"
        assert g.elapsed_s < REQUEST_TIMEOUT_S, i


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetLab]:
    hosts = ["router", "prefill", *DECODE, "outside"]
    with NetLab(hosts, tmp_path_factory.mktemp("netlab")) as made:
        yield made


@pytest.fixture(scope="module")
def model(tiny_model_factory: Any) -> str:
    """Deeper than the tiny llama: a decode step of some ms, so streams of 800 tokens last
    seconds and a fault lands mid-stream."""
    return str(tiny_model_factory("llama", **MODEL_SHAPE))


@pytest.fixture(scope="module")
def cluster(lab: NetLab, model: str) -> Iterator[Cluster]:
    c = Cluster(lab, model)
    try:
        c.start()
        yield c
    finally:
        c.close()


@pytest.fixture
def net(lab: NetLab, cluster: Cluster) -> Iterator[NetLab]:
    """The lab for one test, every fault undone after it and the cluster healthy again."""
    cluster.wait_all_healthy()
    yield lab
    lab.heal_all()
    cluster.wait_all_healthy()


MARGIN_STEPS = 200
"""Decode steps a frozen worker's streams have left at least (seconds, as many as the worker
needs at any load): none of them can end between the worker's load reply and its freeze."""


@contextlib.contextmanager
def frozen_mid_stream(cluster: Cluster, steps_before: dict[str, int],
                      futures: list[Future[Completion]]) -> Iterator[tuple[str, int]]:  # fmt: skip
    """A decode worker stopped (SIGSTOP) while its engine runs streams that cannot have
    ended: its own load reply counts them running (`num_running`) after 16 (some tokens out)
    to `LONG_STREAM - MARGIN_STEPS` steps since `steps_before`, and a stream's decode tokens are
    at most the steps since it started, so each has `MARGIN_STEPS` or more to go. The helper
    that reads the loads stops the worker itself, the moment a reply qualifies. Yields (its
    name, its running streams) for the test to break its network; continued (SIGCONT) after.
    NOTE: a fault chosen from what the router or the clients have seen can come after the
    worker's streams ended (the router and the clients read behind the worker, seconds under
    `make test`'s load), and then cut a link that carried nothing: this file's mid-stream
    tests failed so, now and then, with every text right and nothing moved."""
    command = {"cmd": "freeze", "before": steps_before, "min_steps": 16,
               "max_steps": LONG_STREAM - MARGIN_STEPS, "timeout_s": 60}  # fmt: skip
    try:
        frozen = cluster.decode_workers(command, timeout_s=90)
    except AssertionError:
        for f in futures:
            if f.done():
                f.result()  # raise what went wrong with a request first
        raise
    victim = str(frozen["name"])
    try:
        yield victim, int(frozen["num_running"])
    finally:
        os.kill(cluster.procs[victim].pid, signal.SIGCONT)


def num_migrations(cluster: Cluster) -> int:
    """Requests moved to another decode worker after theirs failed (`duet:request_migrations`)."""

    def get() -> str:
        return httpx2.get(f"{cluster.url}/metrics", headers=HEADERS, timeout=10).text

    text = cluster.clients.submit(get).result(20)
    return sum(
        int(float(n))
        for n in re.findall(r"^duet:request_migrations_total\{[^}]*\} (\S+)$", text, re.M)
    )


def test_an_outsider_reaches_the_workers_but_cannot_use_them(net: NetLab, cluster: Cluster):
    probe = net.spawn("outside", [sys.executable, "-m", "tests.cluster.netns_probe",
        "--prefill", cluster.grpc("prefill"), "--decode", cluster.grpc("decode0"),
        "--kv", f"{net.address('decode0')}:{KV_PORT}"], "probe.log",
        {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
         "DUET_CLUSTER_SECRET": "outsider-" + "x" * 40})  # fmt: skip
    assert probe.wait(60) == 0, net.log("probe.log")
    [line] = [ln for ln in net.log("probe.log").splitlines() if ln.startswith("PROBE ")]
    report = json.loads(line[len("PROBE ") :])
    assert all(report["reach"].values()), report  # the ports answer: the secret refuses
    assert (report["prefill_get_load"], report["decode_get_load"]) == ("UNAUTHENTICATED",) * 2
    assert report["kv"]["status"] == "FAILED", report
    assert "different cluster secret" in report["kv"]["error"]
    outsider = re.escape(net.address("outside"))
    wait_for(lambda: re.search(rf"refused a peer.*{outsider}", net.log("decode0.log")), 10,
             "the decode worker's refusal of the outsider's KV channel")  # fmt: skip
    # The cluster's own traffic is unaffected.
    [prompt] = prompts_of([40], seed=1)
    assert_each_once([cluster.submit(prompt, 4).result(60)], expected(cluster.model, [prompt], 4))


def test_a_decode_worker_partitioned_from_the_prefill_worker_mid_transfer(
    net: NetLab, cluster: Cluster
):
    prompts = prompts_of([120, 110, 130, 125], seed=2)
    want = expected(cluster.model, prompts, 8)
    net.impair("prefill", netem=False, rate="16mbit", delay_ms=400)  # transfers of 0.5-2 s
    futures = [cluster.submit(p, 8) for p in prompts]
    wait_for(lambda: cluster.dashboard()["queues"]["transfers_in_flight"] > 0, 30,
             "a KV transfer in flight", 0.02)  # fmt: skip
    net.partition("decode0", "prefill")
    got = [f.result(REQUEST_TIMEOUT_S + 30) for f in futures]
    assert_each_once(got, want)
    transfers = cluster.dashboard()["transfers"]
    assert any(t["decode"] == "decode0" and t["status"] != "done" for t in transfers), transfers
    net.heal_all()
    cluster.wait_pools_free()


def test_a_decode_worker_partitioned_from_the_router_mid_stream_and_back(
    net: NetLab, cluster: Cluster
):
    prompts = prompts_of([30, 50, 70, 90], seed=3)
    want = expected(cluster.model, prompts, LONG_STREAM)
    migrated = num_migrations(cluster)
    steps_before = cluster.decode_workers({"cmd": "steps"})
    futures = [cluster.submit(p, LONG_STREAM) for p in prompts]
    with frozen_mid_stream(cluster, steps_before, futures) as (victim, running):
        net.partition("router", victim)
    wait_for(lambda: cluster.states()[victim] == "unhealthy", 20,
             f"the dashboard showing {victim} unhealthy", 0.1)  # fmt: skip
    got = [f.result(REQUEST_TIMEOUT_S + 30) for f in futures]
    assert_each_once(got, want)
    # the partition cut the streams the worker was running, which moved
    assert num_migrations(cluster) - migrated >= running, net.log("router.log")[-4000:]
    net.heal("router", victim)
    wait_for(lambda: cluster.states()[victim] == "healthy", 20, f"{victim} back", 0.1)
    again = [cluster.submit(p, 8) for p in prompts]
    assert_each_once([f.result(60) for f in again], expected(cluster.model, prompts, 8))
    cluster.wait_pools_free()


def test_a_decode_host_whose_link_goes_down_mid_stream_and_up(net: NetLab, cluster: Cluster):
    prompts = prompts_of([20, 40, 60, 80], seed=4)
    want = expected(cluster.model, prompts, LONG_STREAM)
    migrated = num_migrations(cluster)
    steps_before = cluster.decode_workers({"cmd": "steps"})
    futures = [cluster.submit(p, LONG_STREAM) for p in prompts]
    with frozen_mid_stream(cluster, steps_before, futures) as (victim, running):
        net.link_down(victim)
    got = [f.result(REQUEST_TIMEOUT_S + 30) for f in futures]
    assert_each_once(got, want)
    assert num_migrations(cluster) - migrated >= running, net.log("router.log")[-4000:]
    assert cluster.states()[victim] == "unhealthy"
    net.link_up(victim)
    wait_for(lambda: cluster.states()[victim] == "healthy", 20, f"{victim} back", 0.1)
    cluster.wait_pools_free()


@pytest.mark.parametrize("shaping", ["netem", "tbf"])
def test_a_slow_lossy_kv_link(net: NetLab, cluster: Cluster, shaping: str):
    """netem: 50 ms and 5% loss each way on the KV link; tbf (every kernel): a rate limit
    whose bursts queue, then drop at the tail."""
    if shaping == "netem" and (why := netem_unavailable()) is not None:
        pytest.skip(why)
    prompts = prompts_of([100, 150, 200, 250, 120, 180], seed=5)
    want = expected(cluster.model, prompts, 12)
    for host in ("prefill", *DECODE):
        net.impair(host, netem=shaping == "netem", delay_ms=50, loss_pct=5, rate="20mbit")
    got = [f.result(REQUEST_TIMEOUT_S + 30) for f in [cluster.submit(p, 12) for p in prompts]]
    assert_each_once(got, want)
    net.heal_all()
    cluster.wait_pools_free()


def test_a_lab_whose_process_was_killed_is_removed_by_the_next(tmp_path: Path):
    """A test process killed before its fixtures' teardown leaves its lab behind; the next
    lab made on the machine removes it (its bridge names the dead owner)."""
    code = ("import os, sys; from pathlib import Path; from tests.netns import NetLab; "
            "lab = NetLab(['a', 'b'], Path(sys.argv[1])); print(lab.tag, flush=True); "
            "os.kill(os.getpid(), 9)")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    made = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=60)  # fmt: skip
    tag = made.stdout.split()[0]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"duet-{tag}-a" in namespaces  # left behind
    remove_orphans()  # NOTE: a lab another xdist worker makes meanwhile may remove it first
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert f"duet-{tag}" not in namespaces and tag not in links
