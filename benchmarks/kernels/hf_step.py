"""HF transformers' decode step time, the GPU benchmark's baseline (benchmarks/kernels/gpu.py)."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch


def hf_step_s(hf: Any, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> float:
    """HF `generate`'s decode step: the median time between consecutive steps of one greedy
    generation of 1 + `steps` tokens, stamped by a logits processor (after a device sync: HF
    syncs every step to check for stops anyway). Positive by construction, where a difference
    of two generations' times can go negative on a loaded machine."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if scores.is_cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            return scores

    hf.generate(
        ids, attention_mask=mask, max_new_tokens=1 + steps, min_new_tokens=1 + steps,
        do_sample=False, eos_token_id=None, pad_token_id=0,
        logits_processor=LogitsProcessorList([Clock()]),
    )  # fmt: skip
    return statistics.median(b - a for a, b in itertools.pairwise(stamps))
