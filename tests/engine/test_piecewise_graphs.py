"""Piecewise CUDA graphs (`cuda_graph_mode="piecewise"`, engine/piecewise_graphs.py) on the CPU:
the captured sizes, which steps run in pieces, and the eager engine's tokens. CUDA is stood in
for as in test_cuda_graphs.py: capturing a piece records it, replaying calls it over the same
static buffers (the Triton kernels under the interpreter), so the buffers that carry the
residual stream, q|k|v and attention's output between the pieces run for real."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from duet.engine import LLM, EngineConfig, SamplingParams
from duet.engine.errors import InvalidInputError
from duet.engine.piecewise_graphs import (
    piecewise_buckets,
    piecewise_unsupported,
)
from tests.engine.graph_standin import EagerReplay, fake_cuda_graphs
from tests.engine.test_cuda_graphs import ENGINE

PIECEWISE = dict(ENGINE, cuda_graph_mode="piecewise", max_num_batched_tokens=8)


def test_sizes_and_the_modes() -> None:
    assert piecewise_buckets(512) == [1, 2, 4, 8, *range(16, 257, 16), 320, 384, 448, 512]
    assert piecewise_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert piecewise_buckets(8) == [1, 2, 4, 8]
    assert piecewise_buckets(1) == [1]
    assert EngineConfig().cuda_graph_mode == "decode"
    with pytest.raises(InvalidInputError, match=r"cuda_graph_mode: must be one of decode, "
                       r"piecewise; got 'full'"):  # fmt: skip
        EngineConfig(cuda_graph_mode="full")


def test_what_is_not_captured_in_pieces() -> None:
    from duet.engine.model.llama import Attention

    def model(stages: int = 1, exchange: Any = None, attn: Any = None) -> Any:
        tp = SimpleNamespace(pp=SimpleNamespace(num_stages=stages), exchange=exchange)
        attn = attn or Attention.__new__(Attention)
        return SimpleNamespace(tp=tp, layers=[SimpleNamespace(self_attn=attn)])

    assert piecewise_unsupported(model()) is None
    assert piecewise_unsupported(model(stages=2)) == "pipeline stages"
    assert piecewise_unsupported(model(exchange=object())) == "data-parallel attention"
    assert piecewise_unsupported(model(attn=object())) == "an attention without the three parts"


@pytest.fixture
def faked_cuda(monkeypatch: pytest.MonkeyPatch) -> EagerReplay:
    """The runner captures decode and piecewise graphs as on CUDA, through `EagerReplay`."""
    return fake_cuda_graphs(monkeypatch.setattr)


def _record_steps(llm: LLM) -> list[tuple[list[int], str]]:
    """(tokens per request, guesses included; "decode" | "pieces" | "eager") of each step the
    runner executes."""
    runner = llm.engine.runner
    decode, pieces = runner.decode_graphs, runner.piecewise_graphs
    assert decode is not None and pieces is not None
    steps: list[tuple[list[int], str]] = []
    execute = runner.execute

    def record(out: Any, *args: Any) -> Any:
        before = (decode.num_replays, pieces.num_replays)
        result = execute(out, *args)
        after = (decode.num_replays, pieces.num_replays)
        how = "decode" if after[0] > before[0] else "pieces" if after[1] > before[1] else "eager"
        steps.append(([n for _, n in out.scheduled], how))
        return result

    runner.execute = record  # type: ignore[method-assign]
    return steps


def test_steps_with_a_prefill_chunk_run_in_pieces_with_the_eager_tokens(
    tiny_llama: str, faked_cuda: EagerReplay, caplog: pytest.LogCaptureFixture
) -> None:
    """A 30-token prompt prefilled in chunks of an 8-token budget beside a decoding request:
    the steps that carry a chunk replay the pieces of their padded size, the decode-only steps
    the decode graphs, and the tokens are the eager engine's."""
    prompts = [[5, 6, 7], list(range(3, 33))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_llama, **PIECEWISE, enforce_eager=True).generate(
        prompts, params)]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="duet.engine.model_runner"):
        llm = LLM(tiny_llama, **PIECEWISE)
    pieces = llm.engine.runner.piecewise_graphs
    assert pieces is not None and pieces.buckets == [1, 2, 4, 8]
    num_layers = len(pieces.layers)
    assert all(len(g) == num_layers + 1 for g in pieces.graphs.values())
    # decode graphs of 1, 2, 4 requests, then num_layers + 1 pieces at each of 4 sizes
    assert faked_cuda.num_captures == 3 + 4 * (num_layers + 1)
    assert f"steps of up to 8 tokens in {num_layers + 1} pieces, 4 sizes captured" in caplog.text
    steps = _record_steps(llm)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert steps == [
        ([3, 5], "pieces"),  # both prefills start (8 tokens)
        ([1, 7], "pieces"), ([1, 7], "pieces"), ([1, 7], "pieces"),  # a decode beside a chunk
        ([1, 4], "pieces"),  # 5 tokens: the pieces of 8, rows 5-7 padding
        ([1, 1], "decode"), ([1, 1], "decode"), ([1, 1], "decode"),
        ([1], "decode"), ([1], "decode"), ([1], "decode"), ([1], "decode"),
    ]  # fmt: skip
    assert pieces.num_replays == 5


