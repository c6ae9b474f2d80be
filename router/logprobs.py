"""Engine logprobs in OpenAI's two shapes: chat (`content[j]` objects) and completions
(parallel `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists)."""

from __future__ import annotations

from collections.abc import Sequence

from duet.engine import Logprob, TokenLogprobs
from duet.engine.tokenizer import Tokenizer
from duet.router.openai_responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprobs,
    PromptTokenLogprob,
)


class TokenTexts:
    """Text of single tokens as clients see them (decoded, not the raw BPE symbol), cached.

    A token holding part of a multi-byte character decodes to U+FFFD, as in vLLM; with
    `as_ids` tokens read `token_id:<id>` instead, which is exact."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int, as_ids: bool = False) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _finite(logprob: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. Masked tokens get a very low one.
    return logprob if logprob > -9999.0 else -9999.0


def chat_logprobs(
    entries: Sequence[TokenLogprobs], num_top: int, texts: TokenTexts, as_ids: bool = False
) -> ChatLogprobs:
    def item(lp: Logprob) -> ChatTopLogprob:
        token = texts.text(lp.token_id, as_ids)
        return ChatTopLogprob(
            token=token, logprob=_finite(lp.logprob), bytes=list(token.encode("utf-8"))
        )

    content = []
    for entry in entries:
        sampled = item(entry.sampled)
        content.append(
            ChatTokenLogprob(
                token=sampled.token,
                logprob=sampled.logprob,
                bytes=sampled.bytes,
                top_logprobs=[item(lp) for lp in entry.top[:num_top]],
            )
        )
    return ChatLogprobs(content=content)


def response_logprobs(
    entries: Sequence[TokenLogprobs], num_top: int, texts: TokenTexts
) -> list[dict[str, object]]:
    """The Responses API's `output_text` logprobs: chat's content items (token, logprob,
    bytes, top_logprobs), as plain objects."""
    return [c.model_dump() for c in chat_logprobs(entries, num_top, texts).content]


def completion_logprobs(
    entries: Sequence[TokenLogprobs],
    num_top: int,
    texts: TokenTexts,
    text_offset: int = 0,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """`text_offset` is where the first entry's token starts in the choice's text."""
    out = CompletionLogprobs()
    for entry in entries:
        token = texts.text(entry.sampled.token_id, as_ids)
        out.tokens.append(token)
        out.token_logprobs.append(_finite(entry.sampled.logprob))
        out.text_offset.append(text_offset)
        text_offset += len(token)
        # As vLLM: the top `num_top` alternatives, plus the sampled token when not among them.
        top = {texts.text(lp.token_id, as_ids): _finite(lp.logprob) for lp in entry.top[:num_top]}
        top.setdefault(token, _finite(entry.sampled.logprob))
        out.top_logprobs.append(top)
    return out


def prompt_logprobs(
    entries: Sequence[dict[int, Logprob] | None] | None, texts: TokenTexts, as_ids: bool = False
) -> PromptLogprobs | None:
    """The engine's `RequestOutput.prompt_logprobs` in vLLM's JSON shape."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): PromptTokenLogprob(
                logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=texts.text(t, as_ids)
            )
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def echo_logprobs(
    prompt_token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    num_top: int,
    texts: TokenTexts,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """Completions' logprobs of an echoed prompt (OpenAI: the first token's are null)."""
    out = CompletionLogprobs()
    text_offset = 0
    for token_id, entry in zip(prompt_token_ids, entries, strict=True):
        token = texts.text(token_id, as_ids)
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        text_offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(entry[token_id].logprob))
        top = {
            texts.text(t, as_ids): _finite(lp.logprob)
            for t, lp in entry.items()
            if lp.rank is not None and lp.rank <= num_top
        }
        top.setdefault(token, _finite(entry[token_id].logprob))
        out.top_logprobs.append(top)
    return out


def join_logprobs(first: CompletionLogprobs, then: CompletionLogprobs | None) -> CompletionLogprobs:
    """`then` (generated tokens' logprobs) after `first` (the echoed prompt's)."""
    if then is None:
        return first
    return CompletionLogprobs(
        text_offset=first.text_offset + then.text_offset,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        tokens=first.tokens + then.tokens,
        top_logprobs=first.top_logprobs + then.top_logprobs,
    )
