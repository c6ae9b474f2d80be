"""`LLM`: offline generation, like vLLM's."""

from __future__ import annotations

import itertools
import subprocess
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from duet.engine.commands import AbortRequest, AddRequest, FinishStopped, ResetPrefixCache
from duet.engine.config import EngineConfig
from duet.engine.data_parallel import AddOnRank, DPLeader, RankReport
from duet.engine.errors import InvalidInputError
from duet.engine.llm_engine import LLMEngine, Prompt
from duet.engine.output_processor import OfflineOutputs
from duet.engine.outputs import RequestOutput
from duet.engine.parallel import TensorParallel
from duet.engine.sampling_params import SamplingParams
from duet.engine.tokenizer import Message, Tokenizer
from duet.engine.tp_group import TPGroup, TPLeader, rank_config


class LLM:
    """`LLM(model=None, **config)`: config keys are `EngineConfig` fields; unknown keys raise.

    With `tensor_parallel_size` N > 1 and no `tp`, this process is rank 0 and ranks 1..N-1
    start as child processes that follow it (engine/tp_group.py); `shutdown()` (or the end of
    the process) stops them. `tp`: this rank's group, when the caller runs every rank itself
    (each rank then generates the same prompts)."""

    def __init__(
        self, model: str | None = None, *, tp: TensorParallel | None = None, **config: Any
    ) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **config)
        self._leader: TPLeader | None = None
        self._dp: DPLeader | None = None
        if tp is None and self.config.num_ranks > 1:
            self.config = rank_config(self.config)
            group = TPGroup.start(self.config)
            self._leader = TPLeader(group)
            tp = group.tp
            if self.config.data_parallel_size > 1:  # (engine/data_parallel.py)
                assert group.control_group is not None
                self._dp = DPLeader(
                    self.config.data_parallel_size, group.control_group, group.tp.shared_segment
                )
                self._dp_ids = itertools.count()
                self._remote = OfflineOutputs()  # other ranks' requests, assembled here
        try:
            self.engine = LLMEngine(self.config, tp)
        except BaseException:
            if self._leader is not None:
                self._leader.group.close(timeout_s=0.0)  # the followers cannot finish loading
            raise
        if self._leader is not None:
            weakref.finalize(self, self._stop_ranks, self._leader, self._dp)

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
                ids.append(self._add(prompt, sp, priority[i] if priority else 0))
        except Exception:
            for request_id in ids:
                self._abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    @property
    def follower_processes(self) -> list[subprocess.Popen[bytes]]:
        """The child processes of ranks 1..N-1 (none at one rank, or with a given `tp`)."""
        return self._leader.group.followers if self._leader is not None else []

    def shutdown(self) -> None:
        """Stop the follower ranks of a tensor- or data-parallel engine (nothing at one rank).
        Idempotent; the engine takes no further requests."""
        if self._leader is not None:
            self._stop_ranks(self._leader, self._dp)

    @staticmethod
    def _stop_ranks(leader: TPLeader, dp: DPLeader | None) -> None:
        if dp is None:
            leader.stop()
            return
        dp.stop()  # the followers' own loop ends on it
        leader.group.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix on every rank, so that the next prompts compute
        everything (as vLLM's `LLM.reset_prefix_cache`). Refused (False) while a request holds
        blocks, i.e. only between `generate` calls."""
        if not self.engine.kv.pool.reset_prefix_cache():
            return False
        if self._dp is not None:  # each rank resets its own before its next step
            self._dp.record(ResetPrefixCache())
        elif self._leader is not None:  # the followers reset before their next step
            self._leader.record(ResetPrefixCache())
        return True

    def _abort(self, request_id: str) -> None:
        if self._dp is not None:
            if request_id in self.engine.requests:
                self.engine.abort_request(request_id)
            self._dp.record(AbortRequest(request_id))  # a no-op where it is not running
            return
        self.engine.abort_request(request_id)
        if self._leader is not None:
            self._leader.record(AbortRequest(request_id))

    def _add(self, prompt: Prompt, params: SamplingParams, priority: int) -> str:
        if self._dp is not None:
            return self._add_on_rank(prompt, params, priority, self._dp)
        if self._leader is None:
            return self.engine.add_request(prompt, params, priority=priority)
        # The followers apply the same request (token ids, id and all) before the next step.
        text, ids = self.engine.tokenize_prompt(prompt)
        request_id = self.engine.add_request(ids, params, priority=priority, prompt_text=text)
        self._leader.record(AddRequest(request_id, ids, params, priority, prompt_text=text))
        return request_id

    def _add_on_rank(
        self, prompt: Prompt, params: SamplingParams, priority: int, dp: DPLeader
    ) -> str:
        """A request on the data-parallel rank with the fewest unfinished ones: this engine's
        own, or one that rank adds before its next step (checked here first, so that a bad one
        raises now)."""
        text, ids = self.engine.tokenize_prompt(prompt)
        self.engine.check_lengths(len(ids), params)
        request_id = str(next(self._dp_ids))
        rank = dp.assign()
        if rank == 0:
            self.engine.add_request(
                ids, params, request_id=request_id, priority=priority, prompt_text=text
            )
        else:
            add = AddRequest(request_id, ids, params, priority, prompt_text=text)
            dp.record(AddOnRank(rank, add))
            self._remote.open(self.engine.new_assembler(request_id, text, ids, params))
        return request_id

    def _finish_stopped(self, request_id: str, index: int, num_tokens: int) -> None:
        self.engine.finish_stopped(request_id, index, num_tokens)
        if self._leader is not None:
            self._leader.record(FinishStopped(request_id, index, num_tokens))

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
        if self._dp is not None:
            return self._run_data_parallel(ids, use_tqdm, self._dp)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            try:
                if self._leader is not None:
                    self._leader.sync()
                outputs = self.engine.step(self._finish_stopped)
            except BaseException:
                self._out_of_step()
                raise
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[i] for i in ids]

    def _out_of_step(self) -> None:
        """Rank 0's step (or its broadcast) failed: the followers wait in a collective this
        rank will not call, so end them now rather than let a later Stop wait out the group's
        timeout. The engine takes no further work. Nothing at one rank."""
        if self._leader is None:
            return
        self._leader.broken()
        if self._dp is not None:
            self._dp.broken()
        self._leader.group.close(timeout_s=0.0)

    def _run_data_parallel(
        self, ids: list[str], use_tqdm: bool, dp: DPLeader
    ) -> list[RequestOutput]:
        """Every rank steps once per iteration, in lockstep, until none has a request left
        (engine/data_parallel.py)."""
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)

        def finish_remote(request_id: str, index: int, num_tokens: int) -> None:
            dp.record(FinishStopped(request_id, index, num_tokens))  # applied before its next step

        pending = True
        while pending:
            try:
                dp.sync()
                outputs = self.engine.step()
                reports = dp.gather(RankReport([], self.engine.num_unfinished_requests, []))
            except BaseException:
                self._out_of_step()
                raise
            for report in reports[1:]:
                if report.errors:  # a follower refused a request this check could not see
                    for request_id in ids:
                        self._abort(request_id)
                    _, field, message = report.errors[0]
                    raise InvalidInputError(field, message)
                outputs += self._remote.assemble(report.outputs, finish_remote)
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
            pending = dp.total_unfinished > 0
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
