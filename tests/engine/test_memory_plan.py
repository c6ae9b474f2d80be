"""The memory plan (`duet plan`, engine/memory_plan.py) on real models' configs, against
numbers counted by hand, and against what the engine itself computes for a tiny CPU model:
its loaded weights per rank, its KV block bytes and its KV pool sized from (faked) GPU memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from duet.cli.main import main
from duet.engine import kv_sizing
from duet.engine.config import EngineConfig
from duet.engine.errors import InvalidInputError
from duet.engine.kv_sizing import GpuMemory, graph_pool_bytes, size_kv_pool
from duet.engine.loader import load_model
from duet.engine.memory_plan import PlanSettings, activation_bytes, plan_layout, plan_layouts
from duet.engine.model.arch import ModelArchConfig
from duet.engine.model.llama import LlamaForCausalLM
from duet.engine.parallel import SINGLE, ExpertExchange, TensorParallel
from duet.engine.pipeline import PipelineParallel, stage_layers
from duet.kv_transfer.staging import DEFAULT_STAGING_BYTES, NCCL_COMM_BYTES

GIB = 1 << 30
ROPE_31 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def llama31(hidden: int, inter: int, layers: int, heads: int) -> dict:
    """A Llama-3.1 config.json (the fields the hub's files have that duet reads)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": ROPE_31,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    }


LLAMA_8B = llama31(4096, 14336, 32, 32)
LLAMA_70B = llama31(8192, 28672, 80, 64)
LLAMA_405B = llama31(16384, 53248, 126, 128)
QWEN25_72B = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 152064,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 131072,
}

# Weight bytes per rank in bf16, counted by hand (even splits): per layer h*q*d + 2*h*kv*d
# (q, k, v) + q*d*h (o) + 3*h*i/tp (gate, up, down) + 2*h (norms), where q and kv are the
# rank's heads (kv at least 1: replicated past 8 KV heads), then the vocabulary-parallel
# embedding and LM head (V/tp rows each) and the final norm; times 2 bytes.
# Llama-3.1-8B at TP=1: 32 * 218,112,000 + 2 * 128256 * 4096 + 4096 = 8,030,261,248 params.
EXPECTED_WEIGHTS = {
    ("8B", 1): 16_060_522_496,
    ("8B", 2): 8_030_527_488,
    ("8B", 8): 2_008_031_232,
    ("8B", 16): 1_037_836_288,  # 2 ranks per KV head, each holding it whole
    ("70B", 1): 141_107_412_992,
    ("70B", 4): 35_278_831_616,
    ("70B", 8): 17_640_734_720,
    ("405B", 8): 101_470_601_216,
    ("405B", 16): 51_267_928_064,
}
CONFIGS = {"8B": LLAMA_8B, "70B": LLAMA_70B, "405B": LLAMA_405B}


def arch_of(config: dict) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(config)


@pytest.mark.parametrize(("name", "tp"), list(EXPECTED_WEIGHTS))
def test_weights_per_rank_match_the_hand_count(name: str, tp: int) -> None:
    layout = plan_layout(arch_of(CONFIGS[name]), tp, 1, 80 * GIB, PlanSettings())
    assert [r.weights_bytes for r in layout.ranks] == [EXPECTED_WEIGHTS[name, tp]] * tp


def test_qwen25_72b_counts_its_qkv_bias() -> None:
    """8 ranks: q 1024 rows and k, v 128 each with their biases; the MLP in 3696 columns."""
    layout = plan_layout(arch_of(QWEN25_72B), 8, 1, 80 * GIB, PlanSettings())
    assert {r.weights_bytes for r in layout.ranks} == {18_178_859_008}


