"""The speculative-decoding benchmark at a tiny size: the JSON's structure (timings are not
asserted), identical tokens with and without speculation, and its flag errors."""

from __future__ import annotations

import json

import pytest

from benchmarks.speculative.__main__ import main, parse_args


def test_tiny_run_writes_every_row(tiny_llama, tmp_path, capsys):
    out = tmp_path / "speculative.json"
    argv = ["--model", tiny_llama, "--dtype", "float32", "--batch-sizes", "1,2",
            "--num-prompts", "2", "--max-tokens", "6", "--rounds", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "speculative"
    assert result["speculative_config"]["method"] == "ngram"
    assert [(r["workload"], r["batch"]) for r in result["rows"]] == [
        ("copy", 1), ("copy", 2), ("chat", 1), ("chat", 2)
    ]  # fmt: skip
    for row in result["rows"]:
        assert row["identical_tokens"] is True
        assert len(row["rounds"]) == 1 and row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
        assert 0 <= row["acceptance_rate"] <= 1
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-sizes", "1,x"], "must be a comma list of integers"),
        (["--batch-sizes", "0"], "every value must be >= 1"),
        (["--rounds", "0"], "--rounds: must be >= 1; got 0"),
        (["--workloads", "copy,poetry"], "--workloads: unknown 'poetry'"),
        (["--speculative-config", "{"], "--speculative-config: not valid JSON"),
    ],
)
def test_bad_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
