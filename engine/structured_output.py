"""Structured outputs: a grammar (JSON schema, any JSON object, regex, a choice of strings, or
EBNF) that constrains a request's tokens, enforced with xgrammar (docs/structured_outputs.md).

- `StructuredOutputsParams`: what a request asks for, validated on construction (it travels
  inside `SamplingParams`, so through every worker as JSON).
- `GrammarCompiler`: one per engine; compiles a spec against the tokenizer, cached by key.
- `GrammarState`: one per running sequence; accepts each token the sequence gets and fills the
  sequence's row of the token bitmask that the sampler applies to the logits.
"""

from __future__ import annotations

import functools
import importlib
import json as _json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from duet.engine.errors import InvalidInputError
from duet.engine.json_strings import bounded_string_rules, strings_as_patterns

if TYPE_CHECKING:
    import xgrammar as xgr

    from duet.engine.tokenizer import Tokenizer
else:

    class _Xgrammar:  # imported on first use: it imports transformers (2 s of every start)
        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module("xgrammar"), name)

    xgr = _Xgrammar()

logger = logging.getLogger(__name__)

KINDS = ("json", "json_object", "regex", "choice", "grammar")
REASONING_STARTS = (None, "thinking", "may_think")
THINK_START, THINK_END = "<think>", "</think>"

GrammarKey = tuple[str, str, bool, str]

# xgrammar's C++ errors read "[time] /path/file.cc:123: message"; keep the message.
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's `structured_outputs`). Invalid values raise
    `InvalidInputError` naming `structured_outputs.<field>`."""

    json: str | None = None
    """A JSON schema, as JSON text (a dict is serialized): the output is one instance of it."""
    json_object: bool = False
    """The output is any one JSON object."""
    regex: str | None = None
    """The output matches this regular expression in full."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF (GBNF) grammar whose `root` rule the output matches."""
    whitespace: bool = False
    """JSON kinds: allow any whitespace between tokens (off: compact JSON, so a model cannot
    loop on whitespace until max_tokens)."""
    reasoning: str | None = None
    """The grammar applies after the model's thinking: `thinking` (the output starts inside
    it: any text up to `</think>`) or `may_think` (an optional `<think>...</think>` first)."""

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json, sort_keys=True)
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidInputError(
                "structured_outputs",
                f"must set exactly one of {', '.join(KINDS)}; got {given or 'none'}",
            )
        kind = given[0]
        value: Any = getattr(self, kind)
        if kind == "json":
            _check_str("json", value)
            try:
                _json.loads(value)
            except ValueError as e:
                raise InvalidInputError("structured_outputs.json", f"is not JSON: {e}") from None
        elif kind == "json_object":
            if value is not True:
                raise InvalidInputError("structured_outputs.json_object", "must be true")
        elif kind == "choice":
            if not isinstance(value, list) or not value:
                raise InvalidInputError("structured_outputs.choice", "must be a non-empty list")
            if not all(isinstance(c, str) and c for c in value):
                raise InvalidInputError("structured_outputs.choice", "must be non-empty strings")
        else:
            _check_str(kind, value)
        if not isinstance(self.whitespace, bool):
            raise InvalidInputError("structured_outputs.whitespace", "must be a boolean")
        if self.reasoning not in REASONING_STARTS:
            raise InvalidInputError(
                "structured_outputs.reasoning", "must be null, 'thinking' or 'may_think'"
            )
        build_grammar(self)  # refuse what does not compile, before any worker sees it

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> GrammarKey:
        """(kind, value, whitespace, reasoning): equal keys compile to the same grammar (the
        cache key)."""
        kind = self.kind
        value = getattr(self, kind)
        text = _json.dumps(value) if kind == "choice" else "" if kind == "json_object" else value
        return (kind, text, self.whitespace, self.reasoning or "")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in KINDS if getattr(self, k)}
        if self.whitespace:
            out["whitespace"] = True
        if self.reasoning:
            out["reasoning"] = self.reasoning
        return out

    @classmethod
    def from_dict(cls, data: object) -> StructuredOutputsParams:
        if not isinstance(data, dict):
            raise InvalidInputError("structured_outputs", "must be an object")
        unknown = sorted(set(data) - {*KINDS, "whitespace", "reasoning"})
        if unknown:
            raise InvalidInputError(f"structured_outputs.{unknown[0]}", "is not a known field")
        return cls(**data)


