"""JSON-schema strings rewritten so xgrammar compiles them exactly and fast
(`strings_as_patterns` and `bounded_string_rules`, used by engine/structured_output.py;
docs/structured_outputs.md).

NOTE: xgrammar 0.2.8 compiles a plain string to negated classes that accept surrogate code
points (bytes that are not UTF-8, decoded as U+FFFD), and a length-bounded string to
`[^"\\\r\n]{m,n}`, which lets raw control characters through (invalid JSON) and whose masks it
computes at run time. Its pattern path with a positive class gets both right
(tests/engine/test_structured_outputs.py shows the difference).

A length-bounded string is then written as EBNF rules with its closing quote inside them
(`bounded_string_rules`): `q0 ::= "\""`, `qk ::= "\"" | C q(k-1)`. With the quote after the
rules (what a `pattern` gives: `"\"" body "\""`), every token longer than the characters left
could leave the body's rules, so xgrammar checked each such token at run time: 3-15 ms a mask
near the bound (SmolLM2's vocabulary, 2-core Xeon), the whole of structured outputs' cost at
batch 32. With the quote inside, only tokens holding a quote can leave: 0.01 ms, the same
masks."""

from __future__ import annotations

import re
import secrets
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
"""Longest length bound written out as rules (`bounded_string_rules`, or nested optionals in a
pattern: `string_pattern`); past it the bound stays `{m,n}`, exact but with masks computed at
run time. Rules cost compile time, about 10 ms per character of the bound (1.2 s at 128), once
per schema (compiles are cached)."""

# The JSON string character of `_JSON_CHAR` in xgrammar's EBNF (which reads \u and \U escapes).
_JSON_CHAR_EBNF = (
    r'[ !#-\[\]-\ud7ff\ue000-\U0010ffff] | "\\" [\"\\/bfnrt] | '
    r'"\\u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]'
)

_MARK = f"duetbounded{secrets.token_hex(6)}n"
"""Placeholder patterns of bounded strings: random, so no schema can hold one by chance."""

_QUOTE = '"\\""'  # the quote literal as xgrammar prints EBNF


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


def strings_as_patterns(schema: Any, marks: dict[str, tuple[int, int]] | None = None) -> Any:
    """`schema` with each plain string (no pattern, format, enum or const) written as a pattern
    over `_JSON_CHAR` that holds its minLength/maxLength (`string_pattern`). With `marks`, a
    string with a maxLength (up to `_MAX_UNROLLED`) gets a placeholder pattern instead, added
    to `marks` with its (minLength, maxLength): `bounded_string_rules` writes its rules."""
    if isinstance(schema, list):
        return [strings_as_patterns(item, marks) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strings_as_patterns(value, marks) for key, value in schema.items()}
    if out.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(out):
        low, high = out.get("minLength", 0), out.get("maxLength")
        bool_bound = isinstance(low, bool) or isinstance(high, bool)
        if isinstance(low, int) and isinstance(high, int | None) and not bool_bound:
            out.pop("minLength", None)  # else xgrammar names the bad bound
            out.pop("maxLength", None)
            if marks is not None and high is not None and 0 <= low <= high <= _MAX_UNROLLED:
                mark = f"{_MARK}{len(marks)}"
                marks[mark] = (low, high)
                out["pattern"] = f"^{mark}$"
            else:
                out["pattern"] = string_pattern(low, high)
    return out


def bounded_string_rules(ebnf: str, marks: dict[str, tuple[int, int]]) -> str:
    """`ebnf`, xgrammar's print of a schema grammar compiled from `strings_as_patterns(schema,
    marks)`, with each placeholder's string (`"\"" X "\""`, X the placeholder's regex rule)
    written as rules that hold the closing quote (module docstring). Raises ValueError when
    the text is not of that shape."""
    for mark, (low, high) in marks.items():
        found = re.search(rf'^(\w+) ::= Regex\("\^{mark}\$", json_string=true\)\n?', ebnf, re.M)
        if found is None:
            raise ValueError(f"no rule for the placeholder {mark}")
        name = found.group(1)
        ebnf = ebnf[: found.start()] + ebnf[found.end() :]
        quoted = f"{_QUOTE} {name} {_QUOTE}"
        uses = ebnf.count(quoted)
        ebnf = ebnf.replace(quoted, f"{_QUOTE} {name}")
        if uses == 0 or len(re.findall(rf"(?<!\w){name}(?!\w)", ebnf)) != uses:
            raise ValueError(f"the rule {name} is used other than as a whole string")
        if re.search(rf"(?<!\w){name}_d[cqr]\d*(?!\w)", ebnf):
            raise ValueError(f"the rule names {name}_d* are taken")
        ebnf = ebnf.rstrip("\n") + "\n" + "\n".join(_string_rules(name, low, high)) + "\n"
    return ebnf


def _string_rules(name: str, low: int, high: int) -> list[str]:
    """`name` ::= `low` to `high` JSON string characters, then the closing quote."""
    char, optional, required = f"{name}_dc", f"{name}_dq", f"{name}_dr"
    rules = [f"{char} ::= {_JSON_CHAR_EBNF}", f"{optional}0 ::= {_QUOTE}"]
    rules += [f"{optional}{k} ::= {_QUOTE} | ({char} {optional}{k - 1})"
              for k in range(1, high - low + 1)]  # fmt: skip
    rest = f"{optional}{high - low}"
    for j in range(1, low + 1):  # nested: a flat run of required characters was slow
        rules.append(f"{required}{j} ::= {char} {rest}")
        rest = f"{required}{j}"
    rules.append(f"{name} ::= {rest}")
    return rules