def test_pipeline_stages_split_layers_embedding_and_head() -> None:
    """70B at TP=4 x PP=2: 40 layers a stage; stage 0 holds the embedding, stage 1 the LM
    head and the final norm (8 KiB more than the embedding's 32064 x 8192 rows)."""
    layout = plan_layout(arch_of(LLAMA_70B), 4, 2, 80 * GIB, PlanSettings())
    by_stage = {(r.pp_stage, r.tp_rank): r for r in layout.ranks}
    assert {r.layers for r in layout.ranks if r.pp_stage == 0} == {(0, 40)}
    assert {r.layers for r in layout.ranks if r.pp_stage == 1} == {(40, 80)}
    assert by_stage[0, 0].weights_bytes == 17_639_407_616
    assert by_stage[1, 3].weights_bytes == 17_639_424_000
    # KV: 40 layers x 2 (K, V) x 16 tokens x 2 KV heads x 128 x 2 bytes
    assert {r.kv_block_bytes for r in layout.ranks} == {40 * 2 * 16 * 2 * 128 * 2}
    assert stage_layers(126, 4, 1) == (31, 63)  # uneven: 31, 32, 31, 32
    # every stage captures its decode graphs, and counts their pool (none under enforce_eager)
    assert all(r.graph_pool_bytes > 0 for r in layout.ranks)
    eager = plan_layout(arch_of(LLAMA_70B), 4, 2, 80 * GIB, PlanSettings(cuda_graphs=False))
    assert all(r.graph_pool_bytes == 0 for r in eager.ranks)
    # pipeline stages run their other steps eagerly: no pieces' pool
    pieces = PlanSettings(piecewise_graphs=True)
    assert plan_layout(arch_of(LLAMA_70B), 4, 2, 80 * GIB, pieces) == layout


def test_which_layouts_fit_eight_80gib_gpus() -> None:
    """70B fits neither one GPU (131 GiB of weights) nor, at its full 131072-token context,
    two; 405B (756 GiB) fits no layout of 8 x 80 GiB at all, and at TP=8 on 8 x 141 GB it does
    with room for KV."""
    plans = {(p.tp, p.pp): p for p in plan_layouts(arch_of(LLAMA_70B), 8, 80 * GIB, PlanSettings())}
    assert len(plans) == 20  # every TP x PP with TP * PP <= 8
    assert plans[1, 1].num_kv_blocks == 0 and not plans[1, 1].fits
    assert not plans[2, 1].fits and 0 < plans[2, 1].max_context < 131072
    assert plans[8, 1].fits and plans[4, 2].fits
    assert plans[8, 1].max_concurrent_seqs == plans[8, 1].kv_tokens // 131072
    big = plan_layouts(arch_of(LLAMA_405B), 8, 80 * GIB, PlanSettings())
    assert all(p.num_kv_blocks == 0 for p in big)
    h200 = plan_layout(arch_of(LLAMA_405B), 8, 1, 141 * 10**9, PlanSettings())
    assert h200.fits and h200.max_context == 131072


