"""`Sampler`: logits -> token ids for a batch, honouring each request's `SamplingParams`.

Order: penalties, then temperature, top-k, top-p, min-p, then a draw. Logprobs are taken from
the raw logits (before any of that), like OpenAI and vLLM. A request with a seed draws from
its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (sampled token logprob, top-N [(token_id, logprob)]), or None when not requested.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        # logits: [N, V] fp32, one row per request
        raw = logits
        if any(r.sampling_params.needs_penalties or _blocks_stops(r) for r in requests):
            logits = logits.clone()
        for row, request in enumerate(requests):
            if request.sampling_params.needs_penalties:
                _apply_penalties(logits[row], request)
            if _blocks_stops(request):
                # Until min_tokens are out, EOS and stop tokens cannot be drawn at all.
                stops = [*request.eos_token_ids, *request.sampling_params.stop_token_ids]
                logits[row, [t for t in stops if t < logits.shape[-1]]] = float("-inf")

        greedy = [r.sampling_params.greedy for r in requests]
        if all(greedy):  # the common batch: no row gather (a copy of [N, vocab] fp32)
            token_ids = logits.argmax(dim=-1).cpu()
        else:
            token_ids = torch.empty(len(requests), dtype=torch.long)
            if any(greedy):
                rows = torch.tensor([i for i, g in enumerate(greedy) if g])
                token_ids[rows] = logits[rows].argmax(dim=-1).cpu()
            rows_list = [i for i, g in enumerate(greedy) if not g]
            rows = torch.tensor(rows_list)
            probs = _probs(logits[rows], [requests[i] for i in rows_list])
            token_ids[rows] = self._draw(probs, [requests[i] for i in rows_list])

        out_logprobs: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(requests)
        want = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if want:
            lp = torch.log_softmax(raw[want].float(), dim=-1).cpu()
            for j, i in enumerate(want):
                k = requests[i].sampling_params.logprobs or 0
                chosen = float(lp[j, token_ids[i]])
                top: list[tuple[int, float]] = []
                if k:
                    values, ids = lp[j].topk(k)
                    top = list(zip(ids.tolist(), values.tolist(), strict=True))
                out_logprobs[i] = (chosen, top)
        return SamplerOutput(token_ids.tolist(), out_logprobs)

    def _draw(self, probs: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) samples from p.
        noise = torch.empty_like(probs)
        for row, request in enumerate(requests):
            gen = request.generator or self.generator
            noise[row].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1).cpu()


def _blocks_stops(request: Request) -> bool:
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return False
    return bool(params.stop_token_ids or (request.eos_token_ids and not params.ignore_eos))


def _probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    temps = torch.tensor([r.sampling_params.temperature for r in requests], dtype=logits.dtype)
    logits = logits / temps.to(logits.device)[:, None]
    top_ks = [r.sampling_params.top_k for r in requests]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[-1]
        k = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device).clamp(
            max=vocab
        )
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_ps = [r.sampling_params.top_p for r in requests]
    if any(p < 1.0 for p in top_ps):
        p = torch.tensor(top_ps, dtype=probs.dtype, device=probs.device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches p (the top token always stays).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p[:, None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    min_ps = [r.sampling_params.min_p for r in requests]
    if any(m > 0 for m in min_ps):
        m = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)
        probs = probs.masked_fill(probs < m[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _apply_penalties(logits: torch.Tensor, request: Request) -> None:
    """In place on one row [V]."""
    params = request.sampling_params
    vocab = logits.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(request.all_token_ids)), dtype=torch.long, device=logits.device
        )
        seen = seen[seen < vocab]
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
        )
    if (params.presence_penalty or params.frequency_penalty) and request.output_token_ids:
        out = torch.tensor(request.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
            logits.dtype
        )
