"""Sampling behaviour through the public API: seeds, stop strings, n > 1, penalties."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from duet.engine import LLM, InvalidInputError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", load_progress=False)


def prompts(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 512, (int(k),), generator=g).tolist()
        for k in torch.randint(4, 60, (n,), generator=g)
    ]


def test_seeded_sampling_reproducible_alone_and_in_batch(llm):
    target = prompts(1, seed=42)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params)[0].token_ids
    again = llm.generate([target], params)[0].token_ids
    others = prompts(7, seed=5)
    unseeded = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    batch = llm.generate(
        [*others[:3], target, *others[3:]], [unseeded] * 3 + [params] + [unseeded] * 4
    )
    assert alone == again
    assert batch[3].token_ids == alone
    different_seed = SamplingParams(
        max_tokens=20, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True
    )
    assert llm.generate([target], different_seed)[0].token_ids != alone


def test_greedy_ignores_seed(llm):
    p = prompts(1, seed=3)[0]
    a = llm.generate([p], SamplingParams(max_tokens=10, temperature=0, seed=1, ignore_eos=True))[0]
    b = llm.generate([p], SamplingParams(max_tokens=10, temperature=0, seed=2, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids


def test_top_k_one_is_greedy(llm):
    p = prompts(1, seed=4)[0]
    greedy = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    topk1 = llm.generate(
        [p], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=0, ignore_eos=True)
    )[0]
    assert topk1.token_ids == greedy.token_ids


def test_stop_string_is_cut_from_output(llm):
    p = prompts(1, seed=6)[0]
    free = llm.generate([p], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[4:7]  # a piece of what greedy decoding produces
    first = free.text.find(stop)
    out = llm.generate(
        [p], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.text == free.text[:first]
    assert stop not in out.text


def test_a_stop_string_stays_in_the_text_when_asked(llm):
    p = prompts(1, seed=6)[0]
    free = llm.generate([p], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = free.text[4:7]
    first = free.text.find(stop)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=True)  # fmt: skip
    out = llm.generate([p], params)[0]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    assert out.text == free.text[: first + len(stop)]


def test_stop_token_ids(llm):
    p = prompts(1, seed=7)[0]
    free = llm.generate([p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop_id = free.token_ids[5]
    k = free.token_ids.index(stop_id)
    out = llm.generate(
        [p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    )[0]
    assert out.token_ids == free.token_ids[: k + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_eos_stops_unless_ignored(tiny_model_factory):
    # A model whose EOS is the token greedy decoding emits third.
    base = LLM(tiny_model_factory("llama"), dtype="float32", load_progress=False)
    p = prompts(1, seed=8)[0]
    free = base.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[
        0
    ].token_ids
    eos = free[2]
    k = free.index(eos)
    model = tiny_model_factory("llama", eos_token_id=eos)
    llm = LLM(model, dtype="float32", load_progress=False)
    out = llm.generate([p], SamplingParams(max_tokens=10, temperature=0))[0]
    assert out.token_ids == free[: k + 1] and out.finish_reason == "stop"
    full = llm.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert full.token_ids == free and full.finish_reason == "length"
    min_tok = llm.generate([p], SamplingParams(max_tokens=10, min_tokens=k + 1, temperature=0))[0]
    assert len(min_tok.token_ids) > k + 1


def test_n_samples(llm):
    p = prompts(1, seed=9)[0]
    out = llm.generate(
        [p], SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 16 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    again = llm.generate(
        [p], SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    )[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    greedy = llm.generate([p], SamplingParams(n=2, max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_penalties_change_logits_as_specified(llm):
    p = prompts(1, seed=10)[0]
    base = llm.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[
        0
    ].token_ids
    # A strong presence penalty forbids repeating any generated token while fresh ones remain.
    pen = llm.generate(
        [p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=2.0)
    )[0]
    if len(set(base)) < len(base):
        assert pen.token_ids != base
    rep = llm.generate(
        [p],
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1000.0),
    )[0]
    assert not set(rep.token_ids[:-1]) & set(p)  # prompt tokens are pushed far down
    assert len(set(rep.token_ids)) == len(rep.token_ids)


def test_logit_bias_forces_and_bans_tokens_and_leaves_logprobs_the_models(llm):
    p = prompts(1, seed=11)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    base = llm.generate([p], greedy)[0]
    forced = llm.generate([p], dataclasses.replace(greedy, logit_bias={17: 100.0}))[0]
    assert forced.token_ids == [17] * 8
    # The logprobs are the model's own, before the bias: the first is what the model gives
    # token 17 after the prompt (its prompt logprob when the prompt continues with it).
    oracle = llm.generate([[*p, 17]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert oracle.prompt_logprobs is not None and forced.outputs[0].logprobs is not None
    expected = oracle.prompt_logprobs[-1]
    assert expected is not None
    first = forced.outputs[0].logprobs[0].sampled
    assert first.token_id == 17
    assert first.logprob == pytest.approx(expected[17].logprob, abs=1e-4)
    assert first.logprob < base.outputs[0].logprobs[0].sampled.logprob  # not the top choice
    banned = base.token_ids[0]
    out = llm.generate([p], dataclasses.replace(greedy, logit_bias={banned: -100.0}))[0]
    assert banned not in out.token_ids
    assert out.token_ids[0] != base.token_ids[0]


def test_logit_bias_sampling_is_deterministic_alone_and_in_a_batch(llm):
    target = prompts(1, seed=12)[0]
    bias = {t: 5.0 for t in range(100, 140)}
    params = SamplingParams(
        max_tokens=16, temperature=1.0, seed=77, ignore_eos=True, logit_bias=bias
    )
    alone = llm.generate([target], params)[0].token_ids
    others = prompts(3, seed=13)
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    batch = llm.generate([others[0], target, *others[1:]], [plain, params, plain, plain])
    assert batch[1].token_ids == alone
    # The bias holds: 40 of 512 tokens carry e^5 (~148x) the weight, so most draws are theirs.
    assert sum(100 <= t < 140 for t in alone) >= 12
    # The unbiased rows of the batch are untouched.
    assert batch[0].token_ids == llm.generate([others[0]], plain)[0].token_ids


def test_allowed_token_ids_greedy_takes_the_best_allowed_token(llm):
    p = prompts(1, seed=14)[0]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    base = llm.generate([p], greedy)[0]
    allowed = [7, 99, 250, 401, 511, base.token_ids[1]]
    assert base.token_ids[0] not in allowed
    out = llm.generate([p], dataclasses.replace(greedy, allowed_token_ids=allowed))[0]
    assert set(out.token_ids) <= set(allowed) and out.token_ids[0] != base.token_ids[0]
    # The same as a +100 bias on the allowed ids, which outweighs every logit of this model:
    # the argmax over the allowed tokens, with the model's own logprobs.
    bias = {t: 100.0 for t in allowed}
    biased = llm.generate([p], dataclasses.replace(greedy, logit_bias=bias))[0]
    assert out.token_ids == biased.token_ids
    assert out.outputs[0].logprobs == biased.outputs[0].logprobs


def test_allowed_token_ids_sampling_is_deterministic_alone_and_in_a_batch(llm):
    target = prompts(1, seed=15)[0]
    allowed = list(range(200, 204))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True,
                            allowed_token_ids=allowed)  # fmt: skip
    alone = llm.generate([target], params)[0].token_ids
    assert set(alone) <= set(allowed) and len(set(alone)) > 1
    others = prompts(3, seed=16)
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    batch = llm.generate([others[0], target, *others[1:]], [plain, params, plain, plain])
    assert batch[1].token_ids == alone
    assert batch[0].token_ids == llm.generate([others[0]], plain)[0].token_ids


@pytest.mark.parametrize(
    ("ids", "message"),
    [([], "non-empty list"), ([3, -1], "integers >= 0"), ([True], "integers >= 0"),
     ("7", "non-empty list")],
)  # fmt: skip
def test_bad_allowed_token_ids_name_the_field(ids, message):
    with pytest.raises(InvalidInputError, match=message) as e:
        SamplingParams(allowed_token_ids=ids)
    assert e.value.field == "allowed_token_ids"


@pytest.mark.parametrize("salt", ["", 7])
def test_a_bad_cache_salt_names_the_field(salt):
    with pytest.raises(InvalidInputError, match="non-empty string") as e:
        SamplingParams(cache_salt=salt)
    assert e.value.field == "cache_salt"


def test_allowed_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(InvalidInputError, match=r"in \[0, 512\).*got 512") as e:
        llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[3, 512]))
    assert e.value.field == "allowed_token_ids"


def test_blocks_return_to_pool(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not llm.engine.has_unfinished_requests()
