"""The serving benchmark's seeded workload: request lengths from a distribution, random-token
prompts of exactly those lengths, and Poisson arrival times.

Everything is a pure function of the seed, so two runs (say aggregated and disaggregated
`duet serve`) send the identical requests at the identical offsets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

DIST_KINDS = ("fixed", "uniform", "normal")
DIST_HELP = "fixed:N, uniform:LO:HI (inclusive) or normal:MEAN:STD (rounded, clipped to >= 1)"


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts: `fixed:N`, `uniform:LO:HI` or `normal:MEAN:STD`."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """Raises ValueError saying what is wrong with `text` and what is allowed."""
        parts = text.strip().split(":")
        kind, args = parts[0].lower(), parts[1:]
        if kind not in DIST_KINDS:
            raise ValueError(f"unknown distribution {parts[0]!r} in {text!r}; use {DIST_HELP}")
        want = 1 if kind == "fixed" else 2
        if len(args) != want:
            raise ValueError(f"{kind} takes {want} number(s), got {text!r}; use {DIST_HELP}")
        try:
            nums = [float(x) for x in args]
        except ValueError:
            raise ValueError(f"not a number in {text!r}; use {DIST_HELP}") from None
        if not all(math.isfinite(x) for x in nums):
            raise ValueError(f"numbers must be finite, got {text!r}")
        if kind in ("fixed", "uniform") and not all(x == int(x) and x >= 1 for x in nums):
            raise ValueError(f"{kind} lengths must be integers >= 1, got {text!r}")
        if kind == "uniform" and nums[0] > nums[1]:
            raise ValueError(f"uniform:LO:HI needs LO <= HI, got {text!r}")
        if kind == "normal" and (nums[0] < 1 or nums[1] < 0):
            raise ValueError(f"normal:MEAN:STD needs MEAN >= 1 and STD >= 0, got {text!r}")
        return cls(kind, *nums)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"normal:{self.a:g}:{self.b:g}"

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    @property
    def max_len(self) -> int | None:
        """The largest length it can draw (None: unbounded, i.e. normal with STD > 0)."""
        if self.kind == "normal":
            return round(self.a) if self.b == 0 else None
        return int(self.b if self.kind == "uniform" else self.a)


def parse_rates(text: str) -> list[float]:
    """`--rate`: comma-separated requests/s, each > 0, or `inf` (all requests at once)."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(
                f"{part.strip()!r} is not a number; use e.g. 2 or 1,2,4 or inf"
            ) from None
        if not rate > 0:  # also rejects nan
            raise ValueError(f"rates must be > 0 (or inf), got {part.strip()!r}")
        rates.append(rate)
    return rates


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: list[int]  # exactly input_len random non-special token ids
    output_len: int  # max_tokens, reached exactly with ignore_eos

    @property
    def input_len(self) -> int:
        return len(self.prompt_ids)


def build_workload(
    num_requests: int,
    seed: int,
    input_dist: LengthDist,
    output_dist: LengthDist,
    allowed_ids: Sequence[int],
    run_index: int = 0,
) -> list[RequestSpec]:
    """`num_requests` requests; the lengths depend only on `seed`, the prompt tokens on `seed`
    and `run_index`, so every rate of a sweep gets the same lengths but its own prompts (the
    server's prefix cache must not serve one rate from an earlier one)."""
    if not allowed_ids:
        raise ValueError("the tokenizer has no non-special tokens to build prompts from")
    length_rng = random.Random(f"duet-serve-lengths:{seed}")
    lengths = [
        (input_dist.sample(length_rng), output_dist.sample(length_rng)) for _ in range(num_requests)
    ]
    token_rng = random.Random(f"duet-serve-tokens:{seed}:{run_index}")
    return [RequestSpec(token_rng.choices(allowed_ids, k=n_in), n_out) for n_in, n_out in lengths]


def unit_gaps(num_requests: int, seed: int) -> list[float]:
    """Exponential(1) inter-arrival gaps, one per request after the first."""
    rng = random.Random(f"duet-serve-arrivals:{seed}")
    return [rng.expovariate(1.0) for _ in range(max(0, num_requests - 1))]


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: request 0 at 0, then Poisson arrivals at `rate`
    requests/s (gaps Exponential with mean 1/rate); all at 0 for `rate` = inf. Every rate
    scales the same unit gaps, so a sweep's arrival patterns differ only in speed."""
    offsets = [0.0]
    for gap in unit_gaps(num_requests, seed):
        offsets.append(offsets[-1] + (0.0 if math.isinf(rate) else gap / rate))
    return offsets[:num_requests]


def allowed_token_ids(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """Every id of the vocabulary but the special added tokens (BOS/EOS, chat markers), which
    would change how the server treats a prompt."""
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    return [i for i in range(tokenizer.get_vocab_size(with_added_tokens=True)) if i not in special]
