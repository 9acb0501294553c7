"""decide/ranking/whatif.py `merge_intervals`: each key's stays as disjoint intervals, whatever order they come in.

The replay's stays come in their placement's seq order (SQL's key), which a counting sort keeps;
in any other order the function sorts them. Both are checked against the union taken seq by seq.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from kvledger.decide.ranking.whatif import merge_intervals

MINORS = 6
STAYS = st.lists(st.tuples(st.integers(1, 5), st.integers(0, MINORS - 1), st.integers(0, 40), st.integers(0, 12)),
                 max_size=60)


def _held(rows, minors, starts, ends) -> set[tuple[int, int]]:
    """(key, seq) for every seq some interval of the key covers."""
    return {(row * MINORS + minor, seq) for row, minor, start, end in zip(rows, minors, starts, ends)
            for seq in range(start, end)}


@settings(max_examples=300, deadline=None)
@given(STAYS, st.randoms(use_true_random=False), st.booleans())
def test_each_key_is_the_union_of_its_stays_in_disjoint_sorted_intervals(stays, random, in_placement_order) -> None:
    if in_placement_order:  # as SQL hands them: by (minor: the placement), then start
        stays = sorted(stays, key=lambda stay: (stay[1], stay[2]))
    else:
        random.shuffle(stays)
    rows = np.array([row for row, _, _, _ in stays], dtype=np.int64)
    minors = np.array([minor for _, minor, _, _ in stays], dtype=np.int64)
    starts = np.array([start for _, _, start, _ in stays], dtype=np.int64)
    ends = starts + np.array([length for _, _, _, length in stays], dtype=np.int64)
    keys, merged_starts, merged_ends = merge_intervals(rows, minors, MINORS, starts, ends)
    intervals = list(zip(keys.tolist(), merged_starts.tolist(), merged_ends.tolist()))
    assert intervals == sorted(intervals)
    for (key, start, end), (next_key, next_start, _) in zip(intervals, intervals[1:]):
        assert start < end and (key < next_key or end < next_start)  # disjoint, not touching
    assert _held(keys // MINORS, keys % MINORS, merged_starts, merged_ends) == _held(rows, minors, starts, ends.tolist())
