"""``fit()`` and :class:`TrainingRun`: train on a Dask cluster and hold the run while it goes on.

``fit`` checks every argument (:mod:`dask_dl.train.options`) before anything is placed on the cluster, picks the
trainer workers (:mod:`dask_dl.train.placement`) and starts a :class:`~dask_dl.train.driver.Driver`, the
background thread that drives the trainers. The user holds a :class:`TrainingRun`: the state of the run (its
history rows from :mod:`dask_dl.train.aggregate`, status, latest checkpoint) and what can be done with it (stop,
wait, get the model, views).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import warnings
from typing import TYPE_CHECKING, Any

import pandas as pd

from dask_dl.errors import CheckpointError, ConfigurationError, TrainingError
from dask_dl.interrupt import wait_for
from dask_dl.train.option_groups import (
    FineTuning,
    Memory,
    Optimization,
    Recovery,
    Reporting,
    ScaleOut,
    Training,
    non_negative_real,
)
from dask_dl.train.options import RunOptions, check_run
from dask_dl.train.parallel import check_resume
from dask_dl.train.placement import place_trainers

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    import torch
    import xarray as xr
    from distributed import Client
    from matplotlib.figure import Figure

    from dask_dl.tracking import Tracker

__all__ = ["TrainingRun", "fit"]

logger = logging.getLogger("dask_dl.train")


def fit(
    dataset: xr.Dataset,
    *,
    model: str | torch.nn.Module | Callable[..., torch.nn.Module] | None = None,
    epochs: int | None = None,
    batch_size: int | None = None,
    trainers: int | None = None,
    compression: str | None = None,
    lr: float | None = None,
    optimizer: str | None = None,
    warmup_steps: int | None = None,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    seed: int | None = None,
    augment: bool = False,
    augment_on: str = "auto",
    model_kwargs: dict[str, Any] | None = None,
    compression_options: dict[str, Any] | None = None,
    view: str = "none",
    tensorboard: str | None = None,
    client: Client | None = None,
    wait: bool = True,
    normalization: dict[str, Any] | None = None,
    parallel: str | None = None,
    stages: int | None = None,
    microbatches: int | None = None,
    memory_budget: int | str | None = None,
    max_restarts: int | None = None,
    min_trainers: int | None = None,
    checkpoint_every_steps: int | None = None,
    checkpoint_every_seconds: float | None = None,
    loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    weights: str | os.PathLike | None = None,
    freeze_epochs: int = 0,
    head_lr: float | None = None,
    schedule: str | dict[str, Any] | None = None,
    precision: str | None = None,
    channels_last: bool = False,
    accumulate: int | None = None,
    activation_checkpointing: bool = False,
    training: Training | None = None,
    optimization: Optimization | None = None,
    scale_out: ScaleOut | None = None,
    memory: Memory | None = None,
    recovery: Recovery | None = None,
    fine_tuning: FineTuning | None = None,
    reporting: Reporting | None = None,
    workers: list[str] | None = None,
    tracking: str | os.PathLike | Tracker | None = None,
) -> TrainingRun:
    """Train a model on ``dataset`` with synchronous data-parallel SGD over Dask workers.

    Parameters
    ----------
    dataset : xarray.Dataset
        From :func:`dask_dl.open_dataset`; needs ``train`` and ``val`` samples. Only its coordinates are read
        here: every trainer reads the images straight from the store named by ``dataset.encoding["source"]``.
        The model's input channels are the store's (its layout's ``channels``: 1 grey, 3 for a colour store).
    model : str, torch.nn.Module or callable, optional
        A name from :func:`dask_dl.list_models`, ``"torchvision:NAME"`` or ``"timm:NAME"`` (when installed; adapted
        to the data's channels and labels, never downloading weights), a ``torch.nn.Module`` (shipped to the
        trainers by value), or a function returning one (called on each trainer, with ``num_outputs`` and
        ``in_channels`` when it takes them). A model that does not take the data's images or does not return one
        logit per label fails before training, with both shapes. See :mod:`dask_dl.models.source`. Default
        ``dask-dl.train.model``.
    epochs, batch_size, lr, warmup_steps : optional
        Epochs in all (a resumed run continues up to this number), images per step *per trainer* (the global
        batch, ``batch_size * trainers``, is in every history row), learning rate, and the uncompressed steps
        before a compressor starts (a UserWarning says so when the whole run is shorter). Defaults from
        ``dask-dl.train``.
    trainers : int, optional
        Data-parallel trainers, one per worker. Default ``dask-dl.train.trainers``.
    compression : str, optional
        Gradient compressor, a name of :data:`dask_dl.train.compressors.COMPRESSORS` (``none``, ``fp16``,
        ``bf16``, ``powersgd``, ``onebit``, ``onebit2``), or ``auto``: the one the scale-out model predicts
        fastest from the link and compute time measured at the run's start (``run.info["compression"]`` and the
        history's ``compression`` column say which and why; docs/scale-out.md).
    optimizer : {"sgd", "adamw"}, optional
        SGD with momentum ``dask-dl.train.momentum``, or AdamW. Default ``dask-dl.train.optimizer``.
    checkpoint_dir : str, optional
        Local directory or fsspec URL the trainers can write to; rank 0 writes one ``epoch-NNNN.pt`` per epoch.
        Without it, rank 0 keeps the latest checkpoint in memory, and ``run.checkpoint()`` / ``run.model()`` fetch
        it when asked (and once when the run ends): checkpoints never travel to the driver epoch by epoch.
    resume : bool
        Continue from the latest checkpoint in ``checkpoint_dir`` (start afresh when there is none yet).
    seed : int, optional
        Seeds initial weights, data order and augmentation; equal seeds give equal runs.
    augment : bool
        Random affine and brightness/contrast augmentation of training images.
    augment_on : {"auto", "cpu", "device"}
        Where training batches are augmented and normalized. ``cpu``: by the loader, on the trainer's CPU cores;
        ``device``: on the trainer's device, as batched tensor ops with each image's own parameters
        (:mod:`dask_dl.data.device_augment`), the cores only decoding; the parameters come from the same seeded
        stream either way. ``auto``: ``device`` on a GPU trainer (whose batches are also pinned and copied ahead
        on a stream of their own, :mod:`dask_dl.train.feed`), ``cpu`` elsewhere.
    model_kwargs, compression_options : dict, optional
        Passed to :func:`dask_dl.build_model` and to the compressor.
    view : {"none", "auto", "notebook", "terminal", "log"}
        Live view of the progress (:class:`dask_dl.train.view.RunView`).
    tensorboard : str, optional
        Also write each epoch's numbers as TensorBoard scalars under ``tensorboard/<run_id>`` (needs the
        ``tensorboard`` package). The history always goes to ``checkpoint_dir/history.parquet`` too.
    client : distributed.Client, optional
        Cluster to train on. Default: the current client; when there is none, fit starts a local cluster for this
        run and closes it (client first) when the run ends, so nothing is left running: keep a cluster across
        runs by making a ``distributed.Client`` first.
    wait : bool
        Block until training ends (True), or return the running :class:`TrainingRun` at once (False).
    normalization : dict, optional
        ``{"mean": m, "std": s}`` applied to pixels scaled to [0, 1]: numbers for every channel, or one per channel
        of a colour store (e.g. ImageNet's ``{"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}``, or
        :func:`dask_dl.normalize.channel_stats` of the training split). It goes into the checkpoints and the
        exported ONNX graph. Default :data:`dask_dl.normalize.DEFAULT_NORMALIZATION`.
    parallel : {"ddp", "fsdp", "pipeline"}, optional
        How the trainers share the model (:mod:`dask_dl.train.parallel`): ``ddp`` (each holds all of it),
        ``fsdp`` (parameters, gradients and optimizer state sharded over the trainers; checkpoints sharded with
        ``torch.distributed.checkpoint`` beside a consolidated ``epoch-NNNN.pt``) or ``pipeline`` (the model's
        blocks in ``stages`` stages on as many trainers). Every compressor applies to ``ddp``; ``fsdp`` takes
        ``fp16`` and ``bf16`` (its reduce-scatter's dtype), ``pipeline`` only ``none``.
        Default ``dask-dl.train.parallel``.
    stages : int, optional
        Pipeline stages (``parallel="pipeline"``; default 2); ``trainers`` must be a multiple (``trainers //
        stages`` data-parallel replicas of the pipeline, each reading ``batch_size`` images per step).
    microbatches : int, optional
        Micro-batches a pipeline cuts each batch into (default ``stages``; must divide ``batch_size``). The
        schedule is ``dask-dl.train.pipeline-schedule`` (``1f1b`` or ``gpipe``).
    memory_budget : int or str, optional
        Bytes (or e.g. ``"2 GiB"``) of model state (parameters, gradients, optimizer state) one trainer may hold;
        estimated before anything is placed, and a run over it fails with both numbers and the modes that fit.
        Default ``dask-dl.train.memory-budget`` (none).
    max_restarts : int, optional
        When a trainer's worker is lost or a collective fails, re-form the group on the workers there are and go
        on from the newest checkpoint, at most this many times (0: fail at once). Each restart is a row of
        ``run.restarts``. Default ``dask-dl.train.max-restarts``. See the recovery how-to.
    min_trainers : int, optional
        Fewest trainers a restarted run goes on with, once ``dask-dl.train.restart-wait`` seconds passed without
        as many free workers as it started with (the remaining samples of the epoch are re-sharded; error-feedback
        residuals start from zero). Default ``dask-dl.train.min-trainers`` (null: ``trainers``). A pipeline
        restarts on whole pipelines (a multiple of ``stages``): fewer replicas, the same stages.
    checkpoint_every_steps, checkpoint_every_seconds : optional
        Also checkpoint inside epochs, every this many optimizer steps or seconds (0: off), with the loader's
        position, so a restart or ``resume=True`` loses at most that much and neither repeats nor skips a sample.
        Defaults ``dask-dl.train.checkpoint-every-steps`` / ``-seconds``. In every ``parallel`` mode (FSDP's are
        sharded, as its epoch checkpoints).
    loss : {"bce", "ce"} or callable, optional
        ``bce`` trains multi-label (sigmoid per label), ``ce`` single-label (softmax); a function
        ``(logits, targets) -> mean loss`` keeps the dataset's task. Default: the dataset's task decides.
    weights : str, optional
        Start weights: a ``torch.save`` state dict or a dask_dl checkpoint, a local path or fsspec URL read by the
        trainers with ``weights_only=True``. The first layer is adapted to the data's channels and a head of
        another size re-initialised; the report of missing, unexpected, adapted and re-initialised tensors is in
        ``run.info["weights"]`` and the log. Other shape differences fail before training.
    freeze_epochs : int
        Epochs at the start with the backbone frozen (learning rate 0, BatchNorm statistics kept): only the head
        (the last linear layer) trains.
    head_lr : float, optional
        Learning rate of the head (its own parameter group); the backbone trains with ``lr``.
    schedule : str or dict, optional
        Learning-rate schedule over the run's optimizer steps: ``constant``, ``cosine``, ``warmup-cosine``,
        ``onecycle`` or ``plateau``, or a dict with ``name`` and options, e.g.
        ``{"name": "warmup-cosine", "warmup_steps": 100}`` (see :mod:`dask_dl.train.tuning`). Its state is
        checkpointed; every history row has ``lr`` (and ``head_lr``). Default ``dask-dl.train.schedule``.
    precision : {"fp32", "bf16", "fp16"}, optional
        ``bf16`` autocasts the forward pass on CPU and GPU; ``fp16`` (GPU trainers only) adds a gradient scaler.
        Default ``dask-dl.train.precision``.
    channels_last : bool
        Channels-last memory format on GPU trainers (a no-op on CPUs).
    accumulate : int, optional
        Micro-batches per optimizer step (DDP's ``no_sync`` on all but the last): the global batch is
        ``batch_size * trainers * accumulate``. Default ``dask-dl.train.accumulate``.
    activation_checkpointing : bool
        Recompute the model's blocks' activations in backward to save memory (registry models, timm models, and
        models with a ``checkpoint_blocks()`` method).
    training, optimization, scale_out, memory, recovery, fine_tuning, reporting : optional
        The same options in groups, for configurations kept as objects: :class:`dask_dl.Training` (``model``,
        ``model_kwargs``, ``loss``, ``epochs``, ``batch_size``, ``seed``, ``augment``, ``normalization``),
        :class:`dask_dl.Optimization` (``lr``, ``optimizer``, ``schedule``, ``accumulate``),
        :class:`dask_dl.ScaleOut` (``trainers``, ``compression``, ``compression_options``, ``warmup_steps``,
        ``parallel``, ``stages``, ``microbatches``), :class:`dask_dl.Memory` (``precision``, ``channels_last``,
        ``activation_checkpointing``, ``memory_budget``), :class:`dask_dl.Recovery` (``checkpoint_dir``,
        ``resume``, ``max_restarts``, ``min_trainers``, ``checkpoint_every_steps``, ``checkpoint_every_seconds``),
        :class:`dask_dl.FineTuning` (``weights``, ``freeze_epochs``, ``head_lr``) and :class:`dask_dl.Reporting`
        (``view``, ``tensorboard``); e.g. ``fit(ds, recovery=Recovery(max_restarts=5))``. A flat keyword may add
        to a group; one that sets an option of the group to another value is a ConfigurationError.
    workers : list of str, optional
        Train only on these worker addresses (``client.scheduler_info()["workers"]``); a restart stays among them.
    tracking : str, path or Tracker, optional
        Record the run in MLflow (the ``tracking`` extra), from the client: ``http://host:port`` (a tracking
        server), ``sqlite:///runs.db`` or a folder; a :class:`dask_dl.tracking.Tracker`
        (``parent.nested("trial 3")``) to log into that run, which fit ends. Every option as a param, the store's
        shape, the model's source, one step per epoch of every number of the history, and ``history.csv``; an
        ``export_onnx`` of the run uploads the model (``register=`` puts it in the model registry). A tracking
        server that is down or slow never stops or slows training: one warning, and ``run.history`` has it all.
        Default ``dask-dl.tracking.uri``, else the ``MLFLOW_TRACKING_URI`` environment variable, else none
        (``False``: none, whatever they say). See
        the tracking how-to. ``run.tracker`` is the run's :class:`~dask_dl.tracking.Tracker` (None untracked).

    Returns
    -------
    TrainingRun

    Raises
    ------
    DatasetError
        No ``train`` or ``val`` samples, no labels, or a batch larger than one trainer's share of the data.
    ConfigurationError
        Unknown model, compressor, optimizer or view, an unknown option of one, or a number out of range; a
        compressor that does not apply to ``parallel``; a model that cannot be split into ``stages``; a model
        over ``memory_budget``; raised before anything is placed on the cluster.
    ClusterError
        Fewer workers than trainers.

    Warns
    -----
    UserWarning
        A compressed run (any ``compression`` but ``none``) with no more steps than ``warmup_steps``: it would
        send only float32 gradients.
    TrainingError
        (from ``wait``) a non-finite loss, a trainer that failed or timed out.

    Examples
    --------
    >>> run = fit(ds, model="resnet18", epochs=10, trainers=2, compression="onebit", wait=False)  # doctest: +SKIP
    >>> run.history[["epoch", "train_loss", "val_auroc_mean"]]  # doctest: +SKIP
    """
    options = {k: v for k, v in locals().items() if k not in ("dataset", "client", "wait", "workers", "tracking")}
    return fit_visit(dataset, client=client, wait=wait, workers=workers, tracking=tracking, stacklevel=3, **options)


def fit_visit(
    dataset: xr.Dataset,
    *,
    client: Client | None = None,
    wait: bool = True,
    start_state: dict[str, torch.Tensor] | None = None,
    proximal_mu: float = 0.0,
    workers: list[str] | None = None,
    weights_only: bool = False,
    tracking: str | os.PathLike | Tracker | None = None,
    stacklevel: int = 2,
    **given: Any,
) -> TrainingRun:
    """:func:`fit` with the options of a visit of :func:`dask_dl.fit_sites` to one site (not part of ``fit``).

    Parameters
    ----------
    start_state : dict of str to torch.Tensor, optional
        Weights (a ``state_dict``) loaded into the model on every trainer right after it is built, instead of the
        seeded initial weights.
    proximal_mu : float
        FedProx: adds ``proximal_mu / 2 * ||w - w_start||^2`` to the training loss, ``w_start`` being
        ``start_state`` (the seeded initial weights without it). Default 0: off.
    workers : list of str, optional
        Train only on these worker addresses (a site's workers).
    weights_only : bool
        Without ``checkpoint_dir``, rank 0 keeps only the model's weights for ``run.checkpoint()`` (a dict of
        ``model``, ``epoch`` and ``model_name``), so that no optimizer moment, RNG state or history leaves the
        trainers.
    tracking
        As :func:`fit`'s.
    **given
        The options of :func:`fit`.
    """
    from dask_dl.cluster import check_importable, check_visible, close_client, get_client
    from dask_dl.data.order import warn_if_sorted
    from dask_dl.tracking import Tracker, open_tracker, tracking_uri

    given_tracker = tracking if isinstance(tracking, Tracker) else None
    uri = None if given_tracker is not None else tracking_uri(tracking)  # a bad URI fails before any work
    options = check_run(dataset, **given)
    visit = {
        "start_state": start_state,
        "proximal_mu": non_negative_real("proximal_mu", proximal_mu),
        "weights_only": bool(weights_only),
    }
    total_steps = options.steps_per_epoch // options.accumulate * options.epochs
    compressed = options.compression not in ("none", "auto")  # auto says what it chose, warm-up included
    if compressed and options.parallel == "ddp" and options.warmup_steps >= total_steps:
        warnings.warn(
            f"compression={options.compression!r} starts after warmup_steps={options.warmup_steps} uncompressed "
            f"steps, but this run takes {total_steps} steps in all ({options.epochs} epochs x "
            f"{options.steps_per_epoch} steps of global batch {options.global_batch}): every step would send "
            f"float32 gradients. Pass warmup_steps < {total_steps} (e.g. warmup_steps=0) or train longer",
            UserWarning,
            stacklevel=stacklevel,
        )
    warn_if_sorted(options.store, split="train", stacklevel=stacklevel)  # a store in class-folder order learns poorly
    lease = None
    if options.checkpoint_dir is not None:  # one live run per checkpoint_dir, held until the run ends
        from dask_dl.train.lease import CheckpointLease

        lease = CheckpointLease(options.checkpoint_dir).acquire()
    owns_client = client is None and not _current_client_exists()
    try:
        resume_from, history = _resume_point(options) if options.resume else (None, [])
        client = get_client(client)
        workers_allowed = None if workers is None else tuple(workers)
        workers = place_trainers(client, options.trainers, among=workers_allowed)
        check_visible(client, options.store, workers=workers)  # the trainers open the store themselves
        check_importable(client, _modules_needed(options), workers=workers)  # and import the user's modules
        run = TrainingRun(
            client,
            options,
            workers=workers,
            history=history,
            resume_from=resume_from,
            owns_client=owns_client,
            visit=visit,
            among=workers_allowed,
        )
    except BaseException:
        if lease is not None:
            lease.release()
        if owns_client and client is not None:
            close_client(client)
        if given_tracker is not None:
            given_tracker.finish("failed")
        raise
    run._lease = lease
    run.tracker = open_tracker(given_tracker or uri or False, run_name=run.run_id)
    if run.tracker is not None:
        from dask_dl.tracking.runs import start_fit

        start_fit(run.tracker, run, dataset)
    _install_dashboard(client)
    run._start()
    if wait:
        run.wait()
    return run


def _modules_needed(options: RunOptions) -> dict[str, str]:
    """``{module: what needs it}`` for the modules the trainers import to unpickle the model and the loss."""
    from dask_dl.models.source import import_path, module_by_reference

    needs = {name: f"model {options.model_source.name!r}" for name in options.model_source.modules()}
    module = module_by_reference(options.loss) if callable(options.loss) else None
    if module is not None:
        needs.setdefault(module, f"loss {import_path(options.loss)!r}")
    return needs


class TrainingRun:
    """A training run in progress or finished; made by :func:`fit`.

    Attributes
    ----------
    run_id : str
        Name of the run (also the prefix of its actors' keys on the scheduler).
    status : str
        ``starting``, ``running``, ``finished``, ``stopped`` or ``failed``.
    error : BaseException or None
        Why the run failed.
    options : RunOptions
        The checked options of the run.
    workers : list of str
        The workers the trainers run on now (after a restart, the new group's).
    info : dict
        What the trainers reported when they started: ``weights``, the report of ``fit(weights=...)`` (tensors
        ``missing``, ``unexpected``, ``adapted`` and ``reinitialized``); ``compression`` with
        ``compression="auto"``: the compressor chosen (``name``), why (``reason``), the measured ``figures`` and
        the model's ``predicted_s`` per step of each candidate.
    tracker : dask_dl.tracking.Tracker or None
        The run's MLflow run (``fit(tracking=...)``); None when it is not tracked.
    """

    def __init__(
        self,
        client: Client,
        options: RunOptions,
        *,
        workers: list[str],
        history: list[dict[str, Any]],
        resume_from: str | None = None,
        owns_client: bool = False,
        visit: dict[str, Any] | None = None,
        among: tuple[str, ...] | None = None,
    ) -> None:
        from dask_dl.train.driver import Driver
        from dask_dl.train.history import HistoryWriter
        from dask_dl.train.recovery import RestartPolicy
        from dask_dl.train.view import RunView

        self.run_id = f"fit-{uuid.uuid4().hex[:8]}"
        self.client, self.options, self.workers = client, options, list(workers)
        self.epochs, self.checkpoint_dir = options.epochs, options.checkpoint_dir
        self.status, self.error = "starting", None
        self._owns_client = owns_client
        self._lease: Any = None  # the checkpoint_dir's lease, released when the run ends
        self.steps_per_epoch: int | None = None
        self._rows = [dict(r) for r in history]
        self._restarts: list[dict[str, Any]] = []
        self._epoch = len(history)
        self._live: dict[str, Any] = {}
        self._checkpoint: dict[str, Any] | None = None
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._view = RunView(options.view)
        #: what the trainers reported when they started: ``weights``, the start weights' report (fit's weights=);
        #: ``augment_on``, where rank 0 augments and normalizes its batches (``cpu`` or ``device``)
        self.info: dict[str, Any] = {}
        #: the run's MLflow run (:class:`dask_dl.tracking.Tracker`), None when it is not tracked
        self.tracker: Any = None
        self._history_writer = HistoryWriter(
            options.checkpoint_dir, tensorboard=options.tensorboard, run_id=self.run_id
        )
        self.spec = _trainer_spec(options, resume_from, **(visit or {}))
        self._driver = Driver(
            client,
            self.spec,
            workers=self.workers,
            epochs=options.epochs,
            first_epoch=len(history),
            history=history,
            checkpoint_dir=options.checkpoint_dir,
            global_batch=options.global_batch,
            sink=self,
            policy=RestartPolicy(
                options.max_restarts,
                options.min_trainers,
                options.restart_wait_s,
                among,
                hang_grace_s=options.hang_grace_s,
            ),
        )

    # ---- public ---------------------------------------------------------------------------------------

    @property
    def history(self) -> pd.DataFrame:
        """One row per epoch finished so far (also the epochs of the run this one resumed)."""
        with self._lock:
            return pd.DataFrame(list(self._rows))

    @property
    def restarts(self) -> pd.DataFrame:
        """One row per restart after a lost trainer: ``time``, ``lost_workers``, ``error``, where the trainers were
        (``failed_epoch``, ``failed_step``) and went on from (``resumed_epoch``, ``resumed_step``), ``steps_lost``,
        the new ``world_size`` and ``workers``, and the ``seconds`` from the failure to training again."""
        with self._lock:
            return pd.DataFrame(list(self._restarts))

    @property
    def done(self) -> bool:
        """True once the run has finished, stopped or failed and released its workers."""
        return self._finished.is_set()

    @property
    def global_batch(self) -> int:
        """Images per optimizer step over all trainers (``batch_size`` is per trainer, or per pipeline)."""
        return self.options.global_batch

    def stop(self) -> TrainingRun:
        """Ask every trainer to stop; returns at once (``wait()`` to block until the workers are free).

        The trainers stop together at their next agreement, within ``dask-dl.train.check-every`` steps.

        The epoch in progress is not checkpointed: the latest checkpoint stays that of the last completed epoch.
        """
        self._driver.stop()
        return self

    def wait(self, timeout: float | None = None) -> TrainingRun:
        """Block until the run ends; stop it on KeyboardInterrupt (then re-raise it).

        Raises
        ------
        TrainingError
            When the run failed (non-finite loss, a trainer error or timeout).
        TimeoutError
            When ``timeout`` seconds passed and the run still goes on.
        """
        try:
            finished = wait_for(self._finished, timeout)
        except KeyboardInterrupt:
            self.stop()
            wait_for(self._finished)
            raise
        if not finished:
            raise TimeoutError(f"{self.run_id} still runs after {timeout} s (epoch {self._epoch + 1}/{self.epochs})")
        if self.error is not None:
            if isinstance(self.error, TrainingError | ConfigurationError):  # a model or weights that do not fit
                raise self.error
            raise TrainingError(f"{self.run_id} failed: {type(self.error).__name__}: {self.error}") from self.error
        return self

    def checkpoint(self) -> dict[str, Any]:
        """Return the latest checkpoint (the contract's dict) of this run.

        Checkpoints do not travel to the driver as epochs finish: with ``checkpoint_dir`` this reads the newest
        file there; without one it asks rank 0, which keeps the latest, while the run goes on, and returns the
        copy fetched once when the run ended.
        """
        if self.checkpoint_dir is not None:
            from dask_dl.checkpoint import latest_checkpoint, load_checkpoint

            if latest_checkpoint(self.checkpoint_dir) is not None:
                return load_checkpoint(self.checkpoint_dir)
        elif self._checkpoint is None and not self.done:
            checkpoint = self._driver.fetch_checkpoint()
            if checkpoint is not None:
                return checkpoint
        if self._checkpoint is not None:
            return self._checkpoint
        raise TrainingError(f"{self.run_id} has no checkpoint yet: no epoch has completed ({self.status})")

    def model(self) -> torch.nn.Module:
        """Return the model with the weights of the latest checkpoint, on the CPU, in eval mode.

        A user's module is copied (the module passed to ``fit`` is left as it was).
        """
        ck = self.checkpoint()
        source = self.spec.model_source
        net = source.build(num_outputs=len(ck["labels"]), in_channels=int(ck.get("in_channels", 1)))
        net.load_state_dict(ck["model"])
        return net.cpu().eval()

    def plot(self) -> Figure:
        """Loss, validation AUROC, learning rate and images/s per epoch, restarts marked
        (:func:`dask_dl.interpretation.runs.plot_run`): a matplotlib Figure."""
        from dask_dl.interpretation.runs import plot_run

        return plot_run(self)

    def snapshot(self) -> dict[str, Any]:
        """Where the run is, as the plain dict :mod:`dask_dl.train.view` and the dashboard draw."""
        with self._lock:
            rows = list(self._rows)
        live = dict(self._live)
        snap: dict[str, Any] = {
            "run_id": self.run_id,
            "status": self.status,
            "model": self.spec.model_name,
            "compression": self.spec.compression,
            "trainers": len(self.workers),
            "global_batch": self.global_batch,
            "epoch": min(self._epoch, self.epochs - 1),
            "epochs": self.epochs,
            "step": live.get("step", 0) if live.get("epoch", self._epoch) == self._epoch else 0,
            "steps_per_epoch": self.steps_per_epoch or live.get("steps") or 0,
            "loss": live.get("loss", rows[-1]["train_loss"] if rows else None),
            "images_per_s": live.get("images_per_s", rows[-1]["images_per_s"] if rows else None),
            "bytes_sent": int(sum(r.get("bytes_sent", 0) for r in rows)),
            "history": rows,
        }
        if rows and rows[-1].get("seconds"):
            snap["data_wait_share"] = rows[-1]["data_wait_s"] / rows[-1]["seconds"]
        if self.error is not None:
            snap["error"] = f"{type(self.error).__name__}: {self.error}"
        return snap

    def __repr__(self) -> str:
        with self._lock:
            last = self._rows[-1] if self._rows else None
            completed = sum(1 for r in self._rows if r.get("event") != "stopped")
        parts = [self.run_id, self.spec.model_name, f"status={self.status}", f"epochs {completed}/{self.epochs}"]
        if last is not None:
            parts += [f"train_loss={last['train_loss']:.4g}", f"val_auroc_mean={last['val_auroc_mean']:.3f}"]
        return f"TrainingRun({', '.join(parts)})"

    def _repr_html_(self) -> str:
        from dask_dl.train.view import snapshot_html

        return snapshot_html(self.snapshot())

    # ---- reports of the driver (its thread) -------------------------------------------------------------

    def _start(self) -> None:
        self._driver.start()

    def started(self, infos: list[dict[str, Any]]) -> None:
        weights = infos[0].get("weights")
        if weights is not None:
            from dask_dl.models.weights import describe

            self.info["weights"] = weights
            logger.info("%s: %s", self.run_id, describe(weights, str(self.options.weights)))
        self.info["augment_on"] = infos[0].get("augment_on")
        if infos[0].get("compression"):  # compression="auto": the choice, its reason and the measured figures
            self.info["compression"] = infos[0]["compression"]
            logger.info(
                "%s: compression=%r: %s",
                self.run_id,
                self.info["compression"]["name"],
                self.info["compression"]["reason"],
            )
        self.steps_per_epoch = infos[0]["steps_per_epoch"]
        self._epoch = infos[0]["start_epoch"]
        self.status = "running"
        self._publish()

    def progress(self, live: dict[str, Any]) -> None:
        self._live = dict(live)
        self._epoch = live.get("epoch", self._epoch)
        self._view.update(self.snapshot())
        self._publish()

    def epoch_done(self, row: dict[str, Any]) -> None:
        if row.get("event") != "stopped":
            self._epoch = row["epoch"] + 1
        self._live = {}
        with self._lock:
            self._rows.append(row)
            rows = list(self._rows)
        self._history_writer.write(rows)
        if self.tracker is not None:
            from dask_dl.tracking.runs import log_row

            log_row(self.tracker, row)
        self._publish()
        self._view.update(self.snapshot())

    def keep_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._checkpoint = checkpoint

    def restarted(self, row: dict[str, Any], *, history: list[dict[str, Any]], workers: list[str]) -> None:
        with self._lock:
            self._restarts.append(dict(row))
            self._rows = [dict(r) for r in history]  # the epochs the checkpoint holds: later ones are trained again
        self.workers = list(workers)
        self._epoch = row["resumed_epoch"]
        self._live = {}
        self._publish()

    def ended(self, status: str, error: BaseException | None) -> None:
        from dask_dl.cluster import close_client

        self.status, self.error = status, error
        self._epoch = min(self._epoch, self.epochs - 1)
        try:
            self._publish()
            self._view.update(self.snapshot())
            self._view.close()
            self._history_writer.close()
            if self.tracker is not None:  # waits at most dask-dl.tracking.timeout for the server
                from dask_dl.tracking.runs import end_run

                end_run(self.tracker, self.history, status)
            if self._lease is not None:
                self._lease.release()
            if self._owns_client:  # fit started this cluster for the run: nothing is left running
                close_client(self.client)
        except Exception as exc:  # the run's outcome stands; what failed after it is reported, not raised
            logger.warning(
                "%s: closing the run's view, history or cluster failed: %s: %s", self.run_id, type(exc).__name__, exc
            )
        finally:
            self._finished.set()

    def _publish(self) -> None:
        from dask_dl.dashboard import publish

        snap = self.snapshot()
        snap.pop("run_id")
        try:
            publish(self.client, self.run_id, snap)
        except Exception as exc:  # the dashboard page is a view; training goes on without it
            logger.warning("%s: dashboard page not updated: %s: %s", self.run_id, type(exc).__name__, exc)


def _current_client_exists() -> bool:
    from distributed import default_client

    try:
        default_client()
    except ValueError:
        return False
    return True


def _trainer_spec(
    options: RunOptions,
    resume_from: str | None,
    *,
    start_state: dict[str, Any] | None = None,
    proximal_mu: float = 0.0,
    weights_only: bool = False,
) -> Any:
    """The trainers' spec: every field of the run's options, and what only the trainers need."""
    from dataclasses import fields

    from dask_dl.models import MODELS
    from dask_dl.train.spec import TrainerSpec

    return TrainerSpec(
        **{f.name: getattr(options, f.name) for f in fields(options)},
        model_target=MODELS.entry(options.model).target if options.model_source.kind == "registry" else None,
        resume_from=resume_from,
        start_state=None if start_state is None else dict(start_state),
        proximal_mu=proximal_mu,
        weights_only=bool(weights_only),
    )


def _install_dashboard(client: Client) -> None:
    """Serve the /dask-dl/ page on the scheduler's dashboard; training goes on without it if that fails."""
    from dask_dl.dashboard import install

    try:
        install(client)
    except Exception as exc:  # e.g. a scheduler that refuses plugins: the page is a convenience
        logger.warning("dask_dl dashboard page not installed on the scheduler: %s", exc)


def _resume_point(options: RunOptions) -> tuple[str | None, list[dict[str, Any]]]:
    path, ck = newest_good_checkpoint(options.checkpoint_dir)
    if path is None:
        return None, []
    model, labels = options.model, options.labels
    if ck["model_name"] != model or list(ck["labels"]) != list(labels):
        raise TrainingError(
            f"the checkpoint {path!r} is of model {ck['model_name']!r} with labels {list(ck['labels'])}, not "
            f"{model!r} with {list(labels)}; resume with model={ck['model_name']!r} on the same store, or use a "
            "new checkpoint_dir"
        )
    check_resume(ck, path, parallel=options.parallel, stages=options.stages)
    if len(ck["compressor"]) != options.trainers:
        raise TrainingError(
            f"the checkpoint {path!r} was written by {len(ck['compressor'])} trainers; resume with "
            f"trainers={len(ck['compressor'])} (error-feedback residuals are per trainer)"
        )
    return path, [dict(r) for r in ck["history"]]


def newest_good_checkpoint(directory: str) -> tuple[str | None, dict[str, Any] | None]:
    """Return the newest checkpoint of ``directory`` that loads and verifies, with its path; (None, None) if none.

    Damaged, truncated, special or hostile files are skipped with a warning naming each of them.

    Raises
    ------
    CheckpointError
        When there are checkpoint files but none of them is good (the message lists each file's problem).
    """
    from dask_dl.checkpoint import load_checkpoint
    from dask_dl.train.checkpoint import resume_candidates

    problems: list[str] = []
    for path in resume_candidates(directory):  # epoch and step checkpoints, newest first
        try:
            checkpoint = load_checkpoint(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            warnings.warn(
                f"resuming from {path!r}: skipped {len(problems)} newer checkpoint(s) that cannot be used: "
                + " | ".join(problems),
                UserWarning,
                stacklevel=4,
            )
        return path, checkpoint
    if problems:
        raise CheckpointError(
            f"no usable checkpoint in {directory!r} to resume from: " + " | ".join(problems) + "; fix or delete "
            "these files, or train afresh with resume=False and another checkpoint_dir"
        )
    return None, None
