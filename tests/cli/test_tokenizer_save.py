"""`duet tokenizer save DIR`: transformers' AutoTokenizer loads what it writes and encodes,
decodes and renders chat exactly as duet's own tokenizer does, for the embedded GGUF model
(whose tokenizer exists only as GGUF metadata) and for an HF model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duet.cli.main import main
from duet.engine.gguf_loader import default_model_path, load_gguf
from duet.engine.tokenizer import Tokenizer
from tests.conftest import TINY_TEXT

TEXTS = [
    *TINY_TEXT,
    "Hello world",
    "  two leading spaces, trailing  ",
    "don't stop , now ! ? ...",
    "tabs\tand\nnew\r\nlines\n\n",
    "数字 12345 和中文",
    "<|endoftext|> in the middle <|im_end|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour."},
    ],
]


def _duet_gguf_tokenizer() -> Tokenizer:
    """The tokenizer duet serves the embedded model with, built as engine/loader.py builds it
    for a GGUF (without reading the weights)."""
    gguf = load_gguf(default_model_path())
    eos = [gguf.eos_token_id] if gguf.eos_token_id is not None else []
    return Tokenizer(
        gguf.tokenizer(), gguf.chat_template, gguf.bos_token, gguf.eos_token, eos, False
    )


def _assert_same(duet: Tokenizer, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out_dir))
    for text in TEXTS:
        ids = duet.encode(text)
        assert hf.encode(text) == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == duet.decode(ids), text
        assert hf.decode(ids, skip_special_tokens=False) == duet.decode(ids, False), text
    for messages in CHATS:
        want = duet.encode_chat(messages)
        got = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        got = got["input_ids"] if isinstance(got, dict) or hasattr(got, "keys") else got
        assert list(got) == want
    assert hf.eos_token == duet.eos_token


@pytest.fixture(scope="module")
def gguf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    assert main(["tokenizer", "save", str(out)]) == 0
    return out


def test_embedded_model_tokenizer_matches_duet(gguf_tokenizer_dir: Path) -> None:
    files = {p.name for p in gguf_tokenizer_dir.iterdir()}
    assert files == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    config = json.loads((gguf_tokenizer_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["model_max_length"] == 8192
    assert "<|im_start|>" in config["chat_template"]
    _assert_same(_duet_gguf_tokenizer(), gguf_tokenizer_dir)


def test_hf_model_dir_tokenizer_is_copied(tiny_llama: str, tmp_path: Path) -> None:
    out = tmp_path / "tok"
    assert main(["tokenizer", "save", "--model", tiny_llama, str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "tokenizer_config.json"}
    _assert_same(Tokenizer.from_dir(tiny_llama), out)


def test_missing_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenizer", "save", "--model", str(tmp_path / "nope"), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
