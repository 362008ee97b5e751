"""Shared fixtures: the real data in ../shared/data, Dask's own cluster fixtures, GPU skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dask
import pytest

# The repository's conftest.py has pointed TMPDIR and DASK_CONFIG at the run's own folder before dask is imported.

# Registers dask_dl's config defaults before distributed.utils_test snapshots dask.config: its fixtures reset the
# config to that snapshot, which would otherwise lack the "dask-dl" key. The same for dask-gateway's and
# dask-jobqueue's defaults ("gateway.*", "jobqueue.*"), registered when they are first imported: a cluster test
# that ran after another module's reset found them gone (KeyError: 'gateway').
import dask_dl.config  # noqa: F401  # isort: skip
import dask_gateway  # noqa: F401  # isort: skip
from dask_dl.cluster.slurm import _import_jobqueue  # isort: skip

_import_jobqueue()  # keeps this process's Ctrl-C handler, which a plain import replaces


def _fork_workers_from_a_warm_server() -> None:
    """The run's worker processes are forked from a server that imported torch and dask_dl's worker-side modules
    once, not spawned: a spawned worker imports torch again (about 3 s of CPU), and the run starts more than a
    hundred of them (every LocalCluster, every nanny's restart after a kill). Forked, a cluster of two is up in
    0.6 s instead of 3 s.

    The server starts here, while pytest captures this process's output (its workers' output then goes to the
    test that runs, as a test's own output does), before distributed.utils_test snapshots the config that its
    fixtures restore, and before any worker: distributed's own forkserver preload (a shorter list) is then set on
    a server already running and changes nothing. The server has the environment of this moment (TMPDIR, the
    pinned CPU kernels of the repository's conftest.py) and the variables a nanny sets before it spawns; workers
    get their dask config from their nanny, as spawned ones do. Users' clusters keep distributed's default, spawn.
    """
    import multiprocessing
    import multiprocessing.forkserver
    import multiprocessing.util
    import tempfile

    import distributed  # noqa: F401  # its config defaults, read below

    preload = [
        *("distributed", "numpy", "pandas", "torch", "zarr", "PIL.Image", "onnxruntime"),
        *("dask_dl.train.actor", "dask_dl.train.compression.kernels", "dask_dl.data.ingest", "dask_dl.inference"),
        # TorchDynamo, which DistributedDataParallel's constructor imports, and inductor's config, which
        # torch.use_deterministic_algorithms imports (each brings the other): 1.1-1.5 s of CPU in each new trainer
        *("torch._dynamo", "torch._inductor.config"),
    ]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    with pytest.MonkeyPatch.context() as patch:
        # the server's socket lives in this process's multiprocessing folder, removed when this process exits: make
        # it beside the run's temporary folder, not in it (the run removes that folder before it exits)
        patch.setattr(tempfile, "tempdir", os.path.dirname(os.environ["TMPDIR"]))
        multiprocessing.util.get_temp_dir()
        # the variables a nanny sets before it spawns a worker (MALLOC_TRIM_THRESHOLD_, OMP_NUM_THREADS=1, ...),
        # read at a process's start: the server has them, so its forked workers start as spawned ones do
        for name, value in dask.config.get("distributed.nanny.pre-spawn-environ").items():
            patch.setenv(name, str(value))
        multiprocessing.forkserver.ensure_running()
    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})


_fork_workers_from_a_warm_server()
_SCHEDULER = dask.config.get("scheduler", None)  # as the run began: see the fixture below

# distributed's harness: ``client`` gives a Client of a real LocalCluster (2 worker processes) per test,
# ``gen_cluster`` (imported in the tests that use it) an in-process cluster for async tests.
from distributed.utils_test import (  # noqa: F401, E402  # after the config above
    cleanup,
    client,
    cluster_fixture,
    loop,
    loop_in_thread,
)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("DASK_DL_SHARED_DATA", REPO.parent / "shared" / "data"))


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch always installed here
        return False


def pytest_collection_modifyitems(config, items):
    for item in items:  # a test that measures learning trains for real, a fuzz run draws thousands of cases:
        if "learning" in item.keywords or "fuzz" in item.keywords:  # both belong to the full run only
            item.add_marker(pytest.mark.slow)
    if not any("gpu" in item.keywords for item in items):
        return
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_scheduler(tmp_path_factory) -> str:
    """The scheduler file of a real cluster kept for the whole run: ``dask scheduler`` and ``dask worker --nworkers
    2 --nthreads 1``, each in a process group of its own, stopped by pid at the end.

    Its workers stay warm from module to module: torch is imported and the first model built once per run, not
    once per module (about 5 s each time). Started from dask's command line, not as a LocalCluster: distributed's
    per-test fixtures (``client``, ``gen_cluster``) end every multiprocessing child of this process and check that
    no Scheduler lives in it, which a LocalCluster kept for the run would fail.
    """
    from distributed import Client

    from dask_dl.testing.servers import stop_server, unavailable

    folder = tmp_path_factory.mktemp("shared-cluster")
    file, log = folder / "scheduler.json", folder / "cluster.log"
    command = [sys.executable, "-m"]
    # the test modules' folders, which pytest put on sys.path, as a LocalCluster's spawned workers get them: the
    # functions a test sends with client.run are pickled by their module's name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with open(log, "wb") as out:
        scheduler = subprocess.Popen(
            [
                *command,
                "distributed.cli.dask_scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--dashboard-address",
                "127.0.0.1:0",
                "--scheduler-file",
                str(file),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        workers = subprocess.Popen(
            [
                *command,
                "distributed.cli.dask_worker",
                "--scheduler-file",
                str(file),
                "--nworkers",
                "2",
                "--nthreads",
                "1",
                "--host",
                "127.0.0.1",
                "--dashboard-address",
                "127.0.0.1:0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    try:
        try:
            with Client(scheduler_file=str(file), timeout=60) as first:
                first.wait_for_workers(2, timeout=120)
        except Exception as exc:
            unavailable(f"the run's shared cluster did not start ({exc}):\n{log.read_text()[-3000:]}")
        yield str(file)
    finally:
        stop_server(workers, group=True)
        stop_server(scheduler, group=True)


@pytest.fixture(autouse=True)
def _no_default_scheduler_without_a_client():
    """Each test starts with dask's ``scheduler`` config as the run began, when no client is left alive.

    A distributed Client sets ``scheduler: dask.distributed`` while it is the default, and puts back what it found
    when the last default client closes: two default clients closed in the order they were made leave it set with
    none alive, and a later test that computes without a client failed ("Requested dask.distributed scheduler but
    no Client active"), or not, by which tests ran before it in its process.
    """
    from distributed.client import _get_global_client

    yield
    if dask.config.get("scheduler", None) == "dask.distributed" != _SCHEDULER and _get_global_client() is None:
        dask.config.set(scheduler=_SCHEDULER)  # None: dask picks as it did before any client


@pytest.fixture(scope="module")
def cluster_client(shared_scheduler):
    """A Client of the run's shared cluster (2 worker processes x 1 thread), one per test module.

    Each module has a client of its own, so its futures and persisted results go with the module; the workers
    stay warm. A test that kills, stops or scales workers takes :func:`own_cluster_client` instead.
    Not distributed's per-test ``client`` fixture for modules that read Zarr stores in the test process: that
    fixture fails a test for the I/O threads zarr starts (they live as long as the process).
    """
    from distributed import Client

    with Client(scheduler_file=shared_scheduler, timeout=60) as ours:
        ours.wait_for_workers(2, timeout=120)
        yield ours


@pytest.fixture(scope="module")
def own_cluster_client():
    """A LocalCluster of 2 worker processes x 1 thread for one module alone: for the tests that kill, stop or
    scale workers, which would disturb the modules after them on the shared cluster."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as mine,
    ):
        yield mine


@pytest.fixture(scope="session")
def squares_store(tmp_path_factory) -> str:
    """The squares collection (:func:`dask_dl.testing.train.squares_collection`: 64 train and 32 val images with
    labels ``a`` and ``b``) ingested at 32 px in chunks of 8 images, 2 chunks a shard: the training tests' store.

    Ingested once per run, by a cluster of its own that is closed before any test uses the store, so that the
    modules that read it keep their own clusters (those that kill workers included). Tests only read it.
    """
    from distributed import Client, LocalCluster

    import dask_dl
    from dask_dl.testing.train import squares_collection

    root = tmp_path_factory.mktemp("squares")
    path = str(root / "squares.zarr")
    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as ingesting,
    ):
        dask_dl.ingest(squares_collection(root), path, size=32, chunk=8, shard=2, client=ingesting, progress=False)
    return path


@pytest.fixture(scope="session")
def learning_seed() -> int:
    """The seed of the tests marked ``learning``: ``DASK_DL_TEST_SEED``, default 0.

    Those tests assert that a model learns, with margins measured over seeds 0-4 and written beside them; to
    measure the spread again: ``for s in 0 1 2 3 4; do DASK_DL_TEST_SEED=$s python -m pytest -m learning -s; done``.
    """
    return int(os.environ.get("DASK_DL_TEST_SEED", "0"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``: the real NIH table, two NIH images and two DICOM files. Skips when absent."""
    if not (SHARED_DATA / "nih" / "Data_Entry_2017_v2020.csv.gz").exists():
        pytest.skip(f"real data not found at {SHARED_DATA} (set DASK_DL_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture
def cpu_hog():
    """A CPU-bound process beside the test: a busy machine, where a slow shutdown prints tracebacks."""
    import subprocess
    import sys

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()
