"""Looking at a collection, a model and runs: image grids, top losses, ROC/PR and calibration, run curves, a report.

:func:`~dask_dl.interpretation.batch.show_batch` draws images of a store, reading only the chunks it shows;
:func:`~dask_dl.interpretation.interpretation.interpret` scores a split over the cluster and returns an
:class:`~dask_dl.interpretation.interpretation.Interpretation` (top losses gathered chunk by chunk, curves per
label); :mod:`~dask_dl.interpretation.runs` draws runs; :mod:`~dask_dl.interpretation.report` writes one HTML page.
Every function returns a matplotlib Figure (the ``explain`` or ``notebook`` extra). (The package is not called
``interpret``: ``dask_dl.interpret`` is the function.)
"""

from dask_dl.interpretation.batch import show_batch
from dask_dl.interpretation.interpretation import Interpretation, interpret
from dask_dl.interpretation.report import report
from dask_dl.interpretation.runs import compare, plot_run

__all__ = ["Interpretation", "compare", "interpret", "plot_run", "report", "show_batch"]
