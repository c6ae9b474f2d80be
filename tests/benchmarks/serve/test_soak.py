"""benchmarks.serve.soak's plumbing at tiny scale: its accounting (duplicates, losses, p99 and
memory per minute) on made-up outcomes, and one short run against a plain `duet serve` on the
tiny model (no faults, SQLite), whose JSON and plot it writes. The soak itself is a script."""

from __future__ import annotations

import json

from benchmarks.serve.soak import main
from benchmarks.serve.soak_report import (
    Outcome,
    Report,
    batch_per_minute,
    p99_per_minute,
    read_stream,
    requests_per_minute,
    role_of,
    rss_per_minute,
)
from tests.net import free_port


def test_a_stream_finished_twice_is_a_duplicate_and_an_unanswered_one_is_lost():
    twice = Outcome(1.0, 2.0, "completed")
    read_stream(['data: {"choices": [{"text": "a", "finish_reason": "length"}]}',
                 'data: {"choices": [{"text": "", "finish_reason": "length"}]}',
                 "data: [DONE]"], twice)  # fmt: skip
    failed = Outcome(3.0, 4.0)
    read_stream(['data: {"error": {"type": "service_unavailable"}}', "data: [DONE]"], failed)
    report = Report([twice, failed, Outcome(5.0)])
    summary = report.summary()
    assert (twice.num_finishes, twice.num_done) == (2, 1)
    assert (failed.status, failed.cause) == ("failed", "stream error: service_unavailable")
    assert (summary["sent"], summary["completed"], summary["duplicated"], summary["lost"]) == (
        3,
        1,
        1,
        1,
    )
    assert summary["failed"] == {"stream error: service_unavailable": 1}


def test_p99_and_memory_are_per_minute():
    outcomes = [Outcome(0.0, float(i), "completed") for i in range(1, 60)]  # 1..59 s
    outcomes += [Outcome(60.0, 62.0, "completed"), Outcome(61.0, 70.0, "failed")]
    assert p99_per_minute(outcomes) == {0: 59.0, 1: 2.0}  # by the minute it ended; no failure
    samples = [{"t_s": 5, "rss_mb": {"a": 10.0}}, {"t_s": 50, "rss_mb": {"a": 12.0, "b": 1.0}},
               {"t_s": 65, "rss_mb": {"a": 11.0}}]  # fmt: skip
    assert rss_per_minute(samples) == {0: {"a": 12.0, "b": 1.0}, 1: {"a": 11.0}}


def test_requests_and_the_batch_per_minute():
    outcomes = [Outcome(1.0, 3.0, "completed"), Outcome(2.0, 9.0, "completed"),
                Outcome(50.0, 70.0, "completed"), Outcome(55.0, 61.0, "failed"),
                Outcome(59.0)]  # fmt: skip
    assert requests_per_minute(outcomes) == {
        0: {"sent": 5, "completed": 2, "failed": 0, "p50_s": 2.0},
        1: {"sent": 0, "completed": 1, "failed": 1, "p50_s": 20.0},
    }
    looks = [{"t_s": 5, "completed": 1, "failed": 0}, {"t_s": 55, "completed": 3, "failed": 1},
             {"t_s": 125, "completed": 9, "failed": 1}]  # fmt: skip
    assert batch_per_minute(looks) == {0: 4, 2: 10}


def test_processes_are_plotted_by_role():
    assert [role_of(n) for n in (
        "serve:1:ray::DecodeRankActor", "serve:2:ray::PrefillRankActor", "serve:3:ray::RouterActor",
        "redis:4:redis-server 127.0.0.1:18802", "serve:5:/x/python -m duet.cli.main serve --port",
        "serve:6:ray::DashboardAgent",
    )] == ["decode worker", "prefill worker", "router", "redis", "duet serve", "ray"]  # fmt: skip


def test_a_short_run_against_duet_serve_writes_its_report(tiny_llama, tmp_path):
    out = tmp_path / "soak.json"
    result = main(["--model", tiny_llama, "--aggregated", "--no-redis", "--minutes", "0.15",
                   "--saturation-s", "3", "--concurrency", "2", "--load", "0.5",
                   "--kill-every", "0", "--redis-restart-at", "-1", "--batch-lines", "3",
                   "--vocab", "400", "--max-tokens", "8", "--timeout-s", "60",
                   "--port", str(free_port()), "--grpc-port", str(free_port()),
                   "--out", str(out), "--plot"])  # fmt: skip
    assert result["saturation_rps"] > 0 and result["sent"] >= 1
    assert (result["completed"], result["duplicated"], result["lost"]) == (result["sent"], 0, 0)
    assert result["batch"]["status"] == "completed"
    assert (result["batch"]["duplicated"], result["batch"]["lost"]) == (0, 0)
    assert json.loads(out.read_text())["sent"] == result["sent"]
    per_minute = result["requests_per_minute"]
    assert sum(m["sent"] for m in per_minute.values()) == result["sent"]
    assert sum(m["completed"] for m in per_minute.values()) == result["completed"]
    assert result["batch_lines_done_per_minute"]  # looked at every 10 s from the start
    assert out.with_suffix(".png").stat().st_size > 0