def _check_str(kind: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"structured_outputs.{kind}", "must be a non-empty string")


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The tokenizer-independent grammar; raises `InvalidInputError` naming the field when it
    does not compile (a bad schema, regex or EBNF)."""
    grammar = _build_output_grammar(params)
    if params.reasoning is None:
        return grammar
    # Thinking is free text up to </think>: xgrammar's any_text stops at the first end tag.
    begin = "" if params.reasoning == "thinking" else THINK_START
    tag = {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": THINK_END}
    thinking = xgr.Grammar.from_structural_tag(
        _json.dumps({"type": "structural_tag", "format": tag})
    )
    after = xgr.Grammar.concat(thinking, grammar)
    return after if params.reasoning == "thinking" else xgr.Grammar.union(after, grammar)


def _build_output_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    kind = params.kind
    try:
        if kind == "json":
            assert params.json is not None
            return _json_schema_grammar(_json.loads(params.json), params.whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=params.whitespace
            )
        if kind == "regex":
            assert params.regex is not None
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            # json.dumps escapes quotes, backslashes and non-ASCII the way EBNF strings read.
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(_json.dumps(c) for c in params.choice)
            )
        assert params.grammar is not None
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, UnicodeDecodeError) as e:
        # xgrammar decodes its C++ message as UTF-8: where it quotes a byte cut from a
        # non-ASCII grammar (Unexpected character: \xc3), decoding fails and that
        # UnicodeDecodeError carries the message's bytes.
        text = e.object.decode("utf-8", "replace") if isinstance(e, UnicodeDecodeError) else str(e)
        message = _XGR_PREFIX.sub("", (text.strip().splitlines() or [""])[0]).strip()
        raise InvalidInputError(
            f"structured_outputs.{kind}", f"does not compile: {message}"
        ) from None


def _json_schema_grammar(schema: Any, whitespace: bool) -> xgr.Grammar:
    """xgrammar's grammar of `schema`, its strings rewritten (engine/json_strings.py): plain
    strings as patterns, length-bounded ones as rules that hold their closing quote."""
    marks: dict[str, tuple[int, int]] = {}
    text = _json.dumps(strings_as_patterns(schema, marks), ensure_ascii=False)
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=whitespace)
    if not marks:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(bounded_string_rules(str(grammar), marks))
    except ValueError as e:  # xgrammar printed another shape: the patterns are exact too
        logger.warning("bounded strings kept as patterns (slower masks): %s", e)
        text = _json.dumps(strings_as_patterns(schema), ensure_ascii=False)
        return xgr.Grammar.from_json_schema(text, any_whitespace=whitespace)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: `vocab_size` entries (the logits' width); special
    tokens and ids past the tokenizer are empty strings, which xgrammar never allows, except
    the EOS ids, which it allows exactly where the grammar may end."""
    backend = tokenizer.backend
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    vocab = [""] * vocab_size
    for text, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            vocab[token_id] = text
    for token_id, added in backend.get_added_tokens_decoder().items():
        if added.special and token_id < vocab_size:
            vocab[token_id] = ""
    stops = sorted(t for t in tokenizer.eos_token_ids if t < vocab_size)
    return xgr.TokenizerInfo(
        vocab,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stops or None,
        add_prefix_space=meta["add_prefix_space"],
    )


