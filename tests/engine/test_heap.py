"""A serving process freezes what start-up created: later full collections skip it."""

from __future__ import annotations

import gc

from duet.engine.heap import freeze_startup_heap


def test_freeze_moves_the_startup_heap_out_of_the_collectors_reach():
    tracked = len(gc.get_objects())  # torch, pytest and the test modules: tens of thousands
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= tracked // 2
        assert len(gc.get_objects()) < tracked - frozen // 2  # no longer walked
        fresh = [[] for _ in range(10)]  # new objects are collected as before
        assert all(gc.is_tracked(x) for x in fresh)
        assert len(gc.get_objects()) >= 10
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
