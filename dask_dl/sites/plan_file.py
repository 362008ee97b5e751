"""The YAML file of ``dask-dl xsite``: the sites, the protocol and its options, in one place.

.. code-block:: yaml

    protocol: fedavg            # ensemble, incremental, cyclic, fedavg, fedprox
    rounds: 5
    model: small_cnn
    options:                    # any other keyword of dask_dl.fit_sites
      local_epochs: 1
      batch_size: 32
      lr: 0.01
    test: /data/pooled-test.zarr   # optional: a test store the coordinator can read
    sites:
      A:                        # a cluster of its own: only weights and metrics travel
        scheduler: tls://hospital-a.example.org:8786
        store: /data/cxr.zarr   # as the site's workers see it
        tls: {ca: ca.pem, cert: coordinator.pem, key: coordinator-key.pem}
      B:                        # workers of the shared cluster (--scheduler, or a local one) marked site-B
        store: /shared/b.zarr
        resource: site-B
      C:                        # a store alone: a simulation on the shared cluster
        store: /shared/c.zarr

Relative paths are read from the file's folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dask_dl.errors import ConfigurationError

__all__ = ["read_plan_file"]

_TOP = ("protocol", "rounds", "model", "options", "test", "sites")
_SITE = ("scheduler", "store", "resource", "tls")


def read_plan_file(path: str | os.PathLike, *, open_stores: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read an ``xsite`` file; return the ``sites`` mapping of :func:`dask_dl.fit_sites` and its other keywords.

    Sites with a ``scheduler`` stay addresses (``{"scheduler", "security", "store"}``); the others are opened here
    with :func:`dask_dl.open_dataset` (``{"dataset", "resource"}``), and ``test`` too, unless ``open_stores`` is
    False (then their paths stay under ``store`` and ``test``: checking a file before any cluster exists).

    Raises
    ------
    ConfigurationError
        The file is not a mapping, has unknown keys, no sites, or a site without a store.
    """
    import yaml

    path = Path(path)
    try:
        plan = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigurationError(f"{str(path)!r} is not valid YAML: {exc}") from exc
    if not isinstance(plan, dict):
        raise ConfigurationError(f"{str(path)!r} must be a mapping with keys {list(_TOP)}")
    unknown = sorted(set(plan) - set(_TOP))
    if unknown:
        raise ConfigurationError(f"{str(path)!r} has unknown keys {unknown}; the keys are {list(_TOP)}")
    entries = plan.get("sites")
    if not isinstance(entries, dict) or not entries:
        raise ConfigurationError(f"{str(path)!r} has no sites: add 'sites:' with one entry per site")
    sites = {str(name): _site(str(name), entry, path.parent, open_stores) for name, entry in entries.items()}
    options = dict(plan.get("options") or {})
    for key in ("protocol", "rounds", "model"):
        if plan.get(key) is not None:
            options[key] = plan[key]
    if plan.get("test") is not None:
        from dask_dl.data.dataset import open_dataset

        test = _path(plan["test"], path.parent)
        options["test"] = open_dataset(test) if open_stores else test
    return sites, options


def _site(name: str, entry: Any, base: Path, open_stores: bool) -> dict[str, Any]:
    if not isinstance(entry, dict) or "store" not in entry:
        raise ConfigurationError(f"site {name!r} needs at least 'store: PATH'; got {entry!r}")
    unknown = sorted(set(entry) - set(_SITE))
    if unknown:
        raise ConfigurationError(f"site {name!r} has unknown keys {unknown}; a site takes {list(_SITE)}")
    if entry.get("scheduler"):
        site: dict[str, Any] = {"scheduler": str(entry["scheduler"]), "store": str(entry["store"])}
        if entry.get("resource"):
            site["resource"] = str(entry["resource"])
        tls = entry.get("tls")
        if tls:
            from dask_dl.cluster.tls import tls_files

            files = {k: _path(v, base) for k, v in dict(tls).items()}
            site["security"] = tls_files(**files)
        return site
    from dask_dl.data.dataset import open_dataset

    store = _path(entry["store"], base)
    site = {"dataset": open_dataset(store)} if open_stores else {"store": store}
    if entry.get("resource"):
        site["resource"] = str(entry["resource"])
    return site


def _path(value: Any, base: Path) -> str:
    text = str(value)
    if "://" in text or os.path.isabs(text):
        return text
    return str(base / text)
