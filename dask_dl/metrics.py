"""Per-label AUROC: the figure chest X-ray papers report for each finding.

The area under the ROC curve equals the Mann-Whitney U statistic over the positive/negative pairs, a tied pair
counting one half. With average ranks (ties share the mean of their ranks) it is one sort per label:
``AUC = (R_pos - n_pos (n_pos + 1) / 2) / (n_pos n_neg)``, with ``R_pos`` the rank sum of the positives.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata

from dask_dl.errors import DatasetError

__all__ = ["NO_AUROC_NOTE", "auroc", "auroc_text"]

#: the line a text report prints under a table where :func:`auroc_text` wrote ``-``
NO_AUROC_NOTE = "-: no AUROC, the split's images all have that label or all lack it"


def auroc_text(value: float, digits: int = 3) -> str:
    """An AUROC as a report prints it: ``digits`` decimals, or ``-`` where it is undefined (NaN: one class only).

    >>> auroc_text(0.81234), auroc_text(float("nan"))
    ('0.812', '-')
    """
    return f"{value:.{digits}f}" if np.isfinite(value) else "-"


def auroc(y_true, scores) -> np.ndarray | float:
    """Area under the ROC curve of each label, exact, ties counted half.

    Parameters
    ----------
    y_true : array_like
        0/1 (or bool) truth, shape ``(n, k)`` for k labels or ``(n,)`` for one.
    scores : array_like
        Scores of the same shape; higher means more likely positive. Any monotone transform (logits,
        probabilities) gives the same AUROC.

    Returns
    -------
    numpy.ndarray or float
        float64 array of shape ``(k,)``, or a float for 1-D inputs. NaN for a label whose truth has only one
        class, where the AUROC is undefined.

    Raises
    ------
    DatasetError
        Shapes differ, truth values other than 0/1, or non-finite scores.

    Examples
    --------
    >>> auroc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
    0.75
    >>> auroc([[0, 1], [1, 1]], [[0.2, 0.5], [0.7, 0.1]]).tolist()
    [1.0, nan]
    """
    y = np.asarray(y_true)
    s = np.asarray(scores)
    if y.shape != s.shape or y.ndim not in (1, 2):
        raise DatasetError(
            f"auroc takes truth and scores of the same shape (n,) or (n, k); got {y.shape} and {s.shape}"
        )
    one_d = y.ndim == 1
    if one_d:
        y, s = y[:, None], s[:, None]
    if y.dtype != bool:
        bad = ~np.isin(y, (0, 1))
        if bad.any():
            row, col = np.argwhere(bad)[0]
            raise DatasetError(f"truth must be 0 or 1; got {y[row, col].item()!r} at row {row}, label {col}")
    s = s.astype(np.float64, copy=False)
    if not np.isfinite(s).all():
        row, col = np.argwhere(~np.isfinite(s))[0]
        raise DatasetError(f"scores must be finite; got {s[row, col]} at row {row}, label {col}")
    pos = y.astype(bool)
    n_pos = pos.sum(axis=0).astype(np.float64)
    n_neg = y.shape[0] - n_pos
    ranks = rankdata(s, method="average", axis=0)
    rank_sum = np.where(pos, ranks, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        auc = (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
    auc = np.where((n_pos > 0) & (n_neg > 0), auc, np.nan)
    return float(auc[0]) if one_d else auc
