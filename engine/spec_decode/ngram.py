"""`NgramProposer` (prompt lookup): match the sequence's last n tokens (n from
`prompt_lookup_max` down to `prompt_lookup_min`) against its earlier tokens, prompt and output
alike (and a request's Predicted Outputs before them, `prediction_token_ids`), and propose the
tokens that followed the most recent match. No model; costs a vector compare over the
sequence per request per step."""

from __future__ import annotations

import numpy as np

from duet.engine.spec_decode.config import SpeculativeConfig
from duet.engine.spec_decode.proposer import Proposal, ProposeContext, Proposer, TargetInfo


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the longest suffix of `tokens`
    (length n_max down to n_min) found earlier in it: the most recent occurrence followed by k
    tokens, else the most recent; [] when none is."""
    length = tokens.shape[0]
    if k <= 0:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start early enough to be followed by at least one token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # The most recent match, unless it sits too close to the end to be followed by k
            # tokens and an earlier one is (a run of one repeated token, say).
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, config: SpeculativeConfig, target: TargetInfo) -> None:
        super().__init__(config, target)
        self.n_min = config.prompt_lookup_min
        self.n_max = config.prompt_lookup_max

    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        out = []
        for request, k in zip(ctx.requests, ctx.max_tokens, strict=True):
            if k <= 0 or request.num_tokens <= self.n_min:
                out.append(Proposal([]))
                continue
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            predicted = request.sampling_params.prediction_token_ids
            if predicted:  # Predicted Outputs: looked up as if before the prompt
                tokens = np.concatenate([np.asarray(predicted, dtype=np.int64), tokens])
            out.append(Proposal(ngram_lookup(tokens, self.n_min, self.n_max, k)))
        return out
