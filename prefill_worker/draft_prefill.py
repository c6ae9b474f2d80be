"""`DraftPrefill`: a prefill worker computes the draft model's KV over a prompt and ships it
with the target's, for decode workers that speculate with that draft
(`speculative_config`'s `draft_prefill`: `prefill`, or `auto` for prompts of at least
`draft_prefill_min_tokens`; docs/speculative_decoding.md).

The draft is the engine's own `DraftModelProposer` (built from the same `speculative_config`
as the decode workers', with as many blocks as the target's pool); a prefill-only request never
proposes, so the proposer here only prefills. The draft's KV over a prompt is computed right
before the target's pass that completes it (`prefill`), so its blocks are ready when the
transfer opens and travel after the target's layers (`kv_transfer/layers.py`); they are held
until the transfer ends (`release`), like the target's.

Engine thread only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from duet.engine.llm_engine import LLMEngine
from duet.engine.spec_decode.config import SpeculativeConfig
from duet.engine.spec_decode.draft_model import DraftModelProposer
from duet.prefill_worker.config import PrefillWorkerConfig


def prefill_engine_config(config: PrefillWorkerConfig) -> PrefillWorkerConfig:
    """The config a prefill worker's engine is built with: its `speculative_config` only when
    that has the draft prefilled here (a prefill worker never speculates: otherwise it would
    load a draft, or an ngram proposer, for nothing)."""
    spec = config.speculative()
    if spec is None or spec.drafts_on_prefill:
        return config
    return dataclasses.replace(config, speculative_config=None)


class DraftPrefill:
    """The draft's prompt KV on a prefill worker: which requests get it, computing it, and its
    blocks until their transfer ends."""

    def __init__(self, spec: SpeculativeConfig, proposer: DraftModelProposer) -> None:
        assert spec.model is not None  # draft_model requires it
        self.spec = spec
        self.proposer = proposer
        self.model_id = spec.model
        self._prompts: dict[str, list[int]] = {}  # added, draft not computed yet
        self._block_ids: dict[str, list[int]] = {}  # computed: the draft's blocks

    @classmethod
    def of_engine(cls, engine: LLMEngine) -> DraftPrefill | None:
        """The engine's draft when its config has the draft prefilled here, else None."""
        spec = engine.config.speculative()
        if spec is None or not spec.drafts_on_prefill or engine.speculator is None:
            return None
        proposer = engine.speculator.proposer
        assert isinstance(proposer, DraftModelProposer)
        return cls(spec, proposer)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The draft's caches, per layer [2, num_blocks, block_size, heads, head_dim]."""
        return self.proposer.runner.kv_caches

    def add(self, request_id: str, prompt: Sequence[int]) -> None:
        """A new request: its draft is computed here if the config says so for its length."""
        if self.spec.prefills_draft_remotely(len(prompt)):
            self._prompts[request_id] = list(prompt)

    def prefill(self, request_ids: Sequence[str]) -> dict[str, list[int]]:
        """The draft's blocks of those requests that get the draft's KV, computed now (in one
        batch) where not yet; a request the draft's pool cannot hold gets none."""
        todo = [(r, self._prompts.pop(r)) for r in request_ids if r in self._prompts]
        if todo:
            self._block_ids.update(self.proposer.prefill_prompts(todo))
        return {r: self._block_ids[r] for r in request_ids if r in self._block_ids}

    def num_blocks(self, request_id: str) -> int:
        """Draft blocks shipped (or to ship) for the request."""
        return len(self._block_ids.get(request_id, ()))

    def release(self, request_id: str) -> None:
        """The request's transfer ended (or it was aborted): free its draft blocks."""
        self._prompts.pop(request_id, None)
        if self._block_ids.pop(request_id, None) is not None:
            self.proposer.release(request_id)
