"""Speculative decoding: proposers (`ngram`, `draft_model`; EAGLE and MTP heads later)
guess a request's next tokens cheaply, the target model computes them in one step next to
prefill chunks and decodes, and verification keeps the longest prefix the target agrees
with plus one token of its own (docs/speculative_decoding.md)."""

from duet.engine.spec_decode.config import SpeculativeConfig
from duet.engine.spec_decode.factory import create_proposer
from duet.engine.spec_decode.proposer import Proposer

__all__ = ["Proposer", "SpeculativeConfig", "create_proposer"]
