"""The Batch API and a background request in disaggregated mode: the same app over a
ClusterEngine with real prefill and decode workers (gRPC on loopback, KV over gloo)."""

from __future__ import annotations

import asyncio
import io
import json
import socket
from pathlib import Path

import openai
import pytest
import uvicorn

from duet.session_store import SqliteWorkQueue
from tests.cluster.test_cluster_engine import Cluster
from tests.router.rest_server import closing, make_app


@pytest.mark.slow
def test_batch_and_background_over_prefill_and_decode_workers(
    tiny_llama: str, tmp_path: Path
) -> None:
    lines = [
        {
            "custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"prompt number {i} " * (i + 1), "max_tokens": 4, "ignore_eos": True},
        }
        for i in range(6)
    ]  # fmt: skip
    data = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()

    async def main() -> None:
        async with Cluster(tiny_llama) as cluster:
            queue = SqliteWorkQueue(tmp_path / "queue.db", lease_s=10.0)
            app = make_app(cluster.engine, "tiny", work_queue=queue, lifespan=closing(queue))
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30
            )
            try:
                async with asyncio.timeout(120):
                    while not server.started:
                        await asyncio.sleep(0.02)
                    file = await client.files.create(
                        file=("in.jsonl", io.BytesIO(data)), purpose="batch"
                    )
                    batch = await client.batches.create(
                        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
                    )
                    queued = await client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                        extra_body={"background": True, "ignore_eos": True},
                    )  # fmt: skip
                    while (batch := await client.batches.retrieve(batch.id)).status != "completed":
                        await asyncio.sleep(0.1)
                    while True:
                        found = await client.chat.completions.retrieve(queued.id)
                        if found.model_extra and found.model_extra["status"] == "completed":
                            break
                        await asyncio.sleep(0.1)
                assert batch.output_file_id is not None
                text = (await client.files.content(batch.output_file_id)).text
                output = [json.loads(line) for line in text.splitlines()]
                assert [e["custom_id"] for e in output] == [f"r{i}" for i in range(6)]
                assert all(e["response"]["body"]["usage"]["completion_tokens"] == 4 for e in output)
                assert found.usage is not None and found.usage.completion_tokens == 5
            finally:
                await client.close()
                server.should_exit = True
                await asyncio.wait_for(serving, 30)

    asyncio.run(main())