@pytest.mark.parametrize("mode", ["decode", "piecewise"])
def test_the_plan_is_the_engine_s_gpu_kv_sizing(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Given the plan's memory terms as the warm-up's measurement, the engine's `size_kv_pool`
    (graph pools, reservations, clamp) sizes exactly the plan's pool, in either graph mode."""
    arch = arch_of(LLAMA_8B)
    settings = PlanSettings(max_model_len=32768, piecewise_graphs=mode == "piecewise")
    rank = plan_layout(arch, 1, 1, 80 * GIB, settings).ranks[0]
    measured = GpuMemory(
        80 * GIB, rank.others_bytes, rank.weights_bytes, rank.activation_bytes, 2048
    )
    monkeypatch.setattr(kv_sizing, "measure_gpu_memory", lambda *a: measured)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    config = EngineConfig(cuda_graph_mode=mode)
    blocks = size_kv_pool(
        config, model, torch.device("cuda", 0), torch.bfloat16, SINGLE, 32768, True
    )
    assert blocks == rank.num_kv_blocks > 0
    decode_only = graph_pool_bytes(measured, 128, 32, 128)
    # the pieces' pool: 512 tokens at the warm-up's bytes per token
    pieces = -(-rank.activation_bytes // 2048) * 512 if mode == "piecewise" else 0
    assert rank.graph_pool_bytes == decode_only + pieces


@pytest.mark.usefixtures("cpu_kernels_off")  # no packed copies: the weights as on a GPU
@pytest.mark.parametrize("tp", [1, 2])
def test_plan_agrees_with_the_loaded_tiny_model(smollm2_shaped: str, tp: int) -> None:
    """SmolLM2-shaped (9 query heads, 3 KV heads: an uneven split at TP=2): each rank's
    loaded weight bytes and KV block bytes are the plan's."""
    config = json.loads(Path(smollm2_shaped, "config.json").read_text())
    settings = PlanSettings(dtype=torch.float32, max_model_len=512)
    layout = plan_layout(arch_of(config), tp, 1, 80 * GIB, settings)
    for rank in range(tp):
        loaded = load_model(
            smollm2_shaped, torch.float32, torch.device("cpu"), progress=False,
            tp=TensorParallel(rank, tp), deterministic=False,
        )  # fmt: skip
        planned = layout.ranks[rank]
        assert planned.weights_bytes == loaded.weight_bytes
        cfg = loaded.model.config
        assert planned.kv_block_bytes == loaded.model.kv_spec.bytes_per_block(
            cfg.num_hidden_layers, 16, torch.float32
        )
    assert [r.kv_block_bytes for r in layout.ranks] == (
        [2 * 2 * 16 * 3 * 64 * 4] if tp == 1 else [2 * 2 * 16 * 1 * 64 * 4, 2 * 2 * 16 * 2 * 64 * 4]
    )


def test_activations_count_the_gathered_logits_on_rank_0() -> None:
    arch = arch_of(LLAMA_8B)
    t, item = 2048, 2
    mlp = 2 * t * 4096 * item + 4 * t * 14336 * item
    logits = t * 4096 * item + t * 128256 * (item + 4)
    assert activation_bytes(arch, 1, 0, t, torch.bfloat16) == max(mlp, logits)
    # a middle stage: the MLP's peak and the received hidden and residual streams
    middle = activation_bytes(arch, 1, 0, t, torch.bfloat16, first_stage=False, last_stage=False)
    assert middle == mlp + 2 * t * 4096 * item


def test_duet_plan_prints_every_layout(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    assert main(["plan", "--model", str(tmp_path), "--gpus", "8", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert out.count("TP=") == 20
    assert "TP=1 x PP=1 (1 GPUs): does not fit: no room for a KV block" in out
    assert "TP=8 x PP=1 (8 GPUs): fits:" in out
    assert f"{EXPECTED_WEIGHTS['70B', 8] / GIB:.2f}" in out  # 16.43 GiB a rank
    assert main(["plan", "--model", str(tmp_path / "nowhere")]) == 2
    # the pieces' pool changes the single-stage layouts only
    args = ["plan", "--model", str(tmp_path), "--gpus", "8", "--gpu-memory", "80GiB"]
    assert main([*args, "--cuda-graph-mode", "piecewise"]) == 0
    pieces = capsys.readouterr().out.split("\n\n")
    decode = out.split("\n\n")
    changed = [p.split(":")[0] for p, d in zip(pieces, decode, strict=True) if p != d]
    assert changed and all("x PP=1 " in head for head in changed), changed


@pytest.mark.usefixtures("cpu_kernels_off")
def test_plan_agrees_with_loaded_pipeline_stages(tiny_model_factory) -> None:
    """A 3-layer tiny Llama with tied embeddings at PP=2: stage 0 (layer 0 and the table) and
    stage 1 (layers 1-2, the norm and the table as its head) load what the plan counts."""
    model = tiny_model_factory("llama", num_hidden_layers=3, tie_word_embeddings=True)
    config = json.loads(Path(model, "config.json").read_text())
    layout = plan_layout(arch_of(config), 1, 2, 80 * GIB, PlanSettings(dtype=torch.float32))
    for stage, planned in enumerate(layout.ranks):
        tp = TensorParallel(0, 1, None, PipelineParallel(stage, 2))
        loaded = load_model(
            model, torch.float32, torch.device("cpu"), progress=False, tp=tp, deterministic=False
        )
        assert planned.layers == (loaded.model.layer_start, loaded.model.layer_end)
        assert planned.weights_bytes == loaded.weight_bytes
        assert planned.kv_block_bytes == loaded.model.kv_spec.bytes_per_block(
            loaded.model.num_layers, 16, torch.float32
        )
    assert [r.layers for r in layout.ranks] == [(0, 1), (1, 3)]


def test_worker_roles_plan_one_stage(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A decode worker's plan: TP layouts only, with the staging pool and NCCL peers."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    argv = ["plan", "--model", str(tmp_path), "--gpus", "4", "--role", "decode"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    layouts = [line.split(" (")[0] for line in out.splitlines() if line.startswith("TP=")]
    assert layouts == ["TP=1 x PP=1", "TP=2 x PP=1", "TP=3 x PP=1", "TP=4 x PP=1"]
    staging = DEFAULT_STAGING_BYTES + 4 * NCCL_COMM_BYTES  # the decode worker's defaults
    rank0 = next(line for line in out.splitlines() if line.startswith("  0 / 0 "))
    assert rank0.split()[8] == f"{staging / GIB:.2f}"


QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
# At TP=8 with expert parallelism, per layer: q 4 heads and k, v one (replicated) KV head each
# (768 x 2048), o (2048 x 512), q/k norms (256), two layer norms (4096), the router (128 x
# 2048) and 16 whole experts (16 x 3 x 768 x 2048): 78,385,408 params; then 18,992 rows each
# of the embedding and the head, and the final norm; times 2 bytes. Sliced experts (128 x 3 x
# 96 x 2048) weigh the same: expert parallelism changes the products, not the bytes, where
# both split evenly.
QWEN3_30B_EP8_BYTES = 2 * (48 * 78_385_408 + 2 * 18_992 * 2048 + 2048)


def test_expert_parallel_plans_whole_experts_per_rank() -> None:
    arch = arch_of(QWEN3_30B_A3B)
    ep = plan_layout(arch, 8, 1, 80 * GIB, PlanSettings(expert_parallel=True))
    assert [r.weights_bytes for r in ep.ranks] == [QWEN3_30B_EP8_BYTES] * 8
    sliced = plan_layout(arch, 8, 1, 80 * GIB, PlanSettings())
    assert [r.weights_bytes for r in sliced.ranks] == [QWEN3_30B_EP8_BYTES] * 8
    # layouts whose TP does not divide the 128 experts are left out
    settings = PlanSettings(expert_parallel=True, cuda_graphs=False)
    tps = sorted({layout.tp for layout in plan_layouts(arch, 6, 80 * GIB, settings, max_pp=1)})
    assert tps == [1, 2, 4]


@pytest.mark.usefixtures("cpu_kernels_off")
@pytest.mark.parametrize("layout", ["expert parallel", "data parallel"])
def test_a_sharded_mixture_plan_agrees_with_the_loaded_ranks(tiny_model_factory, layout) -> None:
    """A tiny Qwen3-MoE (16 experts) over two ranks, at TP=2 with expert parallelism or as two
    data-parallel ranks (whole attention): each rank loads what the plan counts, 8 whole
    experts a layer."""
    model = tiny_model_factory("qwen3_moe")
    arch = arch_of(json.loads(Path(model, "config.json").read_text()))
    if layout == "expert parallel":
        settings = PlanSettings(dtype=torch.float32, expert_parallel=True)
        plan = plan_layout(arch, 2, 1, 80 * GIB, settings)
        ranks = [TensorParallel(r, 2, None, expert_parallel=True) for r in range(2)]
    else:
        plan = plan_layout(arch, 1, 1, 80 * GIB, PlanSettings(dtype=torch.float32), dp=2)
        ranks = [TensorParallel(exchange=ExpertExchange(r, 2)) for r in range(2)]
    assert len(plan.ranks) == 2
    for planned, tp in zip(plan.ranks, ranks, strict=True):
        loaded = load_model(
            model, torch.float32, torch.device("cpu"), progress=False, tp=tp, deterministic=False
        )
        assert len(loaded.model.layers[0].mlp.experts) == 8
        assert planned.weights_bytes == loaded.weight_bytes


def test_duet_plan_refuses_expert_parallel_for_a_dense_model(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    argv = ["plan", "--model", str(tmp_path), "--gpus", "2", "--enable-expert-parallel"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "--enable-expert-parallel: the model is dense" in capsys.readouterr().err


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_counts_a_mixture_of_dense_and_sparse_layers(tiny_model_factory, tp: int) -> None:
    """The tiny Qwen2-MoE's layer 1 is a dense MLP between two sparse ones (`mlp_only_layers`):
    the plan counts each layer as it is, not every one like layer 0."""
    model = tiny_model_factory("qwen2_moe")
    config = json.loads(Path(model, "config.json").read_text())
    assert config["mlp_only_layers"] == [1]
    layout = plan_layout(arch_of(config), tp, 1, 80 * GIB, PlanSettings(dtype=torch.float32))
    for rank, planned in enumerate(layout.ranks):
        loaded = load_model(
            model, torch.float32, torch.device("cpu"), progress=False,
            tp=TensorParallel(rank, tp, None), deterministic=False,
        )  # fmt: skip
        assert planned.weights_bytes == loaded.weight_bytes


# Data-parallel attention over 8 ranks (EP = 8, TP = 1), per layer: q (4096 x 2048), k and v
# (512 x 2048 each), o (2048 x 4096), q/k norms (256), two layer norms (4096), the router
# (128 x 2048) and 16 whole experts (16 x 3 x 768 x 2048): 94,638,336 params; then the whole
# embedding and head (151,936 x 2048 each) and the final norm; times 2 bytes.
QWEN3_30B_DP8_BYTES = 2 * (48 * 94_638_336 + 2 * 151_936 * 2048 + 2048)


def test_data_parallel_plans_whole_attention_and_an_eighth_of_the_experts() -> None:
    arch = arch_of(QWEN3_30B_A3B)
    settings = PlanSettings(data_parallel=True)
    dp = plan_layout(arch, 1, 1, 80 * GIB, settings, dp=8)
    assert [r.weights_bytes for r in dp.ranks] == [QWEN3_30B_DP8_BYTES] * 8
    assert all(r.graph_pool_bytes == 0 for r in dp.ranks)  # the exchange steps eagerly
    # each rank its own KV: whole KV heads (4 x 128, K and V, 48 layers, bf16) a token
    assert dp.ranks[0].kv_block_bytes == 16 * 4 * 128 * 2 * 48 * 2
    assert dp.max_concurrent_seqs == 8 * min(128, dp.kv_tokens // dp.max_model_len)
    # the activations add the exchange's rows: 8 ranks' 2048 tokens x 8 choices, in and back,
    # and the rank's own, of 2048 values in bf16
    plain = plan_layout(arch, 1, 1, 80 * GIB, PlanSettings())
    rows = 2048 * 8 * 2048 * 2
    assert dp.ranks[0].activation_bytes - plain.ranks[0].activation_bytes == 2 * 8 * rows + 2 * rows
    # listed beside the TP x PP layouts: the sizes that divide the 128 experts
    layouts = plan_layouts(arch, 6, 80 * GIB, settings, max_pp=1)
    assert [lay.dp for lay in layouts if lay.dp > 1] == [2, 4]
    no_dp = plan_layouts(arch, 6, 80 * GIB, PlanSettings(), max_pp=1)
    assert {lay.dp for lay in no_dp} == {1}


def test_a_data_parallel_plan_is_refused_where_the_engine_refuses_it() -> None:
    with pytest.raises(InvalidInputError, match="data_parallel_size: runs at TP and PP 1"):
        plan_layout(arch_of(QWEN3_30B_A3B), 2, 1, 80 * GIB, PlanSettings(), dp=2)
    with pytest.raises(InvalidInputError, match="data_parallel_size: needs a mixture of experts"):
        plan_layout(arch_of(LLAMA_8B), 1, 1, 80 * GIB, PlanSettings(), dp=2)
    with pytest.raises(InvalidInputError, match="expert_parallel_size: must divide"):
        plan_layout(arch_of(QWEN3_30B_A3B), 1, 1, 80 * GIB, PlanSettings(), dp=3)


def test_duet_plan_prints_the_data_parallel_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    assert main(["plan", "--model", str(tmp_path), "--gpus", "2", "--data-parallel"]) == 0
    out = capsys.readouterr().out
    assert "data-parallel layouts too" in out
    assert "\nDP=2 x EP=2 (2 GPUs): fits: " in out and " KV tokens a rank, " in out
    assert "  0 / 0-1 " in out  # one row for both ranks: the same numbers
    for argv, why in (
        (["--model", str(tmp_path), "--data-parallel", "--role", "decode"],
         "--data-parallel: only aggregated serving runs data-parallel attention yet"),
        (["--data-parallel"], "--data-parallel: the model is dense"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main(["plan", *argv])
        assert exc.value.code == 2
        assert why in capsys.readouterr().err
