"""`DraftModelProposer`: a smaller model with the target's tokenizer guesses the next tokens,
greedily, `k` forward steps per target step.

The draft has its own paged KV (a `KVCacheManager` and a `ModelRunner` with as many blocks as
the target's pool, block tables of the same shape) and keeps, per target request, a shadow
`Request` whose tokens are the target's plus its own last guesses. Before each proposal the
shadow is brought back to the longest prefix it shares with the target's tokens: KV past it
(rejected guesses) is recomputed, tokens the target added are computed in one chunk with the
first guess. Greedy guesses are a point mass, so verification is the same as ngram's.

Runs on the engine thread; refuses a draft whose vocabulary differs from the target's, and
tensor parallelism (the draft is not sharded).
"""

from __future__ import annotations

import logging

from engine.errors import InvalidInputError
from engine.kv_cache_manager import KVCacheManager
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.spec_decode.config import FIELD, SpeculativeConfig
from engine.spec_decode.proposer import Proposal, ProposeContext, Proposer, TargetInfo

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0, max_tokens=None)


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, config: SpeculativeConfig, target: TargetInfo) -> None:
        super().__init__(config, target)
        if target.tensor_parallel_size != 1:
            raise InvalidInputError(
                FIELD, "'method' draft_model runs without tensor parallelism only (TP size 1)"
            )
        assert config.model is not None  # SpeculativeConfig requires it
        loaded = load_model(config.model, target.dtype, target.device, progress=False)
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
            max_model_len=target.max_model_len,
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
