"""Finding labels: pipe-separated finding strings (NIH's ``Finding Labels``) as 0/1 label columns."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from dask_dl.data.schema import NIH_LABELS
from dask_dl.errors import CatalogError

__all__ = ["NO_FINDING", "parse_findings"]

#: The finding string of an image without findings.
NO_FINDING = "No Finding"


def parse_findings(
    findings: pd.Series,
    *,
    labels: Sequence[str] = NIH_LABELS,
    label_map: Mapping[str, str] | None = None,
    image_ids: pd.Series | None = None,
) -> pd.DataFrame:
    """Turn pipe-separated finding strings (``"Cardiomegaly|Effusion"``, ``"No Finding"``) into 0/1 columns.

    Parameters
    ----------
    findings : pandas.Series
        One string per image.
    labels : sequence of str
        The label columns to produce, in order. ``"No Finding"`` means all of them are 0.
    label_map : mapping, optional
        Renames findings before they are matched, e.g. ``{"Infiltrate": "Infiltration"}``; map to
        ``"No Finding"`` to ignore a finding.
    image_ids : pandas.Series, optional
        Shown in error messages beside the row number.

    Returns
    -------
    pandas.DataFrame
        ``uint8`` columns ``labels``, same index as ``findings``.

    Raises
    ------
    CatalogError
        For an empty finding, a finding that is not in ``labels`` (naming the row and showing ``label_map=`` as
        the fix), or ``"No Finding"`` together with a finding.
    """
    labels = list(labels)
    ids = image_ids if image_ids is not None else pd.Series(np.arange(len(findings)), index=findings.index)

    def where(pos: int) -> str:
        return f"row {pos} (image {ids.iloc[pos]!r})"

    text = findings.astype("string").str.strip()
    empty = text.isna() | (text == "")
    if empty.any():
        pos = int(np.flatnonzero(empty.to_numpy())[0])
        raise CatalogError(f"{where(pos)} has no finding labels; write {NO_FINDING!r} for an image without findings")
    dummies = text.str.get_dummies(sep="|")
    dummies.columns = [c.strip() for c in dummies.columns]
    if label_map:
        dummies.columns = [label_map.get(c, c) for c in dummies.columns]
    # Duplicate columns appear when stripping or label_map merges names; an image has a finding if any has it.
    dummies = dummies.T.groupby(level=0, sort=False).max().T if dummies.columns.duplicated().any() else dummies
    unknown = [c for c in dummies.columns if c not in labels and c != NO_FINDING]
    if unknown:
        name = unknown[0]
        pos = int(np.flatnonzero(dummies[name].to_numpy())[0])
        guess = difflib.get_close_matches(name, labels, n=1)
        target = guess[0] if guess else labels[0] if labels else NO_FINDING
        raise CatalogError(
            f"unknown label {name!r} in {where(pos)}"
            + (f" (and {len(unknown) - 1} more: {unknown[1:6]})" if len(unknown) > 1 else "")
            + f": labels are {', '.join(labels)}; pass label_map={{{name!r}: {target!r}}}"
        )
    if NO_FINDING in dummies.columns:
        known = [c for c in dummies.columns if c != NO_FINDING]
        both = (dummies[NO_FINDING] > 0) & (dummies[known].sum(axis=1) > 0) if known else None
        if both is not None and both.any():
            pos = int(np.flatnonzero(both.to_numpy())[0])
            raise CatalogError(
                f"{where(pos)} says {findings.iloc[pos]!r}: {NO_FINDING!r} together with findings; "
                f"fix the table, or drop {NO_FINDING!r} from such rows"
            )
    return dummies.reindex(columns=labels, fill_value=0).astype(np.uint8).set_axis(findings.index, axis=0)
