"""Checks every entry point applies to a prompt before it becomes a request: a text provably
too long for the context refused before it is tokenized (`check_prompt_chars`), tokenizing and
validating the ids (`tokenize_prompt`), fitting prompt + output in the context and the KV pool
(`check_lengths`), the ids a request's parameters name being the model's (`check_vocab`)."""

from __future__ import annotations

from collections.abc import Sequence

from duet.engine.errors import InvalidInputError
from duet.engine.sampling_params import SamplingParams
from duet.engine.tokenizer import Tokenizer

Prompt = str | Sequence[int]


def check_prompt_chars(
    tokenizer: Tokenizer, text: str, max_model_len: int, field: str = "prompt"
) -> None:
    """Raises `InvalidInputError` naming `field` when `text` has more characters than the
    context's tokens could hold (no token stands for more than `tokenizer.max_token_chars`):
    tokenizing a huge text costs seconds and gigabytes, counting its characters nothing."""
    max_chars = tokenizer.max_token_chars
    if max_chars is None or len(text) <= max_model_len * max_chars:
        return
    raise InvalidInputError(
        field,
        f"has {len(text)} characters, so at least {-(-len(text) // max_chars)} tokens (a token "
        f"is at most {max_chars} characters); the model's context is {max_model_len}",
    )


def tokenize_prompt(
    tokenizer: Tokenizer, vocab_size: int, prompt: Prompt, max_model_len: int | None = None
) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text or token ids; raises `InvalidInputError`
    for an empty prompt, ids outside the vocabulary, or (given `max_model_len`) a text
    provably too long for the context, refused before it is tokenized."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidInputError("prompt", "must not be empty")
        if max_model_len is not None:
            check_prompt_chars(tokenizer, prompt, max_model_len)
        return prompt, tokenizer.encode(prompt)
    ids = list(prompt)
    if not ids:
        raise InvalidInputError("prompt", "must not be empty")
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidInputError(
            "prompt", f"token ids must be integers in [0, {vocab_size}); got {bad!r}"
        )
    return None, ids


def check_lengths(
    num_prompt: int, params: SamplingParams, max_model_len: int, kv_capacity_tokens: int
) -> int:
    """A request's effective max_tokens; raises `InvalidInputError` when prompt + output
    cannot fit the context or a KV pool of `kv_capacity_tokens`."""
    limit = max_model_len
    if num_prompt >= limit:
        raise InvalidInputError(
            "prompt",
            f"has {num_prompt} tokens; the model's context is {limit}, so at most {limit - 1}",
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
    if num_prompt + max_tokens > limit:
        raise InvalidInputError(
            "max_tokens",
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of "
            f"{limit}; max_tokens must be <= {limit - num_prompt}",
        )
    if num_prompt + max_tokens > kv_capacity_tokens:
        raise InvalidInputError(
            "max_tokens",
            f"prompt + max_tokens ({num_prompt + max_tokens}) exceeds the KV pool "
            f"({kv_capacity_tokens} tokens)",
        )
    return max_tokens


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Raises `InvalidInputError` when `logit_bias`, `allowed_token_ids` or
    `prediction_token_ids` names a token id outside the model's vocabulary of `vocab_size`
    (the sampler indexes its logits by them; the model embeds proposed tokens)."""
    for name, ids in (("logit_bias", params.logit_bias),
                      ("allowed_token_ids", params.allowed_token_ids),
                      ("prediction_token_ids", params.prediction_token_ids)):  # fmt: skip
        bad = sorted(t for t in ids or () if t >= vocab_size)
        if bad:
            raise InvalidInputError(
                name,
                f"token ids must be in [0, {vocab_size}) (the model's vocabulary); got {bad[0]}",
            )
