"""The store's garbage-collection policy: raised for the service's lifetime, then restored."""

from __future__ import annotations

import gc

import pytest

from kvledger.store.gc_policy import young_collections_deferred


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_the_young_threshold_is_raised_inside_and_restored_after(thresholds) -> None:
    gc.set_threshold(700, 10, 10)
    with young_collections_deferred(50_000):
        assert gc.get_threshold() == (50_000, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_higher_threshold_is_never_lowered_and_a_disabled_collector_stays_off(thresholds) -> None:
    gc.set_threshold(100_000, 10, 10)
    with young_collections_deferred(50_000):
        assert gc.get_threshold() == (100_000, 10, 10)
    gc.set_threshold(0, 10, 10)
    with young_collections_deferred(50_000):
        assert gc.get_threshold()[0] == 0


def test_a_threshold_changed_by_someone_else_meanwhile_is_left_as_they_set_it(thresholds) -> None:
    gc.set_threshold(700, 10, 10)
    with young_collections_deferred(50_000):
        gc.set_threshold(20_000, 5, 5)
    assert gc.get_threshold() == (20_000, 5, 5)
