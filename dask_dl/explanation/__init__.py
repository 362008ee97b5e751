"""Explanations: where a model looks (Grad-CAM, occlusion over Dask chunks), measured against true boxes.

:func:`~dask_dl.explanation.maps.explain` computes the maps, :func:`~dask_dl.explanation.localization.localization`
scores them against boxes as the ChestX-ray14 paper does, :func:`~dask_dl.explanation.show.show` draws them.
(The package is not called ``explain``: ``dask_dl.explain`` is the function.)
"""

from dask_dl.explanation.localization import localization
from dask_dl.explanation.maps import explain
from dask_dl.explanation.show import show

__all__ = ["explain", "localization", "show"]
