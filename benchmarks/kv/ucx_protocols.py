"""Which data path UCX chose, read from its `UCX_PROTO_INFO=y` tables.

With `UCX_PROTO_INFO=y` every UCX context prints, the first time it selects protocols for an
operation, a table naming the context, the operation and, per message size range, the protocol
and the transport (lines prefixed with a timestamp and the host:pid)::

    +---------------------------------+------------------------------+
    | decode-4bba391a466f self cfg#0                                  |
    | remote memory read by ucp_get*(multi) into host memory from host |
    +--------+-------------+--------------------+
    | Range  | Description |       Config       |
    +--------+-------------+--------------------+
    | 0..inf | zero-copy   | cma/memory         |
    +--------+-------------+--------------------+

`data_paths` keeps the tables of remote-memory reads and writes between processes (the KV's
own path; active messages carry only duet's notifications, `self` is a context to itself): on a GPU, whether a READ of CUDA memory is
`zero-copy` over `cuda_ipc` or `software emulation` over `tcp` (issue #42's measured 0.07
GB/s), without a profiler.
"""

from __future__ import annotations

import re
from typing import Any

_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")
_REMOTE = re.compile(r"remote memory (read|write) by ")
_AGENT_SUFFIX = re.compile(r"-[0-9a-f]{12}\b")  # duet's agents: a name and a random suffix


def _cells(line: str) -> list[str] | None:
    """The cells of a table row (`| a | b |`), None for anything else."""
    body = _PREFIX.sub("", line).strip()
    if not (body.startswith("|") and body.endswith("|")):
        return None
    return [cell.strip() for cell in body[1:-1].split("|")]


def data_paths(log: str) -> list[dict[str, Any]]:
    """Each distinct remote read/write table in `log`: {"context": the context (the NIXL
    agent's name without duet's random suffix) and its configuration, "operation": what UCX
    selected for, "ranges": [[range, description, transport], ...]}, in the order first
    seen."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, str, tuple[tuple[str, ...], ...]]] = set()
    rows = [cells for line in log.splitlines() if (cells := _cells(line)) is not None]
    i = 0
    while i < len(rows):
        cells = rows[i]
        if len(cells) == 1 and _REMOTE.match(cells[0]):
            context = rows[i - 1][0] if i > 0 and len(rows[i - 1]) == 1 else ""
            context = _AGENT_SUFFIX.sub("", context)
            ranges: list[list[str]] = []
            j = i + 1
            if j < len(rows) and rows[j] and rows[j][0] == "Range":
                j += 1
            while j < len(rows) and len(rows[j]) == 3 and rows[j][0] != "Range":
                ranges.append(rows[j])
                j += 1
            key = (context, cells[0], tuple(tuple(r) for r in ranges))
            if key not in seen and " self " not in f" {context} ":  # not to its own process
                seen.add(key)
                out.append({"context": context, "operation": cells[0], "ranges": ranges})
            i = j
        else:
            i += 1
    return out
