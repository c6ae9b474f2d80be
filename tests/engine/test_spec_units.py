"""Speculative decoding's parts without a model: the ngram lookup, the config's errors, the
verification rule, the rejection sampler's distribution, the adaptive back-off."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from duet.engine import SamplingParams
from duet.engine.config import EngineConfig
from duet.engine.errors import InvalidInputError
from duet.engine.random import uniform
from duet.engine.request import Request
from duet.engine.sampler import Sampler
from duet.engine.sampling_slots import SamplingSlots
from duet.engine.spec_decode.config import SpeculativeConfig
from duet.engine.spec_decode.ngram import ngram_lookup
from duet.engine.spec_decode.proposer import Proposal, ProposeContext, Proposer, TargetInfo
from duet.engine.spec_decode.speculator import Speculator
from duet.engine.spec_decode.verify import accept_point_mass, rejection_sample

# -- ngram --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "n_min", "n_max", "k", "expected"),
    [
        # The longest suffix that occurs earlier wins: [3, 4] after index 1 -> 9, 9.
        ([1, 3, 4, 9, 9, 7, 4, 5, 3, 4], 1, 3, 2, [9, 9]),
        # Most recent occurrence of [5] is followed by [6, 7] (not the earlier [8, 1]).
        ([5, 8, 1, 5, 6, 7, 2, 5], 1, 1, 2, [6, 7]),
        # A run of one token: the most recent match followed by k tokens.
        ([7, 7, 7, 7, 7], 1, 2, 3, [7, 7, 7]),
        # Near the end only what follows: k capped by the sequence.
        ([1, 2, 3, 1, 2], 2, 2, 5, [3, 1, 2]),
        # Shorter than prompt_lookup_min never matches.
        ([1, 2, 3, 1, 2], 3, 4, 2, []),
        # No earlier occurrence at all.
        ([1, 2, 3, 4], 1, 3, 2, []),
        ([1, 2, 1], 1, 3, 0, []),
    ],
)
def test_ngram_lookup(tokens, n_min, n_max, k, expected):
    assert ngram_lookup(np.asarray(tokens), n_min, n_max, k) == expected


# -- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "ngram", "num_spec_tokens": 3}, "'num_spec_tokens' is not a key"),
        ({"num_speculative_tokens": 3}, "'method' is required"),
        ({"method": "medusa"}, "'method' must be one of ngram, draft_model; got 'medusa'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens' must be"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "got '3'"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "'prompt_lookup_max' must be an integer in [4, 1024]; got 2"),
        ({"method": "ngram", "min_acceptance_rate": 1.5}, "'min_acceptance_rate' must be"),
        ({"method": "ngram", "model": "/x"}, "'model' applies to method draft_model only"),
        ({"method": "draft_model"}, "'model' is required with method draft_model"),
        ({"method": "ngram", "draft_prefill": "prefill"},
         "'draft_prefill' applies to method draft_model only; got it with 'ngram'"),
        ({"method": "draft_model", "model": "/x", "draft_prefill": 1},
         "'draft_prefill' must be one of decode, prefill, auto; got 1"),
        ([1], "must be a JSON object"),
    ],
)  # fmt: skip
def test_bad_speculative_config_names_the_key(value, message):
    with pytest.raises(InvalidInputError) as info:
        EngineConfig(speculative_config=value)
    assert info.value.field == "speculative_config"
    assert message in str(info.value)


def test_speculative_config_from_dict():
    config = EngineConfig(
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    ).speculative()
    assert config == SpeculativeConfig("ngram", 4, 2, 3)
    assert EngineConfig().speculative() is None


@pytest.mark.parametrize(
    ("draft_prefill", "min_tokens", "remote"),
    [(None, None, [False, False]), ("decode", None, [False, False]),
     ("prefill", None, [True, True]), ("auto", None, [False, True]), ("auto", 100, [True, True])],
)  # fmt: skip
def test_where_the_draft_is_prefilled(draft_prefill, min_tokens, remote):
    """By prompt length (100 and 256 tokens): auto ships it from 256 tokens by default."""
    config = SpeculativeConfig(
        "draft_model", model="/x", draft_prefill=draft_prefill, draft_prefill_min_tokens=min_tokens
    )
    assert [config.prefills_draft_remotely(n) for n in (100, 256)] == remote
    assert config.drafts_on_prefill == (draft_prefill in ("prefill", "auto"))
    assert not SpeculativeConfig("ngram").prefills_draft_remotely(1000)


# -- verification --------------------------------------------------------------------------------


def test_accept_point_mass_keeps_agreeing_prefix_plus_one():
    drafts = [[5, 6, 7], [], [1, 2], [9]]
    rows = [5, 6, 8, 4, 3, 1, 2, 0, 9, 11]
    #       r0: 5=5 6=6 8!=7 -> [5, 6, 8]; r1: [3]; r2: 1, 2 then bonus 0; r3: 9, bonus 11
    tokens, kept = accept_point_mass(rows, drafts)
    assert tokens == [[5, 6, 8], [3], [1, 2, 0], [9, 11]]
    assert kept == [0, 1, 2, 4, 5, 6, 7, 8, 9]


# Chi-square critical value for 7 degrees of freedom at p = 0.001.
CHI2_7_999 = 24.32


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn where the target has no mass
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _target(temperature: float, top_p: float) -> torch.Tensor:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0], dtype=torch.float64)
    probs = torch.softmax(logits / temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    keep = (ordered.cumsum(0) - ordered) < top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = ordered[keep]
    return out / out.sum()


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 1.0), (1.5, 0.8)])
@pytest.mark.parametrize("draft_kind", ["point", "uniform", "equal"])
def test_rejection_sample_preserves_the_target_distribution(temperature, top_p, draft_kind):
    """20,000 draws of the first emitted token (k = 2 proposals) follow the target exactly,
    whatever the draft; with the draft equal to the target every proposal is accepted."""
    p = _target(temperature, top_p)
    vocab, k, draws = 8, 2, 20_000
    target = p.expand(k + 1, vocab)
    gen = torch.Generator().manual_seed(1234)
    counts = np.zeros(vocab)
    num_accepted = 0
    for _ in range(draws):
        if draft_kind == "point":
            q = None
            ids = torch.tensor([1, 1])
        else:
            dist = p if draft_kind == "equal" else torch.full((vocab,), 1.0 / vocab)
            q = dist.expand(k, vocab)
            ids = torch.multinomial(q, 1, generator=gen)[:, 0]
        u = torch.rand(2, k + 1, generator=gen, dtype=torch.float64)
        tokens, accepted = rejection_sample(target, ids, q, u[0], u[1])
        counts[tokens[0]] += 1
        num_accepted += accepted
        assert len(tokens) == accepted + 1
    assert _chi2(counts, p.numpy()) < CHI2_7_999
    if draft_kind == "equal":
        assert num_accepted == k * draws


def test_engine_point_mass_verification_follows_the_target():
    """The engine's path (sampler rows + `accept_point_mass`): 20,000 seeded requests, each
    with one proposed token; the first token is distributed as the target (temperature 0.8,
    top-p 0.9), the proposal is accepted at the rate p(d), and after an acceptance the bonus
    token is the target's too."""
    vocab, n, d = 8, 20_000, 2
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    params = SamplingParams(temperature=0.8, top_p=0.9)
    slots = SamplingSlots(n, vocab, torch.device("cpu"), _buffer, max_rows=2 * n)
    requests = []
    for i in range(n):
        r = Request(f"r{i}", [1, 2], params, max_tokens=8, sample_seed=i)
        slots.write(i, r)
        requests.append(r)
    batch = slots.prepare(requests, np.arange(n), [[d]] * n)
    out = Sampler()(logits.expand(2 * n, vocab).clone(), batch, lambda t: t.tolist())
    tokens, _ = accept_point_mass(out.token_ids, [[d]] * n)
    p = _target(0.8, 0.9).numpy()
    first = np.bincount([t[0] for t in tokens], minlength=vocab)
    assert _chi2(first, p) < CHI2_7_999
    accepted = [t for t in tokens if len(t) == 2]
    assert len(accepted) == first[d]
    bonus = np.bincount([t[1] for t in accepted], minlength=vocab)
    assert _chi2(bonus, p) < CHI2_7_999
    # Row 0's draw is the plain draw: the same uniform (seed, position) a decode would use.
    assert batch.uniform[0].item() == uniform(0, 2) and batch.uniform[1].item() == uniform(0, 3)


