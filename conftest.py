"""One temporary folder per test run, for the tests and the notebooks alike.

Everything a run writes to the temporary directory goes under one folder: ``tmp_path``, the notebooks' work
folders (a quickstart alone writes 60 MB), the workers' scratch space and the dask config folder. It is removed
when the run ends, and kept (its path printed) when tests failed, to look at what they left. Set before dask is
imported: importing dask_gateway or dask_jobqueue writes their default yaml into the dask config folder, which
must not be the user's ``~/.config/dask``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import tempfile

import pytest

RUN_TMP = tempfile.mkdtemp(prefix="dask-dl-tests-")
os.environ["TMPDIR"] = RUN_TMP  # child processes: notebook kernels, worker processes, CLI runs
tempfile.tempdir = None  # this process: gettempdir() reads TMPDIR again
if "DASK_CONFIG" not in os.environ:
    os.environ["DASK_CONFIG"] = os.path.join(RUN_TMP, "dask-config")
    os.makedirs(os.environ["DASK_CONFIG"])

# One seed, one result, on any machine: every process of the run (this one, the workers, the notebook kernels and
# the CLI runs) computes with PyTorch's CPU kernels pinned to AVX2, and the trainers with torch's deterministic
# algorithms. Without it, a processor with AVX-512 sums in another order than one with AVX2, and the learning
# tests' numbers differ between two machines of one kind (dask_dl.reproducible says more).
# dask_dl.reproducible is loaded by its path, not imported: importing dask_dl here (and with it dask, before pytest
# has set up its plugins) made a TLS client's IO loop fail to start in tests/cluster/test_cluster_local.py (4 of 6
# runs). The module needs nothing but the standard library.
os.environ.setdefault("DASK_DASK_DL__TRAIN__DETERMINISTIC", "true")
_spec = importlib.util.spec_from_file_location(
    "_dask_dl_reproducible", os.path.join(os.path.dirname(__file__), "dask_dl", "reproducible.py")
)
_reproducible = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reproducible)
_reproducible.pin_cpu_kernels()


# Every Dask server of the run (schedulers, nannies, workers: the run's shared clusters, each test's LocalCluster,
# the notebooks' and the CLI runs' clusters) checks its event loop every 100 ms instead of 20 ms, and every worker
# samples its threads for the dashboard's profile every 100 ms instead of 10 ms. At distributed's defaults an idle
# cluster of two workers takes 14% of a core (5.5 s of CPU in 40 s: scheduler, nanny process, two workers), 4.5%
# with these; the suite keeps a cluster or more alive throughout, on 2 cores. The profiler and the tick still run
# (tests/train/test_actor.py pauses and resumes the profiler), only less often; users' clusters keep the defaults.
os.environ.setdefault("DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL", "100ms")
os.environ.setdefault("DASK_DISTRIBUTED__WORKER__PROFILE__INTERVAL", "100ms")

# The Ctrl-C tests press Ctrl-C in this process (SIGINT to itself). A run started in the background of a script
# (`bash .ci/run &`, nohup) inherits SIGINT ignored, as POSIX has a shell without job control start its background
# commands, and Python then installs no KeyboardInterrupt handler: every Ctrl-C test failed or waited for good.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    for item in items:  # each notebook runs top to bottom in a kernel of its own, minutes in all: the full run only
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.TESTS_FAILED:
        return
    shutil.rmtree(RUN_TMP, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus == pytest.ExitCode.TESTS_FAILED:
        terminalreporter.write_line(f"the run's temporary files are kept in {RUN_TMP}")
