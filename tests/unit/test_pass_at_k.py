"""The unbiased pass@k estimator of areal.eval."""

from __future__ import annotations

import itertools
import math

import pytest

from areal.eval import pass_at_k, summarise


@pytest.mark.parametrize("n, c", [(4, 0), (4, 1), (5, 2), (6, 6), (8, 3)])
def test_pass_at_k_equals_the_exact_subset_average(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        exact = sum(any(s) for s in subsets) / len(subsets)
        assert math.isclose(pass_at_k(n, c, k), exact)


def test_summary_is_monotone_and_pass_at_1_is_the_mean():
    correct = [[True, False, False, False], [False] * 4, [True] * 4]
    s = summarise(correct, [1, 2, 4, 8])
    assert math.isclose(s["pass@1"], (0.25 + 0 + 1) / 3)
    assert s["pass@1"] <= s["pass@2"] <= s["pass@4"]
    assert math.isclose(s["pass@4"], 2 / 3)
    assert "pass@8" not in s  # k > n is not estimable