class GrammarCompiler:
    """Compiles specs against one tokenizer; the last `cache_size` compiled grammars are kept by
    key (LRU). Thread-safe: `compile` may run off the engine thread (`AsyncEngine` compiles a
    new spec on a worker thread before the request reaches the engine)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        # Built on the first compile: xgrammar's view of a large vocabulary takes a while.
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[GrammarKey, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_cache_hits = 0

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        with self._lock:
            hit = self._cache.get(params.key)
            if hit is not None:
                self._cache.move_to_end(params.key)
                self.num_cache_hits += 1
                return hit
            if self._compiler is None:
                info = tokenizer_info(self._tokenizer, self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            compiler = self._compiler
        # Outside the lock: a long compile does not hold up cache hits on the engine thread.
        compiled = compiler.compile_grammar(build_grammar(params))
        with self._lock:
            self.num_compiled += 1
            self._cache[params.key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_state(
        self, params: StructuredOutputsParams, prompt: Sequence[int] = (), num_replayed: int = 0
    ) -> GrammarState:
        """A sequence's state at its start, or, with `num_replayed`, after the last that many
        tokens of `prompt` (its own output before a lost worker); `InvalidInputError` when
        they do not follow the grammar."""
        state = GrammarState(xgr.GrammarMatcher(self.compile(params)))
        replayed = list(prompt[len(prompt) - num_replayed :]) if num_replayed > 0 else []
        if num_replayed > len(prompt) or not all(map(state.accept, replayed)):
            raise InvalidInputError(
                "num_replayed",
                f"the prompt's last {num_replayed} tokens do not follow the grammar of "
                f"structured_outputs.{params.kind}",
            )
        return state


class GrammarState:
    """One sequence's position in its grammar. Every token the sequence gets goes through
    `accept`, in order (the first token from a prefill worker and replayed output included)."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher
        self.rejected = False
        """A token the grammar does not allow was accepted (an internal fault)."""

    def accept(self, token_id: int) -> bool:
        if self._matcher.is_terminated():
            return True  # the EOS that ended it (or one past it): nothing more to match
        ok = bool(self._matcher.accept_token(token_id))
        self.rejected = self.rejected or not ok
        return ok

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was taken: the sequence ends here."""
        return bool(self._matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, draft: Sequence[int] = ()) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32, one bit per token) and,
        for a speculating sequence, into `bitmask[row + j + 1]` the tokens allowed after
        `draft[: j + 1]` (every proposed token must have passed `valid_prefix`). The state is
        unchanged afterwards."""
        matcher = self._matcher
        matcher.fill_next_token_bitmask(bitmask, row)
        for j, token in enumerate(draft):
            if not matcher.accept_token(token):
                matcher.rollback(j)
                raise ValueError(f"proposed token {token} is outside the grammar")
            matcher.fill_next_token_bitmask(bitmask, row + j + 1)
        if draft:
            matcher.rollback(len(draft))

    @staticmethod
    def fill_bitmasks(bitmask: torch.Tensor, rows: Sequence[tuple[int, GrammarState]]) -> None:
        """`fill_bitmask` (no draft) of each (row, state), on xgrammar's threads, one per
        intra-op thread: the engine thread runs no kernels meanwhile. The same bits as one row
        at a time."""
        if len(rows) < 2:
            for row, state in rows:
                state.fill_bitmask(bitmask, row)
            return
        _batch_matcher().batch_fill_next_token_bitmask(
            [state._matcher for _, state in rows], bitmask, [row for row, _ in rows]
        )

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows from here, stopping before a token
        that would end it (a guess past the end could not be verified against a mask). The
        state is unchanged afterwards."""
        matcher = self._matcher
        if matcher.is_terminated():
            return 0
        n = 0
        for token in tokens:
            if not matcher.accept_token(token):
                break
            if matcher.is_terminated():
                matcher.rollback(1)
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    return xgr.BatchGrammarMatcher(max(1, torch.get_num_threads()))


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return -(-vocab_size // 32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the disallowed tokens' logits [N, V] to -inf in place; `bitmask` [N, words] int32 on
    the logits' device (rows without a grammar hold all ones). fp32 on the CPU: duet's kernel
    (engine/kernels/sampling_cpu.cpp: whole words at a time, rows in parallel); else
    xgrammar's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        from duet.engine.kernels.cpu import load_cpu_kernels

        kernels = load_cpu_kernels()
        if kernels is not None and logits.stride(-1) == 1 and bitmask.is_contiguous():
            kernels.apply_token_bitmask(logits, bitmask)
            return
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
