"""The driver: the background thread that places the trainers, starts them and frees them.

A :class:`Driver` owns the actors' life cycle: it creates one :class:`~dask_dl.train.actor.TrainingActor` per
worker, forms the process group, and makes one call per rank that runs every epoch
(:meth:`~dask_dl.train.actor.TrainingActor.run_epochs`): the trainers go from epoch to epoch without waiting for
the driver, which only observes. Rank 0 publishes each epoch's history row as a Dask event on the run's topic;
the driver subscribes to it, asks rank 0 for live progress and the scheduler for the trainers' workers once a
second, sees a failed rank at its next look (every 0.25 s), and always releases the actors at the end, also after
errors. Checkpoints stay with the trainers: rank 0 writes them to ``checkpoint_dir``, or every rank keeps the
latest, which the driver fetches when asked and once at the end. What it learns it hands to the run it drives
(a :class:`RunSink`: :class:`~dask_dl.train.run.TrainingRun`), which keeps the state the user sees.

A failed group ends at once on every trainer: the driver makes the survivors' pending collectives fail
(:meth:`~dask_dl.train.actor.TrainingActor.abort_group`) instead of waiting for their timeout. When a rank fails
and the scheduler lost no worker, the driver asks every other rank where it is: one that does not answer within
``dask-dl.train.hang-grace`` seconds hangs (stopped, swapping, deadlocked); the failure is blamed on its worker,
and the driver does not wait for its teardown.

Recovery (``max_restarts > 0``): when a trainer's worker is lost or hangs, or a collective fails, the driver takes
the newest checkpoint (the newest good file of ``checkpoint_dir``, epoch or step; without a directory, the
in-memory copy of the first trainer that survived, which every rank keeps), releases every actor (the survivors
have left their group already), waits for workers (:func:`~dask_dl.train.recovery.wait_for_trainers`), forms a new
group of fresh actors that load that checkpoint, and goes on; each restart is a row of the run's ``restarts``. A
hung worker is restarted through its nanny (removed from the scheduler without one) and left out of every later
group while the scheduler still has it as it was. When every trainer is lost and there is no directory, the
checkpoints were lost with them: the run fails and says so, unless no epoch had completed yet (then it starts
again from the beginning).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from distributed.protocol import pickle

from dask_dl.errors import CheckpointError, ConfigurationError, TrainingError
from dask_dl.train.aggregate import worker_hour_price
from dask_dl.train.placement import busy_workers
from dask_dl.train.recovery import RestartPolicy, recoverable, restart_row, wait_for_trainers

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

    from dask_dl.train.spec import TrainerSpec

__all__ = ["Driver", "RunSink"]

logger = logging.getLogger("dask_dl.train")

_POLL_S = 0.25  # how often the driver looks at running epochs (errors, live progress, stop requests)
_PROGRESS_S = 1.0  # how often it asks rank 0 where the epoch is
_CLAIM_S = 2.0  # how long start() waits for the scheduler to place the first actors (a second run then avoids them)
_LOSS_WAIT_S = 3.0  # after a rank fails, how long to wait for the scheduler to notice a lost trainer worker
_ADVICE = (
    "Every trainer was stopped; the checkpoint of the last completed epoch is kept, and fit(..., checkpoint_dir=..., "
    "resume=True) continues from it"
)


class RunSink(Protocol):
    """What the driver reports to (implemented by :class:`~dask_dl.train.run.TrainingRun`)."""

    run_id: str

    def started(self, infos: list[dict[str, Any]]) -> None: ...

    def progress(self, live: dict[str, Any]) -> None: ...

    def epoch_done(self, row: dict[str, Any]) -> None: ...

    def keep_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...

    def restarted(self, row: dict[str, Any], *, history: list[dict[str, Any]], workers: list[str]) -> None: ...

    def ended(self, status: str, error: BaseException | None) -> None: ...


class Driver:
    """Drive ``spec`` on ``workers`` (one rank each, in order) from a daemon thread, reporting to ``sink``."""

    def __init__(
        self,
        client: Client,
        spec: TrainerSpec,
        *,
        workers: list[str],
        epochs: int,
        first_epoch: int,
        history: list[dict[str, Any]],
        checkpoint_dir: str | None,
        global_batch: int,
        sink: RunSink,
        policy: RestartPolicy | None = None,
    ) -> None:
        self.client, self.spec, self.workers = client, spec, list(workers)
        self.policy = policy or RestartPolicy()
        self.restarts = 0
        self._restart: dict[str, Any] | None = None  # the restart under way, recorded once training goes on
        self._last_progress: dict[str, Any] = {}
        self.epochs, self.epoch, self.checkpoint_dir = epochs, first_epoch, checkpoint_dir
        self.global_batch, self.sink = global_batch, sink
        self.gpu = False
        self.stop_requested = threading.Event()
        self.history = [dict(r) for r in history]  # the rows of the run resumed from, given to rank 0
        self.topic = f"dask-dl-{sink.run_id}"
        self._rows: queue.SimpleQueue = queue.SimpleQueue()  # rows published by rank 0, from the client's loop
        self._delivered = 0  # rows delivered from the current group's run_epochs call
        self._completed = 0  # epochs completed and delivered in this run (all groups)
        self._group_start = first_epoch  # rows of earlier epochs are late events of a failed group: dropped
        self._actor_futures: list[Any] = []
        self._actors: list[Any] = []
        self._worker_ids: dict[str, str | None] = {}  # trainer address -> the scheduler's id of its worker
        self._group_ports: list[int] = []  # every rank's group listeners: what abort_group shuts
        self._hung: dict[str, str | None] = {}  # workers found hung -> their id then: left out while it is the same
        self._thread = threading.Thread(target=self._drive, name=f"dask-dl-{sink.run_id}", daemon=True)

    def start(self) -> None:
        """Place the first group's actors now, in the caller's thread, then drive them from the daemon thread.

        A run started right after this one then sees these workers busy (:func:`~dask_dl.train.placement.
        busy_workers`) and trains on others.
        """
        self._submit_actors()
        deadline = time.monotonic() + _CLAIM_S
        try:
            while time.monotonic() < deadline and not set(self.workers) <= busy_workers(self.client):
                time.sleep(0.02)
        except Exception as exc:  # only a second run's placement depends on it; this run goes on
            logger.warning("%s: could not see the trainers placed: %s: %s", self.sink.run_id, type(exc).__name__, exc)
        finally:
            self._thread.start()

    def stop(self) -> None:
        """Ask every trainer to stop within ``check_every`` steps (all ranks at the same step); returns at once."""
        self.stop_requested.set()
        for rank, actor in enumerate(list(self._actors)):
            try:
                actor.request_stop()  # async actor method: answered while the epoch runs
            except Exception as exc:  # the actor may be gone already (failed worker): nothing left to stop
                self._log_failure("could not ask to stop", rank, exc)

    # ---- the thread ----------------------------------------------------------------------------------------

    def _drive(self) -> None:
        status, error = "failed", None
        try:
            # actor handles bind to the current client of the thread that first calls them: make it this run's
            # client, not the default one (fit(client=...) on a client that is not the default, e.g. one per site)
            with self.client.as_current():
                try:
                    self.client.subscribe_topic(self.topic, lambda event: self._rows.put(event[1]))
                    status = self._drive_with_restarts()
                except BaseException as exc:  # handed to wait(); the thread must not die silently
                    status, error = "failed", exc
                finally:
                    lost = list(getattr(error, "lost_workers", None) or [])
                    try:
                        self._keep_last_checkpoint(lost)
                        self._release(lost=lost, failed=status == "failed")
                    finally:
                        try:
                            self.client.unsubscribe_topic(self.topic)
                        except Exception as exc:  # a client closed under the run: no subscription left to end
                            logger.debug("%s: unsubscribe failed: %s", self.sink.run_id, exc)
        except BaseException as exc:  # the client itself is gone (closed under the run): wait() must still end
            if error is None:
                status, error = "failed", exc
        finally:
            self.sink.ended(status, error)

    def _drive_with_restarts(self) -> str:
        checkpoint: Any = None  # what the next group resumes from (a path or dict); None: the spec's resume_from
        while True:
            try:
                self._form_group(checkpoint)
                return self._run()
            except Exception as exc:
                if self.stop_requested.is_set() or not recoverable(exc) or not self.policy.max_restarts:
                    raise
                if self.restarts >= self.policy.max_restarts:
                    raise TrainingError(
                        f"{self.sink.run_id} gave up after {self.restarts} restart(s) (max_restarts="
                        f"{self.policy.max_restarts}): {exc}",
                        lost_workers=getattr(exc, "lost_workers", None) or [],
                    ) from exc
                checkpoint = self._recover(exc, checkpoint)

    def _recover(self, error: BaseException, previous: Any) -> Any:
        """Release the failed group, find the checkpoint and the workers to go on with; return the checkpoint."""
        began, lost = time.monotonic(), list(getattr(error, "lost_workers", None) or [])
        logger.info(
            "%s: %s; recovering (restart %d of at most %d)",
            self.sink.run_id,
            error,
            self.restarts + 1,
            self.policy.max_restarts,
        )
        failed_at = self._where_failed(lost)
        checkpoint, resumed = self._restart_checkpoint(previous, lost)
        self._release(lost=lost, failed=True)
        self._restart_hung([a for a in lost if a in self._hung])
        stages = self.spec.stages if self.spec.parallel == "pipeline" else 1
        self.workers = wait_for_trainers(
            self.client,
            trainers=len(self.workers),
            policy=self.policy,
            run_id=self.sink.run_id,
            lost=lost + self._still_hung(),
            multiple=stages,
        )
        self.restarts += 1
        self.history = (
            [dict(r) for r in (checkpoint or {}).get("history", [])]
            if isinstance(checkpoint, dict)
            else self._checkpoint_history(checkpoint)
        )
        self.global_batch = self.spec.batch_size * (len(self.workers) // stages) * int(self.spec.accumulate)
        self._restart = {"error": error, "lost": lost, "failed_at": failed_at, "resumed": resumed, "began": began}
        self._group_start = resumed["epoch"]
        return checkpoint

    def _where_failed(self, lost: list[str]) -> dict[str, Any]:
        """Where the furthest surviving trainer was (epoch, step, global_step), else the last live progress."""
        best = dict(self._last_progress)
        for rank, actor in enumerate(list(self._actors)):
            if self.workers[rank] in lost:
                continue
            try:
                live = actor.progress().result(timeout=2)
            except Exception as exc:  # its worker is gone: the others say where training was
                logger.debug("%s: no progress from a failed trainer: %s", self.sink.run_id, exc)
                continue
            if live.get("global_step", -1) > best.get("global_step", -1):
                best = live
        return best

    def _restart_checkpoint(self, previous: Any, lost: list[str]) -> tuple[Any, dict[str, int]]:
        """The newest checkpoint to go on from, and where it stands (epoch, step, global_step)."""
        checkpoint: Any = None
        if self.checkpoint_dir is not None:
            checkpoint = self._newest_in_directory()
        else:
            for rank, actor in enumerate(list(self._actors)):
                if self.workers[rank] in lost:
                    continue
                try:
                    checkpoint = actor.latest_checkpoint(step=True).result(timeout=60)
                except Exception as exc:  # that trainer's worker is gone: ask the next one
                    self._log_failure("kept no checkpoint to restart from", rank, exc)
                    continue
                if checkpoint is not None:
                    break
            if checkpoint is None and isinstance(previous, dict):
                checkpoint = previous
            if checkpoint is None and self._completed:
                raise TrainingError(
                    f"{self.sink.run_id}: every trainer holding a checkpoint was lost, and there is no "
                    f"checkpoint_dir: the {self._completed} completed epoch(s) cannot be restored. Train with "
                    "fit(..., checkpoint_dir=...) to recover from the loss of any trainer"
                )
        if checkpoint is None and self.spec.resume_from is not None:
            checkpoint = self.spec.resume_from
        return checkpoint, _where(self._load(checkpoint))

    def _newest_in_directory(self) -> str | None:
        from dask_dl.checkpoint import load_checkpoint
        from dask_dl.train.checkpoint import resume_candidates

        for path in resume_candidates(self.checkpoint_dir):
            try:
                load_checkpoint(path)
            except (CheckpointError, TrainingError) as exc:
                logger.warning("%s: restart skips the checkpoint %s: %s", self.sink.run_id, path, exc)
                continue
            return path
        return None

    @staticmethod
    def _load(checkpoint: Any) -> dict[str, Any] | None:
        if checkpoint is None or isinstance(checkpoint, dict):
            return checkpoint
        from dask_dl.checkpoint import load_checkpoint

        return load_checkpoint(checkpoint)

    def _checkpoint_history(self, checkpoint: Any) -> list[dict[str, Any]]:
        loaded = self._load(checkpoint)
        return [dict(r) for r in loaded["history"]] if loaded is not None else []

    def _submit_actors(self) -> None:
        from dask_dl.train.actor import TrainingActor

        client = self.client
        suffix = f"-restart{self.restarts}" if self.restarts else ""
        self._actor_futures = [
            client.submit(
                TrainingActor,
                actor=True,
                workers=[address],
                allow_other_workers=False,
                pure=False,
                key=f"dask-dl-trainer-{self.sink.run_id}-{rank}{suffix}",
            )
            for rank, address in enumerate(self.workers)
        ]

    def _form_group(self, checkpoint: Any = None) -> None:
        n = len(self.workers)
        self._group_ports = []  # this group's, once every rank has set up
        if not self._actor_futures:  # a restart's group (the first one's actors were placed by start())
            self._submit_actors()
        self._actors = self._placed_actors()
        self._worker_ids = self._trainer_worker_ids()
        if self.stop_requested.is_set():  # stop() came before the actors existed
            self.stop()
        init_method = self._actors[0].free_address().result()
        # pickled here: a worker that cannot unpickle it (a module of the user's model it cannot import) raises in
        # setup, where an argument distributed fails to unpickle would leave the call unanswered for good
        spec = pickle.dumps(self.spec)
        # all ranks must call init_process_group at once: start every setup before awaiting any
        infos = self._gather(
            [
                a.setup(spec, init_method=init_method, rank=r, world_size=n, checkpoint=checkpoint)
                for r, a in enumerate(self._actors)
            ]
        )
        self.gpu = any(i["gpu"] for i in infos)
        self._group_ports = sorted({p for i in infos for p in i.get("group_ports", ())})
        self.epoch = infos[0]["start_epoch"]
        if self._restart is not None:
            done, self._restart = self._restart, None
            row = restart_row(
                self.restarts,
                error=done["error"],
                lost=done["lost"],
                failed_at=done["failed_at"],
                resumed=done["resumed"],
                workers=self.workers,
                seconds=time.monotonic() - done["began"],
            )
            logger.info(
                "%s: training again on %d trainer(s) from epoch %d step %d (%d step(s) lost)",
                self.sink.run_id,
                n,
                row["resumed_epoch"],
                row["resumed_step"],
                row["steps_lost"],
            )
            self.sink.restarted(row, history=self.history, workers=list(self.workers))
        self.sink.started(infos)

    def _run(self) -> str:
        """Start every rank's epoch loop and observe it to the end; return ``finished`` or ``stopped``."""
        if self.stop_requested.is_set():
            return "stopped"
        price = worker_hour_price(gpu=self.gpu)
        self._delivered = 0
        calls = [
            actor.run_epochs(
                first_epoch=self.epoch,
                epochs=self.epochs,
                history=self.history,
                directory=self.checkpoint_dir,
                topic=self.topic,
                global_batch=self.global_batch,
                price=price,
                resumed=bool(self.history),
                restarted=bool(self.restarts),
            )
            for actor in self._actors
        ]
        results = self._gather(calls, live=True)
        # rank 0's answer lists every row it published: deliver those whose event has not arrived yet
        self._deliver()
        for row in results[0]["rows"][self._delivered :]:
            self._deliver_row(row)
        return results[0]["status"]

    def _deliver(self) -> None:
        while True:
            try:
                row = self._rows.get_nowait()
            except queue.Empty:
                return
            self._deliver_row(row)

    def _deliver_row(self, row: dict[str, Any]) -> None:
        if int(row["epoch"]) < self._group_start:  # published by a group that failed; in the checkpoint's history
            logger.debug("%s: dropped a late row of epoch %s", self.sink.run_id, row["epoch"])
            return
        self._delivered += 1
        self._completed += row.get("event") != "stopped"
        self.epoch = min(int(row["epoch"]) + 1, self.epochs - 1)
        self.sink.epoch_done(row)

    def fetch_checkpoint(self) -> dict[str, Any] | None:
        """Rank 0's latest checkpoint while the trainers live (runs without ``checkpoint_dir``), else None."""
        actors = list(self._actors)
        if not actors or self.checkpoint_dir is not None:
            return None
        return actors[0].latest_checkpoint().result(timeout=60)

    def _keep_last_checkpoint(self, lost: list[str]) -> None:
        """Without ``checkpoint_dir``, fetch the last completed epoch's checkpoint once, before the actors go: from
        rank 0, or the first trainer not ``lost`` (every rank keeps it)."""
        if self.checkpoint_dir is not None or not self._actors:
            return
        for rank, actor in enumerate(list(self._actors)):
            if self.workers[rank] in lost:  # gone, or hung: asking would wait for nothing
                continue
            try:
                checkpoint = actor.latest_checkpoint().result(timeout=60)
            except Exception as exc:  # that trainer's worker died too: ask the next one
                self._log_failure("kept no checkpoint", rank, exc)
                continue
            if checkpoint is not None:
                self.sink.keep_checkpoint(checkpoint)
            return

    def _gather(self, futures: list[Any], *, live: bool = False) -> list[Any]:
        """Results of actor calls; raises the first error at once instead of waiting for the other ranks."""
        last_poll = 0.0
        while True:
            for rank, f in enumerate(futures):
                if f.done():
                    self._result(rank, f)  # raises the rank's error now; the others time out in their collectives
            if all(f.done() for f in futures):
                return [f.result() for f in futures]
            self._deliver()
            if live and time.monotonic() - last_poll > _PROGRESS_S:
                last_poll = time.monotonic()
                lost = self._lost_trainers(within=0)  # a worker gone before its trainer's call failed
                if lost:
                    raise self._lost_error(lost)
                try:
                    self._last_progress = self._actors[0].progress().result(timeout=5)
                    self.sink.progress(self._last_progress)
                except Exception as exc:  # live progress is a view: the epoch's own result carries the numbers
                    self._log_failure("reported no progress", 0, exc)
            _wait_for_one(futures, _POLL_S)

    def _result(self, rank: int, future: Any) -> Any:
        try:
            return future.result()
        except (TrainingError, ConfigurationError):  # a ConfigurationError: a model or weights that do not fit
            raise
        except Exception as exc:
            asked = time.monotonic(), self._ask_where(but=rank)  # answered while the scheduler is asked
            lost = self._lost_trainers()
            if lost and rank not in lost:  # a survivor saw its peer's socket close: blame the worker that died
                raise self._lost_error(lost, rank=rank, exc=exc) from exc
            hung = [] if lost else self._unanswered(*asked)
            if hung:  # a survivor's collective timed out on a peer that is there but does not answer
                ids = self._trainer_worker_ids()
                self._hung.update({self.workers[r]: ids.get(self.workers[r]) for r in hung})
                raise self._hung_error(hung, rank=rank, exc=exc) from exc
            failed = "was lost" if rank in lost else "failed"
            raise TrainingError(
                f"{self.sink.run_id}: trainer {rank} on {self.workers[rank]} {failed} in epoch {self.epoch}: "
                f"{type(exc).__name__}: {exc}. {_ADVICE}",
                lost_workers=[self.workers[r] for r in lost],
            ) from exc

    def _lost_error(
        self, lost: list[int], *, rank: int | None = None, exc: BaseException | None = None
    ) -> TrainingError:
        names = ", ".join(f"trainer {r} on {self.workers[r]}" for r in lost)
        then = (
            ""
            if exc is None
            else (f"; trainer {rank} on {self.workers[rank]} then failed with {type(exc).__name__}: {exc}")
        )
        return TrainingError(
            f"{self.sink.run_id}: {names} was lost in epoch {self.epoch} (the scheduler lost its worker: killed, out "
            f"of memory or preempted){then}. {_ADVICE}",
            lost_workers=[self.workers[r] for r in lost],
        )

    def _hung_error(self, hung: list[int], *, rank: int, exc: BaseException) -> TrainingError:
        addresses = [self.workers[r] for r in hung]
        names = ", ".join(f"trainer {r} on {self.workers[r]}" for r in hung)
        return TrainingError(
            f"{self.sink.run_id}: {names} did not answer for {self.policy.hang_grace_s:g} s "
            f"(dask-dl.train.hang-grace) after trainer {rank} on {self.workers[rank]} failed in epoch {self.epoch}: "
            f"its worker hangs (stopped, swapping or deadlocked); trainer {rank}'s error: {type(exc).__name__}: "
            f"{exc}. {_ADVICE}; a restart leaves the hung worker out and has its nanny restart it (without "
            f"restarts: client.restart_workers({addresses!r}))",
            lost_workers=addresses,
        )

    def _ask_where(self, *, but: int) -> dict[int, Any]:
        """Ask every rank but ``but`` where it is (an ``async`` call: a trainer that hangs does not answer)."""
        asked = {}
        for rank, actor in enumerate(list(self._actors)):
            if rank != but:
                try:
                    asked[rank] = actor.progress()
                except Exception as exc:  # its worker is gone: the scheduler says so
                    self._log_failure("could not be asked where it is", rank, exc)
        return asked

    def _unanswered(self, since: float, asked: dict[int, Any]) -> list[int]:
        """The ranks of ``asked`` that gave no answer ``dask-dl.train.hang-grace`` seconds ``since`` they were asked."""
        deadline, silent = since + self.policy.hang_grace_s, []
        for rank, call in asked.items():
            try:
                call.result(timeout=max(deadline - time.monotonic(), 0.1))
            except TimeoutError:
                silent.append(rank)
            except Exception as exc:  # an answer all the same (its worker is gone, or the actor): not hung
                logger.debug("%s: trainer %d answered with %s: %s", self.sink.run_id, rank, type(exc).__name__, exc)
        return silent

    def _restart_hung(self, hung: list[str]) -> None:
        """Have the nannies of hung workers restart them (workers without one are removed from the scheduler).

        Not waited for (a nanny gives a stopped process seconds before it kills it): the restart goes on on other
        workers meanwhile, leaving the hung ones out while the scheduler still has them.
        """
        if not hung:
            return
        logger.warning("%s: restarting the hung worker(s) %s through their nannies", self.sink.run_id, ", ".join(hung))
        restart = self.client.scheduler.restart_workers(
            workers=hung,
            timeout=self.policy.hang_grace_s,
            wait_for_workers=False,
            on_error="return",
            stimulus_id=f"dask-dl-hung-{self.sink.run_id}-{time.time()}",
        )
        done = asyncio.run_coroutine_threadsafe(restart, self.client.loop.asyncio_loop)
        done.add_done_callback(lambda future: self._restarted_hung(hung, future))

    def _restarted_hung(self, hung: list[str], future: Any) -> None:
        try:
            answers = future.result()
        except Exception as exc:  # they stay left out of the next groups all the same
            logger.warning(
                "%s: could not restart the hung worker(s) %s: %s: %s",
                self.sink.run_id,
                ", ".join(hung),
                type(exc).__name__,
                exc,
            )
            return
        logger.info("%s: restart of the hung worker(s): %s", self.sink.run_id, answers)

    def _still_hung(self) -> list[str]:
        """The workers found hung that the scheduler still has as they were (not restarted, not gone)."""
        now = self._trainer_worker_ids_of(list(self._hung))
        self._hung = {a: i for a, i in self._hung.items() if a in now and now[a] is not None and now[a] == i}
        return sorted(self._hung)

    def _placed_actors(self) -> list[Any]:
        """The trainers' actors once they exist, or a TrainingError naming the workers that left before theirs did.

        An actor's task may run on its worker only: when that worker dies first (killed, preempted, out of memory
        while importing torch), the task waits for it for good, and so did the run. A lost worker is a
        recoverable failure: the restart policy forms the group on the workers there are.
        """
        while True:
            waiting = [a for a, f in zip(self.workers, self._actor_futures, strict=True) if not f.done()]
            if not waiting:
                return [f.result() for f in self._actor_futures]
            present = self._trainer_worker_ids()
            gone = [a for a in waiting if present and present.get(a) is None]
            if gone:
                raise TrainingError(
                    f"{self.sink.run_id}: the worker(s) {', '.join(gone)} left before their trainer started there "
                    "(killed, out of memory or preempted)",
                    lost_workers=gone,
                )
            _wait_for_one(self._actor_futures, _POLL_S)

    def _trainer_worker_ids(self) -> dict[str, str | None]:
        """The scheduler's id of each trainer's worker (a nanny's restarted worker gets a new one)."""
        return self._trainer_worker_ids_of(self.workers)

    def _trainer_worker_ids_of(self, addresses: list[str]) -> dict[str, str | None]:
        if not addresses:
            return {}
        try:
            workers = self.client.sync(self.client.scheduler.identity)["workers"]
        except Exception as exc:  # blaming falls back to the rank that failed
            logger.warning(
                "%s: could not read the scheduler's workers: %s: %s", self.sink.run_id, type(exc).__name__, exc
            )
            return {}
        return {address: workers.get(address, {}).get("id") for address in addresses}

    def _lost_trainers(self, *, within: float = _LOSS_WAIT_S) -> list[int]:
        """Ranks whose worker the scheduler lost (gone or replaced), waiting ``within`` seconds for it to notice."""
        if not self._worker_ids:
            return []
        deadline = time.monotonic() + within
        while True:
            now = self._trainer_worker_ids()
            if not now:
                return []
            lost = [r for r, a in enumerate(self.workers) if now.get(a) is None or now[a] != self._worker_ids.get(a)]
            if lost or time.monotonic() > deadline:
                return lost
            time.sleep(0.2)

    def _release(self, *, lost: list[str] | None = None, failed: bool = False) -> None:
        """Leave the process group on every trainer and delete the actors, also after errors.

        The trainers on ``lost`` workers (gone or hung) are not waited for. After a ``failed`` group, the others'
        pending collectives are made to fail first: they leave their epoch now, not at the collective's timeout.
        """
        actors, self._actors = self._actors, []
        live = []
        for rank, actor in enumerate(actors):
            if self.workers[rank] in (lost or ()):
                logger.debug(
                    "%s: trainer %d on %s is lost: nothing to tear down", self.sink.run_id, rank, self.workers[rank]
                )
            else:
                live.append((rank, actor))
        if failed:
            self._abort(live)
        calls = []
        for rank, actor in live:
            try:
                calls.append((rank, actor.teardown()))
            except Exception as exc:  # its worker is gone: nothing to tear down there
                self._log_failure("could not be torn down", rank, exc)
        # a rank stuck in a collective that could not be aborted answers after the collective's timeout
        deadline = time.monotonic() + float(self.spec.timeout_s) + self.policy.hang_grace_s
        for rank, call in calls:
            try:
                call.result(timeout=max(deadline - time.monotonic(), 1))
            except Exception as exc:
                self._log_failure("failed in teardown", rank, exc)
        futures, self._actor_futures = self._actor_futures, []
        # each Actor proxy holds a Future of its own for the actor's key, and distributed's call closures put the
        # proxy in reference cycles, so it would hold the actor until a garbage collection: release it now
        futures += [getattr(actor, "_future", None) for actor in actors]
        for future in futures:
            if future is not None:
                try:
                    future.release()
                except Exception as exc:  # a closed client: the scheduler forgets the key with the client
                    logger.warning(
                        "%s: could not release %s: %s: %s", self.sink.run_id, future, type(exc).__name__, exc
                    )
        del actors, futures

    def _abort(self, live: list[tuple[int, Any]]) -> None:
        """Make the pending collectives of the ``live`` trainers fail now (async calls, answered mid-collective)."""
        if not self._group_ports:
            return
        calls = []
        for rank, actor in live:
            try:
                calls.append((rank, actor.abort_group(self._group_ports)))
            except Exception as exc:  # its worker is gone: nothing pending there
                self._log_failure("could not be asked to leave its collectives", rank, exc)
        deadline = time.monotonic() + self.policy.hang_grace_s
        for rank, call in calls:
            try:
                shut = call.result(timeout=max(deadline - time.monotonic(), 0.1))
            except Exception as exc:  # it then leaves at the collective's timeout
                self._log_failure("could not leave its collectives", rank, exc)
                continue
            logger.debug("%s: trainer %d shut %d group connection(s)", self.sink.run_id, rank, shut)

    def _log_failure(self, what: str, rank: int, exc: BaseException) -> None:
        where = self.workers[rank] if rank < len(self.workers) else "?"
        logger.warning("%s: trainer %d on %s %s: %s: %s", self.sink.run_id, rank, where, what, type(exc).__name__, exc)


def _wait_for_one(futures: list[Any], timeout: float) -> None:
    """Return when the first of ``futures`` not yet done is done, or after ``timeout`` seconds.

    The loops that watch the trainers look again at once when a call ends (an epoch, a group's setup) instead of
    sleeping out their poll: a short run loses no poll interval per call. Its result or error is left for the
    caller to read.
    """
    pending = next((f for f in futures if not f.done()), None)
    if pending is None:
        return
    with contextlib.suppress(Exception):  # a timeout, or the call's own error: the caller reads every outcome
        pending.result(timeout=timeout)


def _where(checkpoint: dict[str, Any] | None) -> dict[str, int]:
    """Epoch, in-epoch step and run step a checkpoint goes on from (the start of the run without one)."""
    if checkpoint is None:
        return {"epoch": 0, "step": 0, "global_step": 0}
    global_step = int(checkpoint.get("global_step", 0))
    if checkpoint.get("position") is not None:
        position = checkpoint["position"]
        return {
            "epoch": int(position["epoch"]),
            "step": int(position["segments"][-1]["steps"]),
            "global_step": global_step,
        }
    return {"epoch": int(checkpoint["epoch"]) + 1, "step": 0, "global_step": global_step}
