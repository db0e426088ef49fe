"""Dynamic micro-batching (paper Algorithm 1) and padding-free packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from areal.trainer.batching import pack_sequences
from areal.trainer.micro_batches import allocate_micro_batches


def as_sets(mbs: list[list[int]]) -> set[frozenset[int]]:
    return {frozenset(mb) for mb in mbs}


def reference_ffd_count(seqlens: list[int], budget: int) -> int:
    """Number of bins first-fit decreasing uses: longest first, into the first bin with room."""
    loads: list[int] = []
    for n in sorted(seqlens, reverse=True):
        for j, load in enumerate(loads):
            if load + n <= budget:
                loads[j] += n
                break
        else:
            loads.append(n)
    return len(loads)


# ---------------------------------------------------------------- hand cases


def test_first_fit_decreasing_hand_case() -> None:
    # longest first: 5 -> mb A; 4 -> 5+4 = 9 > 8, new mb B; 3 -> A (5+3 = 8);
    # 3 -> A full (11), B (4+3 = 7); 1 -> A (9 > 8), B (7+1 = 8)
    mbs = allocate_micro_batches([5, 4, 3, 3, 1], 8)
    assert as_sets(mbs) == {frozenset({0, 2}), frozenset({1, 3, 4})}


def test_decreasing_order_beats_input_order() -> None:
    # first fit in input order: {3, 3} = 6, {5}, {5} -> 3 micro-batches
    # decreasing: 5 -> A, 5 -> B (10 > 8), 3 -> A (8), 3 -> B (8) -> 2 micro-batches
    mbs = allocate_micro_batches([3, 3, 5, 5], 8)
    assert len(mbs) == 2
    assert all(len(mb) == 2 for mb in mbs)
    assert {frozenset(mb) & {2, 3} for mb in mbs} == {frozenset({2}), frozenset({3})}


def test_everything_fits_in_one_micro_batch() -> None:
    assert as_sets(allocate_micro_batches([2, 3, 1], 10)) == {frozenset({0, 1, 2})}  # 6 <= 10


def test_sequences_exactly_at_the_budget_get_one_micro_batch_each() -> None:
    assert as_sets(allocate_micro_batches([4, 4, 4], 4)) == {
        frozenset({0}),
        frozenset({1}),
        frozenset({2}),
    }


def test_no_sequences_give_no_micro_batches() -> None:
    assert allocate_micro_batches([], 8) == []
    assert allocate_micro_batches([], 8, min_n_mbs=4) == []


def test_min_n_mbs_splits_the_fullest_micro_batch() -> None:
    # 1+1+1+1 = 4 fits one micro-batch, but three are required
    mbs = allocate_micro_batches([1, 1, 1, 1], 8, min_n_mbs=3)
    assert len(mbs) == 3
    assert sorted(len(mb) for mb in mbs) == [1, 1, 2]
    assert sorted(i for mb in mbs for i in mb) == [0, 1, 2, 3]


def test_min_n_mbs_above_the_sequence_count_gives_one_sequence_each() -> None:
    mbs = allocate_micro_batches([3, 2], 8, min_n_mbs=5)
    assert as_sets(mbs) == {frozenset({0}), frozenset({1})}


def test_min_n_mbs_already_met_changes_nothing() -> None:
    assert as_sets(allocate_micro_batches([5, 4, 3, 3, 1], 8, min_n_mbs=2)) == {
        frozenset({0, 2}),
        frozenset({1, 3, 4}),
    }


def test_sequence_longer_than_the_budget_raises() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_mb") as info:
        allocate_micro_batches([3, 9, 2], 8)
    assert "9" in str(info.value)


def test_non_positive_budget_raises() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_mb"):
        allocate_micro_batches([1], 0)


# ---------------------------------------------------------------- properties


@st.composite
def allocation_cases(draw):
    budget = draw(st.integers(1, 64))
    seqlens = draw(st.lists(st.integers(1, budget), max_size=30))
    min_n_mbs = draw(st.integers(1, 12))
    return seqlens, budget, min_n_mbs


@settings(max_examples=300, deadline=None)
@given(allocation_cases())
def test_allocation_properties(case) -> None:
    seqlens, budget, min_n_mbs = case
    mbs = allocate_micro_batches(seqlens, budget, min_n_mbs)
    # every index exactly once
    assert sorted(i for mb in mbs for i in mb) == list(range(len(seqlens)))
    # never an empty micro-batch, never one over budget
    assert all(mb for mb in mbs)
    assert all(sum(seqlens[i] for i in mb) <= budget for mb in mbs)
    # no more micro-batches than first-fit decreasing needs, unless more are required
    ffd = reference_ffd_count(seqlens, budget)
    required = min(min_n_mbs, len(seqlens))
    assert len(mbs) >= required
    assert len(mbs) <= max(ffd, required)
    # and never fewer than the token count allows
    assert len(mbs) >= -(-sum(seqlens) // budget)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.lists(st.integers(1, 64), max_size=30))
def test_allocation_without_min_matches_ffd_count(budget, seqlens) -> None:
    seqlens = [min(n, budget) for n in seqlens]
    mbs = allocate_micro_batches(seqlens, budget)
    assert len(mbs) <= reference_ffd_count(seqlens, budget)
    assert allocate_micro_batches(seqlens, budget) == mbs  # deterministic


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(2, 20), min_size=1, max_size=10), st.integers(1, 19))
def test_overlong_sequences_always_raise(seqlens, shortfall) -> None:
    budget = max(seqlens) - shortfall
    assume(budget >= 1)
    with pytest.raises(ValueError, match="max_tokens_per_mb"):
        allocate_micro_batches(seqlens, budget)


# ---------------------------------------------------------------- packing


def test_pack_sequences_ids_positions_and_boundaries() -> None:
    input_ids, position_ids, cu_seqlens = pack_sequences([[5, 6, 7], [8], [9, 10]])
    assert input_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert cu_seqlens.tolist() == [0, 3, 4, 6]  # cumulative lengths 3, 3+1, 3+1+2
    assert input_ids.dtype == position_ids.dtype == cu_seqlens.dtype == torch.int64


def test_pack_a_single_sequence() -> None:
    input_ids, position_ids, cu_seqlens = pack_sequences([[4, 3, 2, 1]])
    assert input_ids.tolist() == [4, 3, 2, 1]
    assert position_ids.tolist() == [0, 1, 2, 3]
    assert cu_seqlens.tolist() == [0, 4]


def test_pack_no_sequences() -> None:
    input_ids, position_ids, cu_seqlens = pack_sequences([])
    assert input_ids.numel() == 0 and position_ids.numel() == 0
    assert cu_seqlens.tolist() == [0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 500), min_size=1, max_size=12), min_size=1, max_size=8))
def test_pack_round_trips(seqs) -> None:
    input_ids, position_ids, cu_seqlens = pack_sequences(seqs)
    for k, seq in enumerate(seqs):
        lo, hi = cu_seqlens[k].item(), cu_seqlens[k + 1].item()
        assert input_ids[lo:hi].tolist() == seq
        assert position_ids[lo:hi].tolist() == list(range(len(seq)))
