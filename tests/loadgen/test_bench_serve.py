"""`duet bench serve` against a live aggregated REST server on the tiny model: exact request and
token counts, the JSON's shape, goodput at impossible and unbounded SLOs, the PNG; plus the
seeded workload, the Poisson arrivals, SSE framing and flag errors without a server."""

from __future__ import annotations

import itertools
import json
import statistics
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from duet.cli.main import build_parser, main
from duet.engine import AsyncEngine
from duet.loadgen.client import RequestResult, SSEDecoder
from duet.loadgen.metrics import LATENCIES, SLO, summarize
from duet.loadgen.workload import LengthDist, arrival_offsets, build_workload, unit_gaps
from tests.net import free_port
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, make_app, make_engine

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {
    "num_requests", "completed", "failed", "errors", "duration_s", "num_prompt_tokens",
    "num_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
    "slo", "num_good", "goodput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms",
}  # fmt: skip
REQUEST_KEYS = {
    "index", "input_len", "output_len", "prompt_tokens", "output_tokens", "send_s", "ttft_s",
    "tpot_s", "e2e_s", "itl_s", "error",
}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_llama: str) -> Iterator[AsyncEngine]:
    engine = make_engine(tiny_llama)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncEngine) -> Iterator[LiveServer]:
    live = LiveServer(make_app(engine, MODEL_NAME, api_keys=[API_KEY])).start()
    yield live
    live.stop()


def _bench(server: LiveServer, tiny_llama: str, *flags: str) -> int:
    return main(
        ["bench", "serve", "--url", server.url, "--api-key", API_KEY, "--tokenizer", tiny_llama,
         "--request-timeout-s", "60", *flags]
    )  # fmt: skip


def test_sweep_counts_tokens_exactly_and_writes_json_and_png(
    server: LiveServer, tiny_llama: str, tmp_path: Path
) -> None:
    out, png = tmp_path / "agg.json", tmp_path / "agg.png"
    rc = _bench(
        server, tiny_llama, "--rate", "50,inf", "--num-requests", "8",
        "--input-len-dist", "fixed:12", "--output-len-dist", "fixed:6",
        "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9", "--label", "agg",
        "--result-json", str(out), "--plot", str(png),
    )  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    config = result["config"]
    assert (config["model"], config["rates"], config["num_requests"]) == (
        MODEL_NAME,
        [50.0, "inf"],
        8,
    )
    assert (config["input_len_dist"], config["output_len_dist"]) == ("fixed:12", "fixed:6")
    assert [run["rate"] for run in result["runs"]] == [50.0, "inf"]
    for run in result["runs"]:
        s = run["summary"]
        assert set(s) == SUMMARY_KEYS
        assert (s["num_requests"], s["completed"], s["failed"], s["errors"]) == (8, 8, 0, {})
        assert (s["num_prompt_tokens"], s["num_output_tokens"]) == (8 * 12, 8 * 6)
        assert s["num_good"] == 8
        assert s["goodput"] == s["request_throughput"] == pytest.approx(8 / s["duration_s"])
        assert s["output_throughput"] == pytest.approx(48 / s["duration_s"])
        assert s["total_token_throughput"] == pytest.approx((96 + 48) / s["duration_s"])
        for name in LATENCIES:
            stats = s[name]
            assert set(stats) == {"mean", "p50", "p90", "p99"}
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], name
        requests = run["requests"]
        assert [r["index"] for r in requests] == list(range(8))
        for r in requests:
            assert set(r) == REQUEST_KEYS
            assert (r["prompt_tokens"], r["output_tokens"], r["error"]) == (12, 6, None)
            assert 0 < r["ttft_s"] <= r["e2e_s"]
            # Events with output after the first: at most one per further token.
            assert 1 <= len(r["itl_s"]) <= 5
            assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 5)
    # Poisson sends: each request leaves at its seeded offset (not before), in order.
    offsets = arrival_offsets(8, 50.0, seed=0)
    sends = [r["send_s"] for r in result["runs"][0]["requests"]]
    assert all(send >= offset - 1e-3 for send, offset in zip(sends, offsets, strict=True))
    assert sends == sorted(sends)
    assert max(r["send_s"] for r in result["runs"][1]["requests"]) < 0.5  # inf: all at once

    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000

    # Goodput from the same requests under other SLOs: 0 ms is impossible, no bound is all.
    run = result["runs"][0]
    results = [RequestResult.from_json(r) for r in run["requests"]]
    duration = run["summary"]["duration_s"]
    for impossible in (SLO(0, 0), SLO(ttft_ms=0), SLO(tpot_ms=0)):
        assert summarize(results, duration, impossible)["goodput"] == 0
    huge = summarize(results, duration, SLO(1e12, 1e12))
    assert huge["goodput"] == huge["request_throughput"] == run["summary"]["request_throughput"]
    assert summarize(results, duration, SLO())["goodput"] is None  # no SLO, no goodput

    # --compare draws saved results into one figure without sending anything.
    both = tmp_path / "both.png"
    assert main(["bench", "serve", "--compare", str(out), str(out), "--plot", str(both)]) == 0
    assert both.read_bytes().startswith(PNG_MAGIC)


