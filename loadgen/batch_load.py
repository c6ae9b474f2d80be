"""`duet bench serve --with-batch N`: an N-line batch (Batch API) runs beside the timed load,
so the same command measures interactive latency with and without batch work on the server
(compare the two result files with `--compare`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx2


class BatchLoadError(Exception):
    """The server refused the batch (no work queue, bad key, ...)."""


def batch_lines(num_lines: int, model: str, max_tokens: int) -> bytes:
    """A JSONL input file of `num_lines` completions, each generating exactly `max_tokens`."""
    lines = [
        {
            "custom_id": f"bench-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": f"background work item {i}",
                     "max_tokens": max_tokens, "ignore_eos": True},
        }
        for i in range(num_lines)
    ]  # fmt: skip
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


async def submit_batch(
    client: httpx2.AsyncClient, url: str, api_key: str | None, data: bytes
) -> str:
    """Upload `data` and start a batch on it; its id."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    root = url.rstrip("/")
    uploaded = await client.post(
        f"{root}/v1/files",
        headers=headers,
        data={"purpose": "batch"},
        files={"file": ("bench.jsonl", data, "application/jsonl")},
    )
    if uploaded.status_code != 200:
        raise BatchLoadError(
            f"POST /v1/files answered {uploaded.status_code}: {uploaded.text[:200]}"
        )
    created = await client.post(
        f"{root}/v1/batches",
        headers=headers,
        json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions",
              "completion_window": "24h"},
    )  # fmt: skip
    if created.status_code != 200:
        raise BatchLoadError(
            f"POST /v1/batches answered {created.status_code}: {created.text[:200]}"
        )
    return str(created.json()["id"])


async def stop_batch(
    client: httpx2.AsyncClient, url: str, api_key: str | None, batch_id: str
) -> dict[str, Any]:
    """Cancel the batch (the rest of its lines are skipped); its request counts at that time."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = await client.post(f"{url.rstrip('/')}/v1/batches/{batch_id}/cancel", headers=headers)
    if response.status_code != 200:
        raise BatchLoadError(f"cancelling {batch_id} answered {response.status_code}")
    return dict(response.json()["request_counts"])
