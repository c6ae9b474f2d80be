"""`ModelRunner`: owns the model and its KV cache; turns a `SchedulerOutput` into one forward
pass and a sample per request that reached the end of its tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.cpu_runtime import zeroed_host_tensor
from duet.engine.cuda_graphs import DecodeGraphs, uses_decode_graphs
from duet.engine.errors import InvalidInputError
from duet.engine.input_batch import InputBatch, StepInputs
from duet.engine.kernels.cpu import load_cpu_kernels, prefill_kernel_supports
from duet.engine.kernels.triton_runtime import triton_unusable_reason
from duet.engine.kv_cache_manager import KVCacheManager
from duet.engine.model import LlamaForCausalLM
from duet.engine.model.moe import attach_expert_load, experts_read_on_host
from duet.engine.outputs import PromptLogprob, TokenLogprob
from duet.engine.piecewise_graphs import (
    PiecewiseGraphs,
    piecewise_max_tokens,
    piecewise_unsupported,
)
from duet.engine.pipeline import micro_batches, wait_all
from duet.engine.request import Request
from duet.engine.sampler import Sampler, SamplerOutput
from duet.engine.scheduler import SchedulerOutput
from duet.engine.spec_decode.verify import accept_point_mass

logger = logging.getLogger(__name__)


def resolve_attention_backend(
    requested: str, device: torch.device, dtype: torch.dtype, latent_width: int | None = None
) -> str:
    """The attention path a runner uses: "triton" (GPU kernels; on CPU only under the Triton
    interpreter), "cpu" (the C++ decode kernel) or "torch" (the reference).

    auto: Triton on CUDA, the C++ kernel on CPU, the torch reference where neither can run.
    `latent_width` (multi-head latent attention's entry, kv_lora_rank + rope dims): auto takes
    Triton's latent kernel on CUDA (engine/kernels/triton_mla.py) and on the CPU the C++
    kernels where both take that width (DeepSeek's 576; engine/model/latent_attention.py),
    else the torch reference."""
    if requested == "torch":
        return "torch"
    if requested == "triton":
        reason = triton_unusable_reason(device)
        if reason is not None:
            raise InvalidInputError("attention_backend", f"triton cannot run here: {reason}")
        return "triton"
    if device.type == "cuda":
        reason = triton_unusable_reason(device)
        if reason is None:
            return "triton"
        logger.warning("Triton attention unavailable (%s); using the torch reference", reason)
        return "torch"
    kernels = dtype in (torch.float32, torch.bfloat16) and load_cpu_kernels() is not None
    if latent_width is not None:  # the entry is read as one KV head: both kernels take its width
        kernels = kernels and prefill_kernel_supports(latent_width)
    return "cpu" if kernels else "torch"


# Prompt positions whose logits are materialized at once ([rows, vocab] fp32), bounding the
# memory prompt logprobs take whatever the chunk size.
_PROMPT_LOGPROB_ROWS = 256


@dataclass
class StepResult:
    sampled: dict[str, list[int]]  # request id -> new tokens (more than one with speculation)
    logprobs: dict[str, list[TokenLogprob]]  # one per new token, for requests that asked
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)
    """Requests with `prompt_logprobs` that computed prompt positions this step: (the prompt
    index of the first entry, one entry per prompt token from there)."""
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    """Embedding requests (`SamplingParams.pooling`) whose prompt's last chunk ran this step:
    the pooled, unit-length hidden state."""


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str = "auto",
        *,
        enforce_eager: bool = True,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        deterministic: bool = False,
        num_speculative_tokens: int = 0,
        cuda_graph_mode: str = "decode",
        decode_graphs: bool = True,
        prefill_attention: str = "triton",
    ) -> None:
        """`num_speculative_tokens`: most proposed tokens per request per step (0: none).
        `enforce_eager=False` (the engine's default; True here for runners built directly,
        such as a draft model's) captures CUDA graphs for decode batches of up to
        `max_num_seqs` requests and `max_model_len` tokens (default: the model's context)
        where they apply (`uses_decode_graphs`: CUDA, the Triton backend; per rank with
        tensor parallelism). Elsewhere it changes nothing. `cuda_graph_mode` "piecewise" also
        captures the other steps of up to `piecewise_max_tokens` tokens in pieces around attention
        (engine/piecewise_graphs.py) where graphs apply and the model allows it.
        `decode_graphs=False` (a prefill worker's engine: it decodes nothing) captures no
        decode graphs.
        `deterministic`: the Triton decode kernel splits each request by its own length
        (`choose_splits`), so its attention does not depend on the batch.
        `prefill_attention` "sdpa": with Triton, steps whose chunks are all whole prompts run
        their attention in torch's SDPA (`AttentionMetadata.build`)."""
        cfg = model.config
        self.model = model
        self.dtype = dtype  # the model's activations' (and its KV cache's)
        self.block_size = block_size
        self.device = device
        shape = model.kv_spec.shape(num_blocks, block_size)
        self.kv_caches = [
            zeroed_host_tensor(shape, dtype)
            if device.type == "cpu"
            else torch.zeros(shape, dtype=dtype, device=device)
            for _ in range(model.num_layers)  # this pipeline stage's
        ]
        self.sampler = Sampler()
        self._pool_sums: dict[str, torch.Tensor] = {}
        """Embedding requests part-way through their prompt: `mean`'s sum of the rows so far,
        `cls`'s first row."""
        self.num_micro_batched_steps = 0
        """Steps whose forward ran as pipeline micro-batches (`_forward_micro_batches`)."""
        self.attention_backend = resolve_attention_backend(
            attention_backend, device, dtype, model.kv_spec.latent_width
        )
        self.deterministic = deterministic
        self.prefill_attention = prefill_attention
        self.use_triton = self.attention_backend == "triton"
        self.use_decode_kernel = self.attention_backend == "cpu"
        self.prefill_kernel = self.attention_backend == "cpu" and prefill_kernel_supports(
            model.kv_spec.head_dim
        )
        max_model_len = max_model_len or cfg.max_position_embeddings
        self.input_batch = InputBatch(
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            block_size,
            cfg.vocab_size,
            device,
            split_tables=self.use_decode_kernel,
            num_speculative_tokens=num_speculative_tokens,
        )
        self.expert_load = attach_expert_load(model, device)
        """Tokens per routed expert of a mixture of experts (None for a dense model)."""
        self.decode_graphs: DecodeGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        on_host = experts_read_on_host(model)
        if uses_decode_graphs(enforce_eager, device, self.use_triton, on_host):
            if decode_graphs:
                graphs = DecodeGraphs(
                    model, self.kv_caches, max_num_seqs, max_model_len, block_size, deterministic
                )
                logger.info(
                    "CUDA graphs: decode batches of %s requests captured in %.1f s; graph pool "
                    "%.2f GiB",
                    ",".join(map(str, graphs.buckets)), graphs.capture_s,
                    graphs.pool_bytes / 2**30,
                )  # fmt: skip
                self.decode_graphs = graphs
            if cuda_graph_mode == "piecewise":
                self.piecewise_graphs = self._capture_pieces(max_num_batched_tokens)

    def _capture_pieces(self, max_num_batched_tokens: int) -> PiecewiseGraphs | None:
        why = piecewise_unsupported(self.model)
        if why is not None:
            logger.info("piecewise CUDA graphs: off for %s; those steps run eagerly", why)
            return None
        pieces = PiecewiseGraphs(
            self.model, self.kv_caches, piecewise_max_tokens(max_num_batched_tokens)
        )
        logger.info(
            "CUDA graphs: steps of up to %d tokens in %d pieces, %d sizes captured in %.1f s; "
            "graph pool %.2f GiB",
            pieces.max_tokens, len(pieces.layers) + 1, len(pieces.buckets), pieces.capture_s,
            pieces.pool_bytes / 2**30,
        )  # fmt: skip
        return pieces

    def remove_requests(self, request_ids: list[str]) -> None:
        """Requests that left the running set give back their input-batch slots."""
        for request_id in request_ids:
            self._pool_sums.pop(request_id, None)
        if request_ids:
            self.input_batch.remove(request_ids)

    def trim_requests(self, num_blocks: dict[str, int]) -> None:
        """Requests whose block tables were cut to `num_blocks[id]` blocks (see
        `Scheduler.take_trimmed`)."""
        for request_id, n in num_blocks.items():
            self.input_batch.trim(request_id, n)

    def serve_experts(self) -> None:
        """A step with nothing scheduled on a data-parallel rank (engine/data_parallel.py):
        every sparse layer in order with no tokens of its own, serving the rows the other ranks
        route to its experts (engine/model/moe_exchange.py)."""
        from duet.engine.model.moe import SparseMoeBlock

        shape = (0, self.model.config.hidden_size)
        with torch._C._InferenceMode(True):
            empty = torch.empty(shape, dtype=self.dtype, device=self.device)
            for layer in self.model.layers:
                if isinstance(layer.mlp, SparseMoeBlock):
                    layer.mlp.forward(empty)

    def execute(
        self,
        out: SchedulerOutput,
        kv: KVCacheManager,
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        """`on_layer`: see `LlamaForCausalLM.forward` (never with a decode graph)."""
        # torch's own guard: `@torch.inference_mode()` builds and enters a Python context
        # object per call, a measurable share of a batch-1 step's host work.
        with torch._C._InferenceMode(True):
            return self._execute(out, kv, on_layer)

    def _execute(
        self,
        out: SchedulerOutput,
        kv: KVCacheManager,
        on_layer: Callable[[int], None] | None,
    ) -> StepResult:
        batch = self.input_batch
        step = batch.prepare(out.scheduled, kv, out.spec_token_ids)
        graphs = self.decode_graphs
        if (
            graphs is not None
            and on_layer is None
            and graphs.can_run(step.query_lens.tolist(), step.seq_lens.tolist())
        ):
            hidden = graphs.run(
                *step.host_inputs,
                step.seq_lens.tolist(),
                step.block_ids(batch.block_table, self.block_size),
            )
        elif (
            (pp_stages := self.model.tp.pp.num_stages) > 1
            and on_layer is None
            and len(micro := micro_batches(step.num_reqs, pp_stages, step.num_tokens)) > 1
        ):
            hidden = self._forward_micro_batches(step, micro)
        else:
            meta = AttentionMetadata.from_step(
                step,
                batch.block_table,
                self.block_size,
                self.device,
                self.attention_backend,
                self.model.num_kv_heads,
                self.prefill_kernel,
                self.deterministic,
                self.prefill_attention,
            )
            pieces = self.piecewise_graphs
            if pieces is not None and pieces.can_run(step.num_tokens):
                hidden = pieces.run(step.input_ids, step.positions, meta, on_layer)
            else:
                # `.forward`: nn.Module's call path checks for hooks the engine never registers.
                hidden = self.model.forward(
                    step.input_ids, step.positions, self.kv_caches, meta, on_layer
                )
        if self.expert_load is not None:
            self.expert_load.snapshot()  # lands before the sampled tokens' transfer

        prompt_logprobs = self._prompt_logprobs(out, step.query_start, hidden)
        embeddings = self._pool(out, step.query_start, hidden)
        # Only requests whose computed tokens reach their last token sample this step.
        if not step.sample_rows:
            return StepResult({}, {}, prompt_logprobs, embeddings)
        # Every row a logits row (all decodes): the indices are 0..N-1 in order, no gather.
        every_row = step.logits_indices.shape[0] == hidden.shape[0]
        last = hidden if every_row else hidden[step.logits_indices]
        logits = self.model.logits_on_first_rank(last)  # [N, vocab]; None on TP followers
        if len(step.sample_rows) == step.num_reqs:  # every request samples (rows 0..B-1)
            to_sample = [r for r, _ in out.scheduled]
            sample_slots = step.slots
        else:
            to_sample = [out.scheduled[i][0] for i in step.sample_rows]
            sample_slots = step.slots[step.sample_rows]
        spec = out.spec_token_ids
        drafts = [spec.get(r.request_id, []) for r in to_sample] if spec else None
        sampling = batch.sampling.prepare(to_sample, sample_slots, drafts)
        # Tensor parallelism: rank 0 samples and broadcasts its one host transfer (tokens,
        # logprobs), so every rank's scheduler sees the same tokens without the logits.
        result: SamplerOutput
        if logits is None:
            result = self.sampler.follow(sampling, self._receive)
        else:
            result = self.sampler(logits, sampling, self._to_host)
        if drafts is None:
            batch.sampling.record(sampling, result.token_tensor)
            sampled = {r.request_id: [t] for r, t in zip(to_sample, result.token_ids, strict=True)}
            logprobs = {
                r.request_id: [lp]
                for r, lp in zip(to_sample, result.logprobs, strict=True)
                if lp is not None
            }
            return StepResult(sampled, logprobs, prompt_logprobs, embeddings)
        new_tokens, kept_rows = accept_point_mass(result.token_ids, drafts)
        batch.sampling.record(sampling, result.token_tensor, kept_rows)
        sampled, logprobs, row = {}, {}, 0
        for r, tokens, draft in zip(to_sample, new_tokens, drafts, strict=True):
            sampled[r.request_id] = tokens
            if r.sampling_params.logprobs is not None:
                lps = result.logprobs[row : row + len(tokens)]
                logprobs[r.request_id] = [lp for lp in lps if lp is not None]
            row += len(draft) + 1
        return StepResult(sampled, logprobs, prompt_logprobs, embeddings)

    def _pool(
        self, out: SchedulerOutput, query_start: np.ndarray, hidden: torch.Tensor
    ) -> dict[str, list[float]]:
        """The embeddings of the requests whose prompt's last chunk ran this step. `mean`
        sums each chunk's rows in fp32 as the chunks run (a chunk starting at position 0
        starts the sum over: a preempted request's recomputation), `cls` keeps the first
        chunk's first row, `last` takes the last row; each is scaled to unit length (as
        vLLM's and OpenAI's embeddings are)."""
        done: dict[str, list[float]] = {}
        for i, (request, num_new) in enumerate(out.scheduled):
            kind = request.sampling_params.pooling
            if kind is None:
                continue
            start, row = request.num_computed_tokens, int(query_start[i])
            end = min(start + num_new, request.num_prompt_tokens)
            if end <= start:
                continue
            rows = hidden[row : row + end - start].float()
            if kind == "mean":
                total = rows.sum(dim=0)
                if start > 0:
                    total += self._pool_sums.pop(request.request_id)
                self._pool_sums[request.request_id] = total
            elif kind == "cls" and start == 0:
                self._pool_sums[request.request_id] = rows[0].clone()
            if end < request.num_prompt_tokens:
                continue
            if kind == "mean":
                vector = self._pool_sums.pop(request.request_id) / request.num_prompt_tokens
            elif kind == "cls":
                vector = self._pool_sums.pop(request.request_id)
            else:
                vector = rows[-1]
            vector = torch.nn.functional.normalize(vector, dim=0)
            done[request.request_id] = vector.cpu().tolist()
        return done

    def _forward_micro_batches(
        self, step: StepInputs, micro: list[tuple[int, int]]
    ) -> torch.Tensor:
        """The step's forward as micro-batches of its requests, one after another on every
        stage: a stage sends micro-batch m on without waiting and computes m + 1 while the
        next stage computes m, so the stages overlap (engine/pipeline.py). Each micro-batch's
        rows are computed as in the whole batch (the kernels are batch-invariant in
        deterministic mode), so the tokens are the same. Returns the hidden rows of the whole
        step, in order."""
        self.num_micro_batched_steps += 1
        starts = step.query_start
        block_ids = step.block_ids(self.input_batch.block_table, self.block_size)
        sends: list = []
        outs = []
        for lo, hi in micro:
            t0, t1 = int(starts[lo]), int(starts[hi])
            meta = AttentionMetadata.build(
                step.query_lens[lo:hi].tolist(),
                step.seq_lens[lo:hi].tolist(),
                block_ids[lo:hi],
                self.block_size,
                self.device,
                use_decode_kernel=self.use_decode_kernel,
                triton_num_kv_heads=self.model.num_kv_heads if self.use_triton else None,
                slot_mapping=step.slot_mapping[t0:t1],
                deterministic=self.deterministic,
                prefill_attention=self.prefill_attention,
            )
            ids, positions = step.input_ids[t0:t1], step.positions[t0:t1]
            outs.append(self.model.forward(ids, positions, self.kv_caches, meta, None, sends))
        wait_all(sends)
        return torch.cat(outs)

    def _to_host(self, tensor: torch.Tensor) -> list:
        """The step's host transfer on the sampling rank; with tensor parallelism the other
        ranks receive the same values (`_receive`)."""
        self.model.tp.broadcast_sampled(tensor)
        return self.input_batch.to_host(tensor)

    def _receive(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, list]:
        """A tensor-parallel follower's side of `_to_host`: rank 0's `numel` values."""
        buffer = torch.empty(numel, dtype=dtype, device=self.device)
        self.model.tp.broadcast_sampled(buffer)
        return buffer, self.input_batch.to_host(buffer)

    def _prompt_logprobs(
        self, out: SchedulerOutput, query_start: np.ndarray, hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[PromptLogprob]]]:
        """Logprobs of the prompt tokens this step's chunks predict, for the requests that
        asked: position p's logits score prompt token p + 1. Each position's logits come from
        its own hidden row only (rows are independent in the head's matmul and the softmax),
        so a chunk of any size gives the same values (bitwise where the linears are batch
        invariant, docs/determinism.md). Requests that did not ask compute no extra logits."""
        spans: list[tuple[Request, int, int, int]] = []  # (request, first position, end, row)
        for i, (request, num_new) in enumerate(out.scheduled):
            if request.sampling_params.prompt_logprobs is None:
                continue
            start = request.num_computed_tokens
            end = min(start + num_new, request.num_prompt_tokens - 1)
            if end > start:
                spans.append((request, start, end, int(query_start[i])))
        if not spans:
            return {}
        rows = np.concatenate([np.arange(q, q + end - start) for _, start, end, q in spans])
        targets = np.concatenate(
            [np.asarray(r.prompt_token_ids[s + 1 : e + 1], dtype=np.int64) for r, s, e, _ in spans]
        )
        k = max(r.sampling_params.prompt_logprobs or 0 for r, *_ in spans)
        width = 2 + 2 * k
        host: list[float] = []
        for lo in range(0, len(rows), _PROMPT_LOGPROB_ROWS):
            idx = torch.from_numpy(rows[lo : lo + _PROMPT_LOGPROB_ROWS]).to(self.device)
            target = torch.from_numpy(targets[lo : lo + _PROMPT_LOGPROB_ROWS]).to(self.device)
            logits = self.model.logits_on_first_rank(hidden[idx])  # [R, V]; None: a follower
            if logits is None:
                host += self._receive(len(idx) * width, torch.float64)[1]
                continue
            lp = torch.log_softmax(logits, dim=-1)
            chosen = lp.gather(1, target[:, None])  # [R, 1]
            parts = [chosen.double(), ((lp > chosen).sum(dim=-1, keepdim=True) + 1).double()]
            if k:
                values, ids = lp.topk(k, dim=-1)  # [R, k]
                parts += [ids.double(), values.double()]
            host += self._to_host(torch.cat(parts, dim=1).flatten())
        result: dict[str, tuple[int, list[PromptLogprob]]] = {}
        base = 0
        for request, start, end, _ in spans:
            row_k = request.sampling_params.prompt_logprobs or 0
            entries: list[PromptLogprob] = []
            for j in range(base, base + end - start):
                h = host[j * width : (j + 1) * width]
                entries.append(
                    (h[0], int(h[1]), [(int(h[2 + m]), h[2 + k + m]) for m in range(row_k)])
                )
            base += end - start
            result[request.request_id] = (start + 1, entries)
        return result
