"""dask_dl's testing kit: small stores, collections and fakes that tests and benchmarks share.

Each room has a module here (``dask_dl.testing.data``, ``dask_dl.testing.compression``, ...), so that tests import
from the package instead of from each other. Nothing here is imported by ``import dask_dl``.
"""
