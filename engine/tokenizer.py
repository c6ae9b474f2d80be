"""Tokenizer: HF `tokenizers` plus the model's chat template, and incremental detokenization."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

from duet.engine.errors import InvalidInputError, ModelLoadError

Message = dict[str, Any]


class Tokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        ids = set(eos_token_ids)
        eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        if eos_id is not None:
            ids.add(eos_id)
        self.eos_token_ids = frozenset(ids)
        # Some tokenizer.json files lack the post-processor that adds BOS; add it ourselves.
        self.add_bos_token = add_bos_token
        self._template: jinja2.Template | None = None
        self._request_templates: dict[str, jinja2.Template] = {}
        """Per-request templates, compiled, the 16 last used (LRU by insertion order)."""

    @classmethod
    def from_dir(cls, path: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ModelLoadError(f"no tokenizer.json in {path}")
        tok = tokenizers.Tokenizer.from_file(tok_file)
        cfg: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        bos = _token_str(cfg.get("bos_token"))
        add_bos = bool(cfg.get("add_bos_token", False)) and bos is not None
        if add_bos and bos is not None and _post_processor_adds(tok, bos):
            add_bos = False
        return cls(tok, template, bos, _token_str(cfg.get("eos_token")), eos_token_ids, add_bos)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The HF `tokenizers` object (its vocabulary, for grammar compilation)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for (the longest vocabulary entry),
        so `len(text) / max_token_chars` tokens at least; None where the tokenizer may drop
        or merge characters (a normalizer that composes or strips, a pre-tokenizer that
        splits on whitespace, unknown-character tokens), so no such bound holds."""
        return _max_token_chars(self._tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render messages with the model's template, or `chat_template` instead (as
        transformers does). `continue_final_message`: the text ends inside the last message,
        so generation continues it. `kwargs` are more template variables (`tools`, ...)."""
        _check_messages(messages)
        template = self._compiled(chat_template)
        text = template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1])
        return text

    def _compiled(self, chat_template: str | None) -> jinja2.Template:
        if chat_template is None:
            if self.chat_template is None:
                raise InvalidInputError(
                    "messages", "this model has no chat template; use a plain prompt"
                )
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            return self._template
        compiled = self._request_templates.pop(chat_template, None)
        if compiled is None:
            try:
                compiled = _compile_template(chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise InvalidInputError("chat_template", f"is not a valid template: {e}") from None
        self._request_templates[chat_template] = compiled  # most recent last
        while len(self._request_templates) > 16:
            del self._request_templates[next(iter(self._request_templates))]
        return compiled

    def encode_chat(self, messages: list[Message], **kwargs: Any) -> list[int]:
        # The template already holds BOS where the model wants one.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word's tokens as written (leading blanks
    dropped), and with one leading space where that is a different first token and as many
    tokens (a word that starts a text and one in the middle of it tokenize apart)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


# What keeps every character of the text in some token: normalizers that only add or
# substitute characters one for one (or more), pre-tokenizers that split without dropping any.
_KEEPING_NORMALIZERS = {"Prepend", "NFD", "NFKD", "Lowercase"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def _max_token_chars(tok: tokenizers.Tokenizer) -> int | None:
    spec = json.loads(tok.to_str())
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer")
    byte_level = any(p.get("type") == "ByteLevel" for p in _flat(pre))
    # Every character must have tokens of its own (its bytes), never one shared unknown token.
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    if not all(_keeps_characters(n) for n in _flat(spec.get("normalizer"))):
        return None
    if not all(p.get("type") in _KEEPING_PRE_TOKENIZERS for p in _flat(pre)):
        return None
    vocab = tok.get_vocab(with_added_tokens=True)
    return max((len(t) for t in vocab), default=1) or 1


def _flat(component: dict[str, Any] | None) -> list[dict[str, Any]]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        parts = component.get("normalizers") or component.get("pretokenizers") or []
        return [leaf for part in parts for leaf in _flat(part)]
    return [component]


def _keeps_characters(normalizer: dict[str, Any]) -> bool:
    if normalizer.get("type") == "Replace":  # sentencepiece's " " -> "▁": one for one
        pattern = (normalizer.get("pattern") or {}).get("String")
        return pattern is not None and len(normalizer.get("content", "")) >= len(pattern)
    return normalizer.get("type") in _KEEPING_NORMALIZERS


def _check_messages(messages: list[Message]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("messages", "must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidInputError(f"messages[{i}]", "must be an object with a role and content")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise InvalidInputError(
                f"messages[{i}].role",
                f"must be system, user, assistant, tool or developer; got {m['role']!r}",
            )


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _cut_after_final_message(text: str, final: Message) -> str:
    """`text` up to the end of the last message's content (transformers' rule)."""
    content = final.get("content") or ""
    for needle in (content, content.strip()):
        i = text.rfind(needle)
        if needle and i >= 0:
            return text[: i + len(needle)]
    raise InvalidInputError(
        "continue_final_message",
        "the last message's content does not appear in the rendered chat template",
    )


def _raise_template_error(message: str) -> None:
    raise InvalidInputError("messages", f"chat template: {message}")


def _token_str(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _post_processor_adds(tok: tokenizers.Tokenizer, bos: str) -> bool:
    bos_id = tok.token_to_id(bos)
    return bos_id is not None and tok.encode("a").ids[:1] == [bos_id]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window ending at the new token and emits only text that is complete:
    no half UTF-8 sequence (which decodes to U+FFFD) and the right spacing, since the window
    starts a few tokens back where the tokenizer knows whether a word starts with a space."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-5:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add_token(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
