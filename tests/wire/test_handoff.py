"""The prefill hand-off (wire/handoff.py): typed at both ends, JSON in kv_transfer's hands,
and a malformed one refused rather than continued from a wrong token."""

from __future__ import annotations

import json

import pytest

from duet.engine.prefill_handoff import PrefillDone
from duet.wire.handoff import PrefillHandoff


def _through_json(meta):
    return json.loads(json.dumps(meta))  # as tcp and torch_dist carry it


def test_it_survives_kv_transfers_json():
    done = PrefillDone("r1", [4, 5], 17, (-0.25, [(17, -0.25), (3, -2.0)]), 1234, 16)
    handoff = PrefillHandoff.of(done)
    assert PrefillHandoff.from_meta(_through_json(handoff.to_meta())) == handoff
    assert handoff == PrefillHandoff(17, (-0.25, [(17, -0.25), (3, -2.0)]), 1234, 16)


def test_without_logprobs():
    handoff = PrefillHandoff(3, None, 0, 0)
    assert PrefillHandoff.from_meta(_through_json(handoff.to_meta())) == handoff


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        (None, "unexpected fields"),
        ({"first_token": 3}, "unexpected fields"),
        ({"first_token": 3, "logprob": None, "sample_seed": 1, "num_cached_tokens": 0, "x": 1},
         "unexpected fields"),
        ({"first_token": -1, "logprob": None, "sample_seed": 1, "num_cached_tokens": 0},
         "bad token"),
        ({"first_token": "3", "logprob": None, "sample_seed": 1, "num_cached_tokens": 0},
         "bad token"),
        ({"first_token": 3, "logprob": None, "sample_seed": None, "num_cached_tokens": 0},
         "bad token"),
        ({"first_token": 3, "logprob": [0.5], "sample_seed": 1, "num_cached_tokens": 0},
         "bad logprob"),
    ],
    ids=["none", "missing", "extra", "negative", "string", "no-seed", "logprob"],
)  # fmt: skip
def test_a_malformed_one_is_refused(meta, why):
    with pytest.raises(ValueError, match=why):
        PrefillHandoff.from_meta(meta)
