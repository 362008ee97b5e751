"""One temporary folder per test run, for the tests and the notebooks alike.

Everything a run writes to the temporary directory goes under one folder: ``tmp_path``, the notebooks' work
folders (a quickstart alone writes 60 MB), the workers' scratch space and the dask config folder. It is removed
when the run ends, and kept (its path printed) when tests failed, to look at what they left. Set before dask is
imported: importing dask_gateway or dask_jobqueue writes their default yaml into the dask config folder, which
must not be the user's ``~/.config/dask``.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

RUN_TMP = tempfile.mkdtemp(prefix="dask-dl-tests-")
os.environ["TMPDIR"] = RUN_TMP  # child processes: notebook kernels, worker processes, CLI runs
tempfile.tempdir = None  # this process: gettempdir() reads TMPDIR again
if "DASK_CONFIG" not in os.environ:
    os.environ["DASK_CONFIG"] = os.path.join(RUN_TMP, "dask-config")
    os.makedirs(os.environ["DASK_CONFIG"])


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.TESTS_FAILED:
        return
    shutil.rmtree(RUN_TMP, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus == pytest.ExitCode.TESTS_FAILED:
        terminalreporter.write_line(f"the run's temporary files are kept in {RUN_TMP}")
