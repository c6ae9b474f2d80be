"""`PrefillHandoff`: what travels with a request's KV from the prefill worker to the decode
worker, so the decode side continues exactly where the prefill side stopped: the first token,
its logprobs (when the request asked), the sampling seed that keys its draws, and how much of
the prompt was a prefix-cache hit.

kv_transfer carries it as its small JSON metadata (`to_meta`), blind to what it holds; the
decode worker reads it back with `from_meta`, which refuses anything malformed (`ValueError`)
rather than decoding a request from a wrong first token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from duet.engine.outputs import TokenLogprob
from duet.engine.prefill_handoff import PrefillDone


@dataclass(frozen=True)
class PrefillHandoff:
    first_token: int
    logprob: TokenLogprob | None
    """The first token's (logprob, top [(token id, logprob)]); None unless asked for."""
    sample_seed: int
    num_cached_tokens: int

    @classmethod
    def of(cls, done: PrefillDone) -> PrefillHandoff:
        return cls(done.first_token, done.logprob, done.sample_seed, done.num_cached_tokens)

    def to_meta(self) -> dict[str, Any]:
        """As kv_transfer's metadata (JSON)."""
        return {
            "first_token": self.first_token,
            "logprob": self.logprob,
            "sample_seed": self.sample_seed,
            "num_cached_tokens": self.num_cached_tokens,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> PrefillHandoff:
        """Inverse of `to_meta` (after a JSON round trip); `ValueError` naming what is wrong."""
        if not isinstance(meta, dict) or set(meta) != {
            "first_token", "logprob", "sample_seed", "num_cached_tokens"
        }:  # fmt: skip
            raise ValueError(f"prefill hand-off: unexpected fields {sorted(meta or ())}")
        first_token, seed, cached = (
            meta["first_token"],
            meta["sample_seed"],
            meta["num_cached_tokens"],
        )
        if not all(_is_int(v) and v >= 0 for v in (first_token, cached)) or not _is_int(seed):
            raise ValueError(f"prefill hand-off: bad token, seed or cache count in {meta}")
        return cls(first_token, _logprob(meta["logprob"]), seed, cached)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logprob(value: object) -> TokenLogprob | None:
    if value is None:
        return None
    if isinstance(value, list | tuple) and len(value) == 2:
        chosen, top = value
        try:
            return float(chosen), [(int(t), float(lp)) for t, lp in top]
        except (TypeError, ValueError):
            pass
    raise ValueError(f"prefill hand-off: bad logprob {value!r}")
