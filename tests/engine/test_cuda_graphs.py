"""CUDA-graph decode's bookkeeping on the CPU: the padded batch sizes, when graphs are used at
all (on by default on CUDA, never on the CPU), which steps replay them, the start-up log, and
the same tokens as eager steps. CUDA is stood in for by a capture whose replay calls the
captured forward, so the static buffers, padding rows and metadata run for real (the Triton
kernels under the interpreter). The KV budget's share for the graphs: test_kv_sizing.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from duet.engine import LLM, EngineConfig, SamplingParams, model_runner
from duet.engine.cuda_graphs import (
    decode_buckets,
    padded_batch_size,
    uses_decode_graphs,
)
from tests.engine.graph_standin import EagerReplay, fake_cuda_graphs

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
ENGINE = dict(dtype="float32", device="cpu", attention_backend="triton", block_size=4,
              num_kv_blocks=96, max_num_seqs=4, max_model_len=128, load_progress=False)  # fmt: skip
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_buckets_and_padded_sizes() -> None:
    assert decode_buckets(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(4) == [1, 2, 4]
    assert decode_buckets(1) == [1]
    buckets = decode_buckets(20)
    sizes = [padded_batch_size(buckets, n) for n in range(1, 21)]
    assert sizes == [1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8 + [20] * 4
    with pytest.raises(ValueError, match="num_reqs: 21 is more than the largest bucket 20"):
        padded_batch_size(buckets, 21)


def test_graphs_by_default_on_cuda_only() -> None:
    assert EngineConfig().enforce_eager is False
    assert uses_decode_graphs(False, CUDA, use_triton=True)  # at any TP size: per rank
    assert not uses_decode_graphs(True, CUDA, use_triton=True)  # opt-out
    assert not uses_decode_graphs(False, CPU, use_triton=True)  # CPU: eager
    assert not uses_decode_graphs(False, CUDA, use_triton=False)  # torch path


def test_cpu_engine_runs_eagerly_by_default(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, **ENGINE)
    assert llm.engine.config.enforce_eager is False
    assert llm.engine.runner.decode_graphs is None


@pytest.fixture
def faked_cuda(monkeypatch: pytest.MonkeyPatch) -> EagerReplay:
    """The runner captures graphs as on CUDA (unless `enforce_eager`), through `EagerReplay`:
    decode graphs, and piecewise ones in `cuda_graph_mode` piecewise."""
    return fake_cuda_graphs(monkeypatch.setattr)


def test_decode_steps_replay_padded_graphs_and_give_eager_tokens(
    tiny_llama: str, faked_cuda: EagerReplay, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = [list(range(3, 3 + n)) for n in (5, 11, 30)]
    want = [o.token_ids for o in LLM(tiny_llama, **ENGINE, enforce_eager=True).generate(
        prompts, GREEDY)]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="duet.engine.model_runner"):
        llm = LLM(tiny_llama, **ENGINE)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None
    assert graphs.buckets == [1, 2, 4] and faked_cuda.num_captures == 3
    assert graphs.pool_bytes == 3 << 20 and graphs.capture_s > 0
    assert "CUDA graphs: decode batches of 1,2,4 requests captured in" in caplog.text
    assert "graph pool 0.00 GiB" in caplog.text

    replays: list[tuple[int, int]] = []  # (requests, bucket) of each replayed step
    run = graphs.run

    def spy(*args: Any) -> torch.Tensor:
        hidden = run(*args)
        replays.append((hidden.shape[0], padded_batch_size(graphs.buckets, hidden.shape[0])))
        return hidden

    graphs.run = spy  # type: ignore[method-assign]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want
    # Step 1 prefills all three prompts (eager); steps 2-6 decode all three: bucket 4, row 3
    # padding (slot -1, length 0).
    assert replays == [(3, 4)] * 5
    assert graphs.num_replays == 5


def test_steps_with_a_prefill_chunk_run_eagerly(tiny_llama: str, faked_cuda: EagerReplay) -> None:
    """A 30-token prompt prefilled in chunks of an 8-token budget beside a decoding request:
    the steps that carry a chunk run eagerly, exactly the decode-only steps replay."""
    engine = dict(ENGINE, max_num_batched_tokens=8)
    prompts = [[5, 6, 7], list(range(3, 33))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_llama, **engine, enforce_eager=True).generate(
        prompts, params)]  # fmt: skip
    llm = LLM(tiny_llama, **engine)
    runner, graphs = llm.engine.runner, llm.engine.runner.decode_graphs
    assert graphs is not None
    steps: list[tuple[list[int], bool]] = []  # (tokens per request, replayed) of each step
    execute = runner.execute

    def record_step(out: Any, *args: Any) -> Any:
        before = graphs.num_replays
        result = execute(out, *args)
        steps.append(([n for _, n in out.scheduled], graphs.num_replays > before))
        return result

    runner.execute = record_step  # type: ignore[method-assign]
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert steps == [
        ([3, 5], False),  # both prefills start; the short one samples
        ([1, 7], False), ([1, 7], False), ([1, 7], False),  # a decode beside a chunk: eager
        ([1, 4], False),  # the last chunk: the long prompt samples its first token
        ([1, 1], True), ([1, 1], True), ([1, 1], True),  # decode-only: bucket 2
        ([1], True), ([1], True), ([1], True), ([1], True),  # the long one alone: bucket 1
    ]  # fmt: skip
    assert graphs.num_replays == 7


def test_tp2_ranks_replay_the_same_graphs_and_give_eager_tokens(
    tiny_llama: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two gloo ranks capture their graphs with the all-reduces inside (the stand-in capture,
    tp_rank.py's DUET_TEST_EAGER_GRAPHS), decode graphs and piecewise ones (a 16-token step
    budget chunks the prompts): the same buckets, the same replayed steps on both, and TP=1's
    eager tokens."""
    from tests.engine.test_tensor_parallel import _run_ranks

    prompts = [list(range(3, 3 + n)) for n in (5, 11, 30)]
    engine = {k: v for k, v in ENGINE.items() if k not in ("load_progress", "device")}
    engine.update(cuda_graph_mode="piecewise", max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    want = [o.token_ids for o in LLM(tiny_llama, **ENGINE, enforce_eager=True).generate(
        prompts, params)]  # fmt: skip
    monkeypatch.setenv("DUET_TEST_EAGER_GRAPHS", "1")
    ranks = _run_ranks(tiny_llama, tmp_path, prompts, engine=engine)
    for r in ranks:
        assert r["tokens"] == want
        assert r["graph_buckets"] == [1, 2, 4]
        # steps 1-3 in pieces: the first two prompts (5 + 11), then two decodes beside 14 and
        # 8 tokens of the third (its first 8 are the second's, cached); steps 4-18 decode
        assert (r["piece_replays"], r["graph_replays"]) == (3, 15)


def test_pp2_stages_replay_their_graphs_and_give_eager_tokens(
    tiny_llama: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pipeline stages (gloo ranks) each capture their layers' graphs (the stand-in
    capture): stage 1 receives stage 0's hidden and residual streams into its static buffers
    before each replay, stage 0 sends its own after; the same buckets and replayed steps on
    both, and one rank's eager tokens and logprobs (fp32: the stages pass the streams
    unchanged, so nothing is summed in another order)."""
    from tests.engine.test_tensor_parallel import _run_ranks

    prompts = [list(range(3, 3 + n)) for n in (5, 11, 30)]
    engine = {k: v for k, v in ENGINE.items() if k not in ("load_progress", "device")}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    want = LLM(tiny_llama, **ENGINE, enforce_eager=True).generate(prompts, params)
    monkeypatch.setenv("DUET_TEST_EAGER_GRAPHS", "1")
    ranks = _run_ranks(
        tiny_llama, tmp_path, prompts, engine={**engine, "pipeline_parallel_size": 2}
    )
    for r in ranks:
        assert r["tokens"] == [o.token_ids for o in want]
        assert r["graph_buckets"] == [1, 2, 4]
        assert r["graph_replays"] == 15  # step 1 prefills the three prompts (eager)
        for lps, o in zip(r["logprobs"], want, strict=True):
            assert lps == [x.sampled.logprob for x in o.logprobs]


PIECES = dict(cuda_graph_mode="piecewise", max_num_batched_tokens=8)
"""The prompts' steps in pieces (MLA's absorbed queries and latent entries cross them), in
chunks of 8 tokens."""


def test_a_mixture_on_the_fused_kernel_replays_graphs_counting_real_rows_only(
    tiny_model_factory: Any,
    faked_cuda: EagerReplay,
    monkeypatch: pytest.MonkeyPatch,
    cpu_kernels_off: None,
) -> None:
    """A mixture of experts whose sparse blocks run the fused Triton kernel (as the loader
    makes them on CUDA; here interpreted) reads nothing on the host, so its decode steps
    replay graphs: eager's tokens, and the same expert load, since a graph's padding row (3
    requests in bucket 4) routes like a real one but is not counted; MLA's latent writes skip
    the padding row's slot -1. In piecewise mode its prompt steps replay pieces too (MLA's
    absorbed queries and latent entries cross them; a padding row counted nowhere either).
    Off the fused kernel (the grouped path reads each expert's row
    count on the host) the engine captures no graphs. The CPU kernels are off, so that the
    experts stay plain layers for the fuse, as on CUDA."""
    from duet.engine import loader
    from duet.engine.model.moe import SparseMoeBlock

    model = tiny_model_factory("deepseek_v3")  # MLA and DeepSeek's routing on the fused kernel
    monkeypatch.setattr(
        model_runner, "uses_decode_graphs", lambda eager, device, triton, on_host: not (
            eager or on_host)
    )  # fmt: skip
    prompts = [list(range(3, 3 + n)) for n in (3, 5, 9)]
    unfused = LLM(model, **ENGINE)
    assert unfused.engine.runner.decode_graphs is None  # each expert's rows read on the host
    monkeypatch.setattr(loader, "fuse_moe_experts", lambda net, device: sum(
        b.fuse_experts() for b in net.modules() if isinstance(b, SparseMoeBlock)))  # fmt: skip
    runs = {}
    for eager in (True, False):
        llm = LLM(model, **ENGINE, enforce_eager=eager, **PIECES)
        runner = llm.engine.runner
        assert (runner.decode_graphs is None) == eager
        outs = llm.generate(prompts, GREEDY)
        assert runner.expert_load is not None
        cached = sum(o.num_cached_tokens for o in outs)  # prefixes of earlier chunks' prompts
        runs[eager] = ([o.token_ids for o in outs], runner.expert_load.read(), cached)
    graphs, pieces = llm.engine.runner.decode_graphs, llm.engine.runner.piecewise_graphs
    assert graphs is not None and pieces is not None
    # step 1: the first two prompts (3 + 5 tokens), step 2: their decodes beside the third's
    # 5 uncached tokens (its first 4 are the second's), in pieces of 8 (one padding row); then
    # decode graphs: 4 steps of bucket 4 (a padding row), one of bucket 1
    assert (pieces.num_replays, graphs.num_replays) == (2, 5)
    assert runs[False] == runs[True]
    # each computed token (prompt but cached, + 5 decoded) routed top_k times, padding none
    layers, total = runs[True][1], sum(len(p) + 5 for p in prompts) - runs[True][2]
    top_k = 2
    assert all(sum(layer) == total * top_k for layer in layers)
