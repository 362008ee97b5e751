"""ROC, precision-recall and calibration curves of one label's scores, in NumPy.

The ROC curve steps once per distinct score (tied scores move both rates at once), so the area under it by the
trapezoid rule is the AUROC of :func:`dask_dl.metrics.auroc` (ties counted half).
"""

from __future__ import annotations

import numpy as np

__all__ = ["average_precision", "calibration", "pr_curve", "roc_curve"]


def _counts(truth: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """True and false positives above each distinct score, highest score first, and those scores."""
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    s, y = np.asarray(scores, np.float64)[order], np.asarray(truth, bool)[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # the last position of each run of equal scores
    tp = np.cumsum(y)[last]
    return tp, (last + 1) - tp, s[last]


def roc_curve(truth: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """False and true positive rates from (0, 0) to (1, 1), one step per distinct score."""
    tp, fp, _ = _counts(truth, scores)
    return np.r_[0.0, fp / max(fp[-1], 1)], np.r_[0.0, tp / max(tp[-1], 1)]


def pr_curve(truth: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Recall and precision at each distinct score, highest score first."""
    tp, fp, _ = _counts(truth, scores)
    return tp / max(tp[-1], 1), tp / (tp + fp)


def average_precision(truth: np.ndarray, scores: np.ndarray) -> float:
    """The area under the precision-recall steps: the mean of the precision at each recall gained."""
    recall, precision = pr_curve(truth, scores)
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def calibration(truth: np.ndarray, scores: np.ndarray, *, bins: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Mean predicted probability and observed share of positives in each non-empty bin of equal width."""
    scores = np.asarray(scores, np.float64)
    which = np.clip((scores * bins).astype(np.int64), 0, bins - 1)
    count = np.bincount(which, minlength=bins)
    full = count > 0
    predicted = np.bincount(which, scores, minlength=bins)[full] / count[full]
    observed = np.bincount(which, np.asarray(truth, np.float64), minlength=bins)[full] / count[full]
    return predicted, observed
