"""Every bad input raises a ValueError subclass naming the field and the allowed range."""

from __future__ import annotations

import pytest

from duet.engine import LLM, EngineConfig, InvalidInputError, ModelLoadError, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        (dict(max_tokens=0), "max_tokens", "must be an integer >= 1; got 0"),
        (dict(temperature=-0.5), "temperature", "must be >= 0; got -0.5"),
        (dict(top_p=0.0), "top_p", "must be in (0, 1]; got 0.0"),
        (dict(top_p=1.5), "top_p", "must be in (0, 1]; got 1.5"),
        (dict(top_k=-2), "top_k", "must be -1 (disabled) or an integer >= 0; got -2"),
        (dict(n=0), "n", "must be an integer >= 1; got 0"),
        (dict(min_p=2.0), "min_p", "must be in [0, 1]; got 2.0"),
        (dict(presence_penalty=3.0), "presence_penalty", "must be in [-2, 2]; got 3.0"),
        (dict(frequency_penalty=-3.0), "frequency_penalty", "must be in [-2, 2]; got -3.0"),
        (dict(repetition_penalty=0.0), "repetition_penalty", "must be > 0; got 0.0"),
        (dict(logprobs=21), "logprobs", "must be an integer in [0, 20]; got 21"),
        (dict(stop=[""]), "stop", "must be non-empty strings"),
        (
            dict(logit_bias={5: 100.5}),
            "logit_bias",
            "values must be numbers in [-100, 100]; got 100.5 for token 5",
        ),
        (
            dict(logit_bias={-1: 1.0}),
            "logit_bias",
            "keys must be token ids (integers >= 0); got -1",
        ),
        (dict(logit_bias=[1, 2]), "logit_bias", "must be a map of token ids to numbers"),
    ],
)
def test_bad_sampling_params(kwargs, field, message):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert str(info.value) == f"{field}: {message}"


def test_unknown_config_key():
    with pytest.raises(InvalidInputError) as info:
        EngineConfig.from_kwargs(max_num_seq=4)
    assert info.value.field == "max_num_seq"
    assert "unknown config key" in str(info.value) and "max_num_seqs" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(dtype="int8"), "dtype"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(load_format="pt"), "load_format"),
    ],
)
def test_bad_config_values(kwargs, field):
    with pytest.raises(InvalidInputError) as info:
        EngineConfig(**kwargs)
    assert info.value.field == field


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # max_position_embeddings is 1024 in the tiny models; cap the context lower to test it.
    return LLM(tiny_llama, dtype="float32", max_model_len=128, load_progress=False)


def test_empty_prompt(llm):
    for empty in ("", []):
        with pytest.raises(InvalidInputError) as info:
            llm.generate([empty])
        assert info.value.field == "prompt"
        assert str(info.value) == "prompt: must not be empty"


def test_prompt_plus_max_tokens_beyond_context(llm):
    with pytest.raises(InvalidInputError) as info:
        llm.generate([[5] * 100], SamplingParams(max_tokens=50))
    assert info.value.field == "max_tokens"
    assert "max_tokens must be <= 28" in str(info.value)
    with pytest.raises(InvalidInputError) as info:
        llm.generate([[5] * 128])
    assert info.value.field == "prompt" and "at most 127" in str(info.value)


def test_token_ids_out_of_vocab(llm):
    with pytest.raises(InvalidInputError) as info:
        llm.generate([[1, 2, 600]])
    assert info.value.field == "prompt" and "[0, 512)" in str(info.value)


def test_logit_bias_outside_the_vocabulary(llm):
    with pytest.raises(InvalidInputError) as info:
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={511: 1.0, 512: 1.0}))
    assert info.value.field == "logit_bias"
    assert str(info.value) == (
        "logit_bias: token ids must be in [0, 512) (the model's vocabulary); got 512"
    )
    assert not llm.engine.has_unfinished_requests()


def test_bad_prompt_in_batch_queues_nothing(llm):
    with pytest.raises(InvalidInputError):
        llm.generate([[1, 2, 3], ""])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_unknown_llm_kwarg(tiny_llama):
    with pytest.raises(InvalidInputError) as info:
        LLM(tiny_llama, blocksize=8)
    assert info.value.field == "blocksize"


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture(tiny_model_factory, tmp_path):
    import json
    import shutil

    src = tiny_model_factory("llama")
    dst = tmp_path / "gpt"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as info:
        LLM(str(dst))
    msg = str(info.value)
    assert "GPTNeoXForCausalLM" in msg
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in msg


def _tokenizer(normalizer=None, pre_tokenizer=None, byte_fallback=True):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from duet.engine.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abab": 4}
    tok = HFTokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")], unk_token="<unk>",
                                 byte_fallback=byte_fallback))  # fmt: skip
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    return Tokenizer(tok)


def test_a_character_bound_only_where_every_character_stays_in_a_token():
    from tokenizers import normalizers, pre_tokenizers

    from duet.engine.request_checks import check_prompt_chars

    keeps = _tokenizer(normalizers.Sequence([normalizers.Prepend("_"),
                                             normalizers.Replace(" ", "_")]))  # fmt: skip
    assert keeps.max_token_chars == 5  # "<unk>": the longest entry
    check_prompt_chars(keeps, "ab" * 50, 20)  # 100 characters: 20 tokens could hold them
    with pytest.raises(InvalidInputError) as info:
        check_prompt_chars(keeps, "a" * 101, 20, "messages")
    assert info.value.field == "messages"
    assert str(info.value) == (
        "messages: has 101 characters, so at least 21 tokens (a token is at most 5 "
        "characters); the model's context is 20"
    )
    for dropping in (
        _tokenizer(normalizers.NFKC()),  # composes characters
        _tokenizer(normalizers.Strip()),
        _tokenizer(pre_tokenizer=pre_tokenizers.Whitespace()),  # drops whitespace
        _tokenizer(byte_fallback=False),  # a run of unknown characters: one token
    ):
        assert dropping.max_token_chars is None
        check_prompt_chars(dropping, "a" * 10_000, 20)  # no bound: tokenizing decides