def test_max_concurrency_one_is_one_stream(
    server: LiveServer, tiny_llama: str, tmp_path: Path
) -> None:
    out = tmp_path / "one.json"
    rc = _bench(
        server, tiny_llama, "--rate", "inf", "--num-requests", "4", "--max-concurrency", "1",
        "--input-len-dist", "fixed:12", "--output-len-dist", "fixed:6",
        "--result-json", str(out), "--no-plot",
    )  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["config"]["max_concurrency"] == 1
    requests = result["runs"][0]["requests"]
    assert [r["error"] for r in requests] == [None] * 4
    for before, after in itertools.pairwise(requests):  # each sent once the last ended
        assert after["send_s"] >= before["send_s"] + before["e2e_s"]


def test_chat_endpoint_with_impossible_slo(
    server: LiveServer, tiny_llama: str, tmp_path: Path
) -> None:
    out = tmp_path / "chat.json"
    rc = _bench(
        server, tiny_llama, "--endpoint", "chat", "--rate", "inf", "--num-requests", "4",
        "--input-len-dist", "uniform:4:10", "--output-len-dist", "fixed:5",
        "--slo-ttft-ms", "0", "--num-warmup", "0", "--result-json", str(out), "--no-plot",
    )  # fmt: skip
    assert rc == 0
    s = json.loads(out.read_text())["runs"][0]["summary"]
    assert (s["completed"], s["failed"], s["num_output_tokens"]) == (4, 0, 20)
    assert (s["num_good"], s["goodput"]) == (0, 0.0)
    assert not out.with_suffix(".png").exists()


