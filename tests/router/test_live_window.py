"""The dashboard's live series: binning by time, nearest-rank percentiles, tokens/s and
transfer bandwidth per bin, gaps where a bin saw nothing."""

from __future__ import annotations

from duet.router.live_window import BIN_S, WINDOW_S, LiveWindow


def test_series_bins_percentiles_and_bandwidth() -> None:
    now = [1000.0]
    window = LiveWindow(clock=lambda: now[0])
    now[0] = 1000.0 - WINDOW_S - 1  # older than the window: left out
    window.observe_ttft(9.0)
    now[0] = 998.0  # the last bin: (995, 1000]
    for ms in range(1, 101):
        window.observe_ttft(ms / 1000)
    window.observe_itl(0.004)
    window.count_tokens(30)
    window.count_tokens(20)
    now[0] = 1000.0
    series = window.series([(997.0, 2_000_000_000, 1.0), (999.0, 1_000_000_000, 1.0),
                            (990.0, 500, 0.0)])  # fmt: skip
    num_bins = int(WINDOW_S / BIN_S)
    assert len(series["t"]) == num_bins
    assert series["t"][-1] == 1000.0
    assert series["ttft_p50_ms"][-1] == 50.0
    assert series["ttft_p90_ms"][-1] == 90.0
    assert series["ttft_p99_ms"][-1] == 99.0
    assert series["ttft_p50_ms"][:-1] == [None] * (num_bins - 1)
    assert series["itl_p99_ms"][-1] == 4.0
    assert series["tokens_per_s"][-1] == 50 / BIN_S
    assert series["tokens_per_s"][0] == 0.0
    assert series["transfer_gbps"][-1] == 1.5  # 3 GB over 2 s
    assert series["transfer_gbps"][-2] is None  # a zero-time transfer says nothing