def _buffer(shape, dtype, device):
    return torch.zeros(shape, dtype=dtype, device=device)


# -- adaptive back-off ---------------------------------------------------------------------------


class _Fixed(Proposer):
    method = "fixed"

    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        return [Proposal([1] * k) for k in ctx.max_tokens]


def _target_info(max_model_len: int) -> TargetInfo:
    return TargetInfo(512, None, torch.device("cpu"), torch.float32, 16, 64, max_model_len,  # type: ignore[arg-type]
                      8, 256, "auto", 1)  # fmt: skip


def _decoding(request_id: str, max_tokens: int = 100) -> Request:
    r = Request(request_id, [4, 5, 6], SamplingParams(), max_tokens=max_tokens)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_backoff_pauses_double_and_reset_on_a_good_probe():
    config = SpeculativeConfig(num_speculative_tokens=2, max_backoff_steps=4)
    spec = Speculator(config, _target_info(max_model_len=1000))
    spec.proposer = _Fixed(config, spec.proposer.target)
    r = _decoding("a")

    def proposes() -> bool:
        spec.propose([r])
        return bool(r.spec_token_ids)

    assert proposes()
    pattern = []
    for _ in range(4):  # every probe fails: pauses of 1, 2, 4, 4 steps
        spec.observe("a", 2, 0)
        steps = 0
        while not proposes():
            steps += 1
        pattern.append(steps)
    assert pattern == [1, 2, 4, 4]
    spec.observe("a", 2, 2)  # a probe that pays: no pause
    assert proposes() and proposes()
    assert spec.stats.num_backoffs == 4
    assert spec.stats.num_draft_tokens == 10 and spec.stats.num_accepted_tokens == 2
    assert spec.stats.num_accepted_tokens_per_pos == [1, 1]


