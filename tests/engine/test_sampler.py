"""The sampler's draw: counter-based, on the logits' device, exact in distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from duet.engine import SamplingParams
from duet.engine.config import EngineConfig
from duet.engine.llm_engine import LLMEngine
from duet.engine.random import SeedSource, uniform
from duet.engine.request import Request
from duet.engine.sampler import Sampler
from duet.engine.sampling_slots import SamplingSlots


class RecordDevices(TorchFunctionMode):
    """Every torch call's tensor arguments' devices, and any `generator=` it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[torch.device] = set()
        self.generators: list[object] = []
        self.num_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.num_calls += 1
        for value in [*args, *kwargs.values()]:
            for item in value if isinstance(value, list | tuple) else [value]:
                if isinstance(item, torch.Tensor):
                    self.devices.add(item.device)
        if kwargs.get("generator") is not None:
            self.generators.append(kwargs["generator"])
        return func(*args, **kwargs)


def _slots(vocab: int) -> SamplingSlots:
    def buffer(shape, dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)

    return SamplingSlots(8, vocab, torch.device("cpu"), buffer)


def _request(i: int, params: SamplingParams, seed: int) -> Request:
    r = Request(f"r{i}", [1, 2, 3, 4 + i], params, max_tokens=8, sample_seed=seed)
    r.append_output_token(5)
    return r


def test_every_tensor_the_sampler_touches_is_on_the_logits_device_and_no_generator():
    """The GPU crash (a CPU generator handed to a CUDA tensor's `exponential_`) cannot come
    back: the draw takes no generator at all, and every tensor it reads or makes lives where
    the logits do."""
    vocab = 50
    slots = _slots(vocab)
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, top_p=0.8, seed=3),
        SamplingParams(temperature=1.1, top_k=5, min_p=0.1),
        SamplingParams(temperature=0.7, presence_penalty=1.0, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, logprobs=4, min_tokens=4, stop_token_ids=[7]),
    ]
    requests = [_request(i, p, seed=100 + i) for i, p in enumerate(kinds)]
    for slot, r in enumerate(requests):
        slots.write(slot, r)
    logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(0))
    batch = slots.prepare(requests, np.arange(len(requests)))
    record = RecordDevices()
    with record:
        out = Sampler()(logits, batch, lambda t: t.tolist())
        slots.record(batch, out.token_tensor)
    assert record.num_calls > 20  # the mode saw the sampler's work
    assert record.devices == {logits.device}
    assert record.generators == []
    assert out.token_ids[0] == int(logits[0].argmax())
    assert 7 != out.token_ids[4]  # min_tokens: the stop token cannot be drawn yet
    assert out.logprobs[4] is not None and len(out.logprobs[4][1]) == 4
    assert [lp is None for lp in out.logprobs] == [True, True, True, True, False]


def test_uniform_is_a_pure_function_of_seed_and_position():
    draws = [uniform(s, p) for s in range(50) for p in range(200)]
    assert draws == [uniform(s, p) for s in range(50) for p in range(200)]
    assert all(0.0 < u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    # Uniform: each tenth of (0, 1) holds 10% of 10,000 draws, within 4 standard deviations.
    counts = np.bincount((np.array(draws) * 10).astype(int), minlength=10)
    sd = math.sqrt(len(draws) * 0.1 * 0.9)
    assert np.abs(counts - len(draws) / 10).max() < 4 * sd


def test_seed_source_repeats_with_the_engine_seed():
    a, b, c = SeedSource(1), SeedSource(1), SeedSource(2)
    first = [a.next_seed() for _ in range(5)]
    assert first == [b.next_seed() for _ in range(5)]
    assert first != [c.next_seed() for _ in range(5)]


def test_inverse_cdf_draw_follows_the_distribution():
    """4,000 draws (one per position) from a fixed 4-token distribution: frequencies within
    4 standard deviations of the probabilities; zero-probability tokens never drawn."""
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    logits = torch.log(probs).repeat(1, 1)
    slots = _slots(5)
    counts = [0] * 5
    params = SamplingParams(temperature=1.0, seed=11)
    num = 4000
    for position in range(num):
        r = Request("r", list(range(position + 1)), params, max_tokens=1, sample_seed=11)
        slots.write(0, r)
        batch = slots.prepare([r], np.zeros(1, dtype=np.int64))
        counts[Sampler()(logits, batch, lambda t: t.tolist()).token_ids[0]] += 1
    assert counts[1] == counts[4] == 0
    for token, p in ((0, 0.5), (2, 0.3), (3, 0.2)):
        assert abs(counts[token] - num * p) < 4 * math.sqrt(num * p * (1 - p))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(
        EngineConfig(
            model=tiny_llama,
            dtype="float32",
            load_progress=False,
            num_kv_blocks=12,
            enable_prefix_caching=False,
        )
    )


def test_seeded_tokens_survive_a_preemption(engine, tiny_llama):
    """A preempted request recomputes its KV and draws on with the same (seed, position)
    keys: its text equals an unpreempted run's."""
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True)
    prompt = list(range(3, 40))
    engine.add_request(prompt, params, request_id="alone")
    alone = _drain(engine)["alone"]
    # 12 blocks of 16 tokens: three 77-token requests (5 blocks each, no prefix sharing)
    # cannot all run to the end; the newest is preempted and recomputed.
    for i in range(3):
        engine.add_request(prompt, params, request_id=f"crowd{i}")
    before = engine.scheduler.num_preemptions
    crowd = _drain(engine)
    assert engine.scheduler.num_preemptions > before
    assert all(crowd[f"crowd{i}"] == alone for i in range(3))


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


