"""The one metrics style: families declared on a MetricSet, exposed as Prometheus reads them."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvledger.runtime.metric_set import MetricSet


class Example(MetricSet):
    def __init__(self, outside: list[int]) -> None:
        super().__init__()
        self.events = self.counter("example_events", "events by kind", ["kind"])
        self.errors = self.counter("example_errors", "errors")
        self.pairs = self.counter("example_pairs", "by two labels", ["a", "b"])
        self.level = self.gauge("example_level", "a level")
        self.outside = self.gauge("example_outside", "read at scrape time", read=lambda: sum(outside))
        self.latency = self.histogram("example_latency_seconds", "latency", ["stage"], buckets=(0.1, 1.0))


def samples(metrics: MetricSet) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(metrics.text().decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_values_reach_the_exposition_text_as_prometheus_parses_it() -> None:
    outside = [2, 3]
    metrics = Example(outside)
    metrics.events.labels("stored").inc(2)
    metrics.events.inc_each(["stored", "removed", "removed", "removed"])
    metrics.errors.inc()
    metrics.pairs.labels("x", 1).inc(5)
    metrics.level.set(7.5)
    metrics.latency.labels("commit").observe(0.1)  # `le` includes its bound
    metrics.latency.labels("commit").observe(3.0)
    outside.append(10)
    seen = samples(metrics)
    assert seen[("example_events_total", (("kind", "stored"),))] == 3
    assert seen[("example_events_total", (("kind", "removed"),))] == 3
    assert seen[("example_errors_total", ())] == 1
    assert seen[("example_pairs_total", (("a", "x"), ("b", "1")))] == 5
    assert seen[("example_level", ())] == 7.5
    assert seen[("example_outside", ())] == 15
    commit = (("stage", "commit"),)
    assert seen[("example_latency_seconds_bucket", (("le", "0.1"), *commit))] == 1
    assert seen[("example_latency_seconds_bucket", (("le", "1.0"), *commit))] == 1
    assert seen[("example_latency_seconds_bucket", (("le", "+Inf"), *commit))] == 2
    assert seen[("example_latency_seconds_count", commit)] == 2
    assert seen[("example_latency_seconds_sum", commit)] == pytest.approx(3.1)
    assert metrics.registry.get_sample_value("example_events_total", {"kind": "removed"}) == 3
    assert metrics.events.labels("stored").value == 3 and metrics.errors.value == 1 and metrics.outside.value == 15


def test_a_labelled_child_reads_zero_from_its_creation_and_a_family_without_children_still_names_itself() -> None:
    metrics = Example([])
    metrics.events.labels("cleared")
    text = metrics.text().decode()
    assert 'example_events_total{kind="cleared"} 0.0' in text
    assert "# TYPE example_pairs_total counter" in text


def test_a_wrong_label_count_and_a_name_declared_twice_are_refused() -> None:
    metrics = Example([])
    with pytest.raises(ValueError, match="takes labels"):
        metrics.pairs.labels("only-one")
    with pytest.raises(ValueError, match="declared twice"):
        metrics.counter("example_events", "again")
