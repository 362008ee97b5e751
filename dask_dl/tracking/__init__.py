"""MLflow tracking of :func:`dask_dl.fit` and :func:`dask_dl.fit_sites` runs (``tracking=``), logged from the client.

:func:`open_tracker` starts a run (or takes a :class:`Tracker` to nest runs in); :mod:`dask_dl.tracking.runs` holds
what a fit, a cross-site run and an export log. mlflow is imported on the tracker's thread, when first needed: it
is the ``tracking`` extra (``pip install 'dask_dl[tracking]'``).
"""

from dask_dl.tracking.tracker import STATUSES, Tracker, TrackingError, open_tracker, tracking_uri

__all__ = ["STATUSES", "Tracker", "TrackingError", "open_tracker", "tracking_uri"]
