"""benchmarks.serve.engine_paths: per-thread CPU time from /proc and the summary table."""

from __future__ import annotations

import os
import threading
import time

from benchmarks.serve.engine_paths import _thread_cpu_s, table
from tests.waiting import wait_for


def test_thread_cpu_time_counts_a_busy_thread_apart_from_the_main_thread():
    stop = threading.Event()
    tids: list[int] = []

    def spin() -> None:
        tids.append(threading.get_native_id())
        end = time.process_time() + 10
        while not stop.is_set() and time.process_time() < end:
            pass

    pid = os.getpid()
    before = _thread_cpu_s(pid)
    worker = threading.Thread(target=spin)
    worker.start()
    # NOTE: on a loaded machine the thread may get little CPU in a fixed wall time: wait for
    # its CPU time instead (clock ticks are 10 ms), polling slowly so the main thread stays idle.
    during = wait_for(
        lambda: tids and (now := _thread_cpu_s(pid)).get(tids[0], 0.0) >= 0.1 and now,
        60, "the busy thread's CPU time", interval_s=0.05,
    )  # fmt: skip
    stop.set()
    worker.join()
    assert pid in before and pid in during
    assert during[pid] - before[pid] < during[tids[0]]


def test_table_reports_rates_against_offline():
    results = {
        "offline": {"output_tokens": 1000, "seconds": 10.0},
        "engine_thread": {"output_tokens": 1000, "seconds": 8.0},
        "serve": {
            "output_tokens": 1000, "seconds": 12.5, "cpu_window_s": 14.0,
            "server_main_thread_cpu_s": 1.5,
            "server_other_threads_cpu_s": 20.0, "client_cpu_s": 2.5,
        },
    }  # fmt: skip
    text = table(results)
    assert "| offline | 100.0 | 1.00x |" in text
    assert "| engine_thread | 125.0 | 1.25x |" in text
    assert "| serve | 80.0 | 0.80x |" in text
    assert "14.0 s with the client's warm-up" in text and "the client 2.5 CPU-s" in text
    assert "thread (event loop) 1.5 CPU-s" in text