def test_lookahead_grows_on_full_runs_and_shrinks_to_the_accepted_run():
    config = SpeculativeConfig(num_speculative_tokens=8)
    spec = Speculator(config, _target_info(max_model_len=1000))
    spec.proposer = _Fixed(config, spec.proposer.target)
    r = _decoding("a")
    sizes = []
    for accepted in (3, None, None, 0, None, 1):  # None: every guess accepted
        spec.propose([r])
        sizes.append(len(r.spec_token_ids))
        spec.observe("a", sizes[-1], sizes[-1] if accepted is None else accepted)
    spec.propose([r])
    sizes.append(len(r.spec_token_ids))
    # 3 kept of 8: the run plus one; all kept: double, up to 8; none kept: 2 at least
    assert sizes == [8, 4, 8, 8, 2, 4, 2]
    fixed = SpeculativeConfig(num_speculative_tokens=8, adaptive=False)
    spec = Speculator(fixed, _target_info(max_model_len=1000))
    spec.proposer = _Fixed(fixed, spec.proposer.target)
    spec.observe("a", 8, 1)
    assert spec.lookahead("a") == 8


def test_proposals_are_capped_by_max_tokens_and_context():
    config = SpeculativeConfig(num_speculative_tokens=5)
    spec = Speculator(config, _target_info(max_model_len=8))
    spec.proposer = _Fixed(config, spec.proposer.target)
    near_max = _decoding("m", max_tokens=3)  # 0 out, so 2 guesses at most (then a bonus)
    near_context = _decoding("c")  # 3 tokens in a context of 8: 4 guesses at most
    prefilling = _decoding("p")
    prefilling.num_computed_tokens = 0
    spec.propose([near_max, near_context, prefilling])
    assert [near_max.spec_token_ids, near_context.spec_token_ids, prefilling.spec_token_ids] == [
        [1, 1],
        [1, 1, 1, 1],
        [],
    ]


def _target_on(device: str) -> TargetInfo:
    return dataclasses.replace(_target_info(max_model_len=1000), device=torch.device(device))


@pytest.mark.parametrize(
    ("limit", "device", "num_decoding", "proposes"),
    [
        (None, "cpu", 4, True),  # the CPU default: up to 4 decoding requests speculate
        (None, "cpu", 5, False),
        (None, "meta", 64, True),  # no default limit off the CPU
        (2, "cpu", 2, True),
        (2, "cpu", 3, False),
        (16, "cpu", 16, True),
    ],
)
def test_no_proposals_above_disable_by_batch_size(limit, device, num_decoding, proposes):
    config = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=limit)
    spec = Speculator(config, _target_on(device))
    spec.proposer = _Fixed(config, spec.proposer.target)
    requests = [_decoding(f"r{i}") for i in range(num_decoding)]
    prefilling = _decoding("p")  # a prefill chunk beside them does not count
    prefilling.num_computed_tokens = 0
    spec.propose([*requests, prefilling])
    expected = [1, 1] if proposes else []
    assert [r.spec_token_ids for r in requests] == [expected] * num_decoding
    assert prefilling.spec_token_ids == []
    assert spec.stats.num_draft_tokens == 0  # counted at verification, not at proposal


def test_disable_by_batch_size_is_checked():
    with pytest.raises(InvalidInputError, match="'disable_by_batch_size' must be an integer"):
        EngineConfig(speculative_config={"method": "ngram", "disable_by_batch_size": 0})
