"""The trainers' spec: what every rank of a run gets from the driver to build its part of the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_dl.errors import ConfigurationError
from dask_dl.train.options import RunOptions

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TrainerSpec", "unpickle_spec"]


@dataclass(frozen=True)
class TrainerSpec(RunOptions):
    """Everything a trainer needs to build its part of a run; the same for every rank.

    Every field of the run's :class:`~dask_dl.train.options.RunOptions` (so every option of ``fit``), and what
    only the trainers need.
    """

    #: what the model registry holds for ``model`` on the driver (a builder or its "module:attribute" path)
    model_target: Any = None
    #: a checkpoint to start from (``fit(resume=True)``'s newest good one)
    resume_from: str | None = None
    #: weights loaded into the model on every rank right after it is built, before DDP and the optimizer (for
    #: :func:`dask_dl.fit_sites`: the weights a site starts its visit from)
    start_state: dict[str, torch.Tensor] | None = None
    #: FedProx: ``proximal_mu / 2 * ||w - w_start||^2`` is added to the training loss, against ``start_state``
    proximal_mu: float = 0.0
    #: rank 0 keeps only the model's weights (and the epoch) for the driver, not the optimizer's moments, RNG
    #: states or history: what may leave a site in :func:`dask_dl.fit_sites`
    weights_only: bool = False

    @property
    def model_name(self) -> str:
        """The model's name (a registry name, ``torchvision:NAME``, an import path or a class name)."""
        return self.model


def unpickle_spec(spec: TrainerSpec | bytes, address: str) -> TrainerSpec:
    """The run's spec from the driver's pickle, or a ConfigurationError naming the module this worker lacks."""
    if not isinstance(spec, bytes):
        return spec
    from distributed.protocol import pickle

    try:
        return pickle.loads(spec)
    except Exception as exc:
        raise ConfigurationError(
            f"worker {address} cannot load the run's model and options: {type(exc).__name__}: {exc}. The model or "
            "loss comes from a module that does not import there (or imports one that does not): install it where "
            "the workers run, or send it to them before the run (client.upload_file, or dask-dl train --upload)"
        ) from None
