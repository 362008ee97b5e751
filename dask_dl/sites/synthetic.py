"""Synthetic hospitals for trying cross-site training: one store per site, a pooled test store, a pooled store.

:func:`synthetic_sites` draws an NIH-like collection with :func:`dask_dl.synthesize`'s ``sites`` option (each site
its own label mix and exposure), splits each site by patient, and ingests each site's ``train``/``val`` images to
a store of its own, every site's ``test`` images to one pooled test store (what the sites agree to score on), and
every ``train``/``val`` image to one pooled store (the baseline that cross-site training is measured against).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["LEARNABLE", "SyntheticSites", "synthetic_sites"]

#: findings whose synthetic signatures a small CNN learns at 32 px within a few epochs
LEARNABLE: tuple[str, ...] = ("Effusion", "Infiltration", "Consolidation", "Edema", "Emphysema")


@dataclass(frozen=True)
class SyntheticSites:
    """Paths written by :func:`synthetic_sites`."""

    stores: dict[str, str]  #: site name -> its store (train and val splits)
    test: str  #: every site's test images
    pooled: str  #: every site's train and val images together


def synthetic_sites(
    root: str | os.PathLike,
    *,
    n_images: int = 1200,
    sites: int | Sequence[str] = 3,
    size: int = 32,
    labels: Sequence[str] = LEARNABLE,
    val_fraction: float = 0.2,
    test_fraction: float = 0.2,
    seed: int = 0,
    client: Client | None = None,
) -> SyntheticSites:
    """Write synthetic sites under ``root`` and ingest them; return the stores' paths.

    Parameters
    ----------
    n_images
        Images over all sites (drawn at 64 px, stored at ``size``).
    sites
        A number of sites (``site-A``, ...) or their names.
    labels
        The findings to keep.
    val_fraction, test_fraction
        Shares of each site's patients in ``val`` and ``test``.
    client
        Cluster to draw and ingest on (its workers must see ``root``); default: the current client or a local one.

    Returns
    -------
    SyntheticSites
    """
    import pandas as pd

    from dask_dl.data.ingest import ingest
    from dask_dl.data.nih import read_nih
    from dask_dl.data.schema import NIH_LABELS, make_catalog
    from dask_dl.data.splits import split_by_patient
    from dask_dl.data.synthetic import synthesize

    root = Path(root)
    table = synthesize(root / "nih", n_images=n_images, size=64, seed=seed, sites=sites, client=client)
    labels = list(labels)
    drop = [k for k in NIH_LABELS if k not in labels]
    catalogs = {}
    for name in sorted(set(table["site"])):
        catalog = read_nih(root / "nih" / name, site=name)
        catalog = split_by_patient(catalog, seed=seed, val_fraction=val_fraction, test_fraction=test_fraction)
        catalogs[name] = make_catalog(catalog.drop(columns=drop), labels)

    def write(catalog: pd.DataFrame, name: str) -> str:
        path = str(root / f"{name}.zarr")
        ingest(catalog.reset_index(drop=True), path, size=size, chunk=16, shard=2, client=client, progress=False)
        return path

    stores = {name: write(c[c["split"] != "test"], name) for name, c in catalogs.items()}
    everything = pd.concat(list(catalogs.values()), ignore_index=True)
    test = write(everything[everything["split"] == "test"], "test")
    pooled = write(everything[everything["split"] != "test"], "pooled")
    return SyntheticSites(stores=stores, test=test, pooled=pooled)
