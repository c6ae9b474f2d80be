"""`Proposer`: the interface every speculation method implements (built by name in
`engine.spec_decode.factory`).

A proposer is asked, after a step, for the next tokens of the requests that just got a token
and will decode next (`propose`). The scheduler puts those tokens into the next step's
token budget, the target model computes them next to everything else, and verification keeps
the prefix it agrees with. Methods differ only in where guesses come from:

- `ngram`: the request's own tokens (prompt lookup); no model, no state.
- `draft_model`: a small model with its own paged KV, run `k` times per step; it guesses
  greedily (a point mass). A draft that samples would pass its distributions as
  `Proposal.probs`, for `verify.rejection_sample`.
- EAGLE / MTP heads (later): they need the target's hidden states of the step, which
  `ProposeContext.hidden_states` is there to carry.

Invariants: `propose` runs on the engine thread between steps and must not change any request;
it returns at most `max_tokens[i]` tokens for request i (0 means: propose nothing).
`release` is called once for every request that leaves the engine (finished, aborted), so a
proposer with per-request state (a draft model's KV) frees it there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from duet.engine.request import Request
from duet.engine.spec_decode.config import SpeculativeConfig
from duet.engine.tokenizer import Tokenizer


@dataclass
class Proposal:
    """Draft tokens for one request. `probs`: the draft's distribution at each proposed
    position ([len(token_ids), vocab], for rejection sampling); None for a point mass (the
    token was proposed with certainty, as ngram does)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class TargetInfo:
    """What a proposer may need to know of the target engine."""

    vocab_size: int
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    block_size: int
    num_blocks: int  # the target's KV pool (a draft's pool gets as many blocks)
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    attention_backend: str
    tensor_parallel_size: int
    enforce_eager: bool = True  # a draft model's runner captures CUDA graphs unless this
    cuda_graph_mode: str = "decode"  # ... and in which mode (EngineConfig.cuda_graph_mode)
    draft_model: Any = None
    """draft_model: the draft, loaded before the target's KV pool was sized (`LoadedModel`: on
    CUDA its weights are in the memory the pool's sizing measured); None: the proposer loads
    it."""


@dataclass
class ProposeContext:
    """What a step leaves for the proposers: the requests to propose for, each one's cap."""

    requests: Sequence[Request]
    max_tokens: Sequence[int]
    hidden_states: torch.Tensor | None = None  # the target's, for EAGLE/MTP (not filled yet)


class Proposer(ABC):
    method: str

    def __init__(self, config: SpeculativeConfig, target: TargetInfo) -> None:
        self.config = config
        self.target = target

    @abstractmethod
    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        """One proposal per request of `ctx`, in order (empty token list: no guess)."""

    def release(self, request_id: str) -> None:
        """The request left the engine: drop any state kept for it (none by default)."""
        return None
