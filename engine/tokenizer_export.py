"""`duet tokenizer save DIR`: a model's tokenizer as an HF tokenizer directory.

Load generators (aiperf, guidellm) and other tools count tokens with
`transformers.AutoTokenizer.from_pretrained(DIR)`. The embedded default model is a GGUF with no
tokenizer.json on disk, and this machine has no hub access, so this writes one: tokenizer.json
(the same `tokenizers.Tokenizer` duet builds from the GGUF metadata), tokenizer_config.json
(chat template, special tokens, context length) and special_tokens_map.json. For an HF model
directory the tokenizer files are copied as they are. No weights are read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import tokenizers

# Files an HF model directory may hold that make up its tokenizer.
_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def _model_path(model: str | None) -> str:
    from duet.engine.loader import resolve_model_path

    return resolve_model_path(model)


def open_tokenizer(model: str | None) -> tokenizers.Tokenizer:
    """The `tokenizers.Tokenizer` duet uses for `model` (an HF or tokenizer directory, a .gguf
    file, or None for the embedded default), without loading weights.

    Raises `engine.ModelLoadError` naming the path when there is none."""
    from duet.engine import ModelLoadError

    path = _model_path(model)
    if os.path.isdir(path):
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ModelLoadError(f"no tokenizer.json in {path}")
        return tokenizers.Tokenizer.from_file(tok_file)
    from duet.engine.gguf_loader import load_gguf

    return load_gguf(path).tokenizer()


def save_tokenizer(model: str | None, out_dir: str | Path) -> Path:
    """Write `model`'s tokenizer to `out_dir` (created) as an HF tokenizer directory that
    `AutoTokenizer.from_pretrained` loads and that encodes as duet does. Returns `out_dir`."""
    out = Path(out_dir)
    path = _model_path(model)
    out.mkdir(parents=True, exist_ok=True)
    if os.path.isdir(path):
        from duet.engine import ModelLoadError

        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ModelLoadError(f"no tokenizer.json in {path}")
        for name in _HF_TOKENIZER_FILES:
            src = os.path.join(path, name)
            if os.path.isfile(src):
                shutil.copyfile(src, out / name)
        return out
    _save_gguf_tokenizer(path, out)
    return out


def _save_gguf_tokenizer(path: str, out: Path) -> None:
    from duet.engine.gguf_loader import load_gguf

    gguf = load_gguf(path)
    tok = gguf.tokenizer()
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": gguf.bos_token, "eos_token": gguf.eos_token}
    pad_id = gguf.hf_config.get("pad_token_id")
    pad = tok.id_to_token(pad_id) if isinstance(pad_id, int) else None
    specials["pad_token"] = pad or gguf.eos_token  # tools that batch want a pad token
    specials = {k: v for k, v in specials.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        # NOTE: BOS is added (or not) by tokenizer.json's own post-processor, exactly as duet
        # does for GGUF models; add_bos_token here would make some transformers versions add
        # a second one.
        "add_bos_token": False,
        "add_eos_token": False,
        # duet decodes without cleaning up spaces before punctuation; so must the tools.
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf.hf_config["max_position_embeddings"]),
        "chat_template": gguf.chat_template,
    }
    if gguf.chat_template is None:
        del config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
