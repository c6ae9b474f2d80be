"""CUDA graphs stood in for on the CPU (test_cuda_graphs.py, test_piecewise_graphs.py, the TP
ranks of tp_rank.py): `EagerCapture` replays a captured function by calling it, so the graphs'
static buffers, padding rows and metadata run for real (the Triton kernels interpreted)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from duet.engine import model_runner
from duet.engine.cuda_graphs import DecodeGraphs, EagerCapture
from duet.engine.piecewise_graphs import PiecewiseGraphs


class EagerReplay(EagerCapture):
    """`EagerCapture`, as if each capture reserved 3 MiB of the device's memory."""

    def reserved_bytes(self, device: torch.device) -> int:
        return 3 << 20 if self.num_captures else 0


def fake_cuda_graphs(setattr_: Any) -> EagerReplay:
    """Make the model runner capture graphs as on CUDA (unless `enforce_eager`) through one
    `EagerReplay`: decode graphs, and piecewise ones in `cuda_graph_mode` piecewise.
    `setattr_`: `monkeypatch.setattr` (undone after the test), or `setattr` (a process of its
    own)."""
    capture = EagerReplay()
    setattr_(model_runner, "uses_decode_graphs", lambda eager, *args: not eager)
    setattr_(model_runner, "DecodeGraphs", functools.partial(DecodeGraphs, capture=capture))
    setattr_(model_runner, "PiecewiseGraphs", functools.partial(PiecewiseGraphs, capture=capture))
    return capture
