"""`benchmarks/kv/ucx_protocols.py`: UCX's `UCX_PROTO_INFO` tables -> the data paths of remote
reads and writes between processes (the CPU end to end: test_gpu_check.py's nixl step)."""

from __future__ import annotations

from benchmarks.kv.ucx_protocols import data_paths

P = "[1796056923.179993] [gpu:9483 :0]   "
LOG = "\n".join(P + line for line in [
    "+--------------------------------+",
    "| decode-4bba391a466f self cfg#0 |",
    "| remote memory read by ucp_get* into cuda/GPU0 from cuda |",
    "| 0..inf | zero-copy   | cuda_ipc/cuda |",
    "| decode-4bba391a466f intra-node cfg#1 |",
    "| active message by ucp_am_send* from host memory |",
    "|   Range    |    Description     |    Config     |",
    "|          0 | short              | tcp/lo        |",
    "| decode-4bba391a466f intra-node cfg#1 |",
    "| remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda |",
    "+--------+-------------+--------------+",
    "| Range  | Description |    Config    |",
    "+--------+-------------+--------------+",
    "| 0..8184 | short | tcp/lo |",
    "| 8185..inf | software emulation | tcp/lo |",
    "+--------+-------------+--------------+",
    "| prefill-tp0-0d4e50c75462 intra-node cfg#1 |",
    "| remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda |",
    "| Range  | Description |    Config    |",
    "| 0..inf | zero-copy | cuda_ipc/cuda |",
    "| decode-99aa391a466f intra-node cfg#1 |",  # a restarted agent: the same path, once
    "| remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda |",
    "| Range  | Description |    Config    |",
    "| 0..8184 | short | tcp/lo |",
    "| 8185..inf | software emulation | tcp/lo |",
]) + "\nINFO some other line | with a bar |\n"  # fmt: skip


def test_remote_reads_and_writes_between_processes_once_each() -> None:
    assert data_paths(LOG) == [
        {"context": "decode intra-node cfg#1",
         "operation": "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda",
         "ranges": [["0..8184", "short", "tcp/lo"],
                    ["8185..inf", "software emulation", "tcp/lo"]]},
        {"context": "prefill-tp0 intra-node cfg#1",
         "operation": "remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda",
         "ranges": [["0..inf", "zero-copy", "cuda_ipc/cuda"]]},
    ]  # fmt: skip
    assert data_paths("") == []
