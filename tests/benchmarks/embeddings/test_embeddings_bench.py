"""`python -m benchmarks.embeddings` on the tiny model with tiny settings: the rounds alternate,
the ratio is what the timings say, and the two sides' vectors agree (both poolings)."""

from __future__ import annotations

import pytest
from transformers import AutoModel

from benchmarks.embeddings.throughput import parse_args, run, workload
from duet.engine import LLM


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_tiny_run(tiny_llama: str, pooling: str) -> None:
    llm = LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=256)
    model = AutoModel.from_pretrained(tiny_llama).eval()
    vocab = llm.engine.arch.vocab_size
    seen: list[int] = []

    def make_prompts(seed: int) -> list[list[int]]:
        seen.append(seed)
        return workload(vocab, 7, 3, 40, seed)

    prompts = make_prompts(1)
    assert len(prompts) == 7 and all(3 <= len(p) <= 40 for p in prompts)
    assert len({len(p) for p in prompts}) > 1  # HF pads: rows of several lengths
    assert workload(vocab, 7, 3, 40, 2) != prompts  # each round its own prompts
    seen.clear()
    result = run(llm, model, make_prompts, pooling, hf_batch=3, rounds=2)
    assert seen == [0, 1, 2]  # the warm-up's, then one set per round
    assert [r["order"] for r in result["rounds"]] == [["duet", "hf"], ["hf", "duet"]]
    for seed, r in zip((1, 2), result["rounds"], strict=True):
        assert r["tokens"] == sum(len(p) for p in workload(vocab, 7, 3, 40, seed))
        assert r["ratio"] == pytest.approx(r["duet"]["inputs_s"] / r["hf"]["inputs_s"])
        assert r["duet"]["tok_s"] == pytest.approx(r["tokens"] / r["duet"]["wall_s"])
    assert result["min_cosine"] > 0.9999  # padded HF batches and duet agree, fp32


def test_bad_flags_are_named() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--inputs", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--min-len", "9", "--max-len", "3"])