def test_speculative_steps_run_in_pieces_with_the_eager_tokens(
    tiny_llama: str, faked_cuda: EagerReplay
) -> None:
    """ngram speculation: its verify steps (a request's token and its guesses, more than one
    query token) run in pieces, and the greedy tokens are those of the eager engine without
    speculation."""
    prompts = [[42] * 20, [3, 4] * 15]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine = dict(PIECEWISE, max_num_batched_tokens=64)
    want = [o.token_ids for o in LLM(tiny_llama, **engine, enforce_eager=True).generate(
        prompts, params)]  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    llm = LLM(tiny_llama, **engine, speculative_config=spec)
    steps = _record_steps(llm)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    # a request's token and its k <= 3 guesses: some steps verify guesses
    assert any(1 < n <= 4 for tokens, _ in steps[1:] for n in tokens), steps
    # every step with a query of more than one token ran in pieces, the others whole
    assert [how for _, how in steps] == [
        "decode" if tokens == [1] * len(tokens) else "pieces" for tokens, _ in steps
    ]


def test_a_prefill_worker_runs_its_prompt_chunks_in_pieces(
    tiny_llama: str, faked_cuda: EagerReplay
) -> None:
    """A prefill worker's engine decodes nothing: no decode graphs, but in piecewise mode its
    prompt chunks run in pieces, with the eager engine's first tokens."""
    from duet.engine.llm_engine import LLMEngine
    from duet.prefill_worker.config import PrefillWorkerConfig

    config = PrefillWorkerConfig(model=tiny_llama, **PIECEWISE)
    engine = LLMEngine(config)
    runner = engine.runner
    assert runner.decode_graphs is None and runner.piecewise_graphs is not None
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 12)]
    want = [o.token_ids for o in LLM(tiny_llama, **PIECEWISE, enforce_eager=True).generate(
        prompts, params)]  # fmt: skip
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"r{i}")
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    assert [got["r0"], got["r1"]] == want
    # 8-token steps: r0's 5 and r1's first 3, r1's next 8, its last 1
    assert runner.piecewise_graphs.num_replays == 3


def test_a_draft_model_replays_its_own_graphs(
    tiny_llama: str, tiny_model_factory: Any, faked_cuda: EagerReplay
) -> None:
    """A draft model's runner captures graphs as its target's does: its single-token guessing
    steps replay its decode graphs, its catch-up steps (the target's accepted tokens, a new
    prompt) its pieces; the greedy tokens are the eager engine's without speculation."""
    draft = tiny_model_factory("llama", num_hidden_layers=1)
    prompts = [[42] * 20, [3, 4] * 15]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine = dict(PIECEWISE, max_num_batched_tokens=64)
    want = [o.token_ids for o in LLM(tiny_llama, **engine, enforce_eager=True).generate(
        prompts, params)]  # fmt: skip
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    llm = LLM(tiny_llama, **engine, speculative_config=spec)
    assert llm.engine.speculator is not None
    runner = llm.engine.speculator.proposer.runner  # type: ignore[attr-defined]
    assert runner.decode_graphs is not None and runner.piecewise_graphs is not None
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert runner.decode_graphs.num_replays > 0 and runner.piecewise_graphs.num_replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_on_cuda_piecewise_graphs_give_eager_tokens(tiny_model_factory: Any, arch: str) -> None:
    """`cuda_graph_mode` piecewise: prompts prefilled in chunks of a 64-token budget beside
    decodes, and ngram guesses verified, run in pieces around attention; deterministic
    inference (row-invariant products, so T padded rows change no real row): eager's
    tokens in bf16, and a mixture's expert load without the padding rows."""
    prompts = [[5, 6, 7] * 4, list(range(3, 200)), [42] * 30, [3 + i % 500 for i in range(90)]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": 64}  # fmt: skip
    runs = {}
    for eager in (True, False):
        llm = LLM(
            tiny_model_factory(arch), dtype="bfloat16", device="cuda", enforce_eager=eager,
            cuda_graph_mode="piecewise", deterministic=True, num_kv_blocks=256,
            max_num_seqs=8, max_model_len=512, max_num_batched_tokens=64,
            speculative_config=spec, load_progress=False,
        )  # fmt: skip
        runner = llm.engine.runner
        assert (runner.piecewise_graphs is None) == eager
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        load = None if runner.expert_load is None else runner.expert_load.read()
        runs[eager] = (tokens, load)
    assert runner.piecewise_graphs.num_replays > 0
    assert runs[False] == runs[True]


def test_data_parallel_on_cuda_needs_eager_only_where_it_decodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode graphs cannot hold the expert exchange, so a data-parallel engine that decodes
    on CUDA is refused without `enforce_eager`; a prefill worker captures no decode graphs
    (and no pieces under the exchange), so it needs none (as when its default was eager)."""
    from duet.decode_worker.config import DecodeWorkerConfig
    from duet.prefill_worker.config import PrefillWorkerConfig

    monkeypatch.setattr(EngineConfig, "resolve_device", lambda self, *a: torch.device("cuda", 0))
    layout = dict(data_parallel_size=2, expert_parallel_size=2)
    for cls in (EngineConfig, DecodeWorkerConfig):
        with pytest.raises(InvalidInputError, match="data_parallel_size: needs enforce_eager"):
            cls(**layout)
        cls(**layout, enforce_eager=True)
    assert PrefillWorkerConfig(**layout).enforce_eager is False
