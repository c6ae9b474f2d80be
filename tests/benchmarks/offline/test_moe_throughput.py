"""The mixture-of-experts throughput benchmark at a tiny size: the model it builds (HF's own
class, the parameter count its shapes give), the JSON's rows and counts (timings are not
asserted), the round order, and its flag errors."""

from __future__ import annotations

import json

import pytest

from benchmarks.offline.moe_model import MoEShapes, build_moe_dir
from benchmarks.offline.moe_throughput import main, parse_args

TINY = MoEShapes(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, vocab_size=512)  # fmt: skip
TINY_FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.__dict__.items()]


def test_model_is_hf_qwen3_moe_with_the_counted_parameters(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = build_moe_dir(tmp_path / "m", TINY)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == TINY.num_parameters() == 189_824
    # 2 layers x 6 unchosen experts x 3 x 64 x 32, and the embedding table
    assert TINY.num_active_parameters() == 189_824 - 2 * 6 * 3 * 64 * 32 - 512 * 64
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_moe_dir(path, TINY) == path  # built once per shapes
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_tiny_run_writes_both_systems_per_round(tmp_path, capsys):
    out = tmp_path / "moe.json"
    argv = [*TINY_FLAGS, "--model-dir", str(tmp_path / "m"), "--num-prompts", "3",
            "--prompt-len", "4,9", "--output-len", "2,5", "--batch-size", "2", "--threads", "1",
            "--dtype", "float32", "--rounds", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "moe_throughput"
    assert report["shapes"]["num_parameters"] == 189_824
    assert report["config"]["batch_size"] == 2
    num_tokens = report["workload"]["num_output_tokens"]
    rounds = report["rounds"]
    assert [(r["round"], r["dtype"], r["order"]) for r in rounds] == [
        (0, "float32", ["duet", "hf"]), (1, "float32", ["hf", "duet"]),
    ]  # fmt: skip
    for r in rounds:
        duet, hf = r["duet"], r["hf"]
        assert (duet["system"], hf["system"], hf["variant"]) == ("duet", "hf", "batch 2")
        assert duet["num_output_tokens"] == hf["num_output_tokens"] == num_tokens
        assert duet["num_computed_tokens"] == num_tokens  # HF's padded batches compute more
        assert hf["num_computed_tokens"] >= num_tokens
        assert r["ratio"] == pytest.approx(duet["output_tokens_per_s"] / hf["output_tokens_per_s"])
        assert duet["details"]["agreement"]["reference"] == "hf float32 batch 2"
        assert (
            hf["details"]["experts_implementation"] == report["config"]["hf_experts_implementation"]
        )
        assert len(duet["details"]["loadavg_1m"]) == 2
    assert sorted(report["summary"]) == ["float32"]
    ratios = sorted(r["ratio"] for r in rounds)
    assert report["summary"]["float32"]["median_ratio"] == pytest.approx(sum(ratios) / 2)
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "--rounds: must be >= 1; got 0"),
        (["--batch-size", "0"], "--batch-size: must be >= 1; got 0"),
        (["--hf-experts", "fast"], "invalid choice: 'fast'"),
    ],
)
def test_bad_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
