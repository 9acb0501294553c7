"""The compiled JSON writer's numbers: every float reads as `json.dumps` writes it, byte for byte."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.events import WorkerId

from kvledger.core.reuse import ReuseRequest
from kvledger.decide.inventory.index import InventoryIndex
from kvledger.decide.ranking.ranked import AnswerBatch, RankedBatch

EMPTY_INTS = np.zeros(0, dtype=np.int32)
EMPTY_FLOATS = np.zeros(0, dtype=np.float64)


def credited_texts(values: list[float]) -> list[str]:
    """Answers whose only varying field is credited_blocks; that field's text in each."""
    count = len(values)
    ranked = RankedBatch(
        np.full(count, -1, dtype=np.int32), np.array(values, dtype=np.float64), np.zeros(count, dtype=np.int32),
        np.zeros(count, dtype=np.int8), np.zeros(count + 1, dtype=np.int64), EMPTY_INTS,
        np.zeros((0, 5), dtype=np.int32), np.zeros(count + 1, dtype=np.int64),
        EMPTY_INTS, EMPTY_INTS, EMPTY_INTS, EMPTY_INTS, EMPTY_FLOATS, EMPTY_FLOATS, EMPTY_FLOATS,
    )
    index = InventoryIndex()
    requests = [ReuseRequest(f"r{n}", (), 16) for n in range(count)]
    answers = AnswerBatch(requests, ranked, (), 0, (), "cpu", "digest", _texts_of(index))
    return [answer.decode().split('"credited_blocks":')[1].split(',"baseline_blocks"')[0]
            for answer in answers.encoded()]


def _texts_of(index: InventoryIndex):
    from kvledger.decide.ranking.ranked import WorkerTexts

    return WorkerTexts.of(index)


EDGES = [0.0, -0.0, 1.0, -1.0, 0.1, 0.2, 0.1 + 0.2, 1e-4, 9.999e-5, 1e-5, 123456789.125, 1e15, 1e16 - 2, 1e16, 1e17,
         2.0**53, 2.0**53 + 2, 0.5, 0.25, 1 / 3, 2 / 3, 12.5, 99.99999999999999, 9.999999999999999, 5e-324,
         1.7976931348623157e308, float("inf"), float("-inf"), 0.001, 0.0015, 3.0000000000000004, 1000000.0001]


def test_edge_floats_are_written_as_python_writes_them() -> None:
    assert credited_texts(EDGES) == [json.dumps(value) for value in EDGES]
    assert credited_texts([float("nan")]) == ["NaN"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=False), min_size=1, max_size=40))
def test_any_float_is_written_as_python_writes_it(values: list[float]) -> None:
    assert credited_texts(values) == [json.dumps(value) for value in values]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.decimals(min_value=-1e12, max_value=1e12, places=6, allow_nan=False, allow_infinity=False)
                .map(float), min_size=1, max_size=40),
       st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=10),
       st.floats(min_value=0.0, max_value=10_000.0))
def test_costs_and_credit_as_the_cost_model_makes_them(decimals: list[float], blocks: list[int], rate: float) -> None:
    """Short decimals, and the products and differences of the cost model: what answers carry."""
    made = [count * rate / 1000.0 for count in blocks] + [count * 512 * 0.8 / 1000.0 - count * 30.0 / 1000.0
                                                         for count in blocks]
    values = decimals + made + [sum([0.5] * count, 0.0) for count in blocks]
    assert credited_texts(values) == [json.dumps(value) for value in values]


def test_seventeen_digit_floats_are_written_by_the_kernel_as_python_writes_them() -> None:
    """A cost's rounding noise (153.35999999999999) needs 17 digits: the kernel computes them
    exactly, instead of handing the float to Python, and writes what `repr` writes."""
    from kvledger.decide.ranking.kernels import needs_repr

    rng = np.random.default_rng(12)
    blocks = rng.integers(1, 4_000, 20_000)
    values = np.concatenate([
        10 ** rng.uniform(-4, 16, 20_000),
        blocks * 512 * 0.15 / 1000.0 - rng.integers(1, 4_000, 20_000) * 0.35 / 1000.0,
        rng.integers(1, 10**6, 20_000) * 0.01 - rng.integers(1, 10**4, 20_000) * 0.0015,
    ])
    seventeen = np.array([len(repr(value).replace(".", "").lstrip("0")) == 17 for value in values.tolist()])
    written_by_kernel = ~needs_repr(values)
    # Most 17-digit floats no longer leave the kernel (about one in eight still does: where the
    # 16 leading digits are above 2**53, whether 16 digits read back cannot be tested in doubles).
    assert written_by_kernel[seventeen].mean() > 0.8
    kernel_values = values[written_by_kernel].tolist()
    assert credited_texts(kernel_values) == [json.dumps(value) for value in kernel_values]


def test_ids_and_worker_names_are_escaped_as_json_escapes_them() -> None:
    from kvledger.decide.ranking.cpu import CpuBackend
    from kvledger.core.decision_codec import decision_to_json
    from kvledger.core.reuse import decide
    from kvledger.core.settings import ReuseSettings

    index = InventoryIndex()
    ids = ["plain", 'q"1\\', "tab\there", "\x00\x1f\x7f", "é", "☃", "😀", "mixed é 😀 \"x\""]
    requests = [ReuseRequest(request_id, (1, 2), 16, WorkerId("never", 3)) for request_id in ids]
    answers = CpuBackend(index).answer_batch(requests, ReuseSettings())
    expected = [decide(index.fold, request, ReuseSettings(), backend="cpu") for request in requests]
    assert answers.encoded() == [json.dumps(decision_to_json(answer), separators=(",", ":")).encode()
                                 for answer in expected]
    assert CpuBackend(index).answer_texts(requests, ReuseSettings()).answers == answers.encoded()
