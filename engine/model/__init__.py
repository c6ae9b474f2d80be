"""Model definitions (Llama family) and their architecture config."""

from duet.engine.model.arch import SUPPORTED_ARCHITECTURES, ModelArchConfig
from duet.engine.model.llama import LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelArchConfig"]
