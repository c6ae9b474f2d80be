"""Which device a process's engine runs on, and binding it in every thread that touches it.

NOTE: `torch.cuda.set_device` is per thread. A tensor created with a bare `"cuda"` device,
a `torch.cuda.Event`, a `torch.cuda.Stream()` without a device and NCCL's choice of stream all
follow the calling thread's current device, which is cuda:0 in any thread that never set it.
So the engine always holds an indexed device (`cuda:N`), and every thread that touches CUDA
(the engine thread, the KV sender and receiver threads) calls `bind_thread` first.
"""

from __future__ import annotations

import torch


def resolve_device(requested: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `rank` for a config's `device` ("auto", "cpu",
    "cuda"): on CUDA always indexed, `cuda:<rank % visible GPUs>` (ranks of one group on one
    host take one GPU each; under Ray each process sees only its own GPU, so it is cuda:0)."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if requested not in ("auto", "cuda"):
        raise ValueError(f"device: must be auto, cpu or cuda; got {requested!r}")
    num_gpus = torch.cuda.device_count()
    if num_gpus < 1:
        raise RuntimeError("device: cuda was asked for but no CUDA device is visible")
    return torch.device("cuda", rank % num_gpus)


def bind_thread(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing on CPU). Call it first
    in every thread that creates CUDA tensors, events or streams, or runs NCCL."""
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"device: {device} has no index; use resolve_device")
        torch.cuda.set_device(device)
