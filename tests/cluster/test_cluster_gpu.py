"""make("cuda") and NCCL training on a real GPU box; skipped without CUDA (the stand-in runs everywhere else).

dask-cuda's LocalCUDACluster gives one trainer worker per GPU (``CUDA_VISIBLE_DEVICES`` rotated so that each
worker's own GPU comes first) with a ``GPU`` resource, and dask_dl adds CPU workers that see no GPU. Trainers
train with NCCL on their GPUs; ingest and scoring stay on the CPU workers.
"""

from __future__ import annotations

import numpy as np
import pytest

from dask_dl.cluster import connect, cpu_workers, gpu_workers
from dask_dl.cluster.cuda import gpu_count
from dask_dl.testing.cluster import small_story

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_client():
    pytest.importorskip("dask_cuda", reason="make('cuda') needs dask-cuda: pip install 'dask-dl[gpu]'")
    with connect(kind="cuda", cpu_workers=1) as client:
        yield client


def test_make_cuda_has_one_trainer_worker_per_gpu_and_cpu_workers_without_gpus(cuda_client):
    tagged, plain = gpu_workers(cuda_client), cpu_workers(cuda_client)
    assert len(tagged) == gpu_count() and len(plain) == 1
    visible = cuda_client.run(lambda: __import__("os").environ.get("CUDA_VISIBLE_DEVICES"))
    assert visible[plain[0]] == ""
    firsts = [visible[w].split(",")[0] for w in tagged]
    assert len(set(firsts)) == len(tagged)  # each trainer worker's own GPU is its device 0


def test_nccl_training_on_the_gpus_and_data_work_on_the_cpu_worker(cuda_client, tmp_path):
    import torch

    tagged, plain = gpu_workers(cuda_client), cpu_workers(cuda_client)
    story = small_story(cuda_client, tmp_path, trainers=len(tagged))
    assert sorted(story.trainers) == tagged
    assert story.ran_on == {"synthesize": set(plain), "ingest": set(plain), "predict": set(plain)}
    assert np.isfinite(story.history["train_loss"]).all()
    on_gpu = cuda_client.run(lambda: torch.cuda.is_initialized(), workers=tagged)
    assert all(on_gpu.values())  # the trainers trained on their GPUs (NCCL process group)
    assert not any(cuda_client.run(lambda: torch.cuda.is_initialized(), workers=plain).values())
