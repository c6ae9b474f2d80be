"""`LLM`: offline generation, like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from duet.engine.config import EngineConfig
from duet.engine.llm_engine import LLMEngine, Prompt
from duet.engine.outputs import RequestOutput
from duet.engine.parallel import TensorParallel
from duet.engine.sampling_params import SamplingParams
from duet.engine.tokenizer import Message, Tokenizer


class LLM:
    """`LLM(model=None, **config)`: config keys are `EngineConfig` fields; unknown keys raise."""

    def __init__(
        self, model: str | None = None, *, tp: TensorParallel | None = None, **config: Any
    ) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **config)
        self.engine = LLMEngine(self.config, tp)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(params or SamplingParams(), len(prompt_list))
        # Validate everything before queueing anything, so a bad prompt leaves no stragglers.
        for p in prompt_list:
            self.engine.tokenize_prompt(p)
        ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompt_list, params_list, strict=True)):
                ids.append(
                    self.engine.add_request(prompt, sp, priority=priority[i] if priority else 0)
                )
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations: Sequence[list[Message]]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = messages  # type: ignore[assignment]
        prompts = [self.engine.encode_chat(list(c)) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [items]  # type: ignore[list-item]  # one prompt given as token ids
    return items  # type: ignore[return-value]


def _broadcast(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"params: got {len(params)} SamplingParams for {n} prompts")
    return params
