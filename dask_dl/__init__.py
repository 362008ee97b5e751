"""dask_dl: Dask-native interactive deep learning on big image collections.

Importing dask_dl is cheap: the public names below are loaded on first use, so ``import dask_dl`` does not
import torch, onnx or onnxruntime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dask_dl import config as _config  # noqa: F401  (registers the dask.config defaults)
from dask_dl._version import __version__
from dask_dl.errors import (
    CatalogError,
    CheckpointError,
    ClusterError,
    ConfigurationError,
    CrossSiteError,
    DaskDLError,
    DatasetError,
    ExportError,
    IngestError,
    MissingDependencyError,
    StoreError,
    StoreNotFoundError,
    TrainingError,
)

# public name -> module that defines it
_LAZY = {
    "NIH_LABELS": "dask_dl.data.schema",
    "make_catalog": "dask_dl.data.schema",
    "validate_catalog": "dask_dl.data.schema",
    "write_catalog": "dask_dl.data.schema",
    "to_dask_dataframe": "dask_dl.data.frames",
    "read_catalog": "dask_dl.data.catalog",
    "read_nih": "dask_dl.data.nih",
    "read_folders": "dask_dl.data.folders",
    "read_dicom": "dask_dl.data.dicom",
    "split_by_patient": "dask_dl.data.splits",
    "synthesize": "dask_dl.data.synthetic",
    "ingest": "dask_dl.data.ingest",
    "IngestResult": "dask_dl.data.ingest",
    "open_dataset": "dask_dl.data.dataset",
    "check_store": "dask_dl.data.check",
    "StoreCheck": "dask_dl.data.check",
    "StoreLayout": "dask_dl.data.store",
    "summary": "dask_dl.data.dataset",
    "ChunkLoader": "dask_dl.data.loader",
    "fit": "dask_dl.train.run",
    "TrainingRun": "dask_dl.train.run",
    "find_lr": "dask_dl.train.lr_find",
    "Training": "dask_dl.train.option_groups",
    "Optimization": "dask_dl.train.option_groups",
    "ScaleOut": "dask_dl.train.option_groups",
    "Memory": "dask_dl.train.option_groups",
    "Recovery": "dask_dl.train.option_groups",
    "FineTuning": "dask_dl.train.option_groups",
    "Reporting": "dask_dl.train.option_groups",
    "make_compressor": "dask_dl.train.compression",
    "build_model": "dask_dl.models",
    "list_models": "dask_dl.models",
    "register_model": "dask_dl.models",
    "load_weights": "dask_dl.models.weights",
    "export_onnx": "dask_dl.export",
    "read_model_info": "dask_dl.onnx_info",
    "predict": "dask_dl.inference",
    "scores_table": "dask_dl.inference",
    "evaluate": "dask_dl.inference",
    "auroc": "dask_dl.metrics",
    "get_client": "dask_dl.cluster",
    "explain": "dask_dl.explanation.maps",
    "localization": "dask_dl.explanation.localization",
    "show": "dask_dl.explanation.show",
    "show_batch": "dask_dl.interpretation.batch",
    "interpret": "dask_dl.interpretation.interpretation",
    "Interpretation": "dask_dl.interpretation.interpretation",
    "compare": "dask_dl.interpretation.runs",
    "report": "dask_dl.interpretation.report",
    "read_boxes": "dask_dl.data.boxes",
    "attach_boxes": "dask_dl.data.boxes",
    "connect": "dask_dl.cluster",
    "fit_sites": "dask_dl.sites.run",
    "SitesRun": "dask_dl.sites.run",
    "open_tracker": "dask_dl.tracking",
    "sweep": "dask_dl.sweeps.run",
    "Sweep": "dask_dl.sweeps.run",
}

__all__ = [
    "CatalogError",
    "CheckpointError",
    "ClusterError",
    "ConfigurationError",
    "CrossSiteError",
    "DaskDLError",
    "DatasetError",
    "ExportError",
    "IngestError",
    "MissingDependencyError",
    "StoreError",
    "StoreNotFoundError",
    "TrainingError",
    "__version__",
    *sorted(_LAZY),
]


# sub-packages reachable as attributes without importing them first: ``dask_dl.cluster.make("slurm")``
_SUBPACKAGES = ("cluster", "sites")


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"dask_dl.{name}")
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'dask_dl' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover
    from dask_dl.cluster import connect, get_client
    from dask_dl.data.boxes import attach_boxes, read_boxes
    from dask_dl.data.catalog import read_catalog
    from dask_dl.data.check import StoreCheck, check_store
    from dask_dl.data.dataset import open_dataset, summary
    from dask_dl.data.dicom import read_dicom
    from dask_dl.data.folders import read_folders
    from dask_dl.data.frames import to_dask_dataframe
    from dask_dl.data.ingest import IngestResult, ingest
    from dask_dl.data.loader import ChunkLoader
    from dask_dl.data.nih import read_nih
    from dask_dl.data.schema import NIH_LABELS, make_catalog, validate_catalog, write_catalog
    from dask_dl.data.splits import split_by_patient
    from dask_dl.data.store import StoreLayout
    from dask_dl.data.synthetic import synthesize
    from dask_dl.explanation.localization import localization
    from dask_dl.explanation.maps import explain
    from dask_dl.explanation.show import show
    from dask_dl.export import export_onnx
    from dask_dl.inference import evaluate, predict, scores_table
    from dask_dl.interpretation.batch import show_batch
    from dask_dl.interpretation.interpretation import Interpretation, interpret
    from dask_dl.interpretation.report import report
    from dask_dl.interpretation.runs import compare
    from dask_dl.metrics import auroc
    from dask_dl.models import build_model, list_models, register_model
    from dask_dl.models.weights import load_weights
    from dask_dl.onnx_info import read_model_info
    from dask_dl.sites.run import SitesRun, fit_sites
    from dask_dl.sweeps.run import Sweep, sweep
    from dask_dl.train.compression import make_compressor
    from dask_dl.train.lr_find import find_lr
    from dask_dl.train.option_groups import (
        FineTuning,
        Memory,
        Optimization,
        Recovery,
        Reporting,
        ScaleOut,
        Training,
    )
    from dask_dl.train.run import TrainingRun, fit
