"""``fit_sites()`` and :class:`SitesRun`: train one model across sites that keep their data.

``fit_sites`` checks its arguments, connects to the sites (:mod:`dask_dl.sites.site`), builds the starting weights
once on the coordinator, and runs the protocol (:mod:`dask_dl.sites.protocols`) on a background thread. Each
visit is a :func:`dask_dl.fit` on the site's own workers; only weights and metrics come back
(:mod:`dask_dl.sites.transfers` counts them). On a shared cluster whose sites are worker resources, the site
guard (:func:`dask_dl.sites.guard.guard_sites`) is active for the whole run and its audit is kept.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dask_dl import config
from dask_dl.checks import one_of, positive_int
from dask_dl.errors import ConfigurationError, DatasetError, TrainingError
from dask_dl.interrupt import wait_for
from dask_dl.sites.protocols import ON_LOST, ORDERS, PROTOCOLS, Plan

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import xarray as xr
    from distributed import Client

    from dask_dl.sites.site import Connected
    from dask_dl.sites.visits import Coordinator, Visit

__all__ = ["SitesRun", "fit_sites"]

logger = logging.getLogger("dask_dl.sites")


def fit_sites(
    sites: Mapping[str, Any],
    *,
    protocol: str,
    rounds: int,
    model: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    local_epochs: int = 1,
    steps: int | None = None,
    order: str = "fixed",
    proportional_steps: bool = False,
    cyclic_lr: float | None = None,
    site_weighted_loss: bool = False,
    mu: float = 0.0,
    min_sites: int = 1,
    on_lost: str = "continue",
    patience: int = 1,
    test: xr.Dataset | None = None,
    batch_size: int | None = None,
    trainers: int = 1,
    lr: float | None = None,
    optimizer: str | None = None,
    seed: int | None = None,
    augment: bool = False,
    normalization: dict[str, Any] | None = None,
    client: Client | None = None,
    wait: bool = True,
    tracking: Any = None,
) -> SitesRun:
    """Train one model across sites whose images never leave them; only weights and metrics travel.

    Parameters
    ----------
    sites : mapping of str to site
        Site name to where its data is: ``open_dataset(store)`` (a simulation on one cluster),
        ``{"dataset": ds, "resource": "site-A"}`` (a shared cluster whose workers advertise the site's resource;
        the site guard is active while the run lasts), or ``{"scheduler": "tls://...", "security": ...,
        "store": PATH}`` / ``{"cluster": cluster_or_client, "store": PATH}`` (one cluster per site; ``PATH`` as
        the site's workers see it). See :class:`dask_dl.sites.site.Site`.
    protocol : {"ensemble", "incremental", "cyclic", "fedavg", "fedprox"}
        How the weights travel (:mod:`dask_dl.sites.protocols`).
    rounds : int
        Rounds (cycles round the sites; for ``incremental``: the most epochs at one site).
    model, model_kwargs, batch_size, lr, optimizer, seed, augment
        As for :func:`dask_dl.fit`; defaults from ``dask-dl.train``.
    normalization : dict, optional
        ``{"mean": m, "std": s}`` of the 0..1 pixel values, numbers or one per channel, as for :func:`dask_dl.fit`:
        every site trains and scores with it, and it goes into :meth:`SitesRun.checkpoint` and the exported ONNX
        graph. Statistics of the pooled images would need the images in one place: pass values agreed between the
        sites, or per-site statistics averaged (:func:`dask_dl.normalize.channel_stats` at each site). Default
        :data:`dask_dl.normalize.DEFAULT_NORMALIZATION`.
    local_epochs : int
        Epochs per visit (``cyclic``, ``fedavg``, ``fedprox``, ``ensemble``).
    steps : int, optional
        ``cyclic``: steps (global batches) per visit instead of epochs, taken in turn from a seeded cycle
        through the site's training samples.
    order : {"fixed", "shuffled"}
        ``cyclic``: visit the sites in the given order every cycle, or reshuffle it each cycle (seeded).
    proportional_steps : bool
        ``cyclic`` with ``steps``: a site gets ``steps * n_site / mean(n)`` steps (Balachandar et al.).
    cyclic_lr : float, optional
        ``cyclic``: cyclical learning rate, cosine from ``lr`` down to ``cyclic_lr * lr`` over each cycle.
    site_weighted_loss : bool
        ``cyclic``: scale a site's loss by ``n_site / mean(n)``; applied as the same scale of the learning rate,
        which SGD makes the same step of (AdamW ignores a loss scale, so it is refused with ``optimizer="adamw"``).
    mu : float
        ``fedprox``: weight of the proximal term ``mu/2 ||w - w_global||^2`` (required, > 0).
    min_sites : int
        ``fedavg``/``fedprox``: the fewest sites whose weights make a round; fewer fails the run.
    on_lost : {"continue", "stop"}
        A site that goes away mid-round is reported in the history (``event="lost"``) and skipped from then
        on; ``stop`` ends the run after that round (status ``stopped-sites-lost``).
    patience : int
        ``incremental``: epochs without a better validation AUROC before the weights move to the next site.
    test : xarray.Dataset, optional
        A pooled test split the coordinator can read (its ``test`` rows, or every row when it has none), scored
        after every round: on ``client`` when given, else in this process.
    trainers : int
        Data-parallel trainers per site (one per worker of the site).
    client : distributed.Client, optional
        The shared cluster of sites given as datasets (default: the current client).
    wait : bool
        Block until the run ends, or return the running :class:`SitesRun` at once.
    tracking : str, path or Tracker, optional
        Record the run in MLflow, as for :func:`dask_dl.fit`: a parent run (the plan, the options, the sites'
        stores and sizes, and per round each site's scores as ``<site>.<column>`` metrics, then ``history.csv``)
        with one nested run per site and round (that visit's fit, named ``"<site> round <n>"``). Logged by the
        coordinator: only what already reaches it. Default ``dask-dl.tracking.uri``, else ``MLFLOW_TRACKING_URI``.

    Returns
    -------
    SitesRun

    Raises
    ------
    ConfigurationError
        An unknown protocol, order or ``on_lost``; an option of another protocol; a number out of range; sites
        whose labels, task or image size differ.
    DatasetError
        A site without ``train`` or ``val`` samples; a test dataset with other labels.
    TrainingError
        (from ``wait``) every site lost, or fewer than ``min_sites`` answered a ``fedavg`` round.

    Examples
    --------
    On the stores of two sites (not run as a doctest: it needs the stores and a cluster):

    >>> run = fit_sites({"A": open_dataset("a.zarr"), "B": open_dataset("b.zarr")},
    ...                 protocol="fedavg", rounds=5, model="small_cnn")  # doctest: +SKIP
    >>> run.curves  # doctest: +SKIP
    """
    from dask_dl.sites.site import connect_sites
    from dask_dl.sites.transfers import Transfers
    from dask_dl.sites.visits import Coordinator
    from dask_dl.tracking import Tracker, open_tracker, tracking_uri

    uri = tracking if isinstance(tracking, Tracker) else tracking_uri(tracking)  # a bad URI fails before any work
    plan = _check_plan(
        protocol=protocol,
        rounds=rounds,
        local_epochs=local_epochs,
        steps=steps,
        order=order,
        proportional_steps=proportional_steps,
        cyclic_lr=cyclic_lr,
        site_weighted_loss=site_weighted_loss,
        mu=mu,
        min_sites=min_sites,
        on_lost=on_lost,
        patience=patience,
        lr=lr,
        optimizer=optimizer,
        seed=seed,
        n_sites=len(sites) if isinstance(sites, Mapping) else 0,
    )
    fit_options = {
        "model": config.get("train.model", model),
        "model_kwargs": dict(model_kwargs or {}),
        "batch_size": positive_int("batch_size", config.get("train.batch-size", batch_size), example=32),
        "optimizer": config.get("train.optimizer", optimizer),
        "augment": bool(augment),
        "normalization": normalization,
        "compression": "none",
        "warmup_steps": 0,
    }
    trainers = positive_int("trainers", trainers, example=1)
    transfers = Transfers()
    connected = connect_sites(sites, client=client, transfers=transfers)
    try:
        _check_batches(connected, fit_options["batch_size"], trainers)
        spec = _model_spec(connected[0], fit_options)
        fit_options["model"] = spec.name  # a factory by its import path: each site imports it
        fit_options["normalization"] = spec.normalization  # checked: what every visit trains with
        test_part = _test_part(test, spec) if test is not None else None
        coordinator = Coordinator(
            connected,
            model=spec,
            fit_options=fit_options,
            trainers=trainers,
            transfers=transfers,
            test=test_part,
            test_client=client,
        )
        coordinator.initial = _initial_state(spec, plan.seed)
        run = SitesRun(plan, coordinator)
        run._guard = _guard(connected)
    except BaseException:
        for site in connected:
            site.close()
        if isinstance(tracking, Tracker):
            tracking.finish("failed")
        raise
    run.tracker = coordinator.tracker = open_tracker(uri or False, run_name=run.run_id)
    if run.tracker is not None:
        from dask_dl.tracking.runs import start_sites

        start_sites(run.tracker, run)
    run._start()
    if wait:
        run.wait()
    return run


class SitesRun:
    """A cross-site training run in progress or finished; made by :func:`fit_sites`.

    Attributes
    ----------
    run_id : str
    protocol : str
    sites : list of str
    status : str
        ``running``, ``finished``, ``stopped``, ``stopped-sites-lost`` or ``failed``.
    error : BaseException or None
    audit : object or None
        On a shared cluster with site resources: the site guard's audit of the run (``audit.violations``).
    tracker : dask_dl.tracking.Tracker or None
        The run's MLflow parent run (``fit_sites(tracking=...)``); None when it is not tracked.
    """

    def __init__(self, plan: Plan, coordinator: Coordinator) -> None:
        self.run_id = f"sites-{uuid.uuid4().hex[:8]}"
        self.plan, self.protocol = plan, plan.protocol
        self._co = coordinator
        self.sites = [s.name for s in coordinator.sites]
        self.status, self.error = "running", None
        self.audit: Any = None
        #: the run's MLflow run (:class:`dask_dl.tracking.Tracker`), None when it is not tracked
        self.tracker: Any = None
        self._guard: Any = None
        self._rows: list[dict[str, Any]] = []
        self._states: list[dict[str, Any]] = []
        self._rounds_done = 0
        self._model_round = -1  # the round whose weights are the run's
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._drive, name=f"dask-dl-{self.run_id}", daemon=True)

    # ---- public ---------------------------------------------------------------------------------------

    @property
    def history(self) -> pd.DataFrame:
        """One row per round and site (``split="val"``) and per round for the test split (``site="test"``).

        Columns: ``round``, ``site``, ``split``; ``train_loss``, ``steps``, ``samples``, ``lr`` and ``workers``
        (addresses, space-separated) of the site's visit in that round (NaN/empty when it did not train then);
        ``loss``, ``auroc_mean``, ``auroc_<label>`` and ``n`` of the round's model on that split; ``event``
        (``lost``, or ``""``) with ``error``.
        """
        with self._lock:
            return pd.DataFrame(list(self._rows))

    @property
    def curves(self) -> pd.DataFrame:
        """Mean AUROC of the round's model per round (rows) and site (columns), their ``mean``, and ``test``."""
        h = self.history
        if h.empty:
            return pd.DataFrame()
        table = h.pivot_table(index="round", columns="site", values="auroc_mean", aggfunc="first")
        val = [c for c in table.columns if c != "test"]
        table["mean"] = table[val].mean(axis=1)
        return table[[*val, "mean", *(["test"] if "test" in table.columns else [])]]

    @property
    def transfers(self) -> pd.DataFrame:
        """What the coordinator received from each site: ``site``, ``kind``, ``objects``, ``bytes``."""
        return self._co.transfers.summary()

    @property
    def done(self) -> bool:
        """True once the run has ended and its connections and guard are closed."""
        return self._finished.is_set()

    def stop(self) -> SitesRun:
        """Stop the visits in progress and start no more; returns at once (``wait()`` to block)."""
        self._co.stop()
        return self

    def wait(self, timeout: float | None = None) -> SitesRun:
        """Block until the run ends; stop it on KeyboardInterrupt.

        Raises
        ------
        TrainingError
            The run failed (every site lost, too few sites in a round, a bug of a site's training).
        TimeoutError
            ``timeout`` seconds passed and the run goes on.
        """
        try:
            if not wait_for(self._finished, timeout):
                raise TimeoutError(f"{self.run_id} still runs after {timeout} s")
        except KeyboardInterrupt:
            self.stop()
            wait_for(self._finished)
            raise
        if self.error is not None:
            if isinstance(self.error, TrainingError):
                raise self.error
            raise TrainingError(f"{self.run_id} failed: {type(self.error).__name__}: {self.error}") from self.error
        return self

    @property
    def model_round(self) -> int | None:
        """The round the weights of :meth:`states` come from; None before a round has completed."""
        with self._lock:
            return self._model_round if self._states else None

    def state(self) -> dict[str, torch.Tensor]:
        """The weights of the last completed round (for ``ensemble``: see :meth:`states`).

        A finished ``incremental`` run gives the last site's best round instead, as the protocol passes on.
        """
        states = self.states()
        if self.protocol == "ensemble":
            raise TrainingError(
                "an ensemble run has one model per site: use run.states(), or run.model() for their mean"
            )
        return states[0]

    def states(self) -> list[dict[str, torch.Tensor]]:
        """The weights of the last completed round: one state, or one per site for ``ensemble``.

        A finished ``incremental`` run gives the last site's best round instead, as the protocol passes on.
        """
        with self._lock:
            states = list(self._states)
        if not states:
            raise TrainingError(f"{self.run_id} has no weights yet: no round has completed ({self.status})")
        return states

    def model(self) -> torch.nn.Module:
        """The model of :meth:`states` on the CPU in eval mode (``ensemble``: the mean of the sites')."""
        from dask_dl.sites.score import Ensemble, build

        spec = self._co.model
        states = self.states()
        if self.protocol == "ensemble":
            return Ensemble([build(spec, s) for s in states], spec.task).eval()
        return build(spec, states[0])

    def checkpoint(self) -> dict[str, Any]:
        """The weights of :meth:`state` as a checkpoint dict of :mod:`dask_dl.checkpoint` (what ``export_onnx`` takes).

        Its ``epoch`` is the round they come from.

        Raises
        ------
        TrainingError
            For ``ensemble`` (several models: ``export_onnx(run.model(), ..., labels=, input_size=)`` or
            :meth:`export_onnx`), or before a round has completed.
        """
        from dask_dl.checkpoint import FORMAT
        from dask_dl.models.source import model_source

        spec = self._co.model
        return {
            "format": FORMAT,
            "model_name": spec.name,
            "model_kwargs": dict(spec.kwargs),
            "model_source": model_source(spec.name, spec.kwargs).to_dict(),
            "model": self.state(),
            "labels": list(spec.labels),
            "task": spec.task,
            "input_size": int(spec.input_size),
            "in_channels": spec.channels,
            "normalization": dict(spec.normalization),
            "epoch": self._model_round,
            "optimizer": {},
            "compressor": [],
            "rng": [],
            "history": self.history.to_dict("records"),
        }

    def export_onnx(self, path: Any, **options: Any) -> Any:
        """Write the run's model as ONNX (:func:`dask_dl.export_onnx`); an ensemble as one graph of its members."""
        from dask_dl.export import export_onnx

        if self.protocol != "ensemble":
            return export_onnx(self, path, **options)  # itself: a tracked run's export goes to its MLflow run
        spec = self._co.model
        defaults = {
            "labels": list(spec.labels),
            "input_size": int(spec.input_size),
            "task": spec.task,
            "normalization": dict(spec.normalization),
        }
        return export_onnx(self.model(), path, **{**defaults, **options})

    def __repr__(self) -> str:
        return (
            f"SitesRun({self.run_id}, {self.protocol}, sites={self.sites}, status={self.status}, "
            f"rounds {self._rounds_done}/{self.plan.rounds})"
        )

    # ---- the protocol's thread ----------------------------------------------------------------------------

    def _start(self) -> None:
        self._thread.start()

    def _drive(self) -> None:
        from dask_dl.sites.protocols import run_protocol

        try:
            # the weights are those each round reported (or the round the protocol keeps): a run stopped in its
            # first round has none, not the untrained start the protocol began from
            self.status = run_protocol(self.plan, self._co, self._report, self._keep)
        except BaseException as exc:  # handed to wait(); the thread must not die silently
            self.status, self.error = "failed", exc
        finally:
            self._close()

    def _close(self) -> None:
        try:
            if self._guard is not None:
                self.audit = self._guard.close()  # the final audit, then the guard's plugins go
            for site in self._co.sites:
                site.close()
            if self.tracker is not None:  # waits at most dask-dl.tracking.timeout for the server
                from dask_dl.tracking.runs import end_run

                end_run(self.tracker, self.history, self.status)
        except Exception as exc:  # the run's outcome stands; what failed after it is reported, not raised
            logger.warning(
                "%s: closing the guard or a site's connection failed: %s: %s", self.run_id, type(exc).__name__, exc
            )
        finally:
            self._finished.set()

    def _report(self, round_: int, visits: list[Visit], scores: dict[str, dict[str, Any]], state: Any) -> None:
        by_site = {v.site.name: v for v in visits}
        rows = []
        for site in self._co.sites:
            rows.append(_row(round_, site.name, "val", by_site.get(site.name), scores.get(site.name), site))
        if "test" in scores:
            rows.append(_row(round_, "test", "test", None, scores["test"], None))
        if self.tracker is not None:
            from dask_dl.tracking.runs import log_sites_round

            log_sites_round(self.tracker, rows)
        with self._lock:
            self._rows.extend(rows)
            if state is not None:
                self._states = list(state) if isinstance(state, list) else [state]
                self._model_round = round_
            self._rounds_done = round_ + 1

    def _keep(self, round_: int, state: Any) -> None:
        with self._lock:
            self._states, self._model_round = [state], round_


def _row(round_: int, site: str, split: str, visit: Visit | None, scores: dict | None, connected: Any) -> dict:
    row: dict[str, Any] = {"round": round_, "site": site, "split": split}
    nan = math.nan
    row.update(train_loss=nan, steps=0, samples=0, lr=nan, workers="")
    if visit is not None:
        row.update(
            train_loss=visit.train_loss,
            steps=visit.steps,
            samples=visit.samples,
            lr=visit.lr,
            workers=" ".join(visit.workers),
        )
    row.update({"loss": nan, "auroc_mean": nan, "n": 0})
    if scores and "error" not in scores:
        row.update(scores)
    error = (visit.error if visit is not None and not visit.ok else None) or (scores or {}).get("error")
    if error is None and connected is not None and connected.lost is not None and visit is None:
        error = connected.lost
    row["event"] = "lost" if error and error != "stopped" else ("stopped" if error else "")
    row["error"] = error or ""
    return row


def _check_plan(
    *,
    protocol,
    rounds,
    local_epochs,
    steps,
    order,
    proportional_steps,
    cyclic_lr,
    site_weighted_loss,
    mu,
    min_sites,
    on_lost,
    patience,
    lr,
    optimizer,
    seed,
    n_sites,
) -> Plan:
    protocol = one_of("protocol", protocol, PROTOCOLS)
    rounds = positive_int("rounds", rounds, example=5)
    local_epochs = positive_int("local_epochs", local_epochs, example=1)
    if steps is not None:
        steps = positive_int("steps", steps, example=20)
    order = one_of("order", order, ORDERS)
    on_lost = one_of("on_lost", on_lost, ON_LOST)
    patience = positive_int("patience", patience, example=2)
    min_sites = positive_int("min_sites", min_sites, example=2)
    lr = _real("lr", config.get("train.lr", lr), low=0.0, example=0.01)
    mu = _real("mu", mu, low=0.0, example=0.01, strict=False)
    optimizer = config.get("train.optimizer", optimizer)
    seed = config.get("train.seed", seed)
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
        raise ConfigurationError(f"seed must be an integer >= 0, got {seed!r}; pass e.g. seed=0")
    only = {
        "steps": ("cyclic", steps is not None),
        "order": ("cyclic", order != "fixed"),
        "proportional_steps": ("cyclic", bool(proportional_steps)),
        "cyclic_lr": ("cyclic", cyclic_lr is not None),
        "site_weighted_loss": ("cyclic", bool(site_weighted_loss)),
        "mu": ("fedprox", mu > 0),
        "min_sites": ("fedavg", min_sites != 1),
        "patience": ("incremental", patience != 1),
    }
    for name, (owner, given) in only.items():
        owners = ("fedavg", "fedprox") if owner == "fedavg" else (owner,)
        if given and protocol not in owners:
            raise ConfigurationError(
                f"{name} is an option of protocol={'/'.join(owners)}, not of protocol={protocol!r}; drop it or "
                f"pass protocol={owners[0]!r}"
            )
    if protocol == "fedprox" and mu <= 0:
        raise ConfigurationError("protocol='fedprox' needs mu > 0 (the proximal term's weight), e.g. mu=0.01")
    if proportional_steps and steps is None:
        raise ConfigurationError("proportional_steps=True shares out steps per visit: pass steps=... too")
    if cyclic_lr is not None:
        cyclic_lr = _real("cyclic_lr", cyclic_lr, low=0.0, example=0.1)
        if cyclic_lr > 1:
            raise ConfigurationError(f"cyclic_lr={cyclic_lr} is the lowest lr as a share of lr: pass 0 < x <= 1")
    if site_weighted_loss and optimizer == "adamw":
        raise ConfigurationError(
            "site_weighted_loss scales each site's loss, which AdamW ignores (it divides by the gradient's scale); "
            "use optimizer='sgd' with it"
        )
    if n_sites and min_sites > n_sites:
        raise ConfigurationError(f"min_sites={min_sites} is more than the {n_sites} sites; pass min_sites<={n_sites}")
    return Plan(
        protocol=protocol,
        rounds=rounds,
        local_epochs=local_epochs,
        steps=steps,
        order=order,
        proportional_steps=bool(proportional_steps),
        cyclic_lr=cyclic_lr,
        site_weighted_loss=bool(site_weighted_loss),
        mu=mu,
        min_sites=min_sites,
        on_lost=on_lost,
        patience=patience,
        lr=lr,
        seed=int(seed),
    )


def _real(name: str, value: Any, *, low: float, example: float, strict: bool = True) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > low if strict else value >= low):
        return float(value)
    bound = f"> {low}" if strict else f">= {low}"
    raise ConfigurationError(f"{name} must be a number {bound}, got {value!r}; pass e.g. {name}={example}")


def _check_batches(sites: list[Connected], batch_size: int, trainers: int) -> None:
    for site in sites:
        if site.n_train // trainers < batch_size:
            raise DatasetError(
                f"site {site.name!r} has {site.n_train} training samples: fewer than batch_size={batch_size} per "
                f"trainer x {trainers} trainers; pass batch_size <= {max(site.n_train // trainers, 1)}"
            )


def _model_spec(site: Connected, fit_options: dict[str, Any]) -> Any:
    from dask_dl.models import MODELS
    from dask_dl.models.source import model_source
    from dask_dl.normalize import check_normalization
    from dask_dl.sites.score import ModelSpec
    from dask_dl.train.options import check_dataset

    meta = site.dataset.attrs["dask_dl"]
    model = fit_options["model"]
    source = model_source(model, fit_options["model_kwargs"])  # unknown names/options raise here
    if source.kind == "module" or source.kind == "factory" and source.path is None:
        raise ConfigurationError(
            "fit_sites builds its model by name on every site and in the coordinator; got "
            + (
                f"an instance of {source.name!r}, which no name builds again"
                if source.kind == "module"
                else f"the function {source.name!r}, which has no import path"
            )
            + ". Pass a registry "
            "name, 'torchvision:NAME', 'timm:NAME', or the import path 'module:function' of a function that "
            "builds it, in a module every site imports (dask_dl.register_model('my_net', build_my_net) also works)"
        )
    name = source.path if source.kind == "factory" else model
    channels = int(check_dataset(site.dataset)["channels"])
    return ModelSpec(
        name=name,
        labels=tuple(meta["labels"]),
        task=meta.get("task", "multilabel"),
        input_size=int(meta.get("size")),
        kwargs=dict(fit_options["model_kwargs"]),
        target=MODELS.entry(name).target if source.kind == "registry" else None,
        batch_size=int(fit_options["batch_size"]),
        channels=channels,
        normalization=check_normalization(fit_options["normalization"], channels=channels),
    )


def _test_part(test: Any, spec: Any) -> tuple[str, np.ndarray]:
    meta = getattr(test, "attrs", {}).get("dask_dl") if hasattr(test, "data_vars") else None
    if not isinstance(meta, dict) or "source" not in test.encoding:
        raise DatasetError(f"test must be an open_dataset(store) result, got {type(test).__name__}")
    if tuple(meta.get("labels") or ()) != spec.labels:
        raise DatasetError(
            f"the test store has labels {list(meta.get('labels') or ())}, the sites {list(spec.labels)}; ingest the "
            "test split with the sites' labels"
        )
    split = np.asarray(test["split"].values).astype(str)
    samples = np.asarray(test["sample"].values, dtype=np.int64)
    return str(test.encoding["source"]), samples[split == "test"] if (split == "test").any() else samples


def _initial_state(spec: Any, seed: int) -> dict[str, Any]:
    """The weights every protocol starts from: the model built once here with ``seed``, as ``fit`` would."""
    import torch

    from dask_dl.sites.score import build

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build(spec).state_dict().items()}


def _guard(sites: list[Connected]) -> Any:
    """The site guard of a shared cluster whose sites are worker resources; None for other topologies."""
    guarded = {s.name: s.resource for s in sites if s.resource is not None and not s.owns_client}
    if not guarded:
        return None
    from dask_dl.sites.guard import guard_sites

    return guard_sites(sites[0].client, guarded)