def test_requests_over_the_timeout_fail_with_their_error(
    server: LiveServer, tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "timeout.json"
    flags = ["--rate", "inf", "--num-requests", "3", "--input-len-dist", "fixed:8"]
    flags += ["--output-len-dist", "fixed:200", "--result-json", str(out), "--no-plot"]
    # 1 ms cannot hold 200 decode steps: every request ends as a counted timeout.
    rc = main(
        ["bench", "serve", "--url", server.url, "--api-key", API_KEY, "--tokenizer", tiny_llama,
         "--request-timeout-s", "0.001", "--num-warmup", "0", *flags]
    )  # fmt: skip
    assert rc == 1  # a rate that completed nothing
    s = json.loads(out.read_text())["runs"][0]["summary"]
    assert (s["completed"], s["failed"]) == (0, 3)
    assert s["errors"] == {"timed out after 0.001s (--request-timeout-s)": 3}
    assert s["ttft_ms"]["p50"] is None
    # A warm-up that fails stops the run before any timed request, with the reason.
    rc = main(
        ["bench", "serve", "--url", server.url, "--api-key", API_KEY, "--tokenizer", tiny_llama,
         "--request-timeout-s", "0.001", *flags]
    )  # fmt: skip
    assert rc == 2
    assert "warm-up request failed: timed out after 0.001s" in capsys.readouterr().err


def test_waits_for_a_server_that_is_starting(
    engine: AsyncEngine, tiny_llama: str, tmp_path: Path
) -> None:
    late = LiveServer(make_app(engine, MODEL_NAME))  # its port is bound, not yet listening
    timer = threading.Timer(1.5, late.start)
    timer.start()
    try:
        rc = main(
            ["bench", "serve", "--url", late.url, "--tokenizer", tiny_llama, "--rate", "inf",
             "--num-requests", "2", "--input-len-dist", "fixed:4", "--output-len-dist", "fixed:2",
             "--wait-for-server-s", "30", "--num-warmup", "0", "--no-plot",
             "--result-json", str(tmp_path / "late.json")]
        )  # fmt: skip
    finally:
        timer.join()
        late.stop()
    assert rc == 0
    summary = json.loads((tmp_path / "late.json").read_text())["runs"][0]["summary"]
    assert (summary["completed"], summary["num_output_tokens"]) == (2, 4)


def test_server_down_wrong_key_and_unknown_model_are_clear_errors(
    server: LiveServer, tiny_llama: str, capsys: pytest.CaptureFixture[str]
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["bench", "serve", "--url", closed, "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert f"--url: cannot reach {closed}" in err and "Traceback" not in err
    assert main(["bench", "serve", "--url", closed, "--wait-for-server-s", "1.5"]) == 2
    assert "for 1.5s; is `duet serve` running there?" in capsys.readouterr().err
    base = ["bench", "serve", "--url", server.url, "--no-plot"]
    assert main([*base, "--api-key", "sk-wrong"]) == 2
    assert "--api-key: " in capsys.readouterr().err
    assert main([*base, "--api-key", API_KEY, "--model", "nope"]) == 2
    assert f"--model: 'nope' is not served at {server.url}" in capsys.readouterr().err
    assert main([*base, "--api-key", API_KEY, "--endpoint", "chat", "--prompt-format", "ids"]) == 2
    assert "--prompt-format ids: chat messages are text" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--input-len-dist", "uniform:5", "uniform takes 2 number(s)"),
        ("--input-len-dist", "uniform:10:5", "needs LO <= HI"),
        ("--output-len-dist", "fixed:0", "integers >= 1"),
        ("--output-len-dist", "fixed:2.5", "integers >= 1"),
        ("--input-len-dist", "zipf:3", "unknown distribution 'zipf'"),
        ("--input-len-dist", "normal:abc:3", "not a number"),
        ("--output-len-dist", "normal:0:3", "MEAN >= 1"),
        ("--rate", "0", "must be > 0"),
        ("--rate", "1,x", "'x' is not a number"),
        ("--num-requests", "0", "must be >= 1"),
        ("--request-timeout-s", "0", "must be > 0"),
        ("--slo-ttft-ms", "-1", "must be >= 0"),
    ],
)
def test_bad_flags_name_the_flag(
    flag: str, value: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "serve", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and why in err


def test_length_distributions_parse_and_sample() -> None:
    import random

    rng = random.Random(0)
    assert str(LengthDist.parse("fixed:128")) == "fixed:128"
    assert {LengthDist.parse("fixed:128").sample(rng) for _ in range(10)} == {128}
    uniform = [LengthDist.parse("uniform:16:20").sample(rng) for _ in range(500)]
    assert set(uniform) == {16, 17, 18, 19, 20}
    normal = [LengthDist.parse("normal:2:50").sample(rng) for _ in range(500)]
    assert min(normal) == 1 and max(normal) > 50  # clipped below at 1, not above


def test_seeded_workload_is_identical_across_builds() -> None:
    allowed = list(range(3, 500))
    dists = (LengthDist.parse("uniform:16:64"), LengthDist.parse("normal:32:8"))
    first = build_workload(50, 7, *dists, allowed)
    assert first == build_workload(50, 7, *dists, allowed)
    assert first != build_workload(50, 8, *dists, allowed)
    other_rate = build_workload(50, 7, *dists, allowed, run_index=1)
    # Another rate of a sweep: the same lengths, fresh prompts (no prefix-cache hits).
    assert [(r.input_len, r.output_len) for r in other_rate] == [
        (r.input_len, r.output_len) for r in first
    ]
    assert all(a.prompt_ids != b.prompt_ids for a, b in zip(first, other_rate, strict=True))
    assert all(16 <= r.input_len <= 64 and r.output_len >= 1 for r in first)
    assert {t for r in first for t in r.prompt_ids} <= set(allowed)


def test_poisson_gaps_have_the_right_mean() -> None:
    rate, n = 4.0, 200_001
    offsets = arrival_offsets(n, rate, seed=3)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and len(gaps) == n - 1
    # Exponential(rate): mean and standard deviation both 1/rate (1% is > 4 standard errors).
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.01)
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.02)
    assert arrival_offsets(1000, rate, seed=3) == offsets[:1000]  # seeded
    assert arrival_offsets(1000, rate, seed=4) != offsets[:1000]
    # Every rate scales the same unit gaps; inf sends everything at 0.
    assert arrival_offsets(100, 2.0, seed=3) == pytest.approx([2 * o for o in offsets[:100]])
    assert arrival_offsets(5, float("inf"), seed=3) == [0.0] * 5
    assert len(unit_gaps(1, seed=0)) == 0


def test_sse_decoder_handles_any_chunking() -> None:
    stream = (
        ': comment\r\ndata: {"a": "é🎉"}\r\n\r\n'
        "event: x\ndata: line1\ndata:line2\n\n"
        "data: [DONE]\r\r"
    ).encode()
    want = ['{"a": "é🎉"}', "line1\nline2", "[DONE]"]
    for size in (1, 2, 3, 7, len(stream)):
        decoder = SSEDecoder()
        got = [e for i in range(0, len(stream), size) for e in decoder.feed(stream[i : i + size])]
        assert got == want, size
