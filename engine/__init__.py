"""duet's model runtime: models, weights, tokenizer, paged KV cache, scheduler, sampler."""

from duet.engine.async_engine import AsyncEngine
from duet.engine.config import EngineConfig
from duet.engine.errors import InvalidInputError, ModelLoadError
from duet.engine.llm import LLM
from duet.engine.llm_engine import LLMEngine
from duet.engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from duet.engine.sampling_params import SamplingParams
from duet.engine.structured_output import StructuredOutputsParams

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
