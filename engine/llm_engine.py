"""`LLMEngine`: the synchronous core. `add_request`, then `step()` until done; `abort_request`
at any time between steps. One thread drives it (`AsyncEngine` wraps it for serving)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from duet.engine.config import EngineConfig, reports_deterministic
from duet.engine.cpu_runtime import configure_cpu_runtime
from duet.engine.device import bind_thread
from duet.engine.errors import InvalidInputError
from duet.engine.kv_cache_manager import KVCacheManager
from duet.engine.kv_sizing import size_kv_pool
from duet.engine.loader import load_model
from duet.engine.model_runner import ModelRunner, resolve_attention_backend
from duet.engine.output_processor import OfflineOutputs, OutputAssembler
from duet.engine.outputs import EngineOutput, PromptLogprob, RequestOutput
from duet.engine.parallel import SINGLE, TensorParallel
from duet.engine.prefill_handoff import PrefillDone, PrefillStream
from duet.engine.random import SeedSource
from duet.engine.request import Request
from duet.engine.request_checks import Prompt, check_lengths, check_vocab, tokenize_prompt
from duet.engine.request_state import RequestState, RequestTable
from duet.engine.sampling_params import SamplingParams
from duet.engine.scheduler import Scheduler
from duet.engine.spec_decode.proposer import TargetInfo
from duet.engine.spec_decode.speculator import Speculator
from duet.engine.stats import EngineStats
from duet.engine.structured_output import GrammarCompiler
from duet.engine.tokenizer import Message, bad_words_token_ids

__all__ = ["EngineStats", "LLMEngine", "PrefillDone", "PrefillStream", "Prompt",  # re-exported
           "check_lengths", "check_vocab", "tokenize_prompt"]  # fmt: skip

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        """`tp`: this rank's tensor-parallel group when `config.tensor_parallel_size` > 1 (every
        rank runs an engine and must receive the same requests in the same order)."""
        self.config = config
        tp = tp or SINGLE
        if tp.world_size != config.tensor_parallel_size:
            raise InvalidInputError(
                "tensor_parallel_size",
                f"is {config.tensor_parallel_size} but the engine was given a group of "
                f"{tp.world_size} rank(s); LLM(...) and AsyncEngine.from_config start the ranks",
            )
        if tp.pp.num_stages != config.pipeline_parallel_size:
            raise InvalidInputError(
                "pipeline_parallel_size",
                f"is {config.pipeline_parallel_size} but the engine was given "
                f"{tp.pp.num_stages} stage(s); LLM(...) and AsyncEngine.from_config start the ranks",
            )
        dp = config.data_parallel_size
        exchanging = tp.exchange.size if tp.exchange is not None else 1
        if exchanging != dp:
            raise InvalidInputError(
                "data_parallel_size",
                f"is {dp} but the engine was given {exchanging} "
                f"rank(s) to exchange experts with; LLM(...) and AsyncEngine.from_config "
                f"start data-parallel ranks (engine/data_parallel.py)",
            )
        if config.expert_parallel_size > 1 and dp == 1:  # = the TP size (EngineConfig checks)
            tp = dataclasses.replace(tp, expert_parallel=True)
        self.tp = tp
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.resolve_device(tp.global_rank)
        bind_thread(self.device)  # the thread that builds the engine runs it (EngineCore)
        if self.device.type == "cpu":
            configure_cpu_runtime()
        self.dtype = config.resolve_dtype(self.device)
        deterministic = config.resolve_deterministic(self.device)
        prefill_attention = config.resolve_prefill_attention(self.device, deterministic)
        if deterministic and prefill_attention != "triton":
            raise InvalidInputError(
                "prefill_attention",
                f"{prefill_attention} is not batch-invariant with the decode kernel: "
                "deterministic inference needs triton (or --no-deterministic)",
            )
        start = time.perf_counter()
        loaded = load_model(
            config.model, self.dtype, self.device, config.tokenizer, config.hf_overrides,
            config.load_progress and tp.is_leader, tp, deterministic, config.quantization_config(),
            config.load_format,
        )  # fmt: skip
        self.model_name = loaded.name
        self.weight_bytes = loaded.weight_bytes  # what this rank holds (docs/quantization.md)
        self.checkpoint_bytes_read = loaded.checkpoint_bytes_read  # this rank's slices only
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(
            config.max_model_len or loaded.arch.max_position_embeddings,
            loaded.arch.max_position_embeddings,
        )
        use_triton = self.device.type == "cuda" and (
            resolve_attention_backend(
                config.attention_backend, self.device, self.dtype, loaded.model.kv_spec.latent_width
            )
            == "triton"
        )
        spec = config.speculative()
        # A draft model is loaded first: its weights are then in what the KV pool's sizing
        # measures, and its own pool (as many blocks) is in the budget.
        draft = draft_sizing = None
        if spec is not None and spec.method == "draft_model" and tp.world_size == 1:
            from duet.engine.spec_decode.draft_model import draft_sizing as sizing
            from duet.engine.spec_decode.draft_model import load_draft

            draft = load_draft(spec, self.dtype, self.device)
            draft_sizing = sizing(draft, config.block_size, self.dtype)
        self.num_blocks = size_kv_pool(
            config, loaded.model, self.device, self.dtype, tp, self.max_model_len, use_triton,
            draft_sizing,
        )  # fmt: skip
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self.runner = ModelRunner(
            loaded.model,
            self.num_blocks,
            config.block_size,
            self.device,
            self.dtype,
            config.attention_backend,
            enforce_eager=config.enforce_eager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            deterministic=deterministic,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            cuda_graph_mode=config.cuda_graph_mode,
            decode_graphs=config.decodes,
            prefill_attention=prefill_attention,
        )
        target = TargetInfo(
            loaded.arch.vocab_size, self.tokenizer, self.device, self.dtype, config.block_size,
            self.num_blocks, self.max_model_len, config.max_num_seqs,
            config.max_num_batched_tokens, config.attention_backend, tp.world_size,
            config.enforce_eager or not config.decodes, config.cuda_graph_mode, draft,
        )  # fmt: skip
        self.speculator = Speculator(spec, target) if spec else None
        """Speculative decoding (`EngineConfig.speculative_config`), or None."""
        self.deterministic = reports_deterministic(
            self.device, loaded.linears_batch_invariant, self.runner.prefill_kernel,
            self.runner.use_triton, tp.world_size, loaded.model.kv_spec.is_latent,
        )  # fmt: skip
        """Whether a request's tokens are independent of its batch, chunking and prefix hits
        (docs/determinism.md; `engine.config.reports_deterministic`)."""
        self.assemble_outputs = True
        """Whether `add_request` gives each request an `OutputAssembler` for `step` (text and
        stop strings on this thread). An `EngineCore` turns it off: its readers assemble the
        raw `step_outputs` off the engine thread."""
        self._offline = OfflineOutputs()
        self.stats = EngineStats()
        self.requests = RequestTable(self.scheduler, self.kv, self.stats, self.speculator)
        self._ids = itertools.count()
        self._seeds = SeedSource(config.seed)
        self.prefill_stream: PrefillStream | None = None
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.arch.vocab_size)
        """Structured-output grammars for this tokenizer, cached (thread-safe)."""
        logger.info(
            "loaded %s (%s, %s on %s) in %.1fs; KV pool %d blocks x %d tokens",
            self.model_name, self.arch.architecture, str(self.dtype).removeprefix("torch."),
            self.device,
            time.perf_counter() - start, self.num_blocks, config.block_size,
        )  # fmt: skip

    # -- requests --------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt, bounded: bool = True) -> tuple[str | None, list[int]]:
        bound = self.max_model_len if bounded else None
        return tokenize_prompt(self.tokenizer, self.arch.vocab_size, prompt, bound)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        prefill_only: bool = False,
        prompt_text: str | None = None,
        num_replayed: int = 0,
    ) -> str:
        """Queue a prompt (text or token ids). Raises `InvalidInputError` for bad input.

        `prompt_text`: the text that `prompt`'s ids were tokenized from, when the caller
        tokenized it already (each prompt is tokenized once), reported in the outputs.
        `prefill_only`: the prefill half of a disaggregated request. It ends after its first
        token with no output of its own; `take_prefilled` hands over what the decode side
        needs, and its blocks stay held until `release_held`.
        `num_replayed`: the prompt's last tokens that are the request's own earlier output (a
        continuation after a lost worker); a grammar replays them before the first sample."""
        params = params or SamplingParams()
        text, ids = self.tokenize_prompt(prompt)
        text = prompt_text if prompt_text is not None else text
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidInputError("request_id", f"{request_id!r} is already running")
        if prefill_only and params.n != 1:
            raise InvalidInputError("n", f"must be 1 for a prefill-only request; got {params.n}")
        if params.pooling is None and self.arch.embedding_only:
            raise InvalidInputError(
                "model",
                f"{self.model_name} computes embeddings only (its checkpoint is a base model "
                "without an LM head): use /v1/embeddings",
            )
        if params.pooling is not None and (prefill_only or self.config.pipeline_parallel_size > 1):
            raise InvalidInputError(
                "pooling",
                "embeddings are computed by an engine that runs the whole model: not by a "
                "disaggregated prefill worker, nor across pipeline stages",
            )
        max_tokens = self.check_lengths(len(ids), params)
        state = RequestState.new(request_id, text, ids, params.prompt_logprobs)
        for index in range(params.n):
            sub_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = self._new_request(
                sub_id, ids, params, max_tokens, priority, index, num_replayed
            )
            request.prefill_only = prefill_only
            state.add_sample(request)
            self.scheduler.add_request(request)
        self.requests.add(state)
        if self.assemble_outputs and not prefill_only:
            self._offline.open(self.new_assembler(request_id, text, ids, params))
        self.stats.num_prompt_tokens += len(ids) * params.n
        return request_id

    def _new_request(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        priority: int = 0,
        index: int = 0,
        num_replayed: int = 0,
    ) -> Request:
        sample_seed = params.seed + index if params.seed is not None else self._seeds.next_seed()
        if index and params.prompt_logprobs is not None:  # sample 0 computes them for all `n`
            # NOTE: a copy, not `dataclasses.replace`, which validates again, here on the
            # engine's thread: on the CPU it flushes denormals (engine/cpu_runtime.py), under
            # which `0 < 5e-324` is false, and a top_p the router accepted was refused.
            params = copy.copy(params)
            params.prompt_logprobs = None
        eos = self.tokenizer.eos_token_ids
        request = Request(
            request_id, ids, params, max_tokens, eos, priority, sample_seed=sample_seed
        )
        request.num_replayed = num_replayed
        if params.bad_words:
            request.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if params.structured_outputs is not None:
            request.grammar = self.grammar_compiler.new_state(
                params.structured_outputs, ids, num_replayed
            )
        return request

    # -- disaggregation --------------------------------------------------------------------

    def take_prefilled(self) -> list[PrefillDone]:
        """`prefill_only` requests that reached their first token since the last call."""
        out, self.requests.prefilled = self.requests.prefilled, []
        return out

    def release_held(self, request_id: str) -> bool:
        """Free a prefilled request's held blocks (its transfer ended either way)."""
        return self.scheduler.release_held(request_id)

    def add_remote_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        num_replayed: int = 0,
        priority: int = 0,
    ) -> list[int] | None:
        """Decode side: reserve blocks for a prompt whose KV comes from a prefill worker.
        Returns the block ids to receive the KV into (in prompt order), or None when there is
        no free sequence slot or too few free blocks (nothing is queued then). Raises
        `InvalidInputError` for bad input, like `add_request`."""
        _, ids = self.tokenize_prompt(prompt_token_ids)
        if request_id in self.requests:
            raise InvalidInputError("request_id", f"{request_id!r} is already running")
        if params.n != 1:
            raise InvalidInputError("n", f"must be 1 for a disaggregated request; got {params.n}")
        max_tokens = self.check_lengths(len(ids), params)
        request = self._new_request(request_id, ids, params, max_tokens, priority, 0, num_replayed)
        block_ids = self.scheduler.add_remote_request(request)
        if block_ids is None:
            return None
        state = RequestState.new(request_id, None, ids, params.prompt_logprobs)
        state.add_sample(request)
        self.requests.add(state)
        if self.assemble_outputs:
            self._offline.open(self.new_assembler(request_id, None, ids, params))
        self.stats.num_prompt_tokens += len(ids)
        return block_ids

    def complete_remote(
        self,
        request_id: str,
        first_token: int,
        logprob: tuple[float, list[tuple[int, float]]] | None = None,
        sample_seed: int | None = None,
        num_cached_tokens: int = 0,
        prompt_logprobs: Sequence[PromptLogprob | None] | None = None,
    ) -> EngineOutput | None:
        """The KV of a request from `add_remote_request` is in its blocks: take the prefill
        worker's first token (and prompt logprobs) as if computed here, and run the request
        from the next step. Returns its first (raw) output; None when no longer waiting."""
        entry = self.requests.sample_of(request_id)
        if entry is None:
            return None
        if prompt_logprobs is not None:
            entry[0].add_prompt_logprobs(0, prompt_logprobs)
        request = entry[0].samples[entry[1]].request
        if sample_seed is not None:
            request.sample_seed = sample_seed
        request.num_cached_tokens = num_cached_tokens
        if self.scheduler.complete_remote(request_id, first_token) is None:
            return None
        self.requests.on_tokens(request, 1, [logprob] if logprob is not None else None)
        return self.requests.take_outputs()[0]

    def new_assembler(
        self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams
    ) -> OutputAssembler:
        """What turns the request's raw outputs into `RequestOutput`s (see `step_outputs`)."""
        return OutputAssembler(self.tokenizer, request_id, prompt, ids, params)

    def check_lengths(self, num_prompt: int, params: SamplingParams) -> int:
        """The request's effective max_tokens; raises `InvalidInputError` when it cannot fit
        (or its `logit_bias` names a token outside the vocabulary)."""
        capacity = self.num_blocks * self.config.block_size
        check_vocab(params, self.arch.vocab_size)
        return check_lengths(num_prompt, params, self.max_model_len, capacity)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final (aborted) output."""
        return self._offline.abort(self.abort(request_id))

    def abort(self, request_id: str) -> EngineOutput | None:
        """`abort_request`, returning the raw final output (None when not running)."""
        out = self.requests.abort(request_id)
        # no step may follow: the gauges must not keep the aborted request
        self.stats.refresh(self.scheduler, self.kv, self.speculator)
        return out

    def finish_stopped(self, request_id: str, index: int, num_tokens: int) -> None:
        """A stop string ended sample `index` after `num_tokens` output tokens (found by its
        `OutputAssembler`): drop the later tokens and finish it. No-op once it finished."""
        self.requests.finish_stopped(request_id, index, num_tokens)
        self.stats.refresh(self.scheduler, self.kv, self.speculator)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_schedulable_requests(self) -> bool:
        """False when `step` has nothing to run (idle, or only waiting for remote KV)."""
        return self.scheduler.has_schedulable_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- stepping --------------------------------------------------------------------------

    def step(
        self, finish_stopped: Callable[[str, int, int], None] | None = None
    ) -> list[RequestOutput]:
        """Run one scheduler step and forward pass. Returns outputs of requests that changed
        (assembled here: text, stop strings; a stop string ends its sample before the next
        step, through `finish_stopped`, by default `self.finish_stopped`)."""
        return self._offline.assemble(self.step_outputs(), finish_stopped or self.finish_stopped)

    def step_outputs(self) -> list[EngineOutput]:
        """`step`, returning raw outputs (token ids, no text) for the caller to assemble."""
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        self.runner.remove_requests(self.scheduler.take_left_running())
        self.runner.trim_requests(self.scheduler.take_trimmed())
        if sched.empty:
            if self.tp.exchange is not None:  # the other ranks may route rows to our experts
                self.runner.serve_experts()
            return []
        on_layer = None
        if self.prefill_stream is not None:
            completing = [
                (r.request_id, self.kv.get_block_ids(r.request_id))
                for r, n in sched.scheduled
                if r.prefill_only and r.num_computed_tokens + n == r.num_tokens
            ]
            if completing:
                on_layer = self.prefill_stream.begin(completing)
        executing = time.perf_counter()
        result = self.runner.execute(sched, self.kv, on_layer)
        self.stats.execute_seconds += time.perf_counter() - executing
        updated = self.scheduler.update_from_output(sched, result.sampled)
        self.stats.num_steps += 1
        self.stats.observe_step(sched.num_batched_tokens)
        if self.runner.expert_load is not None:
            self.stats.observe_expert_load(self.runner.expert_load.read())
        if self.speculator is not None:
            self.speculator.verified(sched.spec_token_ids, result.sampled)
        for request_id, (first, entries) in result.prompt_logprobs.items():
            self.requests.add_prompt_logprobs(request_id, first, entries)
        for request_id, embedding in result.embeddings.items():
            self.requests.add_embedding(request_id, embedding)
        for request, num_new in updated:
            self.requests.on_tokens(request, num_new, result.logprobs.get(request.request_id))
        if self.speculator is not None:
            self.speculator.propose(r for r, _ in updated if not r.is_finished)
        outputs = self.requests.take_outputs()
        self.stats.refresh(self.scheduler, self.kv, self.speculator)
        self.stats.step_seconds += time.perf_counter() - started
        return outputs

    def encode_chat(self, messages: list[Message]) -> list[int]:
        return self.tokenizer.encode_chat(messages)
