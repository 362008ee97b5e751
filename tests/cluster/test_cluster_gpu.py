"""make("cuda"), NCCL training, CUDA scoring and cudf tables on a real GPU box; skipped without CUDA.

dask-cuda's LocalCUDACluster gives one trainer worker per GPU (``CUDA_VISIBLE_DEVICES`` rotated so that each
worker's own GPU comes first) with a ``GPU`` resource, and dask_dl adds CPU workers that see no GPU. Trainers
train with NCCL on their GPUs; ingest and scoring stay on the CPU workers unless scoring is sent to the GPU
workers (``predict(..., on="gpu")``), where onnxruntime-gpu's CUDA provider scores. Catalogs and score tables
become Dask DataFrames of cudf partitions. Where CUDA exists but onnxruntime-gpu or cudf does not, those tests skip
and say which package is missing. (The stand-in for GPU workers, CPU workers tagged with a ``GPU`` resource, runs
the placement tests everywhere: test_cluster_local.py.)
"""

from __future__ import annotations

import dask.config
import numpy as np
import pytest

import dask_dl
from dask_dl.cluster import connect, cpu_workers, gpu_workers
from dask_dl.cluster.cuda import gpu_count
from dask_dl.testing.cluster import small_story, worker_of_tasks

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


@pytest.fixture(scope="module")
def story(cuda_client, tmp_path_factory):
    return small_story(cuda_client, tmp_path_factory.mktemp("gpu-story"), trainers=len(gpu_workers(cuda_client)))


def test_nccl_training_on_the_gpus_and_data_work_on_the_cpu_worker(cuda_client, story):
    import torch

    tagged, plain = gpu_workers(cuda_client), cpu_workers(cuda_client)
    assert sorted(story.trainers) == tagged
    assert story.ran_on == {"synthesize": set(plain), "ingest": set(plain), "predict": set(plain)}
    assert np.isfinite(story.history["train_loss"]).all()
    on_gpu = cuda_client.run(lambda: torch.cuda.is_initialized(), workers=tagged)
    assert all(on_gpu.values())  # the trainers trained on their GPUs (NCCL process group)
    assert not any(cuda_client.run(lambda: torch.cuda.is_initialized(), workers=plain).values())


def _session_providers(model: str) -> list[list[str]]:
    from dask_dl import inference

    return [session.get_providers() for key, session in inference._SESSIONS.items() if key[0] == model]


def test_predict_on_gpu_uses_the_cuda_provider_on_the_gpu_workers(cuda_client, story):
    import onnxruntime as ort
    from distributed import get_task_stream

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(
            f"onnxruntime {ort.__version__} here has no CUDA provider: pip uninstall onnxruntime, then "
            "pip install onnxruntime-gpu"
        )
    tagged = gpu_workers(cuda_client)
    test = dask_dl.open_dataset(story.store, split="test")
    with get_task_stream(cuda_client) as stream:
        scores = dask_dl.predict(test, story.model, client=cuda_client, on="gpu").compute()
    ran_on = worker_of_tasks(stream.data, "predict")
    assert ran_on and ran_on <= set(tagged)
    providers = cuda_client.run(_session_providers, story.model, workers=tagged)
    used = [p for ps in providers.values() for p in ps]
    assert used and all(p[0] == "CUDAExecutionProvider" for p in used), providers
    # the GPU's scores are the CPU workers' scores up to float32 kernel differences
    np.testing.assert_allclose(scores, story.scores, rtol=0, atol=1e-4)


def test_catalog_and_scores_as_cudf_dask_dataframes(cuda_client, story):
    pytest.importorskip("cudf", reason="cudf tables need cudf: pip install 'dask-dl[gpu]'")
    pytest.importorskip("dask_cudf", reason="cudf tables need dask-cudf: pip install 'dask-dl[gpu]'")
    import cudf

    tagged = gpu_workers(cuda_client)  # the CPU workers see no GPU: cudf partitions are computed on the GPU workers
    test = dask_dl.open_dataset(story.store, split="test")
    table = dask_dl.scores_table(test, story.scores)
    frame = dask_dl.scores_table(test, story.scores, backend="cudf")
    assert isinstance(frame._meta, cudf.DataFrame) and frame.attrs["labels"] == table.attrs["labels"]
    got = cuda_client.compute(frame, workers=tagged).result()
    assert isinstance(got, cudf.DataFrame)
    np.testing.assert_array_equal(got["sample"].to_numpy(), table["sample"].to_numpy())
    np.testing.assert_array_equal(got["image_id"].to_arrow().to_pylist(), table["image_id"].tolist())
    scores = table.filter(like="p_").columns
    np.testing.assert_array_equal(got[list(scores)].to_numpy(), table[list(scores)].to_numpy())
    # the same switch as Dask's own: dataframe.backend=cudf
    with dask.config.set({"dataframe.backend": "cudf"}):
        catalog = dask_dl.to_dask_dataframe(table.drop(columns=list(scores)), npartitions=2)
    assert catalog.npartitions == 2 and isinstance(catalog._meta, cudf.DataFrame)
    by_site = cuda_client.compute(catalog.groupby("site")["sample"].count(), workers=tagged).result()
    by_site = by_site.to_pandas().sort_index()
    assert by_site.to_dict() == table.groupby("site")["sample"].count().sort_index().to_dict()
