"""A seeded offline workload: random-token prompts of mixed lengths, each with its own output
length. Every system in a run gets the identical `Workload`."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]  # per prompt; generation runs to it (ignore_eos)
    seed: int

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def max_model_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.max_tokens, strict=True))

    def summary(self) -> dict[str, int]:
        return {
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "min_prompt_len": min(len(p) for p in self.prompts),
            "max_prompt_len": max(len(p) for p in self.prompts),
            "min_output_len": min(self.max_tokens),
            "max_output_len": max(self.max_tokens),
        }


def make_workload(
    num_prompts: int,
    seed: int,
    vocab_size: int,
    special_ids: set[int],
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
) -> Workload:
    """Prompt and output lengths uniform in the inclusive ranges; prompt tokens uniform over the
    vocabulary minus the special ids."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    prompts = [rng.choices(allowed, k=rng.randint(*prompt_len)) for _ in range(num_prompts)]
    max_tokens = [rng.randint(*output_len) for _ in range(num_prompts)]
    return Workload(prompts, max_tokens, seed)


def special_token_ids(model_dir: Path) -> set[int]:
    """Ids of the tokenizer's special added tokens (BOS/EOS, chat markers, ...)."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    return {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
