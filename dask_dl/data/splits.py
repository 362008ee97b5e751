"""Patient-level splits: every patient's images land in one of train/val/test, by a seeded, stable hash.

Where a collection has no official split, :func:`split_by_patient` assigns whole patients by a BLAKE2b hash of the
patient id keyed by a seed, so the same collection always splits the same way on every machine and Python version.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from dask_dl import config
from dask_dl.data.schema import validate_catalog
from dask_dl.errors import ConfigurationError

__all__ = ["check_fraction", "hashed_split", "split_by_patient"]


def _patient_hash(patient_ids: np.ndarray, seed: int) -> np.ndarray:
    """A uniform number in [0, 1) per patient id, from BLAKE2b: unlike ``hash()`` it is not salted per process."""
    key = str(seed).encode()
    out = np.empty(len(patient_ids), dtype=np.float64)
    for i, pid in enumerate(patient_ids):  # one hash per patient, not per image
        digest = hashlib.blake2b(str(pid).encode(), digest_size=8, key=key).digest()
        out[i] = int.from_bytes(digest, "little") / 2.0**64
    return out


def check_fraction(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ConfigurationError(f"{name}={value!r} is not a fraction in [0, 1); pass e.g. {name}=0.1")
    return value


def hashed_split(patient_ids: pd.Series, *, seed: int, val_fraction: float, test_fraction: float) -> np.ndarray:
    codes, uniques = pd.factorize(patient_ids, sort=False)
    u = _patient_hash(np.asarray(uniques), seed)
    per_patient = np.where(u < test_fraction, "test", np.where(u < test_fraction + val_fraction, "val", "train"))
    return per_patient[codes]


def split_by_patient(
    catalog: pd.DataFrame,
    *,
    seed: int | None = None,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
) -> pd.DataFrame:
    """Assign every patient's images to one split by a seeded, stable hash of the patient id.

    Each patient gets a number in [0, 1) from BLAKE2b keyed by ``seed``; patients below ``test_fraction`` go to
    ``test``, the next ``val_fraction`` to ``val``, the rest to ``train``. The fractions are shares of patients
    (not images) and are met approximately; the split of a patient never depends on the other patients, so
    adding images to a collection does not move anyone.

    Parameters
    ----------
    catalog : pandas.DataFrame
        Any catalog; its ``split`` column is replaced (it need not have one).
    seed : int, optional
        Hash key. Default ``dask-dl.split.seed``.
    val_fraction, test_fraction : float, optional
        Shares of patients for ``val`` and ``test``. Defaults ``dask-dl.split.val-fraction`` and
        ``dask-dl.split.test-fraction``.

    Returns
    -------
    pandas.DataFrame
        A validated copy of ``catalog`` with the new ``split`` column.

    Raises
    ------
    ConfigurationError
        If a fraction is outside [0, 1) or both together reach 1.

    Examples
    --------
    >>> import pandas as pd
    >>> frame = pd.DataFrame({"image_id": ["a", "b", "c"], "path": ["a", "b", "c"],
    ...                       "patient_id": ["p1", "p1", "p2"], "site": "X", "split": "train"})
    >>> frame.attrs = {"labels": [], "task": "multilabel"}
    >>> out = split_by_patient(frame, seed=0, val_fraction=0.0, test_fraction=0.5)
    >>> out["split"].iloc[0] == out["split"].iloc[1]
    True
    """
    seed = int(config.get("split.seed", seed))
    val_fraction = check_fraction("val_fraction", config.get("split.val-fraction", val_fraction))
    test_fraction = check_fraction("test_fraction", config.get("split.test-fraction", test_fraction))
    if val_fraction + test_fraction >= 1.0:
        raise ConfigurationError(
            f"val_fraction={val_fraction} and test_fraction={test_fraction} leave no patients for training; "
            "make their sum less than 1, e.g. val_fraction=0.1, test_fraction=0.2"
        )
    out = catalog.copy()
    out["split"] = hashed_split(
        catalog["patient_id"].astype(str), seed=seed, val_fraction=val_fraction, test_fraction=test_fraction
    )
    return validate_catalog(out)
