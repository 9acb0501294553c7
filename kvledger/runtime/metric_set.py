"""Prometheus metrics, one style for every stage.

A stage declares its families once, on a `MetricSet`: `counter`, `gauge` and `histogram`,
each with optional label names, or with `read=` for a value taken from elsewhere at scrape
time. Updating costs a dict entry and an addition (a histogram, one bisect more): no lock,
no per-bucket walk, so hot paths (ingest's per-batch counts, decide's per-request
latency) can count freely. Prometheus reads the values only when it scrapes. The calls
mirror prometheus_client's (`labels(...).inc()`, `.set()`, `.observe()`); `value` reads one.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

# prometheus_client's defaults, for a histogram that names no buckets of its own.
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)

Read = Callable[[], float]
F = TypeVar("F", bound="_Family")


class _Family:
    """A named metric with label names; a child per label value (a string for one label, a tuple for several)."""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str]) -> None:
        self.name = name
        self.help_text = help_text
        self.label_names = tuple(label_names)

    def _key(self, values: tuple[object, ...]) -> object:
        if len(values) != len(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {values!r}")
        return str(values[0]) if len(values) == 1 else tuple(map(str, values))

    def _labelled(self, key: object) -> list[str]:
        return [key] if len(self.label_names) == 1 else list(key)

    def family(self) -> Metric:
        raise NotImplementedError

    def collect(self) -> list[Metric]:
        """This family alone, as prometheus_client's metrics give theirs."""
        return [self.family()]


class _Child:
    """One label value's counter or gauge."""

    __slots__ = ("_values", "_key")

    def __init__(self, values: dict, key: object) -> None:
        self._values = values
        self._key = key

    def inc(self, amount: float = 1) -> None:
        self._values[self._key] += amount

    def dec(self, amount: float = 1) -> None:
        self._values[self._key] -= amount

    def set(self, value: float) -> None:
        self._values[self._key] = value

    @property
    def value(self) -> float:
        return self._values[self._key]


class _Scalar(_Family):
    """A counter's or gauge's value per label value, or one value read at scrape time."""

    _metric_class: type[CounterMetricFamily] | type[GaugeMetricFamily]

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = (), read: Read | None = None) -> None:
        super().__init__(name, help_text, label_names)
        self._values: collections.Counter = collections.Counter()
        self._read = read
        self._children: dict[object, _Child] = {}

    def labels(self, *values: object) -> _Child:
        key = self._key(values)
        child = self._children.get(key)
        if child is None:
            self._values[key] += 0  # a child reads 0 from its creation on
            child = self._children[key] = _Child(self._values, key)
        return child

    def inc(self, amount: float = 1) -> None:
        self._values[()] += amount

    @property
    def value(self) -> float:
        return self._read() if self._read is not None else self._values[()]

    def family(self) -> Metric:
        metric = self._metric_class(self.name, self.help_text, labels=self.label_names or None)
        if not self.label_names:
            metric.add_metric([], self.value)
        else:
            for key, value in self._values.items():
                metric.add_metric(self._labelled(key), value)
        return metric


class Counter(_Scalar):
    _metric_class = CounterMetricFamily

    def inc_each(self, label_values: Iterable[str]) -> None:
        """One increment per item, each by its (single) label value: a loop at C speed."""
        self._values.update(label_values)


class Gauge(_Scalar):
    _metric_class = GaugeMetricFamily

    def set(self, value: float) -> None:
        self._values[()] = value


class _Buckets:
    """One histogram's counts per `le` bucket (the last is +Inf) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # `le` buckets include their bound
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        total, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            total += count
            buckets.append((floatToGoString(bound), total))
        return buckets

    @property
    def count(self) -> int:
        return sum(self.counts)


class Histogram(_Family):
    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = (),
                 buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        super().__init__(name, help_text, label_names)
        self.bounds = tuple(sorted(bound for bound in buckets if bound != math.inf))
        self._children: dict[object, _Buckets] = {} if label_names else {(): _Buckets(self.bounds)}

    def labels(self, *values: object) -> _Buckets:
        key = self._key(values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = _Buckets(self.bounds)
        return child

    def observe(self, value: float) -> None:
        self._children[()].observe(value)

    @property
    def count(self) -> int:
        return self._children[()].count

    def family(self) -> Metric:
        metric = HistogramMetricFamily(self.name, self.help_text, labels=self.label_names or None)
        for key, child in self._children.items():
            metric.add_metric(self._labelled(key) if self.label_names else [], child.cumulative(), child.sum)
        return metric


class MetricSet:
    """A stage's metrics, in a registry of their own; subclasses declare their families in `__init__`."""

    def __init__(self) -> None:
        self._families: list[_Family] = []
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def counter(self, name: str, help_text: str, label_names: Sequence[str] = (), *, read: Read | None = None) -> Counter:
        return self._declare(Counter(name, help_text, label_names, read))

    def gauge(self, name: str, help_text: str, label_names: Sequence[str] = (), *, read: Read | None = None) -> Gauge:
        return self._declare(Gauge(name, help_text, label_names, read))

    def histogram(self, name: str, help_text: str, label_names: Sequence[str] = (), *,
                  buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        return self._declare(Histogram(name, help_text, label_names, buckets))

    def expect(self, label_name: str, values: Sequence[object]) -> None:
        """Make each family labelled by `label_name` alone show a child at 0 for each of `values` from now on.

        A labelled counter exists only once first incremented, and `rate()` over a series
        that appears with its first increment misses it (the first dead letter, gap or error
        would never show on a dashboard); label values known up front are therefore shown at 0.
        """
        for family in self._families:
            if family.label_names == (label_name,):
                for value in values:
                    family.labels(value)

    def _declare(self, family: F) -> F:
        if any(known.name == family.name for known in self._families):
            raise ValueError(f"metric {family.name} declared twice")
        self._families.append(family)
        return family

    # the prometheus_client collector protocol

    def describe(self) -> list[Metric]:
        return []  # families are declared after registration; names are checked in `_declare`

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.family()

    def text(self) -> bytes:
        """The exposition text a scrape reads."""
        return generate_latest(self.registry)
