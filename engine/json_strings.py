"""JSON-schema strings rewritten as patterns xgrammar compiles exactly and fast
(`strings_as_patterns`, used by engine/structured_output.py; docs/structured_outputs.md).

NOTE: xgrammar 0.2.8 compiles a plain string to negated classes that accept surrogate code
points (bytes that are not UTF-8, decoded as U+FFFD), and a length-bounded string to
`[^"\\\r\n]{m,n}`, which lets raw control characters through (invalid JSON) and whose masks it
computes at run time. Its pattern path with a positive class gets both right
(tests/engine/test_structured_outputs.py shows the difference)."""

from __future__ import annotations

from typing import Any

# One JSON string character: a code point other than a quote, backslash, control character or
# surrogate (written as literal characters: xgrammar's regex reads no \U escape), or an escape,
# as one flat alternation. Measured on a 2-core Xeon, SmolLM2's vocabulary: with the escapes
# nested in a group of their own, xgrammar computed each mask inside a string at run time
# (60-80 ms per token); flat, `C*` takes 0.04 ms.
_JSON_CHAR = (
    "([ !#-\\[\\]-\ud7ff\ue000-" + chr(0x10FFFF) + ']|\\\\["\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4})'
)

_MAX_UNROLLED = 128
"""Longest length bound written out as nested optionals (see `string_pattern`); past it the
bound stays `{m,n}`, exact but with masks computed at run time. Unrolling costs compile time,
about 17 ms per character (1.1 s at 64, 3.5 s at 200), once per schema (compiles are cached)."""


def string_pattern(low: int, high: int | None) -> str:
    """A JSON string body of `low` to `high` (None: any number of) characters. xgrammar 0.2.8
    computes every mask of a `{m,n}` repeat at run time (70-80 ms per token inside a string of
    at most 24 characters), so the bounds are written out: `low` characters, then
    `C(C(C)?)?)?`-style optionals up to `high`, rules whose masks it precomputes (0.5 ms)."""
    longest = low if high is None else high
    if low < 0 or (high is not None and high < low) or longest > _MAX_UNROLLED:
        return f"^{_JSON_CHAR}{{{low},{'' if high is None else high}}}$"  # xgrammar checks it
    body = f"{_JSON_CHAR}*" if high is None else ""
    for _ in range(0 if high is None else high - low):
        body = f"({_JSON_CHAR}{body})?"
    for _ in range(low):  # nested too: a flat run of required characters was slow again
        body = f"({_JSON_CHAR}{body})"
    return f"^{body}$"


def strings_as_patterns(schema: Any) -> Any:
    """`schema` with each plain string (no pattern, format, enum or const) written as a pattern
    over `_JSON_CHAR` that holds its minLength/maxLength (`string_pattern`)."""
    if isinstance(schema, list):
        return [strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strings_as_patterns(value) for key, value in schema.items()}
    if out.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(out):
        low, high = out.get("minLength", 0), out.get("maxLength")
        bool_bound = isinstance(low, bool) or isinstance(high, bool)
        if isinstance(low, int) and isinstance(high, int | None) and not bool_bound:
            out.pop("minLength", None)  # else xgrammar names the bad bound
            out.pop("maxLength", None)
            out["pattern"] = string_pattern(low, high)
    return out
