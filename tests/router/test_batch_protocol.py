"""A Batch API input file's lines against the served model names (router/batch_protocol.py):
any of the server's names is served, another is a rejected line naming them all."""

from __future__ import annotations

import json

from duet.router.batch_protocol import BadLine, parse_batch_file


def test_a_line_may_name_any_served_model() -> None:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}
        for i, model in enumerate(["tiny-main", "gpt-4o-mini", "other"])
    ]  # fmt: skip
    data = "\n".join(json.dumps(line) for line in lines).encode()
    good, bad = parse_batch_file(data, ("tiny-main", "gpt-4o-mini"))
    assert [line.custom_id for line in good] == ["r0", "r1"]
    assert bad == [
        BadLine(3, "r2", "line 3: body.model: 'other' is not served here; this server serves "
                "'tiny-main', 'gpt-4o-mini'")
    ]  # fmt: skip


def test_an_empty_allowed_token_ids_is_a_rejected_line() -> None:
    """Refused when the file is read (as the REST body is), not when the line runs."""
    lines = [
        {"custom_id": f"r{i}", "url": url, "body": {"model": "tiny", **body, "allowed_token_ids": ids}}
        for i, (url, body, ids) in enumerate([
            ("/v1/completions", {"prompt": "hi"}, []),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, []),
            ("/v1/completions", {"prompt": "hi"}, [5]),
        ])
    ]  # fmt: skip
    data = "\n".join(json.dumps(line) for line in lines).encode()
    good, bad = parse_batch_file(data, ("tiny",))
    assert [line.custom_id for line in good] == ["r2"]
    message = "body.allowed_token_ids: List should have at least 1 item after validation, not 0"
    assert bad == [BadLine(1, "r0", f"line 1: {message}"), BadLine(2, "r1", f"line 2: {message}")]
