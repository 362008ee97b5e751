"""Catalogs and score tables as Dask DataFrames, with pandas or cudf partitions.

A catalog (:mod:`dask_dl.data.schema`) or a :func:`~dask_dl.inference.scores_table` is a pandas table that fits
in memory; on a GPU cluster it can also be worked on as a Dask DataFrame whose partitions are cudf DataFrames (on
the GPUs). :func:`to_dask_dataframe` makes either, through Dask's own backend switch
(``dask.config.set({"dataframe.backend": "cudf"})``), so that a site that sets ``dataframe.backend: cudf`` in its
Dask config gets cudf tables without passing anything. cudf and its Dask backend come with the ``gpu`` extra.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from dask_dl.checks import one_of, positive_int
from dask_dl.errors import ClusterError, missing_dependency

if TYPE_CHECKING:  # pragma: no cover
    import dask.dataframe as dd
    import pandas as pd

__all__ = ["BACKENDS", "check_backend", "to_dask_dataframe"]

#: DataFrame backends :func:`to_dask_dataframe` makes
BACKENDS = ("pandas", "cudf")

#: rows per partition when ``npartitions`` is not given: tables of ids and scores are narrow
_ROWS_PER_PARTITION = 100_000


def check_backend(backend: str | None) -> str:
    """Return the backend to use (``backend``, else Dask's ``dataframe.backend``), checked to be usable here.

    Parameters
    ----------
    backend : {"pandas", "cudf"} or None
        The backend asked for; None: Dask's ``dataframe.backend`` setting.

    Returns
    -------
    str
        ``"pandas"`` or ``"cudf"``.

    Raises
    ------
    ConfigurationError
        A backend other than ``"pandas"`` or ``"cudf"``.
    MissingDependencyError
        ``"cudf"`` without cudf and dask-cudf installed (the ``gpu`` extra).
    ClusterError
        ``"cudf"`` installed, but it cannot start in this process (no usable GPU).
    """
    import dask.config

    backend = one_of("backend", backend if backend is not None else dask.config.get("dataframe.backend"), BACKENDS)
    if backend == "cudf":
        for module, package in (("cudf", "cudf-cu12"), ("dask_cudf", "dask-cudf-cu12")):
            if importlib.util.find_spec(module) is None:
                raise missing_dependency(package, "gpu", "a table with the cudf backend")
        try:
            import cudf  # noqa: F401
            import dask_cudf  # noqa: F401  (registers the cudf backend of dask.dataframe)
        except Exception as exc:
            raise ClusterError(
                f"cudf is installed but does not start in this process ({type(exc).__name__}: {exc}); a cudf table "
                "is built where a GPU is visible (the client of a GPU box): use backend='pandas' elsewhere"
            ) from exc
    return backend


def to_dask_dataframe(
    table: pd.DataFrame, *, backend: str | None = None, npartitions: int | None = None
) -> dd.DataFrame:
    """A Dask DataFrame of ``table`` (a catalog or a scores table), with pandas or cudf partitions.

    Parameters
    ----------
    table
        A pandas table, e.g. from :func:`~dask_dl.read_catalog` or :func:`~dask_dl.scores_table`.
    backend : {"pandas", "cudf"}, optional
        Partitions of pandas DataFrames, or of cudf DataFrames on the GPU. Default: Dask's ``dataframe.backend``
        setting (``"pandas"`` unless set).
    npartitions
        Partitions; default one per 100,000 rows.

    Returns
    -------
    dask.dataframe.DataFrame
        The rows of ``table`` in order, with its index, columns and dtypes (strings as the backend keeps them);
        the table's ``attrs`` (label names, task) are in ``frame.attrs``.

    Raises
    ------
    ConfigurationError
        An unknown ``backend`` or a bad ``npartitions``.
    MissingDependencyError
        ``backend="cudf"`` without cudf and dask-cudf: ``pip install 'dask-dl[gpu]'``.
    ClusterError
        ``backend="cudf"`` in a process where cudf cannot start (no usable GPU).

    Examples
    --------
    >>> frame = to_dask_dataframe(catalog, backend="cudf")  # doctest: +SKIP
    >>> frame.groupby("site")["Effusion"].mean().compute()  # doctest: +SKIP
    """
    import dask.config
    import dask.dataframe as dd

    backend = check_backend(backend)
    if npartitions is None:
        npartitions = max(1, -(-len(table) // _ROWS_PER_PARTITION))
    npartitions = positive_int("npartitions", npartitions)
    attrs = dict(table.attrs)
    if backend == "cudf":
        import cudf

        table = cudf.from_pandas(table)  # copied to this process's GPU once, then cut into partitions
    with dask.config.set({"dataframe.backend": backend}):
        # sort=False: the rows stay in the table's order (a catalog's, a store's sample order)
        frame = dd.from_pandas(table, npartitions=npartitions, sort=False)
    frame.attrs = attrs  # on this frame only: Dask's operations do not carry attrs along
    return frame
