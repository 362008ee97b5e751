"""Training through dask-jobqueue on a real single-node SLURM: one GPU job and one CPU job under one scheduler.

The node has no GPU: slurm.conf gives it two ``gpu`` GRES backed by stand-in device files (.ci/slurm), so SLURM
really schedules ``--gres=gpu:1`` jobs, and dask_dl tags their workers with a ``GPU`` resource. Placement is
checked for real: trainers on the GPU job's worker, synthesis/ingest/scoring on the CPU job's worker. Workers bind
to the loopback interface (``interface="lo"``), everything stays on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from dask_dl.cluster import connect, cpu_workers, gpu_workers
from dask_dl.testing.cluster import small_story

# A SLURM cluster's jobs start in seconds each: for the full run only.
pytestmark = pytest.mark.slow

if importlib.util.find_spec("dask_jobqueue") is None:  # not importorskip: importing it replaces the SIGINT handler
    pytest.skip("dask-jobqueue is not installed (pip install 'dask-dl[hpc]')", allow_module_level=True)

SLURM = dict(queue="gpu", jobs=1, gpus_per_job=1, cpu_jobs=1, cpu_queue="debug", memory="1GiB", interface="lo")


@pytest.fixture(scope="module")
def story_store(slurm, tmp_path_factory):
    """Run the small story on SLURM once; return the store, the record and the jobs seen while it ran."""
    workdir = tmp_path_factory.mktemp("slurm")
    with connect(kind="slurm", log_directory=str(workdir / "logs"), **SLURM) as client:
        jobs = sorted((j["partition"], j["gres"], j["state"]) for j in slurm.jobs())
        tagged, plain = gpu_workers(client), cpu_workers(client)
        story = small_story(client, workdir, trainers=1)
    return {"story": story, "jobs": jobs, "tagged": tagged, "plain": plain, "left": slurm.wait_until_gone()}


def test_slurm_gpu_and_cpu_jobs_train_with_trainers_on_the_gpu_job(story_store):
    assert story_store["jobs"] == [("debug", "N/A", "RUNNING"), ("gpu", "gres:gpu:1", "RUNNING")]
    tagged, plain, story = story_store["tagged"], story_store["plain"], story_store["story"]
    assert len(tagged) == 1 and len(plain) == 1
    assert story.trainers == tagged
    assert story.ran_on == {"synthesize": set(plain), "ingest": set(plain), "predict": set(plain)}
    assert np.isfinite(story.history["train_loss"]).all()
    assert story_store["left"] == []  # connect() cancelled both jobs


def _cli(args: list[str], config_dir, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, DASK_CONFIG=str(config_dir))
    return subprocess.run(
        [sys.executable, "-m", "dask_dl.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_batch_script_path_trains_with_cluster_slurm_and_cancels_its_jobs_also_on_error(story_store, slurm, tmp_path):
    # a site's defaults, set once in a yaml: GPU jobs on partition gpu, a CPU job beside them
    site = {
        "dask-dl": {"cluster": {"slurm": {"queue": "gpu", "gpus-per-job": 1, "cpu-jobs": 1, "memory": "1GiB"}}},
        "jobqueue": {"slurm": {"interface": "lo", "log-directory": str(tmp_path / "logs")}},
    }
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    store = story_store["story"].store

    done = _cli(
        ["train", store, "--cluster", "slurm", "--jobs", "1", "--trainers", "1", "--epochs", "1", "-q"], tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "epoch=0" in done.stdout and ": finished" in done.stdout
    assert slurm.wait_until_gone() == []

    # two trainers but one GPU job: placement refuses, the command fails, and the jobs are cancelled all the same
    failed = _cli(["train", store, "--cluster", "slurm", "--jobs", "1", "--trainers", "2", "-b", "8", "-q"], tmp_path)
    assert failed.returncode == 1
    assert "fit asked for 2 trainers but the cluster has only 1 workers with a 'GPU' resource" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert slurm.wait_until_gone() == []


def test_jobs_slurm_refuses_are_one_error_with_sbatchs_words_and_nothing_left_queued(slurm, caplog):
    import logging

    from dask_dl.cluster import make
    from dask_dl.errors import ClusterError

    refused = r"^SLURM refused the {}job \(partition 'nope'\): sbatch: error: invalid partition specified: nope"
    with pytest.raises(ClusterError, match=refused.format("")):
        make("slurm", queue="nope", jobs=2, memory="1GiB", interface="lo")
    # the GPU job is queued, then its CPU job refused: the GPU job is cancelled
    with pytest.raises(ClusterError, match=refused.format("CPU ")):
        make("slurm", **{**SLURM, "cpu_queue": "nope"})
    assert slurm.wait_until_gone() == []
    # dask-jobqueue's own callbacks logged the refusal as tracebacks (and the caller waited for good)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
