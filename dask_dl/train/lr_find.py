"""The learning-rate range test (fastai's and Lightning's ``lr_find``), run by one trainer on the cluster.

From a fresh model, each optimizer step takes the next learning rate of an exponential ramp from ``start_lr`` to
``end_lr`` and records the batch loss, until the ramp ends or the smoothed loss passes ``stop_factor`` times its
lowest value (it diverged). The suggestion is Lightning's: the learning rate where the smoothed loss falls
fastest (its steepest descent), skipping the first ``skip_start`` steps, whose loss is still mostly
initialization noise, and the last. The model, loss, optimizer and loader are the ones ``fit`` builds from the
same options (:func:`dask_dl.train.building.build_trainer_model`, :func:`~dask_dl.train.building.make_optimizer`,
:class:`~dask_dl.data.loader.ChunkLoader`), on the worker a trainer would get (GPU workers first).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dask_dl.checks import positive_int
from dask_dl.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["LRFinder", "find_lr"]

#: ``fit`` options that make no sense for a range test: it trains one trainer for ``steps`` steps, keeps nothing
_NOT_TAKEN = (
    "epochs",
    "trainers",
    "checkpoint_dir",
    "resume",
    "view",
    "tensorboard",
    "wait",
    "workers",
    "schedule",
    "compression",
    "compression_options",
    "warmup_steps",
    "max_restarts",
    "min_trainers",
    "checkpoint_every_steps",
    "checkpoint_every_seconds",
    "parallel",
    "stages",
    "microbatches",
    "freeze_epochs",
    "head_lr",
    "proximal_mu",
    "precision",
    "channels_last",
    "activation_checkpointing",
    "memory_budget",
)


@dataclass(frozen=True)
class LRFinder:
    """What :func:`find_lr` measured.

    Attributes
    ----------
    results
        One row per step: ``lr``, ``loss`` (the batch's), ``smoothed_loss`` (bias-corrected exponential average).
    suggestion
        The learning rate of the smoothed loss's steepest descent; None when too few steps were taken to tell.
    stopped
        ``"diverged"`` (the smoothed loss passed ``stop_factor`` times its lowest) or ``"end"`` (the ramp ended).
    """

    results: pd.DataFrame = field(repr=False)
    suggestion: float | None
    stopped: str

    def __repr__(self) -> str:
        suggestion = "None" if self.suggestion is None else f"{self.suggestion:.3g}"
        return f"LRFinder(suggestion={suggestion}, steps={len(self.results)}, stopped={self.stopped!r})"

    def plot(self, *, ax: Axes | None = None) -> Figure:
        """The loss against the learning rate (log scale), the smoothed loss over it, the suggestion marked."""
        from dask_dl.interpretation.figures import pyplot

        plt = pyplot("LRFinder.plot")
        if ax is None:
            fig, ax = plt.subplots(figsize=(6.0, 3.6))
        else:
            fig = ax.figure
        ax.plot(self.results["lr"], self.results["loss"], color="0.75", lw=0.8, label="batch loss")
        ax.plot(self.results["lr"], self.results["smoothed_loss"], color="C0", lw=1.5, label="smoothed")
        if self.suggestion is not None:
            at = int(np.argmin(np.abs(self.results["lr"].to_numpy() - self.suggestion)))
            ax.plot(
                [self.suggestion],
                [self.results["smoothed_loss"].iloc[at]],
                "o",
                color="C3",
                label=f"suggestion {self.suggestion:.2g}",
            )
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("training loss")
        ax.set_title(f"learning-rate range test ({len(self.results)} steps, {self.stopped})", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        return fig


def suggest(smoothed: np.ndarray, lrs: np.ndarray, *, skip_start: int = 10, skip_end: int = 1) -> float | None:
    """The learning rate where ``smoothed`` falls fastest per step (Lightning's suggestion), None with too few
    points: the ramp is exponential, so a step is the same factor of learning rate everywhere."""
    part = np.asarray(smoothed, dtype=float)[skip_start : len(smoothed) - skip_end]
    if len(part) < 3:
        return None
    return float(lrs[skip_start + int(np.argmin(np.gradient(part)))])


def find_lr(
    dataset: Any,
    *,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    steps: int = 100,
    stop_factor: float | None = 4.0,
    smoothing: float = 0.98,
    skip_start: int = 10,
    client: Client | None = None,
    **fit_kwargs: Any,
) -> LRFinder:
    """Run a learning-rate range test on one trainer and suggest a learning rate for :func:`dask_dl.fit`.

    Parameters
    ----------
    dataset
        From :func:`dask_dl.open_dataset`, as ``fit`` takes it; its train split is read.
    start_lr, end_lr
        The ramp: step ``i`` of ``steps`` trains at ``start_lr * (end_lr / start_lr) ** (i / (steps - 1))``.
    steps
        Optimizer steps at most (one batch each; the loader starts another epoch when one ends).
    stop_factor
        Stop when the smoothed loss passes this many times its lowest value (it diverged); None: run the ramp out.
    smoothing
        Weight of the past in the exponential average of the loss (fastai's 0.98).
    skip_start
        Steps left out at the start when looking for the steepest descent.
    client
        Dask client; default :func:`dask_dl.cluster.get_client`.
    **fit_kwargs
        ``fit``'s options that decide the model and its steps: ``model``, ``model_kwargs``, ``batch_size``,
        ``optimizer``, ``loss``, ``weights``, ``augment``, ``normalization``, ``accumulate``, ``seed`` (momentum
        and weight decay from ``dask-dl.train``). ``lr`` is the ramp's; options of a whole run (``epochs``,
        ``trainers``, ``compression``, ``schedule``, checkpoints, ``precision``: the test runs in fp32) are
        refused.

    Returns
    -------
    LRFinder
        ``.suggestion``, ``.results`` (``lr``, ``loss``, ``smoothed_loss``) and ``.plot()``.

    Raises
    ------
    ConfigurationError
        A bad ramp (``start_lr`` not below ``end_lr``, not positive, fewer steps than ``skip_start + 3``), a
        ``smoothing`` outside [0, 1), a ``stop_factor`` not above 1, an option ``fit`` does not take or the range
        test does not use (the message names it), or any error ``fit`` gives for its options.
    DatasetError
        What ``fit`` says of the dataset (no train split, a batch larger than it, ...).

    Examples
    --------
    >>> finder = dask_dl.find_lr(ds, model="small_cnn", optimizer="adamw")  # doctest: +SKIP
    >>> finder.suggestion  # doctest: +SKIP
    0.0021
    >>> finder.plot()  # doctest: +SKIP
    >>> run = dask_dl.fit(ds, model="small_cnn", optimizer="adamw", lr=finder.suggestion)  # doctest: +SKIP
    """
    from dask_dl.cluster import close_client, get_client
    from dask_dl.train.options import check_run
    from dask_dl.train.placement import place_trainers
    from dask_dl.train.run import _trainer_spec

    ramp = _check_ramp(
        start_lr=start_lr,
        end_lr=end_lr,
        steps=steps,
        stop_factor=stop_factor,
        smoothing=smoothing,
        skip_start=skip_start,
    )
    _check_kwargs(fit_kwargs, check_run)
    options = check_run(dataset, trainers=1, lr=start_lr, **fit_kwargs)
    spec = _trainer_spec(options, None)
    client_ = get_client(client)
    try:
        worker = place_trainers(client_, 1)[0]
        future = client_.submit(
            _range_test,
            spec,
            ramp=ramp,
            stop_factor=stop_factor,
            smoothing=smoothing,
            workers=[worker],
            allow_other_workers=False,
            pure=False,
            key=f"dask-dl-find-lr-{id(spec):x}",
        )
        measured = future.result()
    finally:
        if client is None:
            close_client(client_)
    results = pd.DataFrame(measured["rows"], columns=["lr", "loss", "smoothed_loss"])
    suggestion = suggest(results["smoothed_loss"].to_numpy(), results["lr"].to_numpy(), skip_start=skip_start)
    return LRFinder(results=results, suggestion=suggestion, stopped=measured["stopped"])


def _check_ramp(
    *, start_lr: Any, end_lr: Any, steps: Any, stop_factor: Any, smoothing: Any, skip_start: Any
) -> list[float]:
    for name, value in (("start_lr", start_lr), ("end_lr", end_lr)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ConfigurationError(f"{name} must be a positive number, got {value!r}; e.g. {name}=1e-07")
    if start_lr >= end_lr:
        raise ConfigurationError(
            f"start_lr={start_lr!r} must be below end_lr={end_lr!r}: the ramp rises from one to the other; "
            "e.g. start_lr=1e-07, end_lr=10"
        )
    if isinstance(skip_start, bool) or not isinstance(skip_start, int) or skip_start < 0:
        raise ConfigurationError(f"skip_start must be an integer >= 0, got {skip_start!r}; e.g. skip_start=10")
    steps = positive_int("steps", steps, example=100)
    if steps < skip_start + 3:
        raise ConfigurationError(
            f"steps={steps} leaves fewer than 3 steps after skip_start={skip_start} to find the steepest descent "
            f"in; pass steps >= {skip_start + 3} (e.g. steps=100)"
        )
    if stop_factor is not None and (
        isinstance(stop_factor, bool) or not isinstance(stop_factor, int | float) or not stop_factor > 1
    ):
        raise ConfigurationError(f"stop_factor must be a number above 1 or None, got {stop_factor!r}; e.g. 4.0")
    if isinstance(smoothing, bool) or not isinstance(smoothing, int | float) or not 0 <= smoothing < 1:
        raise ConfigurationError(f"smoothing must be in [0, 1), got {smoothing!r}; e.g. smoothing=0.98")
    return np.geomspace(float(start_lr), float(end_lr), steps).tolist()


def _check_kwargs(fit_kwargs: dict[str, Any], check_run: Any) -> None:
    from dask_dl.train.option_groups import OPTIONS

    taken = list(OPTIONS)
    for name in fit_kwargs:
        if name == "lr":
            raise ConfigurationError("find_lr takes no lr: the ramp sets it; pass start_lr= and end_lr= instead")
        if name in _NOT_TAKEN:
            raise ConfigurationError(
                f"find_lr does not take {name}=: the range test trains one trainer for `steps` steps and keeps "
                "nothing; pass it to fit"
            )
        if name not in taken:
            near = difflib.get_close_matches(name, [*taken, "start_lr", "end_lr", "steps", "stop_factor"], n=1)
            hint = f"; did you mean {near[0]}=?" if near else ""
            raise ConfigurationError(f"find_lr got an unknown option {name}={fit_kwargs[name]!r}{hint}")


def _range_test(spec: Any, *, ramp: list[float], stop_factor: float | None, smoothing: float) -> dict[str, Any]:
    """On the trainer's worker: train a fresh model along ``ramp``; the rows ``(lr, loss, smoothed)``."""
    import torch
    from distributed import get_worker

    from dask_dl.data.loader import ChunkLoader
    from dask_dl.models import MODELS
    from dask_dl.train.building import build_trainer_model, make_optimizer
    from dask_dl.train.losses import loss_function

    if spec.model_name not in MODELS and spec.model_target is not None:  # registered in the user's process
        MODELS.register(spec.model_name, spec.model_target)
    torch.set_num_threads(max(1, get_worker().state.nthreads))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(spec.seed)
    model, _ = build_trainer_model(spec, in_channels=spec.channels)
    model = model.to(device).train()
    loss_fn = loss_function(spec.loss)
    optimizer = make_optimizer(spec, model.parameters())
    loader = ChunkLoader(
        spec.store,
        spec.train_samples,
        batch_size=spec.batch_size,
        seed=spec.seed,
        window=spec.window,
        prefetch=spec.prefetch,
        cache=spec.cache,
        augment=spec.augment,
        normalization=spec.normalization,
    )
    rows, average, lowest, stopped, epoch = [], 0.0, math.inf, "end", 0
    batches = loader.epoch(epoch)
    try:
        for i, lr in enumerate(ramp):
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            for _ in range(spec.accumulate):  # one optimizer step per learning rate, as fit's accumulation takes
                batch = next(batches, None)
                if batch is None:
                    epoch += 1
                    batches = loader.epoch(epoch)
                    batch = next(batches)
                x, y = batch[0].to(device), batch[1].to(device)
                loss = loss_fn(model(x), y) / spec.accumulate
                loss.backward()
            value = float(loss) * spec.accumulate
            if not math.isfinite(value):
                stopped = "diverged"
                break
            optimizer.step()
            average = smoothing * average + (1 - smoothing) * value
            smoothed = average / (1 - smoothing ** (i + 1))
            rows.append((lr, value, smoothed))
            lowest = min(lowest, smoothed)
            if stop_factor is not None and i > 0 and smoothed > stop_factor * lowest:
                stopped = "diverged"
                break
    finally:
        batches.close()
        loader.close()
    return {"rows": rows, "stopped": stopped}
