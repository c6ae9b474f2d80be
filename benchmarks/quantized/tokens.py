"""Each weight format's tokens, to compare two trees: whether a kernel change kept the bits.

    python -m benchmarks.quantized.tokens --out new.json
    (in the other tree, this file copied there) python -m benchmarks.quantized.tokens --out old.json
    python -m benchmarks.quantized.tokens --compare old.json new.json

Per format (bf16, int8, int4, gguf; LM head quantized): the greedy outputs of the speed run's
prompts (one 64-token prompt, then 32: 128 new tokens each) and the top-1 token at every place
of the accuracy text (teacher forced, windows of 1,024). `--compare` prints, per format,
whether the two files' tokens are identical and each file's agreement with its own bf16.
Only `duet.engine`'s public entry points and the attention metadata are imported, so the file
runs unchanged in older trees."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import torch

from duet.engine import LLM, SamplingParams
from duet.engine.attention import AttentionMetadata

TEXT = Path(__file__).with_name("public_domain_text.txt")
FORMATS = ("bf16", "int8", "int4", "gguf")


def _prompts(count: int, seed: int, vocab: int) -> list[list[int]]:  # as speed.random_prompts
    rng = random.Random(seed)
    return [[rng.randrange(100, min(vocab, 32000) - 1) for _ in range(64)] for _ in range(count)]


def _top1(llm: LLM, text: str, window: int = 1024, block: int = 16) -> list[int]:
    model, vocab = llm.engine.runner.model, llm.engine.arch.vocab_size
    ids = torch.tensor([t if t < vocab else 0 for t in llm.engine.tokenizer.encode(text)])
    out: list[int] = []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        n, blocks = chunk.shape[0], -(-chunk.shape[0] // block)
        if n < 2:
            continue
        caches = [
            torch.zeros(2, blocks, block, model.num_kv_heads, model.config.head_dim,
                        dtype=torch.bfloat16)
            for _ in range(model.config.num_hidden_layers)
        ]  # fmt: skip
        meta = AttentionMetadata.build([n], [n], [list(range(blocks))], block, torch.device("cpu"))
        with torch.inference_mode():
            hidden = model(chunk, torch.arange(n), caches, meta)
            out += model.compute_logits(hidden[:-1]).argmax(-1).tolist()
    return out


def tokens_of(fmt: str) -> dict[str, list[Any]]:
    kwargs: dict[str, Any] = {"dtype": "bfloat16"}
    if fmt != "bf16":
        kwargs.update(quantization=fmt, quantize_lm_head=True)
    if fmt == "int4":
        kwargs["quantization_group_size"] = 32
    llm = LLM(None, load_progress=False, max_num_seqs=32, enable_prefix_caching=False, **kwargs)
    vocab = llm.engine.arch.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    greedy = []
    for count, seed in ((1, 0), (32, 1)):
        outputs = llm.generate(_prompts(count, seed, vocab), params)
        greedy += [list(o.outputs[0].token_ids) for o in outputs]
    return {"greedy": greedy, "top1": _top1(llm, TEXT.read_text())}


def agreement(ours: dict[str, list[Any]], base: dict[str, list[Any]]) -> dict[str, float]:
    """`ours` against `base`: the mean share of each greedy output before its first differing
    token, the outputs equal throughout, the share of places with the same top-1 token."""
    shares = []
    for a, b in zip(ours["greedy"], base["greedy"], strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        shares.append(first / max(1, len(b)))
    same = sum(x == y for x, y in zip(ours["top1"], base["top1"], strict=True))
    return {"greedy_prefix": sum(shares) / len(shares),
            "equal_outputs": sum(s == 1.0 for s in shares),
            "top1_match": same / max(1, len(base["top1"]))}  # fmt: skip


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    lines = []
    for fmt in (f for f in FORMATS if f in old and f in new):
        same = old[fmt] == new[fmt]
        line = f"{fmt}: {'identical' if same else 'DIFFERENT'} tokens"
        if fmt != "bf16" and "bf16" in old and "bf16" in new:
            for name, d in (("old", old), ("new", new)):
                a = agreement(d[fmt], d["bf16"])
                line += (f"; {name} vs its bf16: top-1 {a['top1_match']:.2%}, greedy "
                         f"{a['greedy_prefix']:.1%}, {a['equal_outputs']:.0f} equal")  # fmt: skip
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write this tree's tokens here")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    args = p.parse_args(argv)
    if args.compare:
        old, new = (json.loads(path.read_text()) for path in args.compare)
        print("\n".join(compare(old, new)))
        return
    if args.out is None:
        p.error("--out or --compare is required")
    args.out.write_text(json.dumps({f: tokens_of(f) for f in args.formats.split(",")}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
