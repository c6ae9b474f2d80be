"""Expert parallelism (`expert_parallel_size` = `tensor_parallel_size`): attention stays
tensor-parallel, each rank holds a contiguous half of the routed experts whole (and the router
whole, Qwen2-MoE's shared expert sliced), and the layer's one all-reduce sums the experts'
contributions. In fp32 the greedy tokens equal TP=1's and TP=2's without it (the parallelism
tests' rule for a near-tie flipped by the all-reduce's order); the expert load is counted once;
a bad size is refused naming the field."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from duet.engine import LLM, InvalidInputError, SamplingParams
from duet.engine.config import EngineConfig
from duet.engine.loader import load_model
from duet.engine.parallel import TensorParallel
from duet.engine.tp_group import check_layout
from tests.conftest import MOE_ARCHS
from tests.engine.test_aggregated_tp import _count_flips

PROMPTS = [[5, 9, 17], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [300, 7], list(range(60, 120))]
# checkpoint names of a routed expert's gate, up and down projections
PROJ_NAMES = {
    "mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                "block_sparse_moe.experts.{e}.w2"),
    "qwen2_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                  "mlp.experts.{e}.down_proj"),
}  # fmt: skip
PROJ_NAMES["qwen3_moe"] = PROJ_NAMES["qwen2_moe"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_each_rank_holds_its_half_of_the_experts_whole(tiny_model_factory, cpu_kernels_off, arch):
    path = tiny_model_factory(arch)
    ckpt = load_file(f"{path}/model.safetensors")
    for rank in range(2):
        tp = TensorParallel(rank, 2, None, expert_parallel=True)  # loading runs no collective
        net = load_model(path, torch.float32, torch.device("cpu"), progress=False, tp=tp).model
        moe = net.config.moe
        assert moe is not None
        half = moe.num_experts // 2
        num_expert_params = 0
        for i in sorted(moe.sparse_layers):
            block = net.layers[i].mlp
            assert (block.first_expert, len(block.experts)) == (rank * half, half)
            assert torch.equal(block.gate.weight, ckpt[f"model.layers.{i}.{_router(arch)}"])
            for j, expert in enumerate(block.experts):
                gate, up, down = (
                    ckpt[f"model.layers.{i}.{name.format(e=rank * half + j)}.weight"]
                    for name in PROJ_NAMES[arch]
                )
                assert torch.equal(expert.gate_up_proj.weight, torch.cat([gate, up]))
                assert torch.equal(expert.down_proj.weight, down)
                num_expert_params += sum(p.numel() for p in expert.parameters())
            if block.shared_expert is not None:  # sliced as a dense MLP: half its rows
                size = moe.shared_expert_intermediate_size
                down = ckpt[f"model.layers.{i}.mlp.shared_expert.down_proj.weight"]
                cols = slice(rank * size // 2, (rank + 1) * size // 2)
                assert torch.equal(block.shared_expert.down_proj.weight, down[:, cols])
        hidden = net.config.hidden_size
        expected = len(moe.sparse_layers) * half * 3 * moe.intermediate_size * hidden
        assert num_expert_params == expected


def _router(arch: str) -> str:
    return "block_sparse_moe.gate.weight" if arch == "mixtral" else "mlp.gate.weight"


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_ep2_gives_tp1_and_tp2_tokens(tiny_model_factory, arch):
    """Four prompts x 8 greedy tokens, fp32; the expert counts of the EP engine (rank 0's:
    every rank routes every token, and one reports) equal TP=1's."""
    path = tiny_model_factory(arch)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    kwargs = dict(dtype="float32", load_progress=False, num_kv_blocks=64)
    tp1 = LLM(path, **kwargs)
    ref = tp1.generate(PROMPTS, params)
    runs = {}
    for ep in (1, 2):
        llm = LLM(path, tensor_parallel_size=2, expert_parallel_size=ep, **kwargs)
        try:
            runs[ep] = llm.generate(PROMPTS, params)
            stats = llm.engine.stats
            assert llm.engine.tp.expert_parallel == (ep == 2)
        finally:
            llm.shutdown()
        assert [p.returncode for p in llm.follower_processes] == [0]
    assert _count_flips(ref, runs[2]) <= 1
    assert _count_flips(runs[1], runs[2]) <= 1
    if [o.outputs[0].token_ids for o in runs[2]] == [o.outputs[0].token_ids for o in ref]:
        assert stats.moe_expert_tokens == tp1.engine.stats.moe_expert_tokens


def test_bad_sizes_are_refused_naming_the_field(tiny_model_factory, tiny_llama):
    with pytest.raises(InvalidInputError) as info:
        EngineConfig(tensor_parallel_size=2, expert_parallel_size=4)
    assert info.value.field == "expert_parallel_size"
    assert "must be 1 or tensor_parallel_size (2)" in str(info.value)
    assert "got 4" in str(info.value)
    with pytest.raises(InvalidInputError, match=r"tensor_parallel_size \(1\)"):
        EngineConfig(expert_parallel_size=2)
    # before any rank starts: a dense model, experts that do not split into whole shares
    with pytest.raises(InvalidInputError) as info:
        LLM(tiny_llama, tensor_parallel_size=2, expert_parallel_size=2, load_progress=False)
    assert info.value.field == "expert_parallel_size"
    assert "must be 1 for a dense model" in str(info.value)
    mixtral = tiny_model_factory("mixtral")  # 8 experts
    with pytest.raises(InvalidInputError) as info:
        check_layout(EngineConfig(model=mixtral, tensor_parallel_size=3, expert_parallel_size=3))
    assert "must divide the model's routed experts (8)" in str(info.value)
    assert "got 3" in str(info.value)
