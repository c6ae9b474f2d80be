"""Sampling parameters as protobuf fields (wire/sampling.py): every field a worker applies
arrives exactly (doubles, not JSON text), what the router applies itself never travels, and a
bad value is refused naming its field."""

from __future__ import annotations

import dataclasses

import pytest

from duet.engine import InvalidInputError, SamplingParams, StructuredOutputsParams
from duet.v1 import worker_pb2
from duet.wire.sampling import sampling_from_proto, sampling_to_proto

EVERY_FIELD = SamplingParams(
    max_tokens=77,
    min_tokens=3,
    temperature=0.9,
    top_p=0.95,
    top_k=40,
    min_p=0.05,
    seed=-(1 << 62),
    stop_token_ids=[5, 9],
    ignore_eos=True,
    presence_penalty=-1.5,
    frequency_penalty=0.3,
    repetition_penalty=1.1,
    logprobs=0,
    prompt_logprobs=20,
    structured_outputs=StructuredOutputsParams(choice=["yes", "no"], reasoning="may_think"),
    logit_bias={0: -100.0, 17: 0.125, 511: 100.0},
    allowed_token_ids=[300, 4, 17],
    cache_salt="tenant-7",
    prediction_token_ids=[8, 8, 2, 511],
)


def _over_the_wire(params: SamplingParams) -> SamplingParams:
    data = sampling_to_proto(params).SerializeToString()
    return sampling_from_proto(worker_pb2.SamplingParams.FromString(data))


@pytest.mark.parametrize(
    "params",
    [
        EVERY_FIELD,
        SamplingParams(),  # the defaults: None stays None, 1.0 stays 1.0
        SamplingParams(max_tokens=None, temperature=0.0, top_k=-1),
        SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "integer"}')),
        SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)),
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+", whitespace=True)),
        SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= "x"')),
    ],
    ids=["every-field", "defaults", "greedy-unbounded", "json", "json-object", "regex", "ebnf"],
)
def test_every_field_arrives_exactly(params):
    assert _over_the_wire(params) == params


@pytest.mark.parametrize("change", [{"n": 2}, {"stop": ["###"]}], ids=["n", "stop-strings"])
def test_what_the_router_applies_never_travels(change):
    with pytest.raises(ValueError, match="the router's"):
        sampling_to_proto(dataclasses.replace(EVERY_FIELD, **change))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_an_embedding_request_arrives_exactly(pooling):
    params = SamplingParams(temperature=0.0, max_tokens=1, pooling=pooling)
    assert _over_the_wire(params) == params
    assert _over_the_wire(SamplingParams(max_tokens=1)).pooling is None


@pytest.mark.parametrize("change", [{"skip_special_tokens": False},
                                    {"include_stop_str_in_output": True}])  # fmt: skip
def test_what_shapes_the_text_stays_with_the_router(change):
    params = dataclasses.replace(EVERY_FIELD, **change)
    assert _over_the_wire(params) == EVERY_FIELD  # the worker sends token ids, never text


def test_a_seed_outside_64_bits_names_the_field():
    with pytest.raises(InvalidInputError) as e:
        sampling_to_proto(SamplingParams(seed=1 << 63))
    assert e.value.field == "seed"


def _defaults(**fields) -> worker_pb2.SamplingParams:
    """What the router sends for `SamplingParams()`, with `fields` changed."""
    message = sampling_to_proto(SamplingParams())
    for name, value in fields.items():
        if name == "structured_outputs":
            message.structured_outputs.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (_defaults(top_p=0.0), "top_p"),
        (_defaults(temperature=-1.0), "temperature"),
        (_defaults(logprobs=21), "logprobs"),
        (_defaults(repetition_penalty=0.0), "repetition_penalty"),
        (
            _defaults(structured_outputs=worker_pb2.WorkerStructuredOutputs(whitespace=True)),
            "structured_outputs",
        ),
        (
            _defaults(structured_outputs=worker_pb2.WorkerStructuredOutputs(json="{not json")),
            "structured_outputs.json",
        ),
    ],
    ids=["top_p", "temperature", "logprobs", "repetition_penalty", "no-kind", "bad-schema"],
)
def test_a_bad_value_from_the_wire_names_its_field(message, field):
    with pytest.raises(InvalidInputError) as e:
        sampling_from_proto(message)
    assert e.value.field == field


def test_a_logit_bias_out_of_range_from_the_wire_names_its_field():
    message = sampling_to_proto(SamplingParams())
    message.logit_bias[3] = 250.0
    with pytest.raises(InvalidInputError) as e:
        sampling_from_proto(message)
    assert e.value.field == "logit_bias"


def test_logit_bias_survives_the_json_form():
    assert SamplingParams.from_json(EVERY_FIELD.to_json()) == EVERY_FIELD
