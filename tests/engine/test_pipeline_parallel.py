"""Aggregated pipeline parallelism: `LLM(pipeline_parallel_size=P)` splits the layers into P
stages (engine/pipeline.py), rank 0 here and the other stages' ranks as child processes. The
stages pass the hidden and residual streams unchanged, so in fp32 greedy tokens equal one
rank's exactly (no reduction changes order); with TP=2 per stage, as TP=2 alone (near-ties
counted as in test_aggregated_tp)."""

from __future__ import annotations

import pytest
import torch

from duet.engine import LLM, InvalidInputError, SamplingParams
from duet.engine.loader import open_model
from duet.engine.model import LlamaForCausalLM
from duet.engine.parallel import TensorParallel, TensorSlice
from duet.engine.pipeline import PipelineParallel, micro_batches, stage_layers
from duet.engine.weight_files import ReadStats

pytestmark = pytest.mark.timeout(600)


def _prompts(vocab: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [
        torch.randint(3, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(40, 120, (count,), generator=g)
    ]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _tokens(model: str, prompts: list[list[int]], **parallel: int) -> list[list[int]]:
    llm = LLM(model, dtype="float32", load_progress=False, num_kv_blocks=256, **parallel)
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(12))]
        # With stages, the prompts' steps (hundreds of tokens) ran as micro-batches.
        micro = llm.engine.runner.num_micro_batched_steps
        assert (micro > 0) == (parallel.get("pipeline_parallel_size", 1) > 1)
        return tokens
    finally:
        llm.shutdown()
        assert [p.returncode for p in llm.follower_processes] == [0] * (
            parallel.get("pipeline_parallel_size", 1) * parallel.get("tensor_parallel_size", 1) - 1
        )


def test_stage_layers_split_evenly() -> None:
    assert [stage_layers(2, 2, s) for s in range(2)] == [(0, 1), (1, 2)]
    assert micro_batches(5, 2, 1000) == [(0, 2), (2, 5)]
    assert micro_batches(1, 4, 1000) == [(0, 1)]
    assert micro_batches(8, 2, 8) == [(0, 8)]  # a decode step: one batch
    assert micro_batches(8, 4, 300) == [(0, 4), (4, 8)]  # 128 tokens a micro-batch at least
    assert [stage_layers(126, 4, s) for s in range(4)] == [(0, 31), (31, 63), (63, 94), (94, 126)]


def test_pp2_equals_pp1(tiny_model_factory) -> None:
    """A 4-layer tiny Llama (tied embeddings: the last stage holds the table as its head):
    stage 0 runs layers 0-1, stage 1 layers 2-3; 8 prompts, 12 tokens each, identical."""
    model = tiny_model_factory("llama", num_hidden_layers=4, tie_word_embeddings=True)
    prompts = _prompts(512, 8)
    ref = _tokens(model, prompts)
    got = _tokens(model, prompts, pipeline_parallel_size=2)
    assert got == ref


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_two_stages_equals_one_stage_and_none(tiny_model_factory, method) -> None:
    """Every rank runs the same scheduler and speculator from the same commands (an ngram
    proposer reads the tokens every rank holds; a draft model is replicated on every rank),
    the last stage verifies, and the accepted tokens reach every stage with the step's
    broadcast: tokens and acceptance counts equal one stage's, and greedy tokens equal
    decoding without speculation. The draft is the target itself (every guess accepted);
    the ngram proposer matches after one token, without back-off, on prompts that repeat."""
    model = tiny_model_factory("llama", num_hidden_layers=4)
    spec: dict = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    if method == "draft_model":
        spec["model"] = model
    else:
        spec.update(adaptive=False, prompt_lookup_min=1)
    prompts = [p[:20] * 4 for p in _prompts(512, 6)]

    def run(speculative_config: dict | None, **parallel: int):
        llm = LLM(model, dtype="float32", load_progress=False, num_kv_blocks=256,
                  speculative_config=speculative_config, **parallel)  # fmt: skip
        try:
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(64))]
            speculator = llm.engine.speculator
            return tokens, None if speculator is None else speculator.stats
        finally:
            llm.shutdown()

    plain, _ = run(None)
    one, one_stats = run(spec)
    two, two_stats = run(spec, pipeline_parallel_size=2)
    assert one == plain and two == plain
    assert two_stats == one_stats and two_stats is not None
    assert two_stats.num_draft_tokens > 100
    if method == "draft_model":
        assert two_stats.num_accepted_tokens == two_stats.num_draft_tokens
    else:
        assert two_stats.num_accepted_tokens > 0


