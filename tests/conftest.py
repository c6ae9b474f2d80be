"""Shared fixtures: tiny random models of each supported architecture, built locally."""

from __future__ import annotations

import os

# NOTE: under pytest-xdist each worker's torch would start an OpenMP pool of a thread per core:
# N workers x N threads on N cores, whose spin-waits starve one another (seen: a test of 36 s
# alone at 460 s in an oversubscribed run). Each worker, and every process it starts, gets its
# share of the cores instead; tests about threads set their counts themselves.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if XDIST_WORKERS:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // XDIST_WORKERS)))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# NOTE: the Triton interpreter runs `tl.dot` through numpy, i.e. OpenBLAS, and the tests of the
# kernels' batch invariance need a tile's product to give a row the same bits wherever it sits
# in the tile (as a GPU's MMA does). OpenBLAS's SkylakeX sgemm does; its Haswell/Zen one does
# not (a row alone and the same row 6th in a tile differ in the last bit), and this machine's
# environment may name Haswell (OPENBLAS_CORETYPE=Haswell was set on an AMD Zen 5 VM). So where
# the CPU has AVX-512, the tests take SkylakeX's kernels, set before numpy (which torch
# imports) loads OpenBLAS; xdist workers and subprocesses inherit it.
if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= _cpu_flags():
    os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"

import pytest  # noqa: E402
import torch  # noqa: E402

if XDIST_WORKERS:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case torch came in earlier

if not torch.cuda.is_available():
    # NOTE: Triton fixes interpreter mode when triton.language is first imported, and other
    # libraries (transformers) import it early: set it before any test module is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# NOTE: every duet process needs the cluster secret (cluster_auth): the workers and clients
# the tests start read it from here, and subprocesses inherit it.
os.environ.setdefault("DUET_CLUSTER_SECRET", "tests-" + os.urandom(24).hex())

TINY_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé tëxt, emojis 🎉🚀 and numbers 1234567890.",
    "Continuous batching mixes prefill chunks with decode steps.",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCH_CONFIGS: dict[str, dict] = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "llama3": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None
    ),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32),
    "smollm2": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=True
    ),
    # mixtures of experts (issue 44): top-2 of 8 or 16 experts
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
    "qwen2_moe": dict(  # a shared expert, and a dense layer between two sparse ones
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        rope_theta=1000000.0,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        head_dim=32,
    ),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")

_DEEPSEEK_BASE = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,  # HF's MLA expands K and V to every head: no grouping
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    n_shared_experts=1,
    first_k_dense_replace=1,  # a dense layer, then two sparse ones
    kv_lora_rank=48,  # an entry of 64: the C++ attention kernels' widths (576 at real shapes)
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
)
ARCH_CONFIGS.update(
    {
        # multi-head latent attention and DeepSeek's routers (issue 44)
        "deepseek_v2": dict(  # V2-Lite's shape: no q LoRA, greedy softmax routing
            architectures=["DeepseekV2ForCausalLM"],
            model_type="deepseek_v2",
            **_DEEPSEEK_BASE,
            n_routed_experts=8,
            q_lora_rank=None,
            topk_method="greedy",
        ),
        "deepseek_v2_grouped": dict(  # q LoRA, group-limited greedy, a routed scaling factor
            architectures=["DeepseekV2ForCausalLM"],
            model_type="deepseek_v2",
            **_DEEPSEEK_BASE,
            n_routed_experts=16,
            q_lora_rank=48,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
        "deepseek_v3": dict(  # sigmoid scores, noaux_tc with a correction bias, q LoRA
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            **_DEEPSEEK_BASE,
            n_routed_experts=16,
            q_lora_rank=48,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        "deepseek_v3_yarn": dict(  # V3 with yarn rope (its mscale in the softmax scale)
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            **_DEEPSEEK_BASE,
            n_routed_experts=8,
            q_lora_rank=48,
            n_group=2,
            topk_group=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "mscale": 1.0,
                "mscale_all_dim": 0.7,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    }
)
DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v2_grouped", "deepseek_v3", "deepseek_v3_yarn")


def build_tokenizer(path: str, vocab_size: int = 512) -> None:
    """A small byte-level BPE trained on fixed text, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_TEXT * 20, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    import json

    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
             "tokenizer_class": "PreTrainedTokenizerFast"},
            f,
        )  # fmt: skip


def build_tiny_model(
    path: str, arch: str, seed: int = 0, base_model: bool = False, **overrides
) -> str:
    """Save a random tiny model of `arch` (HF format, safetensors) under `path`; `base_model`:
    HF's base class (`LlamaModel`: no LM head, tensors without the `model.` prefix), as
    embedding models ship."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    base = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=2,
        initializer_range=0.2,
    )
    spec = {**base, **ARCH_CONFIGS[arch], **overrides}
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = (AutoModel if base_model else AutoModelForCausalLM).from_config(
        config, dtype=torch.float32
    )
    with torch.no_grad():  # DeepSeek-V3's routing bias starts at 0: make it steer the choice
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    model.save_pretrained(path)
    build_tokenizer(path)
    return path


@pytest.fixture
def cpu_kernels_off(monkeypatch):
    """`DUET_CPU_KERNELS=0` for one test: the plain torch paths (the setting is read once per
    process, so the cache is cleared on the way in and out)."""
    from duet.engine.kernels.cpu import cpu_kernels_enabled

    monkeypatch.setenv("DUET_CPU_KERNELS", "0")
    cpu_kernels_enabled.cache_clear()
    yield
    monkeypatch.undo()
    cpu_kernels_enabled.cache_clear()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict[tuple, str] = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = (arch, repr(sorted(overrides.items())))  # values may be dicts (rope_parameters)
        if key not in cache:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            cache[key] = build_tiny_model(path, arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


SMOLLM2_SHAPES = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    initializer_range=0.05,
)
"""SmolLM2-135M's layer shapes (2 layers, a 512-token vocabulary): the linear kernels' code
paths depend on the shapes, and the tiny models' shapes hide differences that these show."""


@pytest.fixture(scope="session")
def smollm2_shaped(tiny_model_factory) -> str:
    return tiny_model_factory("llama", **SMOLLM2_SHAPES)


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker that ends without a word is reported only as "crashed": a SIGTERM (the
    default handler ends the process silently) then prints every thread's stack first."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import faulthandler
        import signal
        import sys

        faulthandler.register(signal.SIGTERM, file=sys.__stderr__, all_threads=True, chain=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` hands whole modules to xdist workers as they free up (`--dist loadfile
    --no-loadscope-reorder`, docs/development.md), in collection order: modules with a `slow`
    test go first (stable: each module's own order is kept), so the longest modules start
    early instead of holding up the end of the run."""
    slow = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in slow)
