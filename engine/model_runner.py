"""`ModelRunner`: owns the model and its KV cache; turns a `SchedulerOutput` into one forward
pass and a sample per request that reached the end of its tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.kernels.cpu import load_cpu_kernels
from engine.kv_cache_manager import KVCacheManager
from engine.model import LlamaForCausalLM
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import SchedulerOutput


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


@dataclass
class StepResult:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        attention_backend: str = "auto",
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = [
            torch.zeros(
                (2, num_blocks, block_size, model.num_kv_heads, cfg.head_dim),
                dtype=dtype,
                device=device,
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler(seed)
        # Decode attention: the C++ kernel on CPU when it builds, else the torch reference.
        self.use_decode_kernel = (
            attention_backend == "auto"
            and device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and load_cpu_kernels() is not None
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> StepResult:
        requests = [r for r, _ in out.scheduled]
        query_lens = [n for _, n in out.scheduled]
        starts = [r.num_computed_tokens for r in requests]
        seq_lens = [s + n for s, n in zip(starts, query_lens, strict=True)]

        input_ids = np.concatenate(
            [
                np.asarray(r.all_token_ids[s:e], dtype=np.int64)
                for r, s, e in zip(requests, starts, seq_lens, strict=True)
            ]
        )
        positions = np.concatenate(
            [np.arange(s, e, dtype=np.int64) for s, e in zip(starts, seq_lens, strict=True)]
        )
        meta = AttentionMetadata.build(
            query_lens,
            seq_lens,
            [kv.get_block_ids(r.request_id) for r in requests],
            self.block_size,
            self.device,
            self.use_decode_kernel,
        )
        hidden = self.model(
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(positions).to(self.device),
            self.kv_caches,
            meta,
        )

        # Only requests whose computed tokens reach their last token sample this step.
        sample_rows = [i for i, r in enumerate(requests) if seq_lens[i] == r.num_tokens]
        if not sample_rows:
            return StepResult({}, {})
        last = torch.tensor(
            [meta.query_start_loc[i + 1] - 1 for i in sample_rows], device=self.device
        )
        logits = self.model.compute_logits(hidden[last])  # [N, vocab]
        to_sample = [requests[i] for i in sample_rows]
        result: SamplerOutput = self.sampler(logits, to_sample)
        sampled = {r.request_id: t for r, t in zip(to_sample, result.token_ids, strict=True)}
        logprobs = {
            r.request_id: lp
            for r, lp in zip(to_sample, result.logprobs, strict=True)
            if lp is not None
        }
        return StepResult(sampled, logprobs)
