"""`create_proposer`: the one place a proposal method's name becomes its class, imported
lazily (a method's dependencies load only when it is configured)."""

from __future__ import annotations

import importlib

from duet.engine.spec_decode.config import SpeculativeConfig
from duet.engine.spec_decode.proposer import Proposer, TargetInfo

_PROPOSERS: dict[str, tuple[str, str]] = {
    "ngram": ("duet.engine.spec_decode.ngram", "NgramProposer"),
    "draft_model": ("duet.engine.spec_decode.draft_model", "DraftModelProposer"),
}


def create_proposer(config: SpeculativeConfig, target: TargetInfo) -> Proposer:
    """The proposer of `config.method`, built from `config`."""
    entry = _PROPOSERS.get(config.method)
    if entry is None:
        raise ValueError(f"no proposer for method {config.method!r}")
    module, name = entry
    proposer_cls: type[Proposer] = getattr(importlib.import_module(module), name)
    return proposer_cls(config, target)
