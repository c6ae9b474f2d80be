"""`AsyncEngine`: an `LLMEngine` on an `EngineCore` thread, for servers.

`generate()` is an async iterator of incremental `RequestOutput`s; leaving it early (client
gone, task cancelled) aborts the request and frees its blocks. Only the engine thread touches
the `LLMEngine`; other threads talk to it through the core's typed commands (and compile
structured-output grammars with its thread-safe `grammar_compiler`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import torch.distributed as dist

from duet.engine.config import EngineConfig
from duet.engine.core import AbortRequest, AddRequest, EngineCore, EngineDeadError, EngineRole
from duet.engine.data_parallel import DataParallelRole, DPLeader
from duet.engine.llm_engine import EngineStats, LLMEngine, Prompt
from duet.engine.outputs import RequestOutput
from duet.engine.parallel import SINGLE, TensorParallel
from duet.engine.peer_lockstep import PeerLockstep
from duet.engine.sampling_params import SamplingParams
from duet.engine.tokenizer import Message, Tokenizer
from duet.engine.tp_group import TPGroup, rank_config

__all__ = ["AsyncEngine", "EngineDeadError"]


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        role: EngineRole | None = None,
        name: str = "engine",
        group: TPGroup | None = None,
        tp: TensorParallel = SINGLE,
        control_group: dist.ProcessGroup | None = None,
        peers: PeerLockstep | None = None,
    ) -> None:
        """`engine`: the engine, or (in serving processes, see `EngineCore`) a function that
        builds it on the engine thread; returns once it is built. `role`: what runs around
        each step (default: aggregated generation). `group`: the tensor-parallel ranks this
        process leads as rank 0 (`TPGroup.start`), stopped with the engine; or `tp` and
        `control_group`, this rank's place in a group someone else started (a decode worker's
        ranks, each in its own process). `peers`: data-parallel peers it steps with, each
        taking its own requests (engine/peer_lockstep.py)."""
        self.group = group
        if group is not None:
            tp, control_group = group.tp, group.control_group
        control = control_group
        self.core = EngineCore(engine, role, name=name, tp=tp, control_group=control, peers=peers)
        try:
            self.core.wait_ready()
        except BaseException:
            if group is not None:
                group.close(timeout_s=0.0)  # the followers cannot finish loading
            raise
        self.engine = self.core.engine

    @classmethod
    def from_config(cls, config: EngineConfig | None = None, **kwargs: Any) -> AsyncEngine:
        """An engine built on its own thread (the only thread that runs its CPU kernels).
        With `tensor_parallel_size` N > 1 this process is rank 0 and ranks 1..N-1 start as
        child processes (engine/tp_group.py)."""
        given = config or EngineConfig.from_kwargs(**kwargs)
        if given.num_ranks == 1:
            return cls(lambda: LLMEngine(given))
        ranked = rank_config(given)
        group = TPGroup.start(ranked)
        role = None
        if ranked.data_parallel_size > 1:  # rank 0 of the lockstep (engine/data_parallel.py)
            assert group.control_group is not None
            leader = DPLeader(
                ranked.data_parallel_size, group.control_group, group.tp.shared_segment
            )
            role = DataParallelRole(leader, lambda: group.close(timeout_s=0.0))
        return cls(lambda: LLMEngine(ranked, group.tp), role=role, group=group)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self.core.is_running

    # What the servers read of the engine (router.engine_client.EngineClient).

    @property
    def is_ready(self) -> bool:
        return self.is_running

    @property
    def deterministic(self) -> bool:
        return self.engine.deterministic

    @property
    def speculates_with_ngram(self) -> bool:
        speculator = self.engine.speculator
        return speculator is not None and speculator.proposer.method == "ngram"

    @property
    def declared_pooling(self) -> str | None:
        return self.engine.arch.declared_pooling

    @property
    def computes_embeddings(self) -> bool:
        """Embeddings need the final hidden states where the outputs are made: not across
        pipeline stages."""
        return self.engine.config.pipeline_parallel_size == 1

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.max_num_seqs

    @property
    def scheduling_policy(self) -> str:
        """fcfs, or priority (a request's `priority` orders the waiting queue)."""
        return self.engine.config.scheduling_policy

    @property
    def stats(self) -> EngineStats:
        role = self.core.role
        if isinstance(role, DataParallelRole):  # every rank's, as one engine's
            return role.stats()
        return self.engine.stats

    def tokenize_prompt(self, prompt: Prompt, bounded: bool = True) -> tuple[str | None, list[int]]:
        return self.engine.tokenize_prompt(prompt, bounded)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        return self.engine.encode_chat(messages)

    def check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return self.engine.check_lengths(num_prompt_tokens, params)

    async def start(self) -> None:
        """Nothing to start: the engine thread runs from construction."""

    async def stop(self) -> None:
        """Nothing to stop: whoever built the engine shuts it down."""

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        num_replayed: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Bad input raises `InvalidInputError` before anything
        is queued. `num_replayed`: see `LLMEngine.add_request`."""
        if self.core.dead is not None:
            raise EngineDeadError("engine is not running") from self.core.dead
        params = params or SamplingParams()
        text, ids = self.engine.tokenize_prompt(prompt)
        self.engine.check_lengths(len(ids), params)
        if params.structured_outputs is not None:
            # Compile a new grammar on a worker thread; the engine thread then hits the cache.
            await asyncio.to_thread(self.engine.grammar_compiler.compile, params.structured_outputs)
        request_id, out_queue = self.core.open_stream(request_id)
        assembler = self.engine.new_assembler(request_id, text, ids, params)
        self.core.submit(
            AddRequest(
                request_id, ids, params, priority, prompt_text=text, num_replayed=num_replayed
            )
        )
        # aclosing: leaving this generator must run iterate's abort at once, not at GC time.
        async with aclosing(self.core.iterate(request_id, out_queue, assembler)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        self.core.submit(AbortRequest(request_id))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread (and the follower ranks); in-flight streams end with
        `EngineDeadError`."""
        self.core.shutdown(timeout_s)
        if self.group is not None:
            self.group.close()
