"""Token deltas and prompt logprobs on the wire (wire/deltas.py): ids and logprobs only, and
the router reads back exactly what the decode worker's engine produced."""

from __future__ import annotations

import torch

from duet.engine.outputs import EngineOutput, SampleDelta
from duet.v1 import worker_pb2
from duet.wire.deltas import (
    delta_of,
    prompt_logprobs_from_proto,
    prompt_logprobs_to_proto,
    sample_delta_of,
)


def _over_the_wire(out: EngineOutput, index: int = 0) -> SampleDelta:
    data = delta_of(out).SerializeToString()
    return sample_delta_of(worker_pb2.OutputDelta.FromString(data), index)


def test_a_step_arrives_as_the_engine_made_it():
    logprobs = [(-0.5, [(11, -0.5), (12, -1.25)]), None, (-0.125, [])]
    step = SampleDelta(0, [11, 40, 7], logprobs, "stop", 7)
    out = EngineOutput("r1", [step], finished=True, num_cached_tokens=32)
    assert _over_the_wire(out, index=3) == SampleDelta(3, [11, 40, 7], logprobs, "stop", 7)
    delta = delta_of(out)
    assert delta.num_cached_tokens == 32
    assert [f.name for f, _ in delta.ListFields()] == [
        "token_ids", "logprobs", "finish_reason", "stop_token_id", "num_cached_tokens",
    ]  # fmt: skip


def test_an_embedding_arrives_as_float32():
    vector = [0.5, -0.25, 0.1, 1e-8]
    out = EngineOutput("r1", [SampleDelta(0, [5], None, "length")], True, 0, None, vector)
    delta = worker_pb2.OutputDelta.FromString(delta_of(out).SerializeToString())
    # float32 on the wire, as the base64 encoding of /v1/embeddings sends it anyway
    assert list(delta.embedding) == [float(torch.tensor(v, dtype=torch.float32)) for v in vector]
    assert list(delta_of(EngineOutput("r1", [SampleDelta(0, [5])])).embedding) == []


def test_a_running_step_without_logprobs():
    out = EngineOutput("r1", [SampleDelta(0, [5])])
    assert _over_the_wire(out) == SampleDelta(0, [5], None, None, None)


def test_prompt_logprobs_round_trip():
    entries = [None, (-1.5, 2, [(9, -0.5)]), (-0.25, 1, [])]
    wire = prompt_logprobs_to_proto(entries, [1, 2, 3])
    assert [w.sampled.token_id for w in wire[1:]] == [2, 3]
    assert prompt_logprobs_from_proto(wire) == entries
    assert prompt_logprobs_from_proto([]) is None
