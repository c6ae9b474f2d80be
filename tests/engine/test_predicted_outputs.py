"""Predicted Outputs (`SamplingParams.prediction_token_ids`, OpenAI's `prediction`): with ngram
speculation the proposer also looks the output up in the prediction, so an output that
follows it is proposed run after run and accepted; the tokens are the unspeculated engine's
with or without a prediction, right or wrong. (REST: tests/router/test_predicted_outputs.py)"""

from __future__ import annotations

import pytest
import torch

from duet.engine import LLM, InvalidInputError, SamplingParams

ENGINE = dict(dtype="float32", load_progress=False, num_kv_blocks=256, max_num_seqs=8)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}  # fmt: skip


def test_a_followed_prediction_is_accepted_and_changes_no_token(tiny_llama: str) -> None:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (12, 30, 7)]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, **ENGINE).generate(prompts, greedy)]

    def run(predictions: list[list[int] | None]) -> tuple[list[list[int]], int, int]:
        llm = LLM(tiny_llama, speculative_config=NGRAM, **ENGINE)
        params = [
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prediction_token_ids=p)
            for p in predictions
        ]
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats.spec_decode
        assert stats is not None
        return (
            [o.outputs[0].token_ids for o in outs],
            stats.num_accepted_tokens,
            stats.num_draft_tokens,
        )

    plain, plain_accepted, _ = run([None] * 3)
    followed, accepted, drafted = run(want)  # the very output, predicted
    wrong, _, _ = run([[7, 8, 9, 10] * 10] * 3)  # a prediction the output never follows
    assert plain == followed == wrong == want
    # An output's first two tokens find no match (the lookup's suffix is 2-3 tokens); after
    # them every guess comes from the prediction and is right: 4 of each 5 tokens a step
    # makes are accepted guesses (the fifth is the verification's own), 30 of 38 per output.
    assert accepted == drafted >= 3 * 28 > plain_accepted


def test_prediction_token_ids_are_checked(tiny_llama: str) -> None:
    with pytest.raises(InvalidInputError) as bad:
        SamplingParams(prediction_token_ids=[1, -2])
    assert bad.value.field == "prediction_token_ids"
    llm = LLM(tiny_llama, speculative_config=NGRAM, **ENGINE)
    with pytest.raises(InvalidInputError) as outside:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, prediction_token_ids=[5, 10**6]))
    assert outside.value.field == "prediction_token_ids"
    assert "the model's vocabulary" in str(outside.value)
