"""`SamplingSlots`: each running request's sampling parameters, kept per slot of the
`InputBatch` and written once when the request joins, plus the per-slot token counts that
penalties read. `prepare` gathers the rows that sample this step into one host buffer and
copies it to the device: a step builds no tensor from Python objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from duet.engine.random import uniform
from duet.engine.request import Request
from duet.engine.structured_output import GrammarState, bitmask_words

BufferFn = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]

# Rows of the float staging buffer, one value per sampled request.
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION, _UNIFORM = range(7)
_NUM_FLOAT_ROWS = 7
# Rows of the int staging buffer.
_TOP_K, _SLOT, _WANT, _GREEDY = range(4)
_NUM_INT_ROWS = 4


@dataclass
class SamplingBatch:
    """The sampling parameters of the N requests that sample this step, on the logits'
    device (views of the slots' buffers, valid until the next `prepare`)."""

    num_rows: int
    temperature: torch.Tensor  # [N] fp64; greedy rows hold 1.0 (they take the argmax)
    top_p: torch.Tensor  # [N]
    min_p: torch.Tensor  # [N]
    top_k: torch.Tensor  # [N] long; the vocabulary size where unset
    greedy: torch.Tensor | None  # [N] bool; None when every row is greedy
    uniform: torch.Tensor  # [N] fp64 in (0, 1): this token's draw (engine.random)
    presence: torch.Tensor  # [N]
    frequency: torch.Tensor  # [N]
    repetition: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] long: rows of the token counts
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    max_top_k: int  # the largest top-k asked (0 when none)
    any_top_p: bool
    any_min_p: bool
    any_penalties: bool
    # (row, token ids) not to draw: stop tokens before min_tokens, what bad words forbid next
    stop_masks: list[tuple[int, list[int]]]
    logprob_rows: torch.Tensor  # [W] long: rows that asked for logprobs
    logprob_ks: list[int]  # [W] top alternatives each asked for
    logprob_host_rows: list[int]  # [W] the rows of `logprob_rows`, on the host
    counts: torch.Tensor | None  # [slots, V] int32 output-token counts (with penalties)
    prompt_mask: torch.Tensor | None  # [slots, V] bool: prompt tokens (with penalties)
    bitmask: torch.Tensor | None = None  # [N, ceil(V/32)] int32 allowed tokens (with grammars)
    # logit_bias: (row, token ids [B] long, biases [B] fp32), on the logits' device.
    biases: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # allowed_token_ids: (row, token ids [A] long), on the logits' device.
    allowed: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # With speculation and penalties: (rows, token ids) to count on top of the slot's counts,
    # the proposed tokens before each row.
    draft_counts: tuple[torch.Tensor, torch.Tensor] | None = None


