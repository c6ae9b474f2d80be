"""engine.gguf_tokenizer: the tokenizer a GGUF file describes, against transformers loading the
same file (the embedded SmolLM2, and tiny GGUF files written here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from duet.engine.gguf_loader import GGUFModel, default_model_path, load_gguf
from tests.engine.gguf_files import (
    add_sentencepiece_vocab,
    quick_gguf_reading_in_transformers,
    write_tiny_gguf,
)

# Varied text; the chat markers must stay whole special tokens.
TEXTS = [
    "Hello world!",
    "12345",
    "x = 12345 + 67.89",
    "I ❤️ emoji 🚀🎉",
    "Café naïve façade — déjà vu",
    "def f(x):\n    return x * 2\n\n\tpass",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing  ",
    "日本語のテキスト",
    "don't you'll WE'RE",
    "a\r\nb",
    "x  *  2 and 3\n 4",  # whitespace before a digit: see test_smollm2_tokenizer_splits_digits
]


@pytest.fixture(scope="module")
def smol() -> GGUFModel:
    return load_gguf(default_model_path())


@pytest.fixture(scope="module")
def hf_tokenizer():  # -> transformers tokenizer
    from transformers import AutoTokenizer

    path = default_model_path()
    with quick_gguf_reading_in_transformers():
        return AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path)
        )


def test_smollm2_tokenizer_matches_transformers(smol: GGUFModel, hf_tokenizer) -> None:
    tokenizer = smol.tokenizer()
    for text in TEXTS[:-1]:
        ids = tokenizer.encode(text).ids
        assert ids == hf_tokenizer.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    chat = tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert chat[0] == smol.bos_token_id == 1 and chat[-1] == smol.eos_token_id == 2
    assert (smol.bos_token, smol.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smol.chat_template == hf_tokenizer.chat_template
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template


def test_smollm2_tokenizer_splits_digits(smol: GGUFModel, hf_tokenizer) -> None:
    # NOTE: SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) cut every
    # digit out before GPT-2's split; transformers' GGUF tokenizer skips that step, so it differs
    # where whitespace precedes a digit ("  2": ["ĠĠ", "2"] vs ["Ġ", "Ġ2"]). The oracle is the
    # transformers vocabulary with tokenizer.json's pre-tokenizer.
    oracle = hf_tokenizer.backend_tokenizer
    oracle.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer = smol.tokenizer()
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == oracle.encode(text).ids, text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    space_digit = tokenizer.encode("  2").tokens
    assert space_digit == ["ĠĠ", "2"]


# -- tiny tokenizers against transformers --------------------------------------------------------

TINY_TEXTS = [
    "the hello 123456 world",
    "  12 3\n\n  the\n \n",
    "Hello,  World! 42 it's",
    "<|im_start|>user\nhello<|im_end|>",
    "<think>hello</think>",
    "naïve 日本 🚀",
    "it's  don't\r\n\tthe   hello",
]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_tiny_byte_level_tokenizer_matches_transformers(tmp_path: Path, pre: str) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pre=pre)
    tokenizer = load_gguf(str(path)).tokenizer()
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TINY_TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == reference.encode(text), (pre, text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    think = tokenizer.encode("<think>").ids
    assert len(think) == 1 and tokenizer.decode(think, skip_special_tokens=True) == "<think>"


def test_tiny_smollm_pre_tokenizer_splits_digits(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pre="smollm")
    tokenizer = load_gguf(str(path)).tokenizer()
    # The vocabulary has "12", "123" and "Ġ1", but SmolLM2 never sees digits merged.
    assert tokenizer.encode("x 123").tokens == ["x", "Ġ", "1", "2", "3"]
    assert tokenizer.decode(tokenizer.encode("x 123").ids) == "x 123"


def test_tiny_sentencepiece_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "sp.gguf"
    write_tiny_gguf(path, vocab=add_sentencepiece_vocab)
    tokenizer = load_gguf(str(path)).tokenizer()
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [
        "hello world",
        "hello  world",
        " hello",
        "héllo wörld 🚀",
        "hello\nworld",
        "<s>hello</s> world",
    ]:
        ids = tokenizer.encode(text).ids
        assert ids == reference.encode(text), text
        assert ids[0] == 1  # BOS: SentencePiece GGUFs add it unless they say otherwise
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    assert tokenizer.encode("hello world").tokens == ["<s>", "▁hello", "▁world"]
    assert tokenizer.decode(tokenizer.encode("héllo 🚀").ids) == "héllo 🚀"
