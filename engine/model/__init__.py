"""Model definitions (Llama family) and their architecture config."""

from engine.model.arch import SUPPORTED_ARCHITECTURES, ModelArchConfig
from engine.model.llama import LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelArchConfig"]
