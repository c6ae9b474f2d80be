"""The hand-off benchmark at a tiny size: both workers for real, every rep of both modes done,
the JSON's structure (timings are not asserted), and its flag errors."""

from __future__ import annotations

import json

import pytest

from benchmarks.kv.handoff import MODES, main, parse_args


@pytest.mark.parametrize(("flag", "backend"), [("auto", "tcp"), ("torch_dist", "torch_dist")])
def test_tiny_run_writes_every_rep_of_both_modes(tiny_llama, tmp_path, capsys, flag, backend):
    out = tmp_path / "handoff.json"
    argv = ["--model", tiny_llama, "--dtype", "float32", "--prompt-lens", "9,40"]
    argv += ["--kv-backend", flag, "--reps", "2", "--warmup", "1", "--threads", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "kv_handoff" and result["dtype"] == "float32"
    assert result["kv_backend"] == backend
    assert [row["prompt_len"] for row in result["rows"]] == [9, 40]
    for row in result["rows"]:
        for mode in MODES:
            reps = row[mode]["reps"]
            assert len(reps) == 2
            # the hand-off is the tail of the time to first token
            assert all(0 < r["handoff_s"] < r["ttft_s"] for r in reps)
            assert row[mode]["ttft_s"]["min"] <= row[mode]["ttft_s"]["median"]
        want = row["whole"]["handoff_s"]["median"] / row["layerwise"]["handoff_s"]["median"]
        assert row["handoff_ratio"] == pytest.approx(want)
    table = capsys.readouterr().out
    assert "hand-off layerwise" in table and f"wrote {out}" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-lens", "512,x"], "a comma list of integers"),
        (["--prompt-lens", "1"], "every prompt length must be >= 2"),
        (["--reps", "0"], "--reps: must be >= 1; got 0"),
        (["--warmup", "-1"], "--warmup: must be >= 0; got -1"),
        (["--kv-backend", "rdma"], "invalid choice: 'rdma'"),
    ],
)
def test_bad_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