class SamplingSlots:
    def __init__(
        self,
        num_slots: int,
        vocab_size: int,
        device: torch.device,
        buffer: BufferFn,
        max_rows: int | None = None,
    ) -> None:
        """`max_rows`: most sampling rows in one step (default one per slot; with speculation,
        a request samples one row per proposed token plus one)."""
        cpu = torch.device("cpu")
        rows = self._max_rows = max(num_slots, max_rows or 0)
        self.vocab_size = vocab_size
        self.device = device
        self._buffer = buffer
        self._temperature = np.zeros(num_slots)
        self._top_p = np.ones(num_slots)
        self._min_p = np.zeros(num_slots)
        self._top_k = np.full(num_slots, vocab_size, dtype=np.int64)
        self._presence = np.zeros(num_slots)
        self._frequency = np.zeros(num_slots)
        self._repetition = np.ones(num_slots)
        self._seed = [0] * num_slots
        self._penalized = [False] * num_slots
        # Each slot's logit_bias as device tensors (ids, values), made once when it joins.
        self._bias: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots
        # Each slot's allowed_token_ids as a device tensor, made once when it joins.
        self._allowed: list[torch.Tensor | None] = [None] * num_slots
        # Slots whose request only takes the argmax (greedy; no penalties, min_tokens, logprobs
        # or grammar): a step of only such rows reads no per-row parameter (`_plain_batch`).
        self._plain = [False] * num_slots
        self._plain_batches: dict[int, SamplingBatch] = {}
        self._floats_host = buffer((_NUM_FLOAT_ROWS, rows), torch.float64, cpu)
        self._ints_host = buffer((_NUM_INT_ROWS, rows), torch.int64, cpu)
        on_cpu = device.type == "cpu"
        self._floats_dev = (
            self._floats_host if on_cpu else buffer((_NUM_FLOAT_ROWS, rows), torch.float64, device)
        )
        self._ints_dev = (
            self._ints_host if on_cpu else buffer((_NUM_INT_ROWS, rows), torch.int64, device)
        )
        self._floats_np = self._floats_host.numpy()
        self._ints_np = self._ints_host.numpy()
        self._ones = buffer((rows,), torch.int32, device)
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}  # views of n rows (`_views_of`)
        self._want_views = [self._ints_dev[_WANT, :w] for w in range(rows + 1)]
        self._ones.fill_(1)
        self.counts: torch.Tensor | None = None  # made when the first penalized request joins
        self.prompt_mask: torch.Tensor | None = None
        # Made when the first request with a grammar joins: host (pinned on CUDA) and device.
        self._bitmask_host: torch.Tensor | None = None
        self._bitmask_dev: torch.Tensor | None = None

    def write(self, slot: int, request: Request) -> None:
        """A request joins `slot`: keep its parameters (and its token counts if it has
        penalties: its output so far, e.g. after a preemption or a remote prefill)."""
        p = request.sampling_params
        greedy = p.greedy
        self._temperature[slot] = 1.0 if greedy else p.temperature
        self._top_p[slot] = p.top_p
        self._min_p[slot] = p.min_p
        self._top_k[slot] = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
        self._presence[slot] = p.presence_penalty
        self._frequency[slot] = p.frequency_penalty
        self._repetition[slot] = p.repetition_penalty
        self._seed[slot] = request.sample_seed
        self._penalized[slot] = p.needs_penalties
        self._bias[slot] = None
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=self.device)
            values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
            self._bias[slot] = ids, values.to(self.device)
        self._allowed[slot] = None
        if p.allowed_token_ids:
            self._allowed[slot] = torch.tensor(
                p.allowed_token_ids, dtype=torch.long, device=self.device
            )
        self._plain[slot] = (
            greedy
            and not p.logit_bias
            and not p.allowed_token_ids
            and not p.bad_words
            and not p.needs_penalties
            and p.min_tokens == 0
            and p.logprobs is None
            and request.grammar is None
        )
        if p.needs_penalties:
            counts, mask = self._penalty_buffers()
            vocab = self.vocab_size
            counts[slot].zero_()
            mask[slot].zero_()
            if request.output_token_ids:
                out = torch.tensor(request.output_token_ids, device=self.device)
                counts[slot] += torch.bincount(out[out < vocab], minlength=vocab).to(counts.dtype)
            prompt = torch.tensor(request.prompt_token_ids, device=self.device)
            mask[slot, prompt[prompt < vocab]] = True

    def _bitmask_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bitmask_host is None or self._bitmask_dev is None:
            # A row per sampling row, not per slot: grammar rows share a step with the rows of
            # speculating requests.
            shape = (self._max_rows, bitmask_words(self.vocab_size))
            self._bitmask_host = self._buffer(shape, torch.int32, torch.device("cpu"))
            self._bitmask_dev = (
                self._bitmask_host
                if self.device.type == "cpu"
                else self._buffer(shape, torch.int32, self.device)
            )
        return self._bitmask_host, self._bitmask_dev

    def _penalty_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None or self.prompt_mask is None:
            shape = (len(self._seed), self.vocab_size)
            self.counts = self._buffer(shape, torch.int32, self.device)
            self.prompt_mask = self._buffer(shape, torch.bool, self.device)
        return self.counts, self.prompt_mask

    def prepare(
        self,
        requests: Sequence[Request],
        slots: np.ndarray,
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """Gather the sampling rows of `requests` (those that sample this step, in order;
        `slots` their rows) and copy them to the device.

        `drafts`: each request's proposed tokens, when some speculate. A request with d of them
        samples d + 1 rows, the target's distribution after its last token and after each
        proposed one: row j is drawn as the token at position `num_tokens + j` would be with
        the proposed tokens before it taken (its uniform, min_tokens and penalty counts)."""
        if drafts is None:
            plain = self._plain
            for slot in slots.tolist():
                if not plain[slot]:
                    break
            else:
                return self._plain_batch(len(requests), slots)
        offsets: list[int] | None = None
        drafts_of: dict[int, Sequence[int]] | None = None  # first row -> proposed tokens
        draft_counts: list[tuple[int, int]] = []
        if drafts is not None and any(drafts):
            rows_of: list[Request] = []
            offsets = []
            row_slots = []
            drafts_of = {}
            for request, slot, draft in zip(requests, slots, drafts, strict=True):
                drafts_of[len(rows_of)] = draft
                for j in range(len(draft) + 1):
                    rows_of.append(request)
                    offsets.append(j)
                    row_slots.append(slot)
                    draft_counts.extend((len(rows_of) - 1, t) for t in draft[:j])
            requests = rows_of
            slots = np.asarray(row_slots, dtype=np.int64)
        n = len(requests)
        idx = slots
        floats, ints = self._floats_np, self._ints_np
        ints[_SLOT, :n] = idx
        all_greedy = True
        any_greedy = False
        any_penalties = False
        stop_masks: list[tuple[int, list[int]]] = []
        logprob_ks: list[int] = []
        logprob_rows: list[int] = []
        grammars: list[tuple[int, GrammarState, Sequence[int]]] = []
        biases: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        allowed: list[tuple[int, torch.Tensor]] = []
        for row, request in enumerate(requests):
            slot = int(idx[row])
            if (bias := self._bias[slot]) is not None:
                biases.append((row, *bias))
            if (ids := self._allowed[slot]) is not None:
                allowed.append((row, ids))
            params = request.sampling_params
            ahead = offsets[row] if offsets is not None else 0  # proposed tokens before it
            if not params.greedy:
                all_greedy = False
                floats[_UNIFORM, row] = uniform(self._seed[slot], request.num_tokens + ahead)
                ints[_GREEDY, row] = 0
            else:
                floats[_UNIFORM, row] = 0.5
                ints[_GREEDY, row] = 1
                any_greedy = True
            any_penalties = any_penalties or self._penalized[slot]
            if request.grammar is not None:
                # NOTE: no min_tokens mask here: the grammar alone says when EOS may come.
                if not ahead:  # its rows after proposed tokens are filled with this one
                    draft = drafts_of[row] if drafts_of is not None else ()
                    grammars.append((row, request.grammar, draft))
            elif request.num_output_tokens + ahead < params.min_tokens:
                stops = [*params.stop_token_ids]
                if not params.ignore_eos:
                    stops.extend(request.eos_token_ids)
                stops = [t for t in stops if t < self.vocab_size]
                if stops:
                    stop_masks.append((row, stops))
            if request.bad_words_token_ids:
                before = drafts_of[row - ahead][:ahead] if drafts_of is not None else ()
                banned = [t for t in request.banned_next(before) if t < self.vocab_size]
                if banned:
                    stop_masks.append((row, banned))
            if params.logprobs is not None:
                ints[_WANT, len(logprob_ks)] = row
                logprob_ks.append(params.logprobs)
                logprob_rows.append(row)
        # NOTE: an all-greedy batch without penalties reads none of the per-row parameters
        # (the sampler takes the argmax), so their gathers are skipped: they stay stale.
        max_top_k, any_top_p, any_min_p = 0, False, False
        if not all_greedy or any_penalties:
            for row, src in (
                (_TEMPERATURE, self._temperature),
                (_TOP_P, self._top_p),
                (_MIN_P, self._min_p),
                (_PRESENCE, self._presence),
                (_FREQUENCY, self._frequency),
                (_REPETITION, self._repetition),
            ):
                np.take(src, idx, out=floats[row, :n])
            np.take(self._top_k, idx, out=ints[_TOP_K, :n])
        if not all_greedy:
            asked = ints[_TOP_K, :n]
            asked = asked[asked < self.vocab_size]
            max_top_k = int(asked.max()) if asked.size else 0
            any_top_p = bool((floats[_TOP_P, :n] < 1.0).any())
            any_min_p = bool((floats[_MIN_P, :n] > 0.0).any())
        bitmask = self._fill_bitmask(n, grammars) if grammars else None
        if self._floats_dev is not self._floats_host:
            self._floats_dev.copy_(self._floats_host, non_blocking=True)
            self._ints_dev.copy_(self._ints_host, non_blocking=True)
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = self._views_of(n)
        (
            temperature, top_p, min_p, top_k, greedy, uniform_, presence, frequency, repetition,
            slot_ids,
        ) = views  # fmt: skip
        return SamplingBatch(
            num_rows=n,
            temperature=temperature,
            top_p=top_p,
            min_p=min_p,
            top_k=top_k,
            greedy=None if all_greedy else greedy.bool(),
            uniform=uniform_,
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            slots=slot_ids,
            all_greedy=all_greedy,
            any_greedy=any_greedy,
            any_top_k=max_top_k > 0,
            max_top_k=max_top_k,
            any_top_p=any_top_p,
            any_min_p=any_min_p,
            any_penalties=any_penalties,
            stop_masks=stop_masks,
            logprob_rows=self._want_views[len(logprob_ks)],
            logprob_ks=logprob_ks,
            logprob_host_rows=logprob_rows,
            counts=self.counts if any_penalties else None,
            prompt_mask=self.prompt_mask if any_penalties else None,
            bitmask=bitmask,
            biases=biases,
            allowed=allowed,
            draft_counts=self._draft_counts(draft_counts)
            if any_penalties and draft_counts
            else None,
        )

    def _plain_batch(self, n: int, slots: np.ndarray) -> SamplingBatch:
        """`prepare` of n plain rows (see `_plain`): the sampler takes the argmax and reads no
        per-row parameter, so the batch is the same every step of n rows (made once per n).
        Only the slot ids are written, when token counts exist (`record` reads them)."""
        if self.counts is not None:
            self._ints_np[_SLOT, :n] = slots
            if self._ints_dev is not self._ints_host:
                self._ints_dev.copy_(self._ints_host, non_blocking=True)
        batch = self._plain_batches.get(n)
        if batch is None:
            views = self._views.get(n)
            if views is None:
                views = self._views[n] = self._views_of(n)
            temperature, top_p, min_p, top_k, _, uniform_, presence, frequency, repetition, ids = (
                views
            )
            batch = self._plain_batches[n] = SamplingBatch(
                num_rows=n,
                temperature=temperature,
                top_p=top_p,
                min_p=min_p,
                top_k=top_k,
                greedy=None,
                uniform=uniform_,
                presence=presence,
                frequency=frequency,
                repetition=repetition,
                slots=ids,
                all_greedy=True,
                any_greedy=True,
                any_top_k=False,
                max_top_k=0,
                any_top_p=False,
                any_min_p=False,
                any_penalties=False,
                stop_masks=[],
                logprob_rows=self._want_views[0],
                logprob_ks=[],
                logprob_host_rows=[],
                counts=None,
                prompt_mask=None,
            )
        return batch

    def _views_of(self, n: int) -> tuple[torch.Tensor, ...]:
        """The first `n` rows of each device buffer row, made once per `n`."""
        f, i = self._floats_dev, self._ints_dev
        return (
            f[_TEMPERATURE, :n], f[_TOP_P, :n], f[_MIN_P, :n], i[_TOP_K, :n], i[_GREEDY, :n],
            f[_UNIFORM, :n], f[_PRESENCE, :n], f[_FREQUENCY, :n], f[_REPETITION, :n],
            i[_SLOT, :n],
        )  # fmt: skip

    def _draft_counts(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.tensor([r for r, _ in pairs], dtype=torch.long, device=self.device)
        tokens = torch.tensor([t for _, t in pairs], dtype=torch.long, device=self.device)
        return rows, tokens.clamp(max=self.vocab_size - 1)

    def _fill_bitmask(
        self, n: int, grammars: list[tuple[int, GrammarState, Sequence[int]]]
    ) -> torch.Tensor:
        """Each grammar row's allowed tokens (every token for the other rows; a speculating
        request's rows after each proposed token from its grammar with those tokens taken),
        copied to the device without waiting. On a GPU this host work overlaps the forward
        pass, which was launched before `prepare`."""
        host, dev = self._bitmask_buffers()
        host[:n].fill_(-1)
        for row, grammar, draft in grammars:
            if draft:
                grammar.fill_bitmask(host, row, draft)
        GrammarState.fill_bitmasks(host, [(row, g) for row, g, draft in grammars if not draft])
        if dev is not host:
            dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n]

    def record(
        self, batch: SamplingBatch, token_ids: torch.Tensor, rows: list[int] | None = None
    ) -> None:
        """Count this step's sampled tokens (on the device, no sync) for later penalties.
        `rows`: only these rows' tokens (with speculation: the tokens verification kept)."""
        if self.counts is None:
            return
        if rows is None:
            self.counts.index_put_(
                (batch.slots, token_ids), self._ones[: batch.num_rows], accumulate=True
            )
        elif rows:
            keep = torch.tensor(rows, dtype=torch.long, device=token_ids.device)
            self.counts.index_put_(
                (batch.slots[keep], token_ids[keep]), self._ones[: len(rows)], accumulate=True
            )
