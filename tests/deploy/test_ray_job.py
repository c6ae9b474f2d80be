"""`ray job submit` end to end, as the README describes it: a Ray head started by hand with
token auth and duet's custom resources, the job submitted, served, stopped. Its prefill group
is two pipeline stages (`--prefill-pp 2`: each stage's rank ships its layer's KV), whose
greedy text is the aggregated engine's."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from duet.deploy.local_ray import LOOPBACK_ENV
from duet.engine import LLM, SamplingParams
from tests.deploy.ray_start import one_ray_start_at_a_time
from tests.net import free_port
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def run(args, env, timeout=120):
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout + result.stderr


AGENT_NOT_READY = "No available agent to submit job"
"""What Ray's dashboard answers (a 500) to a submission before the head's job agent has
registered (seconds after `ray start` on a loaded machine: Ray says to try again later), or
when the agent never came up."""


def submit(args, env, timeout_s=90.0):
    """`ray job submit`, again while the head's job agent is not up yet (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        out = result.stdout + result.stderr
        if result.returncode == 0 or AGENT_NOT_READY not in out or time.monotonic() > deadline:
            assert result.returncode == 0, out[-4000:]
            return out
        time.sleep(1.0)


def job_status_over_rest(dashboard: str, job_id: str, token: str) -> str:
    """The job's status from the dashboard's REST API (`GET /api/jobs/<id>`, what the CLI asks
    too): a poll without the second of CPU each `ray job status` process costs to start."""
    r = httpx.get(f"{dashboard}/api/jobs/{job_id}", timeout=30,
                  headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    assert r.status_code == 200, r.text[-2000:]
    return str(r.json()["status"])


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


def node_logs(temp_dir: str, tail: int = 3000) -> str:
    """The ends of a Ray node's own logs (its GCS, raylet and dashboard), for a start that failed."""
    out = []
    for path in sorted(Path(temp_dir).glob("session_*/logs/*")):
        if path.name.startswith(("gcs_server", "raylet", "dashboard.")) and path.is_file():
            out.append(f"\n--- {path.name}:\n{path.read_text(errors='replace')[-tail:]}")
    return "".join(out)


@contextlib.contextmanager
def ray_head(args: list[str], env: dict[str, str], log: Path) -> Iterator[None]:
    """A Ray head of the test's own: `ray start --head --block` in a new process group, with a
    private temp dir, started while no other Ray test starts a node (`one_ray_start_at_a_time`).
    Leaving stops this head only: on SIGTERM `ray start` stops its node's processes (workers and
    the job's driver follow through Ray's fate-sharing), and whatever of its process group is
    left is killed. `ray stop` would stop every Ray on the machine."""
    temp_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths stay < 108 chars
    cmd = [RAY, "start", "--head", "--block", f"--temp-dir={temp_dir}", *args]
    # NOTE: no drain on SIGTERM (30 s by default): nothing here serves traffic then.
    env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    head: subprocess.Popen[bytes] | None = None

    def started() -> bool:
        assert head is not None
        assert head.poll() is None, (
            f"ray start exited with {head.returncode}:\n{log.read_text()}{node_logs(temp_dir)}"
        )
        return "Ray runtime started." in log.read_text()

    try:
        with one_ray_start_at_a_time(), open(log, "w") as out:
            head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            wait_for(started, 120, "the Ray head to start", 0.2)
        yield
    finally:
        if head is not None:
            head.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(timeout=60)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)  # its group only: the session it leads
            head.wait(timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_serves_and_stops(tiny_llama, tmp_path):
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": uuid.uuid4().hex,  # what an operator would keep in a secret
        "GLOO_SOCKET_IFNAME": "lo",
        "DUET_ADVERTISE_HOST": "127.0.0.1",
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        # The node on loopback, as `duet serve`'s own Ray (deploy/local_ray.py): its address
        # was the machine's interface, whose names are not in the test run's hosts file, and
        # no usage-stats thread asking the network for its servers.
        **LOOPBACK_ENV,
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    gcs, dash_port, rest, grpc_port = (free_port() for _ in range(4))
    dashboard = f"http://127.0.0.1:{dash_port}"
    resources = json.dumps({"prefill": 2, "decode": 1, "router": 1})
    # NOTE: the agents' ports too: Ray's defaults (the job agent's 52365) are shared with any
    # other Ray on the machine, such as the other deploy tests' under xdist, and a job agent
    # that cannot bind never comes up ("No available agent to submit job").
    agent_ports = [f"--dashboard-agent-listen-port={free_port()}",
                   f"--dashboard-agent-grpc-port={free_port()}",
                   f"--runtime-env-agent-port={free_port()}",
                   f"--metrics-export-port={free_port()}"]  # fmt: skip
    head_args = [*agent_ports, f"--port={gcs}", f"--dashboard-port={dash_port}", "--num-cpus=2",
                 f"--resources={resources}", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]  # fmt: skip
    job_id = f"duet-{uuid.uuid4().hex[:8]}"
    with ray_head(head_args, env, tmp_path / "ray-head.log"):
        # Without the token the cluster refuses the submission.
        denied = subprocess.run(
            [RAY, "job", "list", "--address", dashboard],
            env={**env, "RAY_AUTH_TOKEN": "wrong"}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert denied.returncode != 0
        submit([RAY, "job", "submit", "--address", dashboard, "--no-wait", "--submission-id", job_id,
             "--", sys.executable, "-m", "duet.cli.ray_job", "--model", tiny_llama,
             "--dtype", "float32", "--prefill-pp", "2", "--served-model-name", "tiny",
             "--port", str(rest), "--grpc-port", str(grpc_port),
             "--session-store", f"sqlite:///{tmp_path}/sessions.db"], env)  # fmt: skip
        url = f"http://127.0.0.1:{rest}"

        def serving() -> bool:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            status = job_status_over_rest(dashboard, job_id, env["RAY_AUTH_TOKEN"])
            assert status in ("PENDING", "RUNNING"), run(
                [RAY, "job", "logs", "--address", dashboard, job_id], env
            )[-3000:]
            return False

        wait_for(serving, 600, "the job to serve", 0.5)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = list(range(3, 60))
        r = api.completions.create(
            model="tiny", prompt=prompt, max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.usage.prompt_tokens == 57 and r.usage.completion_tokens == 4
        want = LLM(tiny_llama, dtype="float32", load_progress=False).generate(
            [prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        )
        assert r.choices[0].text == want[0].text
        run([RAY, "job", "stop", "--address", dashboard, job_id], env, timeout=180)
        assert job_status(dashboard, job_id, env) == "STOPPED"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
