"""`ForwardContext`: what every layer of one step shares (the dense and the latent attention
read it alike)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from duet.engine.attention import GatherWorkspace
from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.model.rotary import RotaryEmbedding


@dataclass
class ForwardContext:
    """What every layer of one step shares."""

    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    rotary: RotaryEmbedding
    workspace: GatherWorkspace
    decode_kernels: Any | None = None
    """The CPU kernels when every token of the step is a decode on them: a layer's rotary
    embedding, KV write and attention are then one call (`decode_attention_step`)."""
