"""The embedded engine's length buckets: one padded forward per group of similar lengths."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from areal.rollout.engine import length_buckets


@given(st.lists(st.integers(1, 4096), min_size=1, max_size=64))
def test_every_row_once_and_padding_bounded(lengths):
    buckets = length_buckets(lengths, max_padding=0.25)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for b in buckets:
        longest = max(lengths[i] for i in b)
        cells = len(b) * longest
        assert cells - sum(lengths[i] for i in b) <= 0.25 * cells + 1e-9


def test_equal_lengths_share_one_forward_and_a_long_tail_gets_its_own():
    assert length_buckets([7] * 16) == [list(range(16))]
    assert length_buckets([300, 10, 12, 11]) == [[0], [2, 3, 1]]