def test_pp2_keeps_only_its_layers(tiny_model_factory) -> None:
    model = tiny_model_factory("llama", num_hidden_layers=4)
    llm = LLM(model, dtype="float32", load_progress=False, num_kv_blocks=64,
              pipeline_parallel_size=2)  # fmt: skip
    try:
        net = llm.engine.runner.model
        assert (net.layer_start, net.layer_end, net.lm_head) == (0, 2, None)
        assert len(llm.engine.runner.kv_caches) == 2
        out = llm.generate([[5, 6, 7]], _greedy(3))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_too_many_stages_is_refused_before_any_process(tiny_llama: str) -> None:
    with pytest.raises(InvalidInputError, match=r"pipeline_parallel_size.*num_hidden_layers \(2\)"):
        LLM(tiny_llama, dtype="float32", pipeline_parallel_size=3)


def test_pp2_by_tp2_equals_tp2(smollm2_shaped: str) -> None:
    """4 ranks (2 stages of TP=2, SmolLM2's 3 KV heads split 1 + 2 in each stage): the stages
    change no sum's order, so the tokens are TP=2's exactly (TP=2 against TP=1:
    test_aggregated_tp)."""
    prompts = _prompts(512, 6)
    ref = _tokens(smollm2_shaped, prompts, tensor_parallel_size=2)
    got = _tokens(smollm2_shaped, prompts, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert got == ref


def _stage_model(arch, stage: int, num_stages: int, tp_rank: int = 0, tp: int = 1):
    pp = PipelineParallel(stage, num_stages, tp_rank, tp)
    with torch.device("meta"):
        return LlamaForCausalLM(arch, None, TensorParallel(tp_rank, tp, None, pp))


@pytest.mark.parametrize("embedded", [False, True], ids=["safetensors", "gguf"])
def test_each_stage_reads_only_its_tensors(tiny_model_factory, embedded: bool) -> None:
    """Stages read their layers' tensors and nothing of the others' (a tied embedding is read
    by the first and the last); the tensors they read are the full checkpoint's, so the
    stages read it once between them."""
    source = open_model(None if embedded else tiny_model_factory("llama", num_hidden_layers=4))
    stats = ReadStats()
    full = dict(source.weights(None, stats))
    arch = source.arch
    seen: list[set[str]] = []
    reads = []
    for stage in range(2):
        net = _stage_model(arch, stage, 2)
        stage_stats = ReadStats()
        names = set()
        for name, tensor in source.weights(net.weight_slice, stage_stats):
            assert torch.equal(tensor, full[name]), name
            names.add(name)
        seen.append(names)
        reads.append(stage_stats.num_bytes)
    first, last = seen
    shared = {"model.embed_tokens.weight"} if arch.tie_word_embeddings else set()
    assert first & last == shared and first | last == set(full)
    half = arch.num_hidden_layers // 2
    assert {n for n in first if ".layers." in n} == {
        n for n in full if ".layers." in n and int(n.split(".")[2]) < half
    }
    shared_stats = ReadStats()  # the shared tensors' bytes in the file (GGUF: quantized)
    for _ in source.weights(
        lambda n, _: None if n in shared else TensorSlice(0, 0, 0), shared_stats
    ):
        pass
    assert sum(reads) == stats.num_bytes + shared_stats.num_bytes
