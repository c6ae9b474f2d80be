"""`ExpertLoad`: how many (token, choice) pairs each routed expert of each sparse layer received,
counted on the device as the router picks them, for the engine's stats and /metrics.

Each `SparseMoeBlock` adds its step's expert ids into its row of one [L, E] int64 tensor: where
the experts run as grouped products (moe.grouped_experts), the `bincount` that cuts their rows
is added, so the ids are counted once; beside the fused Triton kernel, `record_expert_ids`
adds them with `index_add_` (no host sync: CUDA's `bincount` reads the ids' range on the
host; `index_add_` does not). The model runner calls `snapshot` after the step's forward, before the sampled
tokens come to the host: on CUDA a non-blocking copy into pinned memory, which the sampled
tokens' transfer (the step's one sync) waits for; `read` waits on the copy's event, a no-op
once that sync happened (a step that samples nothing, a prefill chunk, waits for its forward).

With pipeline parallelism a rank counts its own stage's sparse layers only.
"""

from __future__ import annotations

import torch


class ExpertLoad:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        """Cumulative (token, choice) pairs per sparse layer and expert: [L, E]."""
        self._cuda = device.type == "cuda"
        self._host = torch.zeros(num_layers, num_experts, dtype=torch.int64,
                                 pin_memory=self._cuda)  # fmt: skip
        self._copied: torch.cuda.Event | None = None

    def snapshot(self) -> None:
        """Start copying the counts to the host (after a step's forward, before its sync)."""
        if not self._cuda:
            return
        self._host.copy_(self.counts, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def read(self) -> list[list[int]]:
        """The counts as of the last `snapshot` (CUDA) or now (CPU): [L][E]."""
        if not self._cuda:
            return self.counts.tolist()
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()


def record_expert_ids(
    counts: torch.Tensor, ids: torch.Tensor, row_weight: torch.Tensor | None = None
) -> None:
    """Add one to `counts` ([E]) for every entry of `ids` ([T, k] expert ids); with
    `row_weight` ([>= T] int64, 1 or 0 per row), only the rows whose weight is 1: a CUDA
    graph's padding rows (engine/cuda_graphs.py) route like any other and must not count."""
    flat = ids.reshape(-1)
    if row_weight is None:
        counts.index_add_(0, flat, torch.ones_like(flat))
    else:
        counts.index_add_(0, flat, row_weight[: ids.shape[0]].repeat_interleave(ids.shape[1]))


def imbalance(step_counts: list[list[int]]) -> float:
    """A step's expert imbalance: for each sparse layer, the most pairs any expert received over
    the mean per expert (1.0 = perfectly even, E = every pair on one expert), averaged over the
    layers that routed any token; 0.0 when none did."""
    ratios = [max(layer) * len(layer) / total for layer in step_counts if (total := sum(layer)) > 0]
    return sum(ratios) / len(ratios) if ratios else 0.0
