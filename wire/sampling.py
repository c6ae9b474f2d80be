"""`engine.SamplingParams` <-> `duet.v1.SamplingParams` (worker.proto): one sample's
parameters as protobuf fields, never JSON text.

The router's side (`sampling_to_proto`) refuses what a worker would not apply, so nothing is
silently dropped (Predicted Outputs travel: the router sets them only when every decode worker
speculates with ngram): stop strings (and `include_stop_str_in_output`) and `skip_special_tokens`
are the router's (it detokenizes), and `n` is split by the router into samples. The worker's
side (`sampling_from_proto`) validates as the `SamplingParams` constructor does:
`InvalidInputError` naming the field.
"""

from __future__ import annotations

from typing import Any

from duet.engine import InvalidInputError, SamplingParams, StructuredOutputsParams
from duet.v1 import worker_pb2

_INT64 = (-(1 << 63), (1 << 63) - 1)


def sampling_to_proto(params: SamplingParams) -> worker_pb2.SamplingParams:
    """One sample's parameters for a worker. `InvalidInputError` for a seed outside int64;
    `ValueError` for fields the router must have applied itself (a bug, not the client's)."""
    if params.n != 1 or params.stop:
        raise ValueError("a worker takes one sample (n=1) and no stop strings: the router's")
    if params.seed is not None and not _INT64[0] <= params.seed <= _INT64[1]:
        raise InvalidInputError("seed", f"must fit in 64 bits; got {params.seed}")
    message = worker_pb2.SamplingParams(
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop_token_ids=params.stop_token_ids,
        bad_words=params.bad_words,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
    )
    if params.logit_bias:
        message.logit_bias.update(params.logit_bias)
    if params.allowed_token_ids:
        message.allowed_token_ids.extend(params.allowed_token_ids)
    if params.prediction_token_ids:
        message.prediction_token_ids.extend(params.prediction_token_ids)
    if params.pooling is not None:
        message.pooling = params.pooling
    for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs", "cache_salt"):
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    so = params.structured_outputs
    if so is not None:
        out = message.structured_outputs
        if so.choice is not None:
            out.choice.choices.extend(so.choice)
        else:
            setattr(out, so.kind, getattr(so, so.kind))
        out.whitespace = so.whitespace
        out.reasoning = so.reasoning or ""
    return message


def sampling_from_proto(message: worker_pb2.SamplingParams) -> SamplingParams:
    """A worker's view of the parameters the router sent; `InvalidInputError` naming the
    field for a value out of range or a grammar that does not compile."""

    def optional(name: str) -> Any:
        return getattr(message, name) if message.HasField(name) else None

    structured = None
    if message.HasField("structured_outputs"):
        so = message.structured_outputs
        kind = so.WhichOneof("kind")
        if kind is None:
            raise InvalidInputError("structured_outputs", "names no kind")
        value: Any = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
        structured = StructuredOutputsParams.from_dict(
            {kind: value, "whitespace": so.whitespace, "reasoning": so.reasoning or None}
        )
    return SamplingParams(
        max_tokens=optional("max_tokens"),
        seed=optional("seed"),
        logprobs=optional("logprobs"),
        prompt_logprobs=optional("prompt_logprobs"),
        cache_salt=optional("cache_salt"),
        min_tokens=message.min_tokens,
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        min_p=message.min_p,
        stop_token_ids=list(message.stop_token_ids),
        bad_words=list(message.bad_words),
        ignore_eos=message.ignore_eos,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty,
        structured_outputs=structured,
        logit_bias=dict(message.logit_bias) or None,
        allowed_token_ids=list(message.allowed_token_ids) or None,
        prediction_token_ids=list(message.prediction_token_ids) or None,
        pooling=message.pooling or None,
    )
