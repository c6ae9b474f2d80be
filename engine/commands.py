"""The engine thread's commands: the closed set of typed requests other threads submit to an
`EngineCore` (engine/core.py), applied in order at the start of an iteration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from duet.engine.llm_engine import Prompt
from duet.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Queue a prompt. `prefill_dest`: a prefill worker's request, whose KV goes to the decode
    worker at that address after its first token (the request is `prefill_only`)."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int = 0
    prefill_dest: str | None = None
    prompt_text: str | None = None  # what `prompt`'s ids were tokenized from, if they were
    num_replayed: int = (
        0  # the prompt's tail that is the request's own output (a grammar replays it)
    )


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request wherever it is (queued, running, transferring) and free its blocks."""

    request_id: str


@dataclass(frozen=True)
class FinishStopped:
    """A stop string ended sample `index` of the request after its first `num_tokens` output
    tokens (found where its text is made, off the engine thread): drop the tokens the engine
    made after them and finish the sample as stopped. A no-op once it finished anyway."""

    request_id: str
    index: int
    num_tokens: int


@dataclass(frozen=True)
class ReserveRemote:
    """Decode side: reserve blocks for a prompt whose KV a prefill worker sends."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_wait_s: float
    num_replayed: int = 0  # as in AddRequest
    priority: int = 0  # as in AddRequest


@dataclass(frozen=True)
class ReleaseHeld:
    """Prefill side: free a prefilled request's held blocks; `result` is what rank 0 tells
    the caller once they are free."""

    request_id: str
    result: Any = None


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget every cached prefix (`BlockPool.reset_prefix_cache`), so that the next prompts
    compute everything. Every rank holds the same blocks, so each refuses or resets alike."""


@dataclass(frozen=True)
class Stop:
    """End the loop; streams still open end with `EngineDeadError`."""


EngineCommand = (
    AddRequest
    | AbortRequest
    | FinishStopped
    | ReserveRemote
    | ReleaseHeld
    | ResetPrefixCache
    | Stop
)
