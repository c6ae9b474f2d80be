"""Length-bounded JSON strings under structured outputs: random walks over the allowed tokens
stay valid JSON, lengths hold exactly, and the fast rules (`bounded_string_rules`) mask exactly
as the slow patterns do (split from test_structured_outputs.py, which holds the rest)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from duet.engine import LLM, StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=512)


def test_length_bounded_strings_stay_valid_json(llm: LLM) -> None:
    """Random walks over every allowed token: xgrammar 0.2.8's own string rules let raw control
    characters through (about a third of these walks were invalid JSON) and surrogate code
    points (bytes that are not UTF-8: U+FFFD in the text, and too long a string)."""
    import random

    from duet.engine.structured_output import apply_bitmask, bitmask_words

    compiler = llm.engine.grammar_compiler
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2,
              "maxLength": 6}}, "required": ["s"]}  # fmt: skip
    spec = StructuredOutputsParams(json=schema)
    rng = random.Random(0)
    bitmask = torch.zeros((1, bitmask_words(512)), dtype=torch.int32)
    for _ in range(100):
        state, tokens = compiler.new_state(spec), []
        while not state.is_terminated:
            state.fill_bitmask(bitmask, 0)
            logits = torch.zeros(1, 512)
            apply_bitmask(logits, bitmask)
            token = rng.choice((logits[0] == 0).nonzero()[:, 0].tolist())
            assert state.accept(token)
            tokens.append(token)
        text = llm.tokenizer.decode(tokens)
        assert "\ufffd" not in text
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("low, high", [(0, 3), (2, 5), (3, 3), (2, None), (0, None), (1, 200)])
def test_string_length_bounds_hold_exactly(llm: LLM, low: int, high: int | None) -> None:
    """minLength/maxLength as duet writes them (nested optionals up to 128, `{m,n}` past it):
    a string is accepted exactly when its decoded length is within the bounds, an escape or a
    multi-byte character counting as one."""
    bounds = {"minLength": low} | ({} if high is None else {"maxLength": high})
    schema = {"type": "object", "properties": {"s": {"type": "string", **bounds}},
              "required": ["s"]}  # fmt: skip
    compiled = llm.engine.grammar_compiler.compile(
        StructuredOutputsParams(json=schema, whitespace=False)
    )
    bodies = [
        "",
        "a",
        "ab",
        "abc",
        "a\\nb",
        "\\u00e9x",
        "\u00e9\u00e9\u00e9\u00e9",
        "abcde",
        "abcdef",
        "x" * 199,
        "x" * 201,
    ]
    for body in bodies:
        length = len(json.loads(f'"{body}"'))
        matcher = xgr.GrammarMatcher(compiled)
        accepted = matcher.accept_string('{"s": "' + body + '"}') and matcher.is_completed()
        assert accepted == (low <= length and (high is None or length <= high)), (body, length)


BOUNDED = {
    "type": "object",
    "$defs": {"label": {"type": "string", "minLength": 1, "maxLength": 4}},
    "properties": {
        "a": {"type": "string", "maxLength": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                 "minItems": 1, "maxItems": 3},
        "either": {"anyOf": [{"type": "string", "minLength": 2, "maxLength": 2},
                             {"type": "integer"}]},
        "x": {"$ref": "#/$defs/label"},
        "y": {"$ref": "#/$defs/label"},
        "free": {"type": "string"},
    },
    "required": ["a", "tags", "either", "x", "y", "free"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.mark.parametrize("whitespace", [False, True])
def test_bounded_strings_as_rules_give_the_patterns_masks(llm: LLM, whitespace: bool) -> None:
    """Length-bounded strings written as rules that hold their closing quote
    (`bounded_string_rules`, fast masks) allow exactly the tokens their patterns allow
    (`string_pattern`, the slow masks), at every step of random walks over allowed tokens:
    top level, in an array, in anyOf, a $ref used twice, with and without free whitespace."""
    import random

    from duet.engine.json_strings import strings_as_patterns
    from duet.engine.structured_output import bitmask_words, tokenizer_info

    compiler = llm.engine.grammar_compiler
    spec = StructuredOutputsParams(json=BOUNDED, whitespace=whitespace)
    fast = compiler.compile(spec)
    assert "_dq" in str(fast.grammar)  # the rules, not the fallback to patterns
    text = json.dumps(strings_as_patterns(json.loads(spec.json or "")))  # keys as it sorts them
    vocab = llm.engine.arch.vocab_size
    slow = xgr.GrammarCompiler(tokenizer_info(llm.tokenizer, vocab)).compile_grammar(
        xgr.Grammar.from_json_schema(text, any_whitespace=whitespace)
    )
    words = bitmask_words(vocab)
    rng = random.Random(3)
    num_steps = 0
    for _ in range(30):
        matchers = [xgr.GrammarMatcher(fast), xgr.GrammarMatcher(slow)]
        for _ in range(60):
            masks = [torch.zeros((1, words), dtype=torch.int32) for _ in matchers]
            for matcher, mask in zip(matchers, masks, strict=True):
                matcher.fill_next_token_bitmask(mask, 0)
            assert torch.equal(masks[0], masks[1])
            num_steps += 1
            bits = [(w >> b) & 1 for w in masks[0][0].tolist() for b in range(32)]
            allowed = [t for t, bit in enumerate(bits[:vocab]) if bit]
            token = rng.choice(allowed)
            assert all(m.accept_token(token) for m in matchers)
            if matchers[0].is_terminated():
                break
    assert num_steps > 600
