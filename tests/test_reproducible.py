"""One seed, one result: the CPU kernels pinned by environment, deterministic trainers, a run that repeats itself."""

from __future__ import annotations

import os

import dask
import pytest
import torch
from distributed import Client

import dask_dl
from dask_dl.cluster.local import make_local
from dask_dl.reproducible import PINNED_CPU_KERNELS, cpu_pinning_environment, pin_cpu_kernels
from dask_dl.testing.train import squares_collection

PINNABLE = cpu_pinning_environment() == PINNED_CPU_KERNELS  # an x86-64 processor with AVX2, as CI's


def test_pin_cpu_kernels_sets_what_is_missing_and_keeps_what_is_set():
    environ = {"MKL_CBWR": "COMPATIBLE"}
    added = pin_cpu_kernels(environ)
    if PINNABLE:
        assert added == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
        assert environ == {"MKL_CBWR": "COMPATIBLE", **added}  # the user's own choice stays
    else:
        assert added == {} and environ == {"MKL_CBWR": "COMPATIBLE"}


def test_pinning_after_torch_is_imported_says_it_is_too_late():
    assert "torch" in __import__("sys").modules  # imported at the top of this module
    with pytest.raises(RuntimeError, match="after torch was imported.*ATEN_CPU_CAPABILITY=avx2"):
        pin_cpu_kernels()


@pytest.mark.skipif(not PINNABLE, reason="no AVX2 x86-64 processor: nothing to pin")
@pytest.mark.parametrize("deterministic", [True, False])
def test_local_workers_get_the_pinned_environment_when_deterministic(monkeypatch, deterministic):
    for name in PINNED_CPU_KERNELS:  # the test run pins every process: here the workers get them from make_local
        monkeypatch.delenv(name, raising=False)
    # spawned, as users' workers are: the test run forks its workers from a server whose environment is pinned
    spawned = {"distributed.worker.multiprocessing-method": "spawn"}
    with (
        dask.config.set({"dask-dl.train.deterministic": deterministic, **spawned}),
        make_local(n_workers=1, env={"DASK_DL_OWN": "1"}) as cluster,
        Client(cluster) as client,
    ):
        names = [*PINNED_CPU_KERNELS, "DASK_DL_OWN"]
        (seen,) = client.run(lambda: {k: os.environ.get(k) for k in names}).values()
    pinned = PINNED_CPU_KERNELS if deterministic else dict.fromkeys(PINNED_CPU_KERNELS)
    assert seen == {**pinned, "DASK_DL_OWN": "1"}  # beside the env= the caller gave


@pytest.mark.slow
def test_a_deterministic_run_repeats_itself_bit_for_bit(tmp_path, cluster_client):
    """Two runs of one seed on two trainers: equal weights to the last bit, with torch's deterministic algorithms
    on in the trainers (the test run sets ``dask-dl.train.deterministic``); off again when a run says so."""
    store = str(tmp_path / "squares.zarr")
    dask_dl.ingest(
        squares_collection(tmp_path), store, size=32, chunk=8, shard=2, client=cluster_client, progress=False
    )
    ds = dask_dl.open_dataset(store)
    options = dict(
        model="small_cnn", model_kwargs={"width": 8}, epochs=2, batch_size=8, trainers=2, lr=0.05, optimizer="sgd"
    )
    assert dask.config.get("dask-dl.train.deterministic") is True
    first, second = (dask_dl.fit(ds, seed=3, client=cluster_client, **options).checkpoint()["model"] for _ in "ab")
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert set(cluster_client.run(torch.are_deterministic_algorithms_enabled).values()) == {True}
    with dask.config.set({"dask-dl.train.deterministic": False}):
        other = dask_dl.fit(ds, seed=4, client=cluster_client, **options).checkpoint()["model"]
    assert set(cluster_client.run(torch.are_deterministic_algorithms_enabled).values()) == {False}
    assert not all(torch.equal(first[k], other[k]) for k in first)  # another seed: other weights
