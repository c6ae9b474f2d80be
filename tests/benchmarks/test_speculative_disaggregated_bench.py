"""The draft-prefill benchmark at a tiny size: both scenarios and choices in the JSON with
identical tokens (timings are not asserted), the truncated draft it builds, and its flag
errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from benchmarks.speculative.disaggregated import main, parse_args
from benchmarks.speculative.truncated_draft import truncated_draft


def test_a_truncated_draft_keeps_the_first_layers(tiny_llama, tmp_path):
    out = truncated_draft(Path(tiny_llama), 1, tmp_path / "draft")
    config = json.loads((out / "config.json").read_text())
    target = load_file(str(Path(tiny_llama) / "model.safetensors"))
    draft = load_file(str(out / "model.safetensors"))
    assert config["num_hidden_layers"] == 1
    assert sorted(draft) == sorted(n for n in target if ".layers.1." not in n)
    assert all(draft[n].equal(target[n]) for n in draft)
    assert (out / "tokenizer.json").read_text() == (Path(tiny_llama) / "tokenizer.json").read_text()
    with pytest.raises(ValueError, match=r"num_layers: must be in \[1, 2\]; got 3"):
        truncated_draft(Path(tiny_llama), 3, tmp_path / "bad")


def test_tiny_run_writes_both_choices(tiny_llama, tmp_path, capsys):
    draft = truncated_draft(Path(tiny_llama), 1, tmp_path / "draft")
    out = tmp_path / "result.json"
    argv = ["--model", tiny_llama, "--draft", str(draft), "--dtype", "float32",
            "--prompt-lens", "16,40", "--max-tokens", "6", "--reps", "1", "--warmup", "0",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "speculative_disaggregated"
    assert [(r["scenario"], r["prompt_len"]) for r in result["rows"]] == [
        ("alone", 16), ("alone", 40), ("beside a decode", 16), ("beside a decode", 40)
    ]  # fmt: skip
    for row in result["rows"]:
        assert row["same"] is True
        assert sorted(row["ratio"]) == sorted(row["decode"].keys() - {"reps"})
        assert all(len(row[c]["reps"]) == 1 and row[c]["ttft_s"] > 0 for c in ("decode", "prefill"))
    assert "bg_max_gap_s" in result["rows"][-1]["ratio"]
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reps", "0"], "--reps: must be >= 1; got 0"),
        (["--max-tokens", "1"], "--max-tokens: must be >= 2"),
        (["--prompt-lens", "0"], "prompt length"),
    ],
)
def test_bad_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