def test_top_p_from_candidates_equals_the_full_sort():
    """The CPU path looks at the 512 likeliest tokens first and sorts only the rows whose set
    reaches past them: either way the kept set is the exact one."""
    from duet.engine.sampler import _top_p

    gen = torch.Generator().manual_seed(3)
    vocab = 5000
    scales = torch.tensor([0.5, 2.0, 4.0, 8.0, 12.0, 1.0])[:, None]  # flat to peaked rows
    probs = torch.softmax(torch.randn(6, vocab, generator=gen) * scales, dim=-1)
    p = torch.tensor([0.9, 0.95, 0.5, 0.99, 0.3, 0.8])[:, None]
    ordered = probs.sort(dim=-1, descending=True).values
    keep = ((ordered.cumsum(-1) - ordered) < p).sum(-1, keepdim=True)
    expected = probs.masked_fill(probs < ordered.gather(-1, keep - 1), 0.0)
    assert int(keep.max()) > 512 > int(keep.min())  # rows of both kinds in one batch
    assert torch.equal(_top_p(probs, p), expected)
    assert int(keep[2:5].max()) < 512
    peaked = probs[2:5]  # every row's set within the candidates: the fast path alone
    assert torch.equal(_top_p(peaked, p[2:5]), expected[2:5])


def _sorted_threshold(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    ordered = probs.sort(dim=-1, descending=True).values
    keep = ((ordered.cumsum(-1) - ordered) < p).sum(-1, keepdim=True)
    threshold = ordered.gather(-1, keep.clamp(min=1) - 1)
    return threshold.masked_fill(p >= 1.0, 0.0)


def _rows_of_every_kind(vocab: int) -> torch.Tensor:
    """Flat to peaked softmax rows, a row with top-k's zeros, one of ties, a one-hot row."""
    gen = torch.Generator().manual_seed(11)
    scales = torch.tensor([0.05, 0.5, 2.0, 8.0, 30.0])[:, None]
    rows = torch.softmax(torch.randn(5, vocab, generator=gen) * scales, dim=-1)
    zeros = rows[2].clone()
    zeros[zeros < zeros.topk(40).values[-1]] = 0.0
    ties = torch.randint(1, 5, (vocab,), generator=gen).float()
    onehot = torch.zeros(vocab)
    onehot[vocab // 3] = 1.0
    return torch.cat([rows, zeros[None], (ties / ties.sum())[None], onehot[None]])


@pytest.mark.parametrize("vocab", [97, 5000, 49152])
def test_cpu_sampling_kernels_give_the_torch_paths_bits(vocab):
    """The C++ top-p threshold (selecting a chunk at a time) and inverse-CDF draw (no fp64
    [N, V] tensor) against the full sort and cumsum + searchsorted: the same bits for flat,
    peaked, zero-padded, tied and one-hot rows, at every p (1.0 keeps everything)."""
    from duet.engine.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here"
    probs = _rows_of_every_kind(vocab)
    n = probs.shape[0]
    for value in (0.0, 0.1, 0.5, 0.9, 0.95, 0.999, 0.9999999, 1.0):
        p = torch.full((n, 1), value)
        got = kernels.top_p_threshold(probs, p[:, 0].contiguous())
        assert torch.equal(got, _sorted_threshold(probs, p)), value
    gen = torch.Generator().manual_seed(5)
    for _ in range(50):
        u = torch.rand(n, generator=gen)
        cdf = probs.double().cumsum(dim=-1)
        want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        want.clamp_(max=vocab - 1)
        assert torch.equal(kernels.sample_inverse_cdf(probs, u), want)
    # u at the edges: u = 0 draws the first token with mass.
    first = kernels.sample_inverse_cdf(probs, torch.zeros(n))
    assert first.tolist() == [int((row > 0).nonzero()[0]) for row in probs]


def test_top_p_at_one_keeps_every_token_alone_or_beside_top_p_rows():
    """A row with top_p = 1 keeps its tail even when a neighbour's top-p makes the batch take
    the top-p path (the rounding of its cumulative sum once dropped the smallest tokens)."""
    from duet.engine.sampler import _top_p

    probs = _rows_of_every_kind(5000)[:2]
    out = _top_p(probs, torch.tensor([[1.0], [0.5]]))
    assert torch.equal(out[0], probs[0])
    assert int((out[1] > 0).sum()) < int((probs[1] > 0).sum())


@pytest.mark.parametrize("vocab", [1, 7, 16, 100, 49152])
def test_cpu_argmax_kernel_is_torch_argmax(vocab):
    """First maximal index on ties, a NaN as the maximum, all -inf rows, rows shorter than a
    vector and the vocabulary's size."""
    from duet.engine.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here"
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.randn(8, vocab, generator=gen)
    rows[1] = torch.randint(0, 3, (vocab,), generator=gen).float()  # many ties
    rows[2] = float("-inf")
    rows[3, vocab // 2] = float("nan")
    rows[4, vocab - 1] = 1e9  # the maximum in the tail
    rows[5] = 0.0
    rows[5, vocab // 3 :] = float("-inf")
    rows[6] = torch.finfo(torch.float32).min
    assert torch.equal(kernels.argmax_rows(rows), rows.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [16384, 49152, 50000])
def test_cpu_argmax_kernel_splits_few_rows_by_columns(vocab):
    """Fewer rows than threads: each row's columns are split between threads and the parts
    combined; ties across parts keep the first index, a NaN anywhere wins at its first place,
    -inf parts lose to finite ones."""
    from duet.engine.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here"
    before = torch.get_num_threads()
    torch.set_num_threads(4)  # parts = min(threads, vocab // 8192) > 1 on any machine
    try:
        gen = torch.Generator().manual_seed(vocab)
        cases = [torch.randn(vocab, generator=gen) for _ in range(9)]
        cases[1][vocab - 3] = 50.0  # the maximum in the last part
        cases[2][:] = 1.0  # all tied: the first
        cases[3][vocab // 2 + 5] = float("nan")  # a NaN in a later part only
        cases[4][vocab - 1] = float("nan")
        cases[4][7] = float("nan")  # NaNs in the first and last parts: the first
        cases[5][:] = float("-inf")
        cases[6][: vocab // 2] = float("-inf")  # the first half -inf
        cases[7][3], cases[7][vocab - 20] = 60.0, 60.0  # tied maxima in two parts
        cases[8][vocab // 4] = float("inf")
        for row in cases:
            one = row[None].contiguous()
            assert kernels.argmax_rows(one).tolist() == one.argmax(dim=-1).tolist()
        two = torch.stack(cases[:2])  # two rows, still fewer than the threads
        assert torch.equal(kernels.argmax_rows(two), two.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


def test_a_tiny_repetition_penalty_keeps_the_row_finite():
    """repetition_penalty 1e-40 (allowed: any value > 0) divides a seen token's positive
    logit past the float range: +inf, and a sampled row of NaN probabilities took the
    vocabulary's last id. Capped, the seen token is on top and drawn, sampled or greedy."""
    vocab = 50
    slots = _slots(vocab)
    kinds = [
        SamplingParams(temperature=1.0, repetition_penalty=1e-40, seed=1),
        SamplingParams(temperature=0, repetition_penalty=1e-40),
    ]
    requests = [_request(i, p, seed=100 + i) for i, p in enumerate(kinds)]  # seen: 1-5
    for slot, r in enumerate(requests):
        slots.write(slot, r)
    logits = torch.full((2, vocab), -1.0)
    logits[:, 2] = 3.0  # seen and positive: pushed up without bound
    logits[:, 40] = 9.0  # unseen: the model's favourite, untouched
    batch = slots.prepare(requests, np.arange(2))
    out = Sampler()(logits, batch, lambda t: t.tolist())
    assert out.token_ids == [2, 2]
