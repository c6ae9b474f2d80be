"""Real processes on a real Redis: a task whose router is SIGKILLed mid-task is taken over and
completed by another consumer, and a `duet serve` router killed mid-batch leaves the batch to
its restart, or to a replica running beside it, which finishes it with every custom_id exactly
once."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import openai
import pytest
import redis

from duet.session_store import RedisWorkQueue, Task
from tests.net import free_port
from tests.session_store.conftest import RedisServer
from tests.waiting import wait_for

# A consumer process that claims one task, says so, then works on it forever (until killed).
_DOOMED_CONSUMER = textwrap.dedent(
    """
    import asyncio, sys
    from duet.session_store import RedisWorkQueue

    async def main() -> None:
        queue = RedisWorkQueue.from_url(sys.argv[1], key_prefix=sys.argv[2], lease_s=0.5)
        while not (got := await queue.claim("doomed")):
            await asyncio.sleep(0.02)
        print("claimed", got[0].task_id, flush=True)
        while True:  # renewing the lease, as a live router does, until SIGKILL
            await queue.renew(got[0])
            await asyncio.sleep(0.1)

    asyncio.run(main())
    """
)


def test_a_consumer_killed_mid_task_leaves_it_to_another(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    prefix = f"test-{uuid.uuid4().hex[:12]}"

    async def enqueue() -> None:
        async with RedisWorkQueue.from_url(redis_server.url, key_prefix=prefix) as q:
            await q.enqueue([Task("job", "echo", {"x": 1})])

    asyncio.run(enqueue())
    out = tmp_path / "consumer.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", _DOOMED_CONSUMER, redis_server.url, prefix],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        )
    try:
        wait_for(lambda: out.read_text().strip(), 30, "the consumer to claim the task", 0.02)
        assert out.read_text().split() == ["claimed", "job"]
    finally:
        proc.kill()
        proc.wait(timeout=10)

    async def take_over() -> None:
        async with RedisWorkQueue.from_url(redis_server.url, key_prefix=prefix, lease_s=0.5) as q:
            assert await q.claim("survivor") == []  # its lease (renewed until the kill) holds
            deadline = asyncio.get_running_loop().time() + 5
            while not (got := await q.claim("survivor")):
                assert asyncio.get_running_loop().time() < deadline, "no takeover in 5 s"
                await asyncio.sleep(0.05)
            [delivery] = got
            assert (delivery.task_id, delivery.num_deliveries) == ("job", 2)
            assert await q.complete(delivery, {"done_by": "survivor"})
            assert await q.results(["job"]) == [{"done_by": "survivor"}]
            assert (await q.num_pending(), await q.dead_letters()) == (0, [])

    asyncio.run(take_over())


class Router:
    """`duet serve` on the tiny model with its work queue on Redis."""

    def __init__(self, model: str, redis_url: str, log: Path) -> None:
        self.port = free_port()
        cmd = [
            sys.executable, "-m", "duet.cli", "serve", "--model", model, "--dtype", "float32",
            "--port", str(self.port), "--grpc-port", "0", "--served-model-name", "tiny",
            "--session-store", redis_url, "--queue-lease", "1", "--max-num-seqs", "4",
            "--num-kv-blocks", "256", "--shutdown-timeout", "0",
        ]  # fmt: skip
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=30
        )

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, f"the router exited:\n{self.log.read_text()[-3000:]}"
            try:
                self.client.models.list()
                return True
            except openai.APIConnectionError:
                return False

        wait_for(ready, timeout_s, f"the router on port {self.port}", 0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.client.close()


@pytest.mark.slow
@pytest.mark.parametrize("takeover", ["restart", "replica"])
def test_a_router_killed_mid_batch_is_finished_by_another(
    tiny_llama: str, redis_server: RedisServer, tmp_path: Path, takeover: str
) -> None:
    """`restart`: the killed router is started again. `replica`: a second router, running all
    along beside the first, finishes what the killed one held."""
    num_lines = 12
    # Long lines: the first router must be caught holding some, by polls that may come a
    # second apart on a loaded machine (48 tokens a line let all 12 finish between two polls).
    max_tokens = 480
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/completions" if i % 2 else "/v1/chat/completions",
            "body": {"prompt": f"p{i}", "max_tokens": max_tokens, "ignore_eos": True}
            if i % 2
            else {"messages": [{"role": "user", "content": f"m{i}"}], "max_tokens": max_tokens,
                  "ignore_eos": True},
        }
        for i in range(num_lines)
    ]  # fmt: skip
    data = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
    first = Router(tiny_llama, redis_server.url, tmp_path / "first.log")
    second: Router | None = None
    if takeover == "replica":
        second = Router(tiny_llama, redis_server.url, tmp_path / "second.log")
    try:
        first.wait_ready()
        if second is not None:
            second.wait_ready()
        file = first.client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = first.client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        def num_held() -> int:
            """Batch lines the first router holds (claimed, not acknowledged)."""
            consumers = r.xinfo_consumers("duet:queue:work:stream", "routers")
            return sum(c["pending"] for c in consumers if f"-{first.proc.pid}-" in c["name"])

        def mid_batch() -> bool:
            counts = first.client.batches.retrieve(batch.id).request_counts
            assert counts is not None and counts.completed < num_lines, "finished before the kill"
            return counts.completed >= 2 and num_held() > 0

        with redis.Redis.from_url(redis_server.url, decode_responses=True) as r:
            wait_for(mid_batch, 120, "the first router to finish 2 lines and run more", 0.02)
            first.proc.kill()  # SIGKILL: no drain, no cleanup
            first.proc.wait(timeout=10)
            # It died holding leases: tasks pending under its consumer, not acknowledged.
            assert num_held() > 0
    except BaseException:
        if second is not None:
            second.stop()
        raise
    finally:
        first.stop()
    if second is None:
        second = Router(tiny_llama, redis_server.url, tmp_path / "second.log")
    try:
        second.wait_ready()

        def finished() -> bool:
            return second.client.batches.retrieve(batch.id).status == "completed"

        wait_for(finished, 180, f"the {takeover} to finish the batch", 0.2)
        done = second.client.batches.retrieve(batch.id)
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (num_lines, 0)
        assert done.output_file_id is not None
        text = second.client.files.content(done.output_file_id).text
        output = [json.loads(x) for x in text.splitlines()]
        assert sorted(e["custom_id"] for e in output) == sorted(
            f"req-{i}" for i in range(num_lines)
        )
        assert all(
            e["response"]["body"]["usage"]["completion_tokens"] == max_tokens for e in output
        )
    finally:
        second.stop()
