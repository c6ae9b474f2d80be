"""The engine flags of `duet serve`, `duet generate` and `duet chat`, generated from
`EngineConfig`'s fields so the two never drift: one flag per field, spelled as vLLM users type
it (`block_size` -> `--block-size`), its help the field's docstring, its type the field's.

Every flag defaults to None, meaning "not given": only the flags given reach `EngineConfig`,
whose own defaults apply to the rest. A value `EngineConfig.__post_init__` refuses is an
argparse error naming the flag (exit code 2, no traceback).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import json
import re
import textwrap
import typing
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NoReturn

from duet.engine.config import (
    ATTENTION_BACKENDS,
    CUDA_GRAPH_MODES,
    DEVICES,
    DTYPES,
    LOAD_FORMATS,
    PREFILL_ATTENTIONS,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from duet.engine.errors import InvalidInputError
from duet.engine.quant.config import QUANTIZATIONS

# Option strings where the field's name is not what vLLM users type (the first one is the
# canonical spelling, used in error messages).
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    "kv_cache_memory_bytes": ("--kv-cache-memory", "--kv-cache-memory-bytes"),
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    "pipeline_parallel_size": ("--pipeline-parallel-size", "-pp"),
    "data_parallel_size": ("--data-parallel-size", "-dp"),
}
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES,
    "device": DEVICES,
    "attention_backend": ATTENTION_BACKENDS,
    "prefill_attention": PREFILL_ATTENTIONS,
    "scheduling_policy": SCHEDULING_POLICIES,
    "quantization": QUANTIZATIONS,
    "load_format": LOAD_FORMATS,
    "cuda_graph_mode": CUDA_GRAPH_MODES,
}
METAVARS = {"model": "PATH|ID", "tokenizer": "PATH", "kv_cache_memory_bytes": "BYTES"}

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """`4294967296`, `4GiB`, `512MiB`, `1.5GB`: a whole number of bytes (KiB/MiB/GiB/TiB are
    powers of 1024, kB/MB/GB/TB powers of 1000)."""
    match = _BYTES_RE.fullmatch(text)
    unit = match[2].lower() if match else ""
    if match is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"must be a number of bytes, plain or with a unit (KiB, MiB, GiB, TiB, kB, MB, GB, "
            f"TB), e.g. 4GiB; got {text!r}"
        )
    value = Fraction(match[1]) * _BYTE_UNITS[unit]
    if value.denominator != 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of bytes; got {text!r}")
    return int(value)


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON object, e.g. '{"max_position_embeddings": 2048}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}); got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object, e.g. '{{\"max_position_embeddings\": 2048}}'; got {text!r}"
        )
    return value


_TYPE_METAVARS: dict[Any, str] = {int: "N", float: "X", parse_json_object: "JSON", str: "NAME"}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), whitespace
    collapsed to one line, for the fields `cls` itself declares."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_names(name: str) -> tuple[str, ...]:
    """The option strings of field `name`; the first is the one errors name."""
    return FLAG_NAMES.get(name, ("--" + name.replace("_", "-"),))


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _shown(default: Any) -> str:
    if default is None:
        return "unset"
    return default if isinstance(default, str) else json.dumps(default)


def _converter(name: str, annotation: Any) -> Callable[[str], Any] | None:
    """The argparse `type` of a field (None for bools: BooleanOptionalAction)."""
    if name == "kv_cache_memory_bytes":
        return parse_bytes
    base = {a for a in typing.get_args(annotation) if a is not type(None)} or {annotation}
    if bool in base:
        return None
    if int in base:
        return int
    if float in base:
        return float
    if dict in base or any(typing.get_origin(a) is dict for a in (annotation, *base)):
        return parse_json_object
    if str in base:
        return str
    raise TypeError(f"EngineConfig.{name}: no command-line type for {annotation!r}")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field, in a group of their own."""
    group = parser.add_argument_group(
        "engine", "EngineConfig fields (engine/config.py); omitted ones keep its defaults"
    )
    hints = typing.get_type_hints(EngineConfig)
    docs = field_docs(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        default = _default_of(f)
        help_text = f"{docs.get(f.name, '')} (default: {_shown(default)})".replace("%", "%%")
        convert = _converter(f.name, hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if convert is None:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = convert
            if f.name in CHOICES:
                kwargs["choices"] = CHOICES[f.name]
            else:
                kwargs["metavar"] = METAVARS.get(f.name) or _TYPE_METAVARS[convert]
        group.add_argument(*flag_names(f.name), **kwargs)


def given_engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` fields the command line set (absent flags are left out)."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if getattr(args, f.name, None) is not None
    }


def fail_on_field(parser: argparse.ArgumentParser, error: InvalidInputError) -> NoReturn:
    """Report a config error as an argparse error naming the flag of its field (exit 2)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    where = flag_names(error.field)[0] if error.field in names else error.field
    parser.error(f"{where}: {error.message}")


def build_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of the engine flags given, validated: a refused value exits through
    `parser.error`, naming the flag."""
    try:
        return EngineConfig.from_kwargs(**given_engine_flags(args))
    except InvalidInputError as e:
        fail_on_field(parser, e)
