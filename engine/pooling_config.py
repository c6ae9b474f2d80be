"""The pooling an embedding model declares: sentence-transformers' `modules.json` names its
`Pooling` module, whose `config.json` says how token states become one vector
(`pooling_mode_lasttoken`: Qwen3-Embedding, e5-mistral, gte-Qwen2; `pooling_mode_mean_tokens`;
`pooling_mode_cls_token`), as vLLM reads it. `/v1/embeddings` pools that way unless
`--embedding-pooling` says otherwise."""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_MODES = (  # sentence-transformers' flag -> duet's pooling, in the order ST's Pooling reads them
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
    ("pooling_mode_weightedmean_tokens", "weighted_mean"),
    ("pooling_mode_lasttoken", "last"),
)


def declared_pooling(model_dir: str) -> str | None:
    """The pooling `model_dir`'s sentence-transformers configuration declares (`last`, `mean`,
    `cls`, or the name of one duet does not compute: `max`, ...), or None when it declares
    none (no `modules.json`, no `Pooling` module, or an unreadable file, which is logged)."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    try:
        with open(modules_path) as f:
            modules = json.load(f)
        pooling = next(
            (m for m in modules if isinstance(m, dict) and m.get("type") == _POOLING_MODULE), None
        )
        if pooling is None:
            return None
        with open(os.path.join(model_dir, pooling.get("path", ""), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        logger.warning("%s: cannot read its sentence-transformers pooling (%s)", model_dir, e)
        return None
    modes = [name for flag, name in _MODES if config.get(flag)]
    if len(modes) != 1:  # several at once are concatenated by ST: not one pooling
        return "+".join(modes) or None
    return modes[0]
