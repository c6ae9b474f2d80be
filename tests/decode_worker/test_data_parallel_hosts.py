"""A data-parallel decode group over two machines: two decode workers of a Qwen3-MoE, each on a
host of its own (a network namespace: tests/netns.py), exchanging half of the routed experts
each over gloo across the hosts' link, with a prefill worker and the router on two more hosts
and the KV over `tcp`. No shared memory joins them (the workers say the exchange goes over
their `eth0`, the interface that reaches the group's store), every prompt's greedy text equals
the aggregated engine's (bf16: the exchange keeps one rank's bits), and both workers decoded.

Before `engine/rendezvous.py:gloo_interface_toward`, gloo bound the interface of the host
name, which resolves to loopback here (as in many containers), and the second worker failed at
"Gloo connectFullMesh ... Connection refused, remote=[127.0.0.1]"."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2
import pytest

from duet.engine import LLM, SamplingParams
from tests.netns import NetLab, unavailable
from tests.router.rest_server import API_KEY, MODEL_NAME
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
ENGINE = {"dtype": "bfloat16", "num_kv_blocks": 64, "load_progress": False, "num_threads": 1}
WORKER = {**ENGINE, "kv_backend": "tcp"}
PROMPTS = [[(7 * i + 3 * j) % 400 + 50 for j in range(5 + 3 * i)] for i in range(8)]
GRPC_PORT, KV_PORT, STORE_PORT, REST_PORT = 7000, 7100, 7200, 8000
DECODE = ("decode0", "decode1")

_why_not = unavailable()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=str(_why_not))


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[NetLab]:
    with NetLab(["router", "prefill", *DECODE], tmp_path) as made:
        yield made


def _start(lab: NetLab, model: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)  # the workers choose it
    python = [sys.executable, "-m"]
    procs = {}
    procs["prefill"] = lab.spawn("prefill", [*python, "duet.prefill_worker",
        "--config", json.dumps({"model": model, **WORKER}), "--host", lab.address("prefill"),
        "--port", str(GRPC_PORT), "--name", "prefill"], "prefill.log", env)  # fmt: skip
    group = f"tcp://{lab.address('decode0')}:{STORE_PORT}"
    for rank, name in enumerate(DECODE):
        decode = {"model": model, **WORKER, "kv_host": lab.address(name), "kv_port": KV_PORT,
                  "data_parallel_size": 2, "expert_parallel_size": 2}  # fmt: skip
        procs[name] = lab.spawn(name, [*python, "duet.decode_worker", "--config",
            json.dumps(decode), "--host", lab.address(name), "--port", str(GRPC_PORT),
            "--name", name, "--dp-rank", str(rank), "--dp-init-method", group],
            f"{name}.log", env)  # fmt: skip
    grpc = {name: f"{lab.address(name)}:{GRPC_PORT}" for name in ("prefill", *DECODE)}
    cluster = {"local_prefill_threshold": 0, "poll_interval_s": 0.2}
    procs["router"] = lab.spawn("router", [*python, "tests.cluster.netns_router",
        "--model", model, "--host", lab.address("router"), "--port", str(REST_PORT),
        "--prefill", f"prefill={grpc['prefill']}",
        *(a for d in DECODE for a in ("--decode", f"{d}={grpc[d]}")),
        "--cluster", json.dumps(cluster)], "router.log", env)  # fmt: skip

    def ready(name: str) -> bool:
        if procs[name].poll() is not None:  # one that exits fails the wait at once
            raise AssertionError(f"{name} exited: {lab.log(f'{name}.log')[-3000:]}")
        return "DUET_READY" in lab.log(f"{name}.log")

    wait_for(lambda: all([ready(name) for name in procs]), 180, "every process ready", 0.1)
    return procs


def test_a_data_parallel_group_over_two_hosts_gives_the_aggregated_text(
    tiny_model_factory, lab: NetLab
) -> None:
    model = tiny_model_factory("qwen3_moe")
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.text for o in LLM(model, **ENGINE).generate(PROMPTS, greedy)]
    procs = _start(lab, model)
    url = f"http://{lab.address('router')}:{REST_PORT}"
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def complete(prompt: list[int]) -> str:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        reply = httpx2.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["text"])

    try:
        with ThreadPoolExecutor(8, initializer=lab.enter_fn("router")) as clients:
            assert list(clients.map(complete, PROMPTS)) == want
            board = clients.submit(
                lambda: httpx2.get(f"{url}/v1/dashboard", headers=headers, timeout=30).json()
            ).result(60)
        decoded = {t["decode"] for t in board["transfers"] if t["status"] == "done"}
        assert decoded == set(DECODE)  # both took some, each its own requests
        for rank, name in enumerate(DECODE):
            said = f"data-parallel rank {rank} of 2: experts exchanged through gloo over eth0"
            assert said in lab.log(f"{name}.log"), lab.log(f"{name}.log")[-3000:]
    finally:
        for name in ("router", "prefill", *DECODE):
            NetLab.stop(procs[name])
