"""AUROC against hand-computed cases and a brute-force Mann-Whitney count."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dask_dl import DatasetError
from dask_dl.metrics import auroc


def _pairwise_auroc(y: np.ndarray, s: np.ndarray) -> float:
    pos, neg = s[y == 1], s[y == 0]
    if len(pos) == 0 or len(neg) == 0:
        return math.nan
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def test_hand_computed_cases():
    assert auroc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == 0.75
    assert auroc([0, 1], [0.2, 0.9]) == 1.0
    assert auroc([0, 1], [0.9, 0.2]) == 0.0
    assert auroc([0, 1, 1], [0.5, 0.5, 0.5]) == 0.5
    # pairs (pos, neg): (0.5, 0.1) win, (0.5, 0.5) tie, (0.9, 0.1) win, (0.9, 0.5) win -> 3.5 / 4
    assert auroc([0, 0, 1, 1], [0.1, 0.5, 0.5, 0.9]) == 0.875
    # bool truth and integer scores
    assert auroc(np.array([False, True, True]), np.array([3, 1, 5])) == 0.5


def test_two_dimensional_per_label():
    y = np.array([[0, 1, 0], [1, 1, 0], [1, 0, 0]])
    s = np.array([[0.1, 0.3, 0.0], [0.8, 0.2, 0.5], [0.7, 0.9, 0.2]])
    out = auroc(y, s)
    assert out.shape == (3,) and out.dtype == np.float64
    assert out[0] == 1.0
    assert out[1] == 0.0  # the negative (0.9) beats both positives
    assert math.isnan(out[2])  # no positives: undefined


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_with_ties(seed):
    rng = np.random.default_rng(seed)
    n, k = 300, 6
    y = (rng.random((n, k)) < rng.uniform(0.05, 0.6, k)).astype(np.uint8)
    # few distinct values: many ties within and across classes
    s = rng.integers(0, 12, (n, k)).astype(np.float32) / 11
    s[:, 3] = rng.random(n)  # one column without ties
    y[:, 4] = 0  # one single-class column
    expected = np.array([_pairwise_auroc(y[:, j], s[:, j]) for j in range(k)])
    np.testing.assert_allclose(auroc(y, s), expected, rtol=0, atol=1e-12, equal_nan=True)
    assert math.isnan(auroc(y, s)[4])
    # invariant under a monotone transform (logits vs probabilities)
    np.testing.assert_allclose(auroc(y, np.log(s + 0.01)), expected, rtol=0, atol=1e-12, equal_nan=True)


def test_bad_inputs():
    with pytest.raises(DatasetError, match=r"same shape.*\(3,\) and \(2,\)"):
        auroc([0, 1, 1], [0.1, 0.2])
    with pytest.raises(DatasetError, match="truth must be 0 or 1; got 2 at row 1"):
        auroc([0, 2, 1], [0.1, 0.2, 0.3])
    with pytest.raises(DatasetError, match="scores must be finite; got nan at row 2"):
        auroc([0, 1, 1], [0.1, 0.2, np.nan])
