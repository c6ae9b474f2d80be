"""The planner's policy: given signals and current sizes, the exact sizes it picks, with
hysteresis, cooldowns, stabilization, pending pods, min/max and the shared GPU budget."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from duet.deploy.planner.config import PlannerConfig, PlannerConfigError, PoolConfig
from duet.deploy.planner.metrics import LoadSignals
from duet.deploy.planner.policy import PoolSizes, ScalingPolicy

# Prefill pods cost 2 GPUs, decode pods 1; 10 GPUs in all.
CONFIG = PlannerConfig(
    prefill=PoolConfig("prefill", min_replicas=1, max_replicas=4, gpus_per_replica=2),
    decode=PoolConfig("decode", min_replicas=1, max_replicas=6, gpus_per_replica=1),
    gpu_budget=10,
    ttft_p90_target_s=1.0,
    tpot_p90_target_s=0.1,
    prefill_queued_tokens_per_replica=1000,
    decode_occupancy_target=0.75,
    hysteresis=0.2,
    scale_up_cooldown_s=60,
    scale_down_cooldown_s=300,
    scale_down_stabilization_s=600,
    min_samples=20,
)


def signals(**overrides: object) -> LoadSignals:
    """A healthy interval: latencies at half their targets, moderate load, all joined."""
    base = LoadSignals(
        ttft_p90_s=0.5, tpot_p90_s=0.06, num_ttft_samples=100, num_tpot_samples=1000,
        prefill_queued_tokens=1000, decode_batch_occupancy=0.6, num_prefill_workers=8,
        num_decode_workers=8, num_requests_waiting=0,
    )  # fmt: skip
    return replace(base, **overrides)


def decide(policy: ScalingPolicy, s: LoadSignals | None, cur: tuple[int, int], t: float):
    d = policy.decide(s, PoolSizes(*cur), t)
    return (d.sizes.prefill, d.sizes.decode), d.reasons


def test_ttft_over_target_grows_prefill_in_proportion():
    sizes, reasons = decide(ScalingPolicy(CONFIG), signals(ttft_p90_s=1.5), (2, 2), 0)
    assert sizes == (3, 2)  # ceil(2 x 1.5)
    assert reasons["prefill"] == "TTFT p90 1.500s > target 1.0s"
    # A large miss is capped at doubling.
    assert decide(ScalingPolicy(CONFIG), signals(ttft_p90_s=5.0), (2, 2), 0)[0] == (4, 2)
    # One pod at least, even for a small miss above the band.
    assert decide(ScalingPolicy(CONFIG), signals(ttft_p90_s=1.25), (3, 2), 0)[0] == (4, 2)


def test_queued_prefill_tokens_grow_prefill():
    # 3,500 queued tokens need ceil(3.5) = 4 pods of 1,000.
    sizes, reasons = decide(ScalingPolicy(CONFIG), signals(prefill_queued_tokens=3500), (2, 2), 0)
    assert sizes == (4, 2)
    assert reasons["prefill"] == "3500 queued tokens"
    # Within the band (<= 2,400 for two pods) nothing moves.
    assert decide(ScalingPolicy(CONFIG), signals(prefill_queued_tokens=2300), (2, 2), 0)[0] == (
        2, 2,
    )  # fmt: skip


def test_tpot_or_occupancy_over_target_grows_decode():
    assert decide(ScalingPolicy(CONFIG), signals(tpot_p90_s=0.15), (1, 2), 0)[0] == (1, 3)
    sizes, reasons = decide(ScalingPolicy(CONFIG), signals(decode_batch_occupancy=0.95), (1, 2), 0)
    assert sizes == (1, 3)  # ceil(2 x 0.95 / 0.75)
    assert reasons["decode"] == "occupancy 0.95 > 0.75"


def test_inside_the_hysteresis_band_nothing_changes():
    s = signals(ttft_p90_s=1.15, tpot_p90_s=0.085, prefill_queued_tokens=1100,
                decode_batch_occupancy=0.85)  # fmt: skip
    policy = ScalingPolicy(CONFIG)
    for t in range(0, 3600, 15):
        assert decide(policy, s, (2, 3), t)[0] == (2, 3)


def test_percentiles_from_too_few_samples_are_ignored():
    s = signals(ttft_p90_s=9.0, num_ttft_samples=5)
    sizes, reasons = decide(ScalingPolicy(CONFIG), s, (2, 2), 0)
    assert sizes == (2, 2)
    assert reasons["prefill"] == "TTFT p90 n/a, within band"


def test_growth_waits_for_pods_of_the_last_scale_up():
    # Two prefill pods are asked for, one prefill worker has joined.
    s = signals(ttft_p90_s=3.0, num_prefill_workers=1)
    sizes, reasons = decide(ScalingPolicy(CONFIG), s, (2, 2), 0)
    assert sizes == (2, 2)
    assert reasons["prefill"].endswith("up held: 1 of 2 workers joined")


def test_scale_up_cooldown():
    policy = ScalingPolicy(CONFIG)
    hot = signals(ttft_p90_s=1.5)
    assert decide(policy, hot, (1, 2), 0)[0] == (2, 2)
    sizes, reasons = decide(policy, hot, (2, 2), 30)
    assert sizes == (2, 2) and reasons["prefill"].endswith("up held: cooldown")
    assert decide(policy, hot, (2, 2), 61)[0] == (3, 2)


def test_scale_down_waits_for_the_window_then_steps_one_pod_per_cooldown():
    policy = ScalingPolicy(CONFIG)
    idle = signals(ttft_p90_s=None, tpot_p90_s=None, num_ttft_samples=0, num_tpot_samples=0,
                   prefill_queued_tokens=0, decode_batch_occupancy=0.0)  # fmt: skip
    cur = (3, 4)  # 10 GPUs: the whole budget
    history = []
    for t in range(0, 2401, 15):
        cur, _ = decide(policy, idle, cur, t)
        if not history or history[-1][1] != cur:
            history.append((t, cur))
    # Nothing for a full stabilization window after start (the planner just came up), then
    # one pod per pool per 300 s cooldown, down to the minimum.
    assert history == [
        (0, (3, 4)), (615, (2, 3)), (915, (1, 2)), (1215, (1, 1)),
    ]  # fmt: skip


def test_a_single_busy_interval_blocks_shrinking_for_the_window():
    policy = ScalingPolicy(CONFIG)
    quiet = signals(prefill_queued_tokens=0, decode_batch_occupancy=0.1)
    for t in range(0, 700, 15):
        decide(policy, quiet, (3, 3), t)
    # A busy interval recommends the current size; for the next 600 s nothing shrinks.
    decide(policy, signals(prefill_queued_tokens=2500), (3, 3), 700)
    for t in range(715, 1300, 15):
        sizes, reasons = decide(policy, quiet, (3, 3), t)
        assert sizes == (3, 3), t
    assert reasons["prefill"].endswith("down held: stabilizing")
    assert decide(policy, quiet, (3, 3), 1315)[0] == (2, 2)


def test_noisy_metrics_around_the_targets_never_flap():
    rng = random.Random(7)
    policy = ScalingPolicy(CONFIG)
    cur = (2, 3)
    sizes_seen = []
    for t in range(0, 4 * 3600, 15):
        noisy = signals(
            ttft_p90_s=rng.uniform(0.85, 1.15),
            tpot_p90_s=rng.uniform(0.085, 0.115),
            prefill_queued_tokens=rng.uniform(1700, 2300),
            decode_batch_occupancy=rng.uniform(0.62, 0.88),
            num_requests_waiting=rng.randint(0, 5),
        )
        cur, _ = decide(policy, noisy, cur, t)
        sizes_seen.append(cur)
    assert set(sizes_seen) == {(2, 3)}


def test_spiky_metrics_only_ever_move_one_way():
    # Every other interval misses the SLO by 30%, the others are fine: the pools grow (with
    # cooldowns between steps) and never shrink back and forth.
    policy = ScalingPolicy(CONFIG)
    cur = (1, 1)
    changes = []
    for i, t in enumerate(range(0, 3600, 15)):
        spike = i % 2 == 0
        s = signals(
            ttft_p90_s=1.3 if spike else 0.5, tpot_p90_s=0.13 if spike else 0.05,
            prefill_queued_tokens=0, decode_batch_occupancy=0.3,
        )  # fmt: skip
        new, _ = decide(policy, s, cur, t)
        if new != cur:
            changes.append((t, new))
        cur = new
    assert changes[0] == (0, (2, 2))
    prefill, decode = [c[1][0] for c in changes], [c[1][1] for c in changes]
    assert prefill == sorted(prefill) and decode == sorted(decode)
    times = [c[0] for c in changes]
    assert all(b - a >= 60 for a, b in itertools.pairwise(times))


def test_the_gpu_budget_goes_to_the_pool_missing_its_slo_worst():
    # 2 prefill pods (4 GPUs) + 4 decode pods (4 GPUs) = 8 of 10 GPUs. Both pools want two
    # more pods; the 2 spare GPUs buy one prefill pod, whose TTFT miss is worse.
    s = signals(ttft_p90_s=2.5, tpot_p90_s=0.15)
    sizes, reasons = decide(ScalingPolicy(CONFIG), s, (2, 4), 0)
    assert sizes == (3, 4)
    assert reasons["decode"].endswith("capped at 4 by the 10-GPU budget")
    # With decode the worse, the 2 GPUs buy two decode pods.
    s = signals(ttft_p90_s=1.5, tpot_p90_s=0.3)
    assert decide(ScalingPolicy(CONFIG), s, (2, 4), 0)[0] == (2, 6)


def test_over_budget_shrinks_the_pool_under_less_pressure():
    # 3 x 2 + 5 = 11 GPUs on a 10-GPU budget (someone scaled by hand).
    # Prefill runs hotter (3,500 queued tokens on 3 pods: 1.17 of capacity) than decode
    # (occupancy 0.7 of 0.75: 0.93), so decode gives up the pod.
    s = signals(decode_batch_occupancy=0.7, prefill_queued_tokens=3500)
    sizes, reasons = decide(ScalingPolicy(CONFIG), s, (3, 5), 0)
    assert sizes == (3, 4)
    assert reasons["decode"].endswith("shrunk to fit 10 GPUs")
    s = signals(decode_batch_occupancy=0.7, prefill_queued_tokens=2500)
    assert decide(ScalingPolicy(CONFIG), s, (3, 5), 0)[0] == (2, 5)


# A data-parallel decode group of 8 workers over two 4-GPU pods: the pool moves 2 pods at a time.
GROUPS = replace(
    CONFIG,
    decode=PoolConfig("decode", min_replicas=2, max_replicas=8, gpus_per_replica=4,
                      workers_per_replica=4, pods_per_group=2),
    gpu_budget=26,
)  # fmt: skip


def test_a_pool_whose_groups_span_pods_moves_in_whole_groups():
    # Occupancy 0.9 on 2 pods wants ceil(2 x 0.9 / 0.75) = 3 pods: a whole group is 4.
    hot = signals(decode_batch_occupancy=0.9, num_decode_workers=8)
    sizes, reasons = decide(ScalingPolicy(GROUPS), hot, (1, 2), 0)
    assert sizes == (1, 4) and reasons["decode"] == "occupancy 0.90 > 0.75"
    # Idle: a group (2 pods) per 300 s cooldown after the window, down to the minimum; from a
    # size that is not whole groups, to whole groups first.
    idle = signals(ttft_p90_s=None, tpot_p90_s=None, num_ttft_samples=0, num_tpot_samples=0,
                   prefill_queued_tokens=0, decode_batch_occupancy=0.0)  # fmt: skip
    for start, steps in (
        ((1, 6), [(615, (1, 4)), (915, (1, 2))]),
        ((1, 5), [(615, (1, 4)), (915, (1, 2))]),
    ):  # 5: scaled by hand
        policy, cur, history = ScalingPolicy(GROUPS), start, []
        for t in range(0, 1801, 15):
            cur, _ = decide(policy, idle, cur, t)
            if not history or history[-1][1] != cur:
                history.append((t, cur))
        assert history == [(0, start), *steps]
    # The budget grants whole groups: 2 prefill GPUs + 2 decode pods (8) leave 16 GPUs, one
    # group of two pods; the 4 GPUs of a third pod are left over, not spent on half a group.
    hot = signals(decode_batch_occupancy=2.0, num_decode_workers=8)
    sizes, reasons = decide(ScalingPolicy(replace(GROUPS, gpu_budget=22)), hot, (1, 2), 0)
    assert sizes == (1, 4)
    assert reasons["decode"].endswith("capped at 4 by the 22-GPU budget")


def test_bounds_apply_even_without_metrics():
    sizes, reasons = decide(ScalingPolicy(CONFIG), None, (0, 9), 0)
    assert sizes == (1, 6)
    assert reasons == {
        "prefill": "no metrics: hold; bounded to [1, 4]",
        "decode": "no metrics: hold; bounded to [1, 6]",
    }
    assert decide(ScalingPolicy(CONFIG), None, (2, 3), 0)[0] == (2, 3)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PoolConfig("decode", min_replicas=3, max_replicas=2),
         "decode.max_replicas: must be >= max(1, decode.min_replicas=3); got 2"),
        (lambda: PoolConfig("prefill", gpus_per_replica=0),
         "prefill.gpus_per_replica: must be >= 1; got 0"),
        (lambda: PoolConfig("decode", min_replicas=1, max_replicas=4, pods_per_group=2),
         "decode.min_replicas: must be a multiple of decode.pods_per_group (2); got 1"),
        (lambda: replace(CONFIG, gpu_budget=2),
         "gpu_budget: must be >= the 3 GPUs the pools' min_replicas need; got 2"),
        (lambda: replace(CONFIG, hysteresis=1.0), "hysteresis: must be in [0, 1); got 1.0"),
        (lambda: replace(CONFIG, decode_occupancy_target=0.0),
         "decode_occupancy_target: must be in (0, 1]; got 0.0"),
        (lambda: replace(CONFIG, ttft_p90_target_s=-1.0),
         "ttft_p90_target_s: must be > 0; got -1.0"),
    ],
)  # fmt: skip
def test_bad_config_names_the_field(make, message):
    with pytest.raises(PlannerConfigError) as e:
        make()
    assert str(e.value) == message
