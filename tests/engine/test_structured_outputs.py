"""Structured outputs in the engine: on a random tiny model only the grammar makes the output
valid, so every sample parsing, matching or being one of the choices is the grammar at work."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from duet.engine import LLM, InvalidInputError, SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"legs": {"type": "integer", "minimum": 0,
                                                          "maximum": 8}}, "required": ["legs"]},
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}  # fmt: skip
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=512)


def so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def test_every_sample_at_temperature_1_follows_its_grammar(llm: LLM) -> None:
    cases = [
        (so(json=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
        (so(json_object=True), lambda t: isinstance(json.loads(t), dict) or 1 / 0),
        (so(regex=r"[a-c]{2,5}-\d{1,3}"), lambda t: re.fullmatch(r"[a-c]{2,5}-\d{1,3}", t) or 1 / 0),
        (so(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so") or 1 / 0),
        (so(grammar='root ::= "(" [0-9]+ ("," [0-9]+)? ")"'),
         lambda t: re.fullmatch(r"\(\d+(,\d+)?\)", t) or 1 / 0),
    ]  # fmt: skip
    for spec, check in cases:
        params = SamplingParams(
            n=8, temperature=1.0, seed=3, max_tokens=300, structured_outputs=spec,
            # a JSON object may nest forever: a bound on depth is the schema's job, not ours
        )  # fmt: skip
        [out] = llm.generate([PROMPT], params)
        assert len(out.outputs) == 8
        for completion in out.outputs:
            if spec.json_object and completion.finish_reason == "length":
                continue
            assert completion.finish_reason == "stop", (spec, completion.text)
            check(completion.text)


def test_greedy_and_seeded_output_does_not_depend_on_the_batch(llm: LLM) -> None:
    spec = so(json=PERSON)
    greedy = SamplingParams(temperature=0, max_tokens=200, structured_outputs=spec)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=200, structured_outputs=spec)
    plain = SamplingParams(temperature=0.7, seed=1, max_tokens=20)
    alone = [llm.generate([PROMPT], p)[0].outputs[0].token_ids for p in (greedy, seeded)]
    batch = llm.generate([PROMPT, PROMPT, [9, 9, 9]], [greedy, seeded, plain])
    assert [o.outputs[0].token_ids for o in batch[:2]] == alone
    assert all(json.loads(o.outputs[0].text) for o in batch[:2])


def test_max_tokens_cuts_with_length_and_stop_strings_cut_with_stop(llm: LLM) -> None:
    spec = so(regex="x{3}y{3}")
    [cut] = llm.generate([PROMPT], SamplingParams(max_tokens=2, structured_outputs=spec))
    assert cut.outputs[0].finish_reason == "length"
    assert len(cut.outputs[0].token_ids) == 2 and "xxxyyy".startswith(cut.outputs[0].text)
    [stopped] = llm.generate(
        [PROMPT], SamplingParams(max_tokens=50, stop=["y"], structured_outputs=spec)
    )
    assert (stopped.outputs[0].text, stopped.outputs[0].finish_reason) == ("xxx", "stop")
    [full] = llm.generate(
        [PROMPT], SamplingParams(max_tokens=50, ignore_eos=True, structured_outputs=spec)
    )
    # The grammar ends the request on its EOS even with ignore_eos.
    assert (full.outputs[0].text, full.outputs[0].finish_reason) == ("xxxyyy", "stop")
    assert full.outputs[0].token_ids[-1] in llm.tokenizer.eos_token_ids


def test_logprobs_are_reported_for_constrained_tokens(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=20, logprobs=2, structured_outputs=so(choice=["ab", "ba"])
    )
    [out] = llm.generate([PROMPT], params)
    completion = out.outputs[0]
    assert completion.text in ("ab", "ba")
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)
    assert all(lp.sampled.logprob <= 0 and len(lp.top) == 2 for lp in completion.logprobs)
    assert [lp.sampled.token_id for lp in completion.logprobs] == completion.token_ids


def test_compiled_grammars_are_cached_by_key(llm: LLM) -> None:
    compiler = llm.engine.grammar_compiler
    before = (compiler.num_compiled, compiler.num_cache_hits)
    spec = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    params = SamplingParams(n=3, max_tokens=30, structured_outputs=so(json=spec))
    llm.generate([PROMPT], params)
    # A dict with its keys in another order is the same schema, hence the same key.
    reordered = dict(reversed(list(spec.items())))
    llm.generate([PROMPT], SamplingParams(max_tokens=30, structured_outputs=so(json=reordered)))
    assert (compiler.num_compiled, compiler.num_cache_hits) == (before[0] + 1, before[1] + 3)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(json='{"type": "strng"}'), "structured_outputs.json"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(regex="(ab"), "structured_outputs.regex"),
        (dict(grammar="root ::= missing_rule"), "structured_outputs.grammar"),
        # xgrammar's message quotes half a UTF-8 character: found by the REST fuzz test
        (dict(grammar="\u00c1\u0093?\u00b0"), "structured_outputs.grammar"),
        (dict(choice=[]), "structured_outputs.choice"),
        (dict(choice=["a", 3]), "structured_outputs.choice"),
        (dict(), "structured_outputs"),
        (dict(regex="a", choice=["a"]), "structured_outputs"),
    ],
)
def test_invalid_specs_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidInputError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.field == field


def test_the_spec_travels_as_json_and_unknown_keys_are_refused() -> None:
    params = SamplingParams(structured_outputs={"regex": "a+", "whitespace": False})
    again = SamplingParams.from_json(params.to_json())
    assert again.structured_outputs == so(regex="a+")
    assert json.loads(params.to_json())["structured_outputs"] == {"regex": "a+"}
    with pytest.raises(InvalidInputError) as e:
        SamplingParams(structured_outputs={"regexp": "a+"})
    assert e.value.field == "structured_outputs.regexp"


def test_a_replayed_output_resumes_the_grammar(llm: LLM) -> None:
    compiler = llm.engine.grammar_compiler
    tok = llm.tokenizer
    spec = so(regex="xxx(yyy|zzz)")
    head = tok.encode("xxxy", add_special_tokens=False)
    state = compiler.new_state(spec, PROMPT + head, len(head))
    assert not state.rejected and not state.is_terminated
    with pytest.raises(InvalidInputError) as e:
        compiler.new_state(spec, PROMPT + tok.encode("xq", add_special_tokens=False), 2)
    assert e.value.field == "num_replayed"


def test_rows_filled_together_equal_rows_filled_one_at_a_time(llm: LLM) -> None:
    """`GrammarState.fill_bitmasks` (xgrammar's threads) writes each row's own mask, exactly."""
    from duet.engine.structured_output import GrammarState, bitmask_words

    compiler = llm.engine.grammar_compiler
    params = SamplingParams(n=5, temperature=1.0, seed=11, max_tokens=40,
                            structured_outputs=so(json=PERSON))  # fmt: skip
    [out] = llm.generate([PROMPT], params)
    states = []
    for i, completion in enumerate(out.outputs):  # each at another point of its object
        state = compiler.new_state(so(json=PERSON))
        assert all(map(state.accept, completion.token_ids[: 1 + 6 * i]))
        states.append(state)
    together = torch.full((9, bitmask_words(llm.engine.arch.vocab_size)), -1, dtype=torch.int32)
    alone = together.clone()
    rows = [(2 * i, state) for i, state in enumerate(states)]
    GrammarState.fill_bitmasks(together, rows)
    for row, state in rows:
        state.fill_bitmask(alone, row)
    assert torch.equal(together, alone)
    assert len({tuple(together[row].tolist()) for row, _ in rows}) > 2  # the states differ
    assert (together[1::2] == -1).all()  # rows without a grammar untouched


@pytest.mark.parametrize("vocab", [32, 49152, 1000])
def test_the_cpu_bitmask_kernel_equals_xgrammars(vocab: int) -> None:
    """duet's C++ mask (whole words at a time) sets exactly the logits xgrammar's own kernel
    sets: random words, all-allowed and none-allowed rows, a partial last word, strided rows."""
    from duet.engine.kernels.cpu import load_cpu_kernels
    from duet.engine.structured_output import apply_bitmask, bitmask_words

    assert load_cpu_kernels() is not None  # else apply_bitmask is xgrammar's: nothing proven
    gen = torch.Generator().manual_seed(vocab)
    words = bitmask_words(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=gen, dtype=torch.int32)
    bitmask[1] = -1  # every token allowed (a row without a grammar)
    bitmask[2] = 0  # none
    bitmask[3, ::2] = 0
    wide = torch.randn(5, vocab + 7, generator=gen)
    ours, theirs = wide[:, :vocab], wide[:, :vocab].contiguous()  # ours: row stride > vocab
    apply_bitmask(ours, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab)
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours[2]).all() and not torch.isinf(ours[1]).any()
    allowed = ((bitmask[0, torch.arange(vocab) // 32] >> (torch.arange(vocab) % 32)) & 1) == 1
    assert torch.equal(~torch.isinf(ours[0]), allowed)


@pytest.mark.slow
def test_200_samples_at_temperature_1_all_validate(llm: LLM) -> None:
    """The issue's bar: 100% of 200 samples valid on a random model (the grammar's doing)."""
    params = SamplingParams(
        n=200, temperature=1.0, seed=7, max_tokens=300, structured_outputs=so(json=PERSON)
    )
    [out] = llm.generate([PROMPT], params)
    assert len(out.outputs) == 200
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_mask_is_applied_on_the_gpu(tiny_llama: str) -> None:
    cuda = LLM(tiny_llama, device="cuda", dtype="float32", load_progress=False, num_kv_blocks=512)
    params = SamplingParams(
        n=8, temperature=1.0, seed=3, max_tokens=300, structured_outputs=so(json=PERSON)
    )
    [out] = cuda.generate([PROMPT], params)
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)
    bitmask = cuda.engine.runner.input_batch.sampling._bitmask_dev
    assert bitmask is not None and bitmask.device.type == "cuda"


def _allowed(compiler: object, state: object) -> set[int]:
    from duet.engine.structured_output import bitmask_words

    vocab = compiler.vocab_size  # type: ignore[attr-defined]
    bitmask = torch.zeros((1, bitmask_words(vocab)), dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)  # type: ignore[attr-defined]
    bits = [(int(bitmask[0, i // 32]) >> (i % 32)) & 1 for i in range(vocab)]
    return {i for i, bit in enumerate(bits) if bit}


@pytest.mark.parametrize("reasoning, think", [("thinking", "so: {x"), ("may_think", "<think>{x")])
def test_the_grammar_applies_after_the_thinking_ends(llm: LLM, reasoning: str, think: str) -> None:
    compiler = llm.engine.grammar_compiler
    tok = llm.tokenizer
    spec = so(regex="[0-9]{2}", reasoning=reasoning)
    assert spec.to_dict() == {"regex": "[0-9]{2}", "reasoning": reasoning}
    thinking = tok.encode(think, add_special_tokens=False)
    state = compiler.new_state(spec, thinking, len(thinking))
    free = _allowed(compiler, state)  # thinking: anything but EOS goes
    assert tok.encode("a", add_special_tokens=False)[0] in free
    assert not free & tok.eos_token_ids
    end = tok.encode("</think>", add_special_tokens=False)
    state = compiler.new_state(spec, thinking + end, len(thinking) + len(end))
    after = _allowed(compiler, state)
    digits = {t for t in range(compiler.vocab_size) if re.fullmatch("[0-9]+", tok.decode([t]))}
    assert digits and after == {t for t in digits if len(tok.decode([t])) <= 2}
    # Without the reasoning field the same thinking text is refused by the grammar.
    with pytest.raises(InvalidInputError):
        compiler.new_state(so(regex="[0-9]{2}"), thinking, len(thinking))


def test_proposed_tokens_are_vetted_and_masked_without_moving_the_state(llm: LLM) -> None:
    """Speculation: `valid_prefix` keeps the guesses the grammar allows (never one that ends
    it), and `fill_bitmask` with a draft writes, row by row, exactly the masks of a state that
    took each guess in turn; the state itself is where it was."""
    from duet.engine.structured_output import bitmask_words

    compiler = llm.engine.grammar_compiler
    tok = llm.tokenizer
    spec = so(regex="xxx(yyy|zzz)")
    ids = [tok.encode(c, add_special_tokens=False)[0] for c in "xyzq"]
    x, y, z, q = ids
    eos = min(llm.engine.tokenizer.eos_token_ids)
    state = compiler.new_state(spec)
    assert state.valid_prefix([x, x, q, x]) == 2
    assert state.valid_prefix([x, x, x, z, z, z, eos]) == 6  # the EOS would end the grammar
    assert state.valid_prefix([y]) == 0
    draft = [x, x, x, z]
    words = bitmask_words(512)
    got = torch.zeros((len(draft) + 1, words), dtype=torch.int32)
    state.fill_bitmask(got, 0, draft)
    want = torch.zeros_like(got)
    walker = compiler.new_state(spec)
    for row in range(len(draft) + 1):
        walker.fill_bitmask(want, row)
        if row < len(draft):
            assert walker.accept(draft[row])
    assert torch.equal(got, want)
    assert not torch.equal(got[3], got[4])  # after "xxx" and after "xxxz": different masks
    # Untouched: the state still starts at the beginning.
    assert state.valid_prefix([x, x, x, y, y, y]) == 6
    assert state.accept(x) and not state.rejected
