"""`python -m benchmarks.structured` on the tiny model with tiny settings: the rounds alternate,
ratios are what the timings say, both sides generate the same tokens per row, and the
constrained replies are checked against the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from benchmarks.structured.throughput import SCHEMA, parse_args, run
from duet.engine import LLM

SMALL = {
    "type": "object",
    "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                      "maximum": 9}},
    "required": ["kind", "n"],
    "additionalProperties": False,
}  # fmt: skip


def test_a_tiny_run(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=256)
    result = run(llm, batches=[2], max_tokens=40, prompt_len=8, rounds=2, schema=SMALL)
    assert result["compile_s"] > 0
    assert [c["batch"] for c in result["cells"]] == [2]
    for cell in result["cells"]:
        assert [r["order"] for r in cell["rounds"]] == [["free", "json"], ["json", "free"]]
        for r in cell["rounds"]:
            assert r["ratio"] == pytest.approx(r["json"]["tok_s"] / r["free"]["tok_s"])
            # Equal work: each free row runs (ignore_eos) exactly as long as its JSON row.
            assert r["free"]["tokens"] == r["json"]["tokens"] == sum(cell["row_tokens"])
            assert r["json"]["num_valid"] == cell["batch"]  # 40 tokens hold the whole object
        assert len(cell["row_tokens"]) == cell["batch"]
        assert all(0 < n < 40 for n in cell["row_tokens"])  # the objects ended, not max_tokens
        assert cell["median_ratio"] == pytest.approx(
            sorted(r["ratio"] for r in cell["rounds"])[0] / 2
            + sorted(r["ratio"] for r in cell["rounds"])[1] / 2
        )
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    json.dumps(result)  # the result file is JSON


def test_bad_flags_exit_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in ((["--rounds", "0"], "--rounds"), (["--batches", "0"], "--batches")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert flag in capsys.readouterr().err
