"""`ray job submit` end to end, as the README describes it: a Ray head started by hand with
token auth and duet's custom resources, the job submitted, served, stopped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import httpx2 as httpx
import openai
import pytest

pytestmark = pytest.mark.slow

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, env, timeout=120):
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout + result.stderr


def job_status(dashboard, job_id, env):
    out = run([RAY, "job", "status", "--address", dashboard, job_id], env)
    for status in ("RUNNING", "PENDING", "SUCCEEDED", "FAILED", "STOPPED"):
        if f"'{job_id}': {status}" in out:
            return status
    for phrase, status in (
        ("was stopped", "STOPPED"),
        ("failed", "FAILED"),
        ("succeeded", "SUCCEEDED"),
    ):
        if f"Job '{job_id}' {phrase}" in out:
            return status
    raise AssertionError(out)


def test_ray_job_submit_serves_and_stops(tiny_llama, tmp_path):
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": uuid.uuid4().hex,  # what an operator would keep in a secret
        "GLOO_SOCKET_IFNAME": "lo",
        "DUET_ADVERTISE_HOST": "127.0.0.1",
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    }
    gcs, dash_port, rest, grpc_port = (free_port() for _ in range(4))
    dashboard = f"http://127.0.0.1:{dash_port}"
    resources = json.dumps({"prefill": 2, "decode": 1, "router": 1})
    run([RAY, "start", "--head", f"--port={gcs}", f"--dashboard-port={dash_port}",
         "--num-cpus=2", f"--resources={resources}", "--disable-usage-stats"], env)  # fmt: skip
    job_id = f"duet-{uuid.uuid4().hex[:8]}"
    try:
        # Without the token the cluster refuses the submission.
        denied = subprocess.run(
            [RAY, "job", "list", "--address", dashboard],
            env={**env, "RAY_AUTH_TOKEN": "wrong"}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert denied.returncode != 0
        run([RAY, "job", "submit", "--address", dashboard, "--no-wait", "--submission-id", job_id,
             "--", sys.executable, "-m", "cli.ray_job", "--model", tiny_llama,
             "--dtype", "float32", "--prefill-tp", "2", "--served-model-name", "tiny",
             "--port", str(rest), "--grpc-port", str(grpc_port),
             "--session-store", f"sqlite:///{tmp_path}/sessions.db"], env)  # fmt: skip
        url = f"http://127.0.0.1:{rest}"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            status = job_status(dashboard, job_id, env)
            assert status in ("PENDING", "RUNNING"), run(
                [RAY, "job", "logs", "--address", dashboard, job_id], env
            )[-3000:]
            assert time.monotonic() < deadline, "the job did not become ready"
            time.sleep(2)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = api.completions.create(model="tiny", prompt=list(range(3, 60)), max_tokens=4)
        assert r.usage.prompt_tokens == 57 and r.usage.completion_tokens == 4
        run([RAY, "job", "stop", "--address", dashboard, job_id], env, timeout=180)
        assert job_status(dashboard, job_id, env) == "STOPPED"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
