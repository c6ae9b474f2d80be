"""`Sampler`: logits -> token ids for the rows that sample this step, honouring each
request's `SamplingParams` (gathered per step by `SamplingSlots`).

Order: allowed_token_ids (every other logit to -inf), penalties, logit_bias, the grammar mask
(structured outputs), then temperature, top-k, top-p, min-p, then a draw. Logprobs are taken from the raw logits (before any of that), like
OpenAI and vLLM, and only for the rows that asked.

The draw is inverse-CDF with one counter-based uniform per row (`engine.random`): the token
a request draws depends only on its own logits, its seed and the token's position, never on
the batch, and there is no generator object to live on the wrong device. Everything the
sampler touches is on the logits' device; the one host transfer is the result
(`to_host`: the tokens, and the logprobs of the rows that asked, in one tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from duet.engine.kernels.cpu import load_cpu_kernels
from duet.engine.sampling_slots import SamplingBatch
from duet.engine.structured_output import apply_bitmask

ToHost = Callable[[torch.Tensor], list]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (sampled token logprob, top-N [(token_id, logprob)]), or None when not requested.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]
    token_tensor: torch.Tensor  # [N] long on the logits' device (for the token counts)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, to_host: ToHost
    ) -> SamplerOutput:
        # logits: [N, V] fp32, one row per sampling request
        raw = logits
        if (
            batch.any_penalties
            or batch.stop_masks
            or batch.biases
            or batch.allowed
            or batch.bitmask is not None
        ):
            logits = logits.clone()
        for row, ids in batch.allowed:
            kept = logits[row, ids]
            logits[row] = float("-inf")
            logits[row, ids] = kept
        if batch.any_penalties:
            _apply_penalties(logits, batch)
        for row, ids, values in batch.biases:
            logits[row, ids] += values.to(logits.dtype)  # ids are distinct: one add each
        if batch.bitmask is not None:
            apply_bitmask(logits, batch.bitmask)  # grammars: disallowed tokens to -inf
        for row, stops in batch.stop_masks:
            # Until min_tokens are out, EOS and stop tokens cannot be drawn at all; nor can
            # what a bad word forbids.
            logits[row, stops] = float("-inf")

        if batch.all_greedy:
            token_ids = _argmax(logits)
        else:
            token_ids = _draw(_probs(logits, batch), batch.uniform)
            if batch.any_greedy:
                assert batch.greedy is not None
                token_ids = torch.where(batch.greedy, _argmax(logits), token_ids)

        n = batch.num_rows
        num_want = len(batch.logprob_ks)
        if not num_want:
            # long: followers of a tensor-parallel group receive this tensor (`follow`)
            token_ids = token_ids.long()
            return SamplerOutput(to_host(token_ids), [None] * n, token_ids)
        want = batch.logprob_rows
        lp = torch.log_softmax(raw.index_select(0, want).float(), dim=-1)  # [W, V]
        chosen = lp.gather(1, token_ids.index_select(0, want)[:, None])  # [W, 1]
        k = max(batch.logprob_ks)
        parts = [token_ids.double(), chosen.double().flatten()]
        if k:
            values, ids = lp.topk(k, dim=-1)  # [W, k]
            parts += [ids.double().flatten(), values.double().flatten()]
        host = to_host(torch.cat(parts))  # the one sync: tokens and logprobs together
        return _unpack(host, batch, token_ids)

    def follow(self, batch: SamplingBatch, receive: Receive) -> SamplerOutput:
        """What `__call__` returns on the rank that sampled, for a tensor-parallel rank that
        holds no logits: `receive(numel, dtype)` gets the sampling rank's one host transfer
        (the tensor it handed `to_host`, broadcast) as (the device tensor, its host list)."""
        n = batch.num_rows
        num_want = len(batch.logprob_ks)
        if not num_want:
            token_ids, host = receive(n, torch.int64)
            return SamplerOutput([int(t) for t in host], [None] * n, token_ids)
        k = max(batch.logprob_ks)
        packed, host = receive(n + num_want + 2 * num_want * k, torch.float64)
        return _unpack(host, batch, packed[:n].long())


Receive = Callable[[int, torch.dtype], tuple[torch.Tensor, list]]
"""(numel, dtype) -> (a device tensor of the sampling rank's values, the same as a list)."""


def _unpack(host: list, batch: SamplingBatch, token_ids: torch.Tensor) -> SamplerOutput:
    """A `SamplerOutput` from the packed host values: the N tokens, then the W chosen
    logprobs, then W x k top ids and W x k top logprobs (k: the largest asked)."""
    n = batch.num_rows
    num_want = len(batch.logprob_ks)
    k = max(batch.logprob_ks)
    tokens = [int(t) for t in host[:n]]
    out_logprobs: list[tuple[float, list[tuple[int, float]]] | None] = [None] * n
    top_ids = host[n + num_want : n + num_want + num_want * k]
    top_values = host[n + num_want + num_want * k :]
    for j, row_k in enumerate(batch.logprob_ks):
        row = batch.logprob_host_rows[j]
        base = j * k
        top = [(int(top_ids[base + m]), top_values[base + m]) for m in range(row_k)]
        out_logprobs[row] = (host[n + j], top)
    return SamplerOutput(tokens, out_logprobs, token_ids)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens [N]: `logits.argmax(dim=-1)`, vectorised in C++ on the CPU."""
    kernels = _kernels(logits)
    if kernels is not None and logits.is_contiguous():
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse CDF per row: the first token whose cumulative probability (fp64, so u * total
    never rounds up to the total) exceeds `uniform` [N] times the row's total."""
    kernels = _kernels(probs)
    if kernels is not None:  # the same sums without a [N, V] fp64 tensor
        return kernels.sample_inverse_cdf(probs, uniform.float().contiguous())
    cdf = probs.double().cumsum(dim=-1)
    target = uniform * cdf[:, -1]
    token_ids = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return token_ids.clamp_(max=probs.shape[-1] - 1)


def _kernels(x: torch.Tensor) -> Any | None:
    """The CPU kernel module for fp32 CPU logits or probabilities, else None (torch)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return load_cpu_kernels()


def _probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    dtype = logits.dtype
    logits = logits / batch.temperature.to(dtype)[:, None]
    if batch.any_top_k:
        # The k-th largest logit per row, from one topk of the largest k asked (no full sort);
        # rows without top-k (k = vocab) keep every token.
        vocab = logits.shape[-1]
        k = batch.top_k[:, None]
        top = logits.topk(batch.max_top_k, dim=-1).values
        kth = top.gather(-1, k.clamp(max=batch.max_top_k) - 1)
        kth = kth.masked_fill(k >= vocab, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if batch.any_top_p:
        probs = _top_p(probs, batch.top_p.to(dtype)[:, None])
    if batch.any_min_p:
        m = batch.min_p.to(dtype)
        probs = probs.masked_fill(probs < m[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


# Top-p candidates looked at first on the CPU, where a full sort of [N, vocab] costs more than
# the forward pass of a small model; the largest `_TOP_P_CANDIDATES` nearly always hold the mass.
_TOP_P_CANDIDATES = 512


def _top_p(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `p` [N, 1] (the top
    token always stays): every token at least as likely as the last one that set needs. A
    row with p >= 1 keeps every token, whatever the rounding of its sum."""
    kernels = _kernels(probs)
    if kernels is not None:  # the same threshold, selecting only as far as the set reaches
        threshold = kernels.top_p_threshold(probs, p[:, 0].float().contiguous())
        return probs.masked_fill(probs < threshold, 0.0)
    vocab = probs.shape[-1]
    if probs.device.type != "cpu" or vocab <= _TOP_P_CANDIDATES:
        ordered = probs.sort(dim=-1, descending=True).values
        return probs.masked_fill(probs < _threshold(ordered, p), 0.0)
    # NOTE: reading `beyond` on the host is no device sync here (CPU); on a GPU the sort is
    # cheap and taken unconditionally, which keeps the step free of syncs.
    candidates = probs.topk(_TOP_P_CANDIDATES, dim=-1).values
    threshold = _threshold(candidates, p)
    beyond = (candidates.sum(dim=-1) - candidates[:, -1] < p[:, 0]).nonzero()[:, 0]
    if beyond.numel():  # rows whose set reaches past the candidates: sort those rows only
        rows = probs.index_select(0, beyond).sort(dim=-1, descending=True).values
        threshold[beyond] = _threshold(rows, p.index_select(0, beyond))
    return probs.masked_fill(probs < threshold, 0.0)


def _threshold(ordered: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The probability of the last token the top-p set needs, from probabilities in
    descending order (the largest `ordered.shape[-1]`)."""
    num_keep = ((ordered.cumsum(dim=-1) - ordered) < p).sum(dim=-1, keepdim=True)
    return ordered.gather(-1, num_keep.clamp(min=1) - 1).masked_fill(p >= 1.0, 0.0)


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place on [N, V]; rows without penalties hold neutral values (1.0, 0.0, 0.0), which
    leave their logits bit for bit as they were."""
    assert batch.counts is not None and batch.prompt_mask is not None
    dtype = logits.dtype
    counts = batch.counts.index_select(0, batch.slots)  # [N, V] int32: output tokens
    if batch.draft_counts is not None:  # speculation: proposed tokens ahead of each row
        rows, tokens = batch.draft_counts
        counts.index_put_((rows, tokens), torch.ones_like(rows, dtype=counts.dtype), True)
    seen = batch.prompt_mask.index_select(0, batch.slots) | (counts > 0)
    rep = batch.repetition.to(dtype)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    # A penalty far below 1 (any in (0, 1] is allowed) overflows a seen token's positive
    # logit to +inf (10 / 1e-40), and a row holding +inf has no softmax: every probability
    # NaN, and a sampled row took the vocabulary's last id. Capped at the dtype's largest
    # value, such tokens share the top instead. (-inf, a masked token, stays.)
    penalized.clamp_(max=torch.finfo(dtype).max)
    logits.copy_(torch.where(seen, penalized, logits))
    counts_f = counts.to(dtype)
    logits -= batch.frequency.to(dtype)[:, None] * counts_f + batch.presence.to(dtype)[:, None] * (
        counts_f > 0
    ).to(dtype)
