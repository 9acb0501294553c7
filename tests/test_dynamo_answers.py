"""decide's compiled Dynamo answers (decide/routers/dynamo_answers.py): a query's token ids read from its
JSON text as msgspec reads them, and the answer's JSON text equal to one built by hand from the rows."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.decide.routers.dynamo_answers import json_token_ids, scores_json
from kvledger.decide.routers.dynamo_indexer import QueryRequest

U32_MAX = 2**32 - 1
WHITESPACE = st.sampled_from(["", " ", "\n", "\t", "\r\n ", "  "])


def _read(text: bytes) -> tuple[bool, list[int]]:
    read, tokens = json_token_ids(np.frombuffer(text, dtype=np.uint8))
    assert tokens.dtype == np.uint32
    return bool(read), tokens.tolist()


def _as_schema_reads(text: bytes) -> list[int] | None:
    """The token ids `QueryRequest` reads from `text`, or None when it refuses them."""
    try:
        return msgspec.json.decode(b'{"model_name":"m","token_ids":%s}' % text, type=QueryRequest).token_ids
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, U32_MAX), max_size=40), spaces=st.lists(WHITESPACE, min_size=82, max_size=82))
def test_plain_u32_arrays_are_read_whatever_their_whitespace(tokens: list[int], spaces: list[str]) -> None:
    text = "[" + spaces[0] + ",".join(f"{spaces[2 * i + 1]}{token}{spaces[2 * i + 2]}" for i, token in enumerate(tokens)) + "]"
    assert json.loads(text) == tokens
    assert _read(text.encode()) == (True, tokens)


@settings(max_examples=300, deadline=None)
@given(value=st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4), max_leaves=12))
def test_anything_else_is_left_to_the_schema_which_reads_the_same_or_refuses(value: object) -> None:
    text = json.dumps(value).encode()
    read, tokens = _read(text)
    expected = _as_schema_reads(text)
    if read:
        assert tokens == expected
    else:  # the handler then decodes with QueryRequest: a refusal, or (never seen) ids it reads itself
        assert expected is None or expected == value


@pytest.mark.parametrize("text", [b"[4294967296]", b"[12345678901]", b"[-1]", b"[1.0]", b"[1e2]", b"[[1]]",
                                  b'["1"]', b"null", b"{}", b"[true]", b"[99999999999999999999999]"])
def test_what_u32_cannot_hold_is_not_read(text: bytes) -> None:
    assert _read(text) == (False, [])
    assert _as_schema_reads(text) is None


def _reference(found: np.ndarray, instance_ids: np.ndarray, ranks: np.ndarray, block_size: int) -> dict:
    """The answer Dynamo's indexer gives for these rows, built as values."""
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict] = {}
    for position, gpu, cpu, disk in found.tolist():
        instance, rank = str(int(instance_ids[position])), str(int(ranks[position]))
        entry = instances.setdefault(instance, {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0})
        entry["dp"][rank] = gpu * block_size
        for tier, blocks in (("gpu", gpu), ("cpu", cpu), ("disk", disk)):
            entry[tier] = max(entry[tier], blocks * block_size)
        entry["longest_matched"] = max(entry["gpu"], entry["cpu"], entry["disk"])
        if gpu:
            scores.setdefault(instance, {})[rank] = gpu * block_size
    return {"scores": scores, "frequencies": [], "instances": instances}


@st.composite
def _rows(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    instances = draw(st.lists(st.integers(0, 2**64 - 1), unique=True, max_size=6))
    instance_ids, ranks, found = [], [], []
    for instance in instances:
        for rank in draw(st.lists(st.integers(0, U32_MAX), unique=True, min_size=1, max_size=3)):
            position = len(instance_ids)
            instance_ids.append(instance)
            ranks.append(rank)
            if draw(st.booleans()):  # this rank holds a prefix: device ≤ device or host ≤ any tier
                disk = draw(st.integers(1, 5000))
                cpu = draw(st.integers(0, disk))
                found.append((position, draw(st.integers(0, cpu)), cpu, disk))
    return (np.array(found, dtype=np.int64).reshape(-1, 4), np.array(instance_ids, dtype=np.uint64),
            np.array(ranks, dtype=np.int64), draw(st.sampled_from([1, 16, 64, 1 << 20])))


@settings(max_examples=300, deadline=None)
@given(rows=_rows())
def test_the_answer_text_is_dynamos_answer_for_the_rows(rows: tuple[np.ndarray, np.ndarray, np.ndarray, int]) -> None:
    found, instance_ids, ranks, block_size = rows
    text = scores_json(found, instance_ids, ranks, block_size).tobytes()
    assert json.loads(text) == _reference(found, instance_ids, ranks, block_size)
    if not found.shape[0]:
        assert text == b'{"scores":{},"frequencies":[],"instances":{}}'
