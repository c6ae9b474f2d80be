"""`DraftModelProposer`: a smaller model with the target's tokenizer guesses the next tokens,
greedily, `k` forward steps per target step.

The draft has its own paged KV (a `KVCacheManager` and a `ModelRunner` with as many blocks as
the target's pool, block tables of the same shape) and keeps, per target request, a shadow
`Request` whose tokens are the target's plus its own last guesses. Before each proposal the
shadow is brought back to the longest prefix it shares with the target's tokens: KV past it
(rejected guesses) is recomputed, tokens the target added are computed in one chunk with the
first guess. Greedy guesses are a point mass, so verification is the same as ngram's.

Disaggregated, the draft's KV over a prompt may come from the prefill worker instead
(`SpeculativeConfig.draft_prefill`): there `prefill_prompts` computes it beside the target's and
the blocks travel in the same transfer; on the decode worker `reserve_prompt` gives the
transfer draft blocks (held by the request's shadow) and `prompt_received` starts the shadow
with the prompt computed, so its first proposal computes only the tokens after the prompt.

Runs on the engine thread; refuses a draft whose vocabulary differs from the target's, and
tensor parallelism (the draft is not sharded).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from duet.engine.errors import InvalidInputError
from duet.engine.kv_cache_manager import KVCacheManager
from duet.engine.kv_sizing import DraftSizing
from duet.engine.loader import LoadedModel, load_model
from duet.engine.model_runner import ModelRunner
from duet.engine.request import Request
from duet.engine.sampling_params import SamplingParams
from duet.engine.scheduler import SchedulerOutput
from duet.engine.spec_decode.config import FIELD, SpeculativeConfig
from duet.engine.spec_decode.proposer import Proposal, ProposeContext, Proposer, TargetInfo

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0, max_tokens=None)


def load_draft(config: SpeculativeConfig, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """The draft model of `config` (method draft_model), on `device` in `dtype`."""
    assert config.model is not None  # SpeculativeConfig requires it
    return load_model(config.model, dtype, device, progress=False)


def draft_sizing(loaded: LoadedModel, block_size: int, dtype: torch.dtype) -> DraftSizing:
    """What `loaded`'s KV pool and graphs add to its target's KV budget (kv_sizing)."""
    model = loaded.model
    return DraftSizing(
        block_bytes=model.kv_spec.bytes_per_block(model.num_layers, block_size, dtype),
        num_heads=model.heads.num_heads,
        head_dim=loaded.arch.head_dim,
    )


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, config: SpeculativeConfig, target: TargetInfo) -> None:
        super().__init__(config, target)
        if target.tensor_parallel_size != 1:
            raise InvalidInputError(
                FIELD, "'method' draft_model runs without tensor parallelism only (TP size 1)"
            )
        assert config.model is not None  # SpeculativeConfig requires it
        loaded = target.draft_model or load_draft(config, target.dtype, target.device)
        draft_vocab = loaded.arch.vocab_size
        if draft_vocab != target.vocab_size or (
            loaded.tokenizer.vocab_size != target.tokenizer.vocab_size
        ):
            raise InvalidInputError(
                FIELD,
                f"'model' {config.model!r} has a vocabulary of {draft_vocab} tokens "
                f"(tokenizer {loaded.tokenizer.vocab_size}); the target's has "
                f"{target.vocab_size} (tokenizer {target.tokenizer.vocab_size}): a draft "
                "model must share the target's tokenizer",
            )
        self.kv = KVCacheManager(target.num_blocks, target.block_size, enable_caching=False)
        self.runner = ModelRunner(
            loaded.model, target.num_blocks, target.block_size, target.device, target.dtype,
            target.attention_backend, max_num_seqs=target.max_num_seqs,
            max_num_batched_tokens=target.max_num_batched_tokens + target.max_num_seqs,
            max_model_len=target.max_model_len, enforce_eager=target.enforce_eager,
            cuda_graph_mode=target.cuda_graph_mode,
        )  # fmt: skip
        self._shadows: dict[str, Request] = {}

    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        guesses: dict[str, list[int]] = {r.request_id: [] for r in ctx.requests}
        caps = dict(zip((r.request_id for r in ctx.requests), ctx.max_tokens, strict=True))
        shadows = [s for s in map(self._sync, ctx.requests) if s is not None]
        shadows = self._catch_up(shadows)
        # Step 1 computes each shadow's last token(s) and guesses one; later steps one more.
        batch = [(s, s.num_tokens - s.num_computed_tokens) for s in shadows]
        for step in range(max(ctx.max_tokens, default=0)):
            batch = [(s, n) for s, n in batch if caps[s.request_id] > step and self._allocate(s, n)]
            if not batch:
                break
            result = self._run(batch)
            for shadow, _ in batch:
                token = result[shadow.request_id][0]
                shadow.append_output_token(token)
                guesses[shadow.request_id].append(token)
            batch = [(s, 1) for s, _ in batch]
        # NOTE: input-batch slots are taken per call: shadows of preempted requests keep
        # their KV but must not hold slots the running ones need.
        self.runner.remove_requests([s.request_id for s in shadows])
        return [Proposal(guesses[r.request_id]) for r in ctx.requests]

    def _catch_up(self, shadows: list[Request]) -> list[Request]:
        """Compute, in chunks within the token budget, what the shadows lack beyond their last
        token (a new prompt, the target's accepted tokens). Returns the shadows that fit."""
        budget = self.target.max_num_batched_tokens
        while sum(s.num_tokens - s.num_computed_tokens for s in shadows) > budget:
            chunk, room = [], budget
            for shadow in shadows:
                gap = shadow.num_tokens - shadow.num_computed_tokens - 1
                if gap > 0 and room > 0 and self._allocate(shadow, min(gap, room)):
                    chunk.append((shadow, min(gap, room)))
                    room -= min(gap, room)
            if not chunk:
                return []
            self._run(chunk)
        return shadows

    def _run(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        out = SchedulerOutput(scheduled=batch, num_batched_tokens=sum(n for _, n in batch))
        result = self.runner.execute(out, self.kv)
        for shadow, num_new in batch:
            shadow.num_computed_tokens += num_new
        return result.sampled

    def release(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)
            self.runner.remove_requests([request_id])

    # -- disaggregation: the draft's prompt KV computed on the prefill worker ------------------

    def prefill_prompts(self, prompts: Sequence[tuple[str, Sequence[int]]]) -> dict[str, list[int]]:
        """Prefill side: compute the draft's KV over each whole prompt (in chunks within the
        token budget, at most `max_num_seqs` requests a pass) and return each one's blocks in
        the draft's pool, in prompt order. A prompt the pool cannot hold is left out (the
        decode worker then computes the draft itself). The blocks stay held until `release`."""
        shadows = []
        for request_id, prompt in prompts:
            shadow = Request(request_id, list(prompt), _GREEDY, max_tokens=1 << 30)
            if self._allocate(shadow, shadow.num_tokens):
                self._shadows[request_id] = shadow
                shadows.append(shadow)
        budget, max_seqs = self.target.max_num_batched_tokens, self.target.max_num_seqs
        for first in range(0, len(shadows), max_seqs):
            group = shadows[first : first + max_seqs]
            while pending := [s for s in group if s.num_computed_tokens < s.num_tokens]:
                batch, room = [], budget
                for shadow in pending:
                    if room > 0:
                        num_new = min(shadow.num_tokens - shadow.num_computed_tokens, room)
                        batch.append((shadow, num_new))
                        room -= num_new
                self._run(batch)
            self.runner.remove_requests([s.request_id for s in group])
        return {s.request_id: self.kv.get_block_ids(s.request_id) for s in shadows}

    def reserve_prompt(self, request_id: str, prompt: Sequence[int]) -> list[int] | None:
        """Decode side: blocks of the draft's pool for a prompt whose draft KV a prefill worker
        sends, held by the request's shadow (freed by `release`); None when the pool cannot
        hold them (the shadow then catches up here)."""
        shadow = Request(request_id, list(prompt), _GREEDY, max_tokens=1 << 30)
        if not self._allocate(shadow, shadow.num_tokens):
            return None
        self._shadows[request_id] = shadow
        return self.kv.get_block_ids(request_id)

    def prompt_received(self, request_id: str, received: bool) -> None:
        """Decode side: the prompt's transfer ended. `received`: the draft's KV is in the
        blocks `reserve_prompt` gave (the shadow starts with the prompt computed); otherwise
        they are freed and the shadow catches up at the first proposal."""
        shadow = self._shadows.get(request_id)
        if shadow is None:
            return
        if received:
            shadow.num_computed_tokens = shadow.num_tokens
        else:
            self.release(request_id)

    def _sync(self, request: Request) -> Request | None:
        """The request's shadow, its tokens the request's and its KV valid up to the prefix
        they share."""
        shadow = self._shadows.get(request.request_id)
        tokens = request.all_token_ids
        if shadow is None:
            shadow = Request(request.request_id, tokens, _GREEDY, max_tokens=1 << 30)
            self._shadows[request.request_id] = shadow
            return shadow
        common = 0
        limit = min(shadow.num_computed_tokens, len(tokens))
        old = shadow.all_token_ids
        while common < limit and old[common] == tokens[common]:
            common += 1
        shadow.all_token_ids = list(tokens)
        shadow.output_token_ids = []
        shadow.num_computed_tokens = min(common, len(tokens) - 1)
        return shadow

    def _allocate(self, shadow: Request, num_new: int) -> bool:
        if self.kv.allocate_slots(shadow, num_new) is not None:
            return True
        logger.debug("draft KV pool full: no guess for %s this step", shadow.request_id)
        return False
