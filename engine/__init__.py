"""duet's model runtime: models, weights, tokenizer, paged KV cache, scheduler, sampler."""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import InvalidInputError, ModelLoadError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "InvalidInputError",
    "LLMEngine",
    "Logprob",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TokenLogprobs",
]
