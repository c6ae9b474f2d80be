"""Aggregated tensor parallelism: `LLM(tensor_parallel_size=N)` runs rank 0 here and ranks
1..N-1 as child processes (engine/tp_group.py). In fp32, greedy tokens equal TP=1's except
where the all-reduce's order of summation flips a near-tie (counted: at most 1 of 16
prompts); SmolLM2's 3 KV heads split at TP=2 and are replicated at TP=4; a bad TP size is
refused before any process starts; followers exit when rank 0 stops, and a lost follower
fails rank 0's next step instead of hanging it."""

from __future__ import annotations

import signal

import pytest
import torch

from duet.engine import LLM, InvalidInputError, SamplingParams
from duet.engine.outputs import RequestOutput

TOPICS = [
    "the moon", "bread", "rivers", "chess", "winter", "bees", "trains", "a lighthouse",
    "volcanoes", "libraries", "the ocean", "clocks", "mountains", "gardens", "storms", "maps",
]  # fmt: skip
NEAR_TIE = 1e-3
"""Largest gap between TP=1's two likeliest tokens where TP=N may pick the other one (fp32:
the row-parallel sums differ from TP=1's in their last bits)."""


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)


def _count_flips(ref: list[RequestOutput], got: list[RequestOutput]) -> int:
    """Prompts whose tokens differ; each must first differ at a near-tie of TP=1's logits,
    where TP=N took TP=1's second choice."""
    flips = 0
    for r, g in zip(ref, got, strict=True):
        a, b = r.outputs[0].token_ids, g.outputs[0].token_ids
        assert len(a) == len(b)
        if a == b:
            continue
        flips += 1
        at = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        top = r.outputs[0].logprobs[at].top  # TP=1's two likeliest at the divergence
        assert [t for t, _ in top] == [a[at], b[at]], (at, top)
        assert top[0][1] - top[1][1] < NEAR_TIE, (at, top)
    return flips


def _prompts(llm: LLM) -> list[list[int]]:
    return [
        llm.engine.encode_chat([{"role": "user", "content": f"Tell me about {t}."}]) for t in TOPICS
    ]


@pytest.fixture(scope="module")
def embedded_tp1() -> tuple[list[list[int]], list[RequestOutput]]:
    llm = LLM(None, dtype="float32", load_progress=False, num_kv_blocks=512)
    prompts = _prompts(llm)
    return prompts, llm.generate(prompts, _greedy(32))


def test_embedded_model_at_tp2_equals_tp1(embedded_tp1) -> None:
    """SmolLM2-135M-Instruct (GGUF, fp32): 16 chats, 32 tokens each."""
    prompts, ref = embedded_tp1
    llm = LLM(None, dtype="float32", load_progress=False, num_kv_blocks=512,
              tensor_parallel_size=2)  # fmt: skip
    try:
        assert [llm.engine.runner.kv_caches[0].shape[3]] == [1]  # rank 0: KV head 0 of 3
        got = llm.generate(prompts, _greedy(32))
    finally:
        llm.shutdown()
    assert _count_flips(ref, got) <= 1
    assert [p.returncode for p in llm.follower_processes] == [0]


@pytest.mark.parametrize("world", [2, 4])
def test_random_smollm2_shapes_at_tp_n_equal_tp1(smollm2_shaped: str, world: int) -> None:
    """SmolLM2's shapes with random weights: TP=2 (KV heads 1 + 2) and TP=4 (KV head 0 on
    ranks 0 and 1): 16 prompts of 3 to 90 tokens, 16 tokens each."""
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, 500, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 90, (16,), generator=g)
    ]
    kwargs = dict(dtype="float32", load_progress=False, num_kv_blocks=256)
    ref = LLM(smollm2_shaped, **kwargs).generate(prompts, _greedy(16))
    llm = LLM(smollm2_shaped, tensor_parallel_size=world, **kwargs)
    try:
        got = llm.generate(prompts, _greedy(16))
    finally:
        llm.shutdown()
    assert _count_flips(ref, got) <= 1
    assert [p.returncode for p in llm.follower_processes] == [0] * (world - 1)


def test_impossible_tp_size_is_refused_before_any_rank_starts(tiny_llama: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        LLM(tiny_llama, tensor_parallel_size=5, load_progress=False)  # 4 query heads
    assert info.value.field == "tensor_parallel_size"
    assert "between 1 and the model's num_attention_heads (4); got 5" in str(info.value)


def test_a_lost_follower_fails_the_next_step(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=64,
              tensor_parallel_size=2)  # fmt: skip
    follower = llm.follower_processes[0]
    follower.send_signal(signal.SIGKILL)
    follower.wait(timeout=30)
    with pytest.raises(RuntimeError):
        llm.generate([[5, 6, 7]], _greedy(4))
    llm.shutdown()


def test_a_failed_step_on_rank_0_ends_the_followers_at_once(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's step raising leaves the follower inside a collective rank 0 will not call: the
    `LLM` ends it at once (a `Stop` broadcast would wait out the group's 600 s timeout) and the
    engine takes no further work."""
    llm = LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=64,
              tensor_parallel_size=2)  # fmt: skip
    follower = llm.follower_processes[0]
    real_step, calls = llm.engine.step, []

    def failing_step(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real_step(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[5, 6, 7]], _greedy(8))
    assert follower.wait(timeout=10) is not None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], _greedy(4))
    llm.shutdown()


def test_reset_prefix_cache_reaches_every_rank(tiny_llama: str) -> None:
    """`LLM.reset_prefix_cache` resets the followers too: a rank that kept its cached prefixes
    would schedule the repeated prompts differently from rank 0, and the step's collectives
    would no longer match."""
    llm = LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=64,
              tensor_parallel_size=2)  # fmt: skip
    prompts = [list(range(5, 45)), list(range(7, 40))]  # 2 full blocks of 16 tokens each
    stats = llm.engine.kv.prefix_stats
    try:
        first = llm.generate(prompts, _greedy(8))
        assert llm.reset_prefix_cache()
        again = llm.generate(prompts, _greedy(8))
        assert stats.num_hits == 0  # computed again from the first token
        cached = llm.generate(prompts, _greedy(8))  # no reset: every rank hits alike
        assert stats.num_hits == 2 * 16 + 2 * 16
    finally:
        llm.shutdown()
    tokens = [[o.outputs[0].token_ids for o in run] for run in (first, again, cached)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert [p.returncode for p in llm.follower_processes] == [0]


def test_bf16_tp2_is_deterministic_run_to_run_and_batch_invariant(smollm2_shaped: str) -> None:
    """docs/determinism.md at one layout: two TP=2 engines in bf16 (fresh ranks each) give the
    same tokens and logprobs bit for bit, and a request alone equals it among others."""
    g = torch.Generator().manual_seed(11)
    others = [
        torch.randint(3, 500, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 90, (7,), generator=g)
    ]
    request = torch.randint(3, 500, (300,), generator=g).tolist()  # two attention partitions
    kwargs = dict(dtype="bfloat16", load_progress=False, num_kv_blocks=256,
                  tensor_parallel_size=2)  # fmt: skip
    runs = []
    for _ in range(2):
        llm = LLM(smollm2_shaped, **kwargs)
        try:
            assert llm.engine.deterministic
            alone = llm.generate([request], _greedy(12))[0]
            batched = llm.generate([*others[:3], request, *others[3:]], _greedy(12))
        finally:
            llm.shutdown()
        assert batched[3].outputs[0].token_ids == alone.outputs[0].token_ids
        assert batched[3].outputs[0].logprobs == alone.outputs[0].logprobs
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in batched])
    assert runs[0] == runs[1]
