"""`ForwardContext`: what every layer of one step shares (the dense and the latent attention
read it alike)."""

from __future__ import annotations

from dataclasses import dataclass

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
