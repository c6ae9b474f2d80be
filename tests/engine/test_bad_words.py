"""vLLM's `bad_words`: each word tokenized with and without a leading space
(`bad_words_token_ids`), the token each forbids next (`Request.banned_next`: a one-token word
always, a longer word's last token once the output ends with the rest, replayed and proposed
tokens counted as output), and generation that never forms them, greedy, seeded, speculating
or not."""

from __future__ import annotations

import dataclasses

import pytest

from duet.engine import LLM, InvalidInputError, SamplingParams
from duet.engine.request import Request
from duet.engine.tokenizer import bad_words_token_ids


def request_with(words: list[list[int]], prompt: list[int], output: list[int],
                 num_replayed: int = 0) -> Request:  # fmt: skip
    request = Request("r", prompt, SamplingParams(), max_tokens=16)
    request.bad_words_token_ids = words
    request.num_replayed = num_replayed
    for token in output:
        request.append_output_token(token)
    return request


def test_a_one_token_word_is_always_banned_and_a_longer_one_after_its_head():
    words = [[7], [3, 4, 5]]
    assert request_with(words, [1, 2], []).banned_next() == [7]
    assert request_with(words, [1, 2], [9, 3]).banned_next() == [7]
    assert request_with(words, [1, 2], [9, 3, 4]).banned_next() == [7, 5]
    assert request_with(words, [1, 2], [9, 9, 9, 3, 4]).banned_next() == [7, 5]
    assert request_with(words, [1, 2], [3, 4, 9]).banned_next() == [7]
    assert request_with([[7], [8]], [1, 2], [3, 4]).banned_next([9]) == [7, 8]
    # The prompt's tail is not output, unless it is the request's own replayed output.
    assert request_with(words, [1, 3, 4], []).banned_next() == [7]
    assert request_with(words, [1, 3, 4], [], num_replayed=2).banned_next() == [7, 5]
    assert request_with(words, [1, 2], [9, 3], num_replayed=0).banned_next([4]) == [7, 5]


def test_words_are_tokenized_bare_and_after_a_space(tiny_llama):
    tokenizer = LLM(tiny_llama, dtype="float32", load_progress=False).engine.tokenizer
    for word in ("the", "  hello there", "x"):
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        want = [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])
        assert bad_words_token_ids(tokenizer, [word]) == want


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", load_progress=False)


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def a_word_of(tokenizer, tokens: list[int], size: int) -> tuple[str, list[list[int]], int]:
    """A word of `size` tokens that `tokens` holds as it tokenizes: (the word, its sequences,
    where it first ends in `tokens`)."""
    for i in range(len(tokens) - size + 1):
        word = tokenizer.decode(tokens[i : i + size])
        if not word.strip():
            continue
        ids = bad_words_token_ids(tokenizer, [word])
        if all(len(w) == size for w in ids) and any(contains(tokens, w) for w in ids):
            ends = [j for j in range(size - 1, len(tokens))
                    if any(tokens[j - size + 1 : j + 1] == w for w in ids)]  # fmt: skip
            return word, ids, ends[0]
    raise AssertionError(f"no word of {size} tokens in {tokens}")


def test_greedy_output_never_forms_a_bad_word(llm):
    prompt = [5, 80, 200, 31, 9]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    free = llm.generate([prompt], greedy)[0].token_ids
    word, ids, first = a_word_of(llm.engine.tokenizer, free, 2)
    out = llm.generate([prompt], dataclasses.replace(greedy, bad_words=[word]))[0].token_ids
    assert not any(contains(out, w) for w in ids)
    assert out[:first] == free[:first] and out[first] != free[first]  # it turns off just there


def test_a_one_token_bad_word_is_a_ban_on_its_ids(llm):
    prompt = [17, 3, 99, 250]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=4, ignore_eos=True)
    free = llm.generate([prompt], params)[0].token_ids
    word, words, _ = a_word_of(llm.engine.tokenizer, free, 1)
    ids = {w[0] for w in words}
    banned = llm.generate([prompt], dataclasses.replace(params, bad_words=[word]))[0].token_ids
    bias = {t: -100.0 for t in ids}  # -100 outweighs every logit of this model
    biased = llm.generate([prompt], dataclasses.replace(params, logit_bias=bias))[0].token_ids
    assert banned == biased and not ids & set(banned)
    others = [[4, 5, 6], [300, 301]]
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    batch = llm.generate([others[0], prompt, others[1]],
                         [plain, dataclasses.replace(params, bad_words=[word]), plain])  # fmt: skip
    assert batch[1].token_ids == banned  # the same in a batch


def test_speculating_gives_the_tokens_of_not_speculating(tiny_llama, llm):
    # The target as its own draft: its guesses are its free greedy tokens, bad words and all,
    # and verification must turn them down just where a word would form.
    spec = LLM(tiny_llama, dtype="float32", load_progress=False,
               speculative_config={"method": "draft_model", "model": tiny_llama,
                                   "num_speculative_tokens": 4})  # fmt: skip
    prompt = [40, 41, 42, 43] * 6
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free = llm.generate([prompt], greedy)[0].token_ids
    word, _, _ = a_word_of(llm.engine.tokenizer, free[4:], 2)
    params = dataclasses.replace(greedy, bad_words=[word])
    want = llm.generate([prompt], params)[0].token_ids
    assert want != free
    assert spec.generate([prompt], params)[0].token_ids == want
    stats = spec.engine.stats.spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("words", [[""], ["  "], "word", [3]])
def test_bad_words_that_are_not_words_name_the_field(words):
    with pytest.raises(InvalidInputError) as e:
        SamplingParams(bad_words=words)
    assert e.value.field == "bad_words"
