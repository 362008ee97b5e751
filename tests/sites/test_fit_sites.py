"""fit_sites on one cluster (sites as datasets): protocols, their options, the run handle, and learning.

Small sites (32 px "squares" collections, one store each, of different sizes) check the mechanics; three
synthetic hospitals (``synthesize``'s ``sites``: their own label mixes and exposures) check that cyclic weight
transfer and federated averaging learn about as well as pooling the data with the same budget.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import dask_dl
from dask_dl import ConfigurationError, DatasetError
from dask_dl.cluster.workers import scheduler_workers
from dask_dl.export import read_model_info
from dask_dl.models import build_model
from dask_dl.normalize import DEFAULT_NORMALIZATION
from dask_dl.sites.score import Ensemble, ModelSpec, score
from dask_dl.sites.synthetic import synthetic_sites
from dask_dl.testing.train import squares_collection
from dask_dl.train.run import fit_visit

# Rounds of trainers at three sites per test: for the full run only.
pytestmark = pytest.mark.slow

OPTIONS = dict(model="small_cnn", model_kwargs={"width": 8}, batch_size=8, lr=0.05, optimizer="sgd", seed=0)
SIZES = {"A": 48, "B": 64, "C": 32}


@pytest.fixture(scope="module")
def cluster3():
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def squares(tmp_path_factory, cluster3) -> dict[str, str]:
    stores = {}
    for i, (name, n) in enumerate(SIZES.items()):
        root = tmp_path_factory.mktemp(name)
        stores[name] = str(root / "site.zarr")
        dask_dl.ingest(
            squares_collection(root, n_train=n, n_val=16, seed=i),
            stores[name],
            size=32,
            chunk=8,
            shard=2,
            client=cluster3,
            progress=False,
        )
    return stores


def _datasets(stores):
    return {name: dask_dl.open_dataset(store) for name, store in stores.items()}


# ---- a visit's start_state and proximal term ----------------------------------------------------------------


def _params(state):
    return torch.cat([v.flatten() for k, v in state.items() if "running" not in k and "num_batches" not in k])


def test_fit_starts_from_start_state_and_pulls_towards_it(squares, cluster3):
    torch.manual_seed(123)
    start = build_model("small_cnn", num_outputs=2, width=8).state_dict()
    torch.manual_seed(OPTIONS["seed"])
    seeded = build_model("small_cnn", num_outputs=2, width=8).state_dict()  # what fit starts from without it
    still = fit_visit(
        dask_dl.open_dataset(squares["B"]),
        epochs=1,
        trainers=1,
        client=cluster3,
        start_state=start,
        **{**OPTIONS, "lr": 1e-9},
    ).checkpoint()["model"]
    torch.testing.assert_close(_params(still), _params(start), rtol=0, atol=1e-6)
    assert float((_params(seeded) - _params(start)).abs().max()) > 0.1  # not the seeded initial weights

    def moved(mu: float) -> float:
        run = fit_visit(
            dask_dl.open_dataset(squares["B"]),
            epochs=2,
            trainers=1,
            client=cluster3,
            start_state=start,
            proximal_mu=mu,
            **OPTIONS,
        )
        return float((_params(run.checkpoint()["model"]) - _params(start)).norm())

    free, held = moved(0.0), moved(5.0)
    assert held < 0.6 * free, (held, free)


def test_fit_trains_only_on_the_workers_given(squares, cluster3):
    workers = sorted(scheduler_workers(cluster3))
    run = fit_visit(
        dask_dl.open_dataset(squares["A"]),
        epochs=1,
        trainers=1,
        client=cluster3,
        workers=workers[2:],
        weights_only=True,
        **OPTIONS,
    )
    assert run.workers == workers[2:]
    assert set(run.checkpoint()) == {"model", "epoch", "model_name"}
    with pytest.raises(dask_dl.ClusterError, match="not workers of the cluster"):
        fit_visit(dask_dl.open_dataset(squares["A"]), trainers=1, client=cluster3, workers=["tcp://nowhere:1"])


# ---- protocols and the run handle ---------------------------------------------------------------------------


def test_cyclic_options_shape_every_visit(squares, cluster3):
    run = dask_dl.fit_sites(
        _datasets(squares),
        protocol="cyclic",
        rounds=2,
        steps=3,
        proportional_steps=True,
        order="shuffled",
        cyclic_lr=0.1,
        site_weighted_loss=True,
        client=cluster3,
        **OPTIONS,
    )
    h = run.history
    mean = np.mean(list(SIZES.values()))
    for _, row in h.iterrows():
        assert row["steps"] == max(1, round(3 * SIZES[row["site"]] / mean)), row
        assert row["samples"] == row["steps"] * 8
    # the learning rate follows the cosine within each cycle, in the shuffled order, times the site's share
    order = np.random.default_rng(0)
    for r in range(2):
        names = [list(SIZES)[k] for k in order.permutation(3)]
        for k, name in enumerate(names):
            low = 0.1 * 0.05
            lr = (low + (0.05 - low) * (1 + math.cos(math.pi * k / 3)) / 2) * SIZES[name] / mean
            got = h[(h["round"] == r) & (h["site"] == name)]["lr"].item()
            assert got == pytest.approx(lr, rel=1e-12), (r, name)
    assert h["auroc_mean"].notna().all() and (h["event"] == "").all()


def test_ensemble_is_the_mean_of_the_site_models_and_exports(squares, cluster3, tmp_path):
    run = dask_dl.fit_sites(_datasets(squares), protocol="ensemble", rounds=1, client=cluster3, **OPTIONS)
    states = run.states()
    assert len(states) == 3
    net = run.model()
    assert isinstance(net, Ensemble)
    x = torch.rand(4, 1, 32, 32)
    members = [build_model("small_cnn", num_outputs=2, width=8) for _ in states]
    for m, s in zip(members, states, strict=True):
        m.load_state_dict(s)
        m.eval()
    with torch.no_grad():
        expected = torch.stack([m(x).sigmoid() for m in members]).mean(0)
        torch.testing.assert_close(net(x).sigmoid(), expected, rtol=0, atol=1e-6)
    info = read_model_info(run.export_onnx(tmp_path / "ensemble.onnx"))
    assert info.labels == ("a", "b") and info.input_size == 32
    # the per-site scores are the ensemble's, computed on each site
    spec = ModelSpec(name="small_cnn", labels=("a", "b"), task="multilabel", input_size=32, kwargs={"width": 8})
    ds = dask_dl.open_dataset(squares["A"])
    mine = score(squares["A"], ds.sample.values[ds.split.values == "val"], states, spec)
    got = run.history.query("site == 'A'").iloc[0]
    assert got["auroc_mean"] == pytest.approx(mine["auroc_mean"], abs=1e-9) and got["n"] == 16


def test_incremental_trains_each_site_until_it_stops_improving_and_hands_over_the_last_sites_best(squares, cluster3):
    run = dask_dl.fit_sites(
        {k: _datasets(squares)[k] for k in ("A", "B")},
        protocol="incremental",
        rounds=6,
        patience=1,
        client=cluster3,
        **OPTIONS,
    )
    h = run.history
    trained = h[h["steps"] > 0]
    assert list(trained["round"]) == list(range(len(trained))) and (h["event"] == "").all()
    best = {}
    for name in ("A", "B"):  # one epoch per round, at one site after the other, until it stops improving
        mine = trained[trained["site"] == name]
        auroc = h[(h["site"] == name) & h["round"].isin(mine["round"])]["auroc_mean"].to_numpy()
        better = [k for k in range(len(auroc)) if auroc[k] > max(auroc[:k], default=-math.inf)]
        stop = next((k for k in range(1, len(auroc)) if k not in better), None)  # patience 1: the first miss ends
        assert len(auroc) == (stop + 1 if stop is not None else 6), (name, auroc)
        best[name] = int(mine["round"].iloc[better[-1]])
    n_a = int((trained["site"] == "A").sum())
    assert trained["site"].tolist() == ["A"] * n_a + ["B"] * (len(trained) - n_a) and 0 < n_a < len(trained)
    spec = ModelSpec(
        name="small_cnn", labels=("a", "b"), task="multilabel", input_size=32, kwargs={"width": 8}, batch_size=8
    )
    ds = dask_dl.open_dataset(squares["B"])
    val = ds.sample.values[ds.split.values == "val"]

    def scored_like(round_: int, state) -> None:  # state scores on B's validation split as round_ did
        mine, row = score(squares["B"], val, [state], spec), h[(h["site"] == "B") & (h["round"] == round_)]
        assert mine["loss"] == pytest.approx(row["loss"].item(), abs=1e-9), round_
        assert mine["auroc_mean"] == pytest.approx(row["auroc_mean"].item(), abs=1e-9), round_

    # the model is B's best round, not its last (which did not improve there, or this proves nothing)
    assert run.model_round == best["B"] == run.checkpoint()["epoch"] < len(trained) - 1, (best, len(trained))
    scored_like(best["B"], run.state())
    # B started from A's best weights, not A's last: A alone hands over the same best, and one epoch on B from it
    # (the seed of B's first visit) is B's first round
    alone = dask_dl.fit_sites(
        {"A": _datasets(squares)["A"]}, protocol="incremental", rounds=6, patience=1, client=cluster3, **OPTIONS
    )
    assert alone.model_round == best["A"] < n_a - 1
    visit = {**OPTIONS, "seed": OPTIONS["seed"] + 1000 * (n_a + 1) + 1, "warmup_steps": 0}
    first = fit_visit(ds, epochs=1, trainers=1, client=cluster3, start_state=alone.state(), **visit)
    scored_like(n_a, first.checkpoint()["model"])


def test_fedprox_and_export_of_a_run(squares, cluster3, tmp_path):
    run = dask_dl.fit_sites(_datasets(squares), protocol="fedprox", mu=0.1, rounds=1, client=cluster3, **OPTIONS)
    assert run.status == "finished" and run.curves.shape == (1, 4)  # A, B, C and their mean
    path = dask_dl.export_onnx(run, tmp_path / "fedprox.onnx")
    assert read_model_info(path).labels == ("a", "b")
    torch.testing.assert_close(run.model().state_dict()["fc.weight"], run.state()["fc.weight"])


def test_normalization_is_every_sites_and_travels_with_the_model(squares, cluster3, tmp_path):
    norm = {"mean": 0.3, "std": 0.2}
    ds = dask_dl.open_dataset(squares["B"])
    run = dask_dl.fit_sites({"B": ds}, protocol="cyclic", rounds=1, normalization=norm, client=cluster3, **OPTIONS)
    # the site trained with it: the same visit through fit (seed of round 0's first visit) gives the same weights
    torch.manual_seed(OPTIONS["seed"])
    initial = build_model("small_cnn", num_outputs=2, width=8).state_dict()  # what every protocol starts from
    visit = {**OPTIONS, "seed": OPTIONS["seed"] + 1000, "warmup_steps": 0}
    alone = fit_visit(
        ds, epochs=1, trainers=1, client=cluster3, start_state=initial, normalization=norm, **visit
    ).checkpoint()["model"]
    for key, value in alone.items():
        torch.testing.assert_close(run.state()[key], value, rtol=0, atol=1e-6)
    # scored with it, on the site
    spec = ModelSpec(
        name="small_cnn",
        labels=("a", "b"),
        task="multilabel",
        input_size=32,
        kwargs={"width": 8},
        batch_size=8,
        normalization=norm,
    )
    val = ds.sample.values[ds.split.values == "val"]
    mine = score(squares["B"], val, [run.state()], spec)
    assert run.history.iloc[0]["loss"] == pytest.approx(mine["loss"], abs=1e-9)
    default = score(squares["B"], val, [run.state()], replace(spec, normalization=dict(DEFAULT_NORMALIZATION)))
    assert abs(default["loss"] - mine["loss"]) > 1e-3
    # and it goes with the model
    assert run.checkpoint()["normalization"] == norm
    assert read_model_info(run.export_onnx(tmp_path / "normalized.onnx")).normalization == norm
    with pytest.raises(ConfigurationError, match="std"):
        dask_dl.fit_sites(
            {"B": ds}, protocol="cyclic", rounds=1, normalization={"mean": 0.3, "std": 0}, client=cluster3
        )


def test_a_model_of_your_own_by_its_import_path_trains_across_sites_and_exports(squares, cluster3, tmp_path):
    from dask_dl.testing.models import TinyNet, tiny_net

    options = {**OPTIONS, "model": "dask_dl.testing.models:tiny_net", "model_kwargs": {"width": 2}}
    run = dask_dl.fit_sites(_datasets(squares), protocol="fedavg", rounds=1, client=cluster3, **options)
    assert run.status == "finished" and np.isfinite(run.curves.to_numpy()).all()
    model = run.model()
    assert isinstance(model, TinyNet) and model.conv1.out_channels == 2
    checkpoint = run.checkpoint()
    assert checkpoint["model_source"] == {
        "kind": "factory",
        "name": "dask_dl.testing.models:tiny_net",
        "kwargs": {"width": 2},
        "path": "dask_dl.testing.models:tiny_net",
    }
    path = dask_dl.export_onnx(checkpoint, tmp_path / "own.onnx")  # rebuilt from the path, without the code
    assert read_model_info(path).labels == ("a", "b")
    same = dask_dl.fit_sites(
        _datasets(squares), protocol="fedavg", rounds=1, client=cluster3, **{**options, "model": tiny_net}
    )  # the function itself: the same run
    for key, value in run.state().items():
        assert torch.equal(same.state()[key], value), key
    refused = [
        (TinyNet(2), "an instance of 'dask_dl.testing.models.TinyNet', which no name builds again"),
        (lambda n: TinyNet(n), r"the function '\S*test_fit_sites\.\S*<lambda>', which has no import path"),
    ]
    for model, said in refused:
        with pytest.raises(ConfigurationError, match=rf"by name .*; got {said}\. Pass a registry name"):
            dask_dl.fit_sites(_datasets(squares), protocol="fedavg", rounds=1, client=cluster3, model=model)


def test_stop_ends_the_run_and_frees_the_workers(squares, cluster3):
    run = dask_dl.fit_sites(_datasets(squares), protocol="cyclic", rounds=200, client=cluster3, wait=False, **OPTIONS)
    run.stop().wait(timeout=120)
    assert run.status == "stopped" and run.done
    assert not any(cluster3.run(lambda: torch.distributed.is_initialized()).values())


def test_bad_arguments_fail_before_any_work(squares, cluster3):
    sites = _datasets(squares)
    cases = [
        (dict(protocol="gossip"), "protocol"),
        (dict(protocol="fedavg", mu=0.1), "mu is an option of protocol=fedprox"),
        (dict(protocol="fedprox"), "needs mu > 0"),
        (dict(protocol="cyclic", min_sites=2), "min_sites is an option of protocol=fedavg/fedprox"),
        (dict(protocol="fedavg", min_sites=4), "more than the 3 sites"),
        (dict(protocol="cyclic", proportional_steps=True), "pass steps"),
        (dict(protocol="cyclic", site_weighted_loss=True, optimizer="adamw"), "AdamW"),
        (dict(protocol="cyclic", cyclic_lr=2.0), "0 < x <= 1"),
        (dict(protocol="cyclic", rounds=0), "rounds"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigurationError, match=message):
            dask_dl.fit_sites(sites, **{"rounds": 1, **options}, client=cluster3)
    with pytest.raises(ConfigurationError, match="has unknown keys"):
        dask_dl.fit_sites({"A": {"data": 1}}, protocol="cyclic", rounds=1, client=cluster3)
    with pytest.raises(ConfigurationError, match="no store"):
        dask_dl.fit_sites({"A": {"scheduler": "tcp://127.0.0.1:1"}}, protocol="cyclic", rounds=1)
    with pytest.raises(DatasetError, match="site 'C' has 32 training samples.*batch_size <= 32"):
        dask_dl.fit_sites(sites, protocol="cyclic", rounds=1, batch_size=40, client=cluster3)
    with pytest.raises(DatasetError, match="site 'A'.*no 'val' samples"):
        dask_dl.fit_sites(
            {"A": dask_dl.open_dataset(squares["A"], split="train")}, protocol="cyclic", rounds=1, client=cluster3
        )


# ---- learning: three synthetic hospitals --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def _no_site_lost(*runs) -> None:
    """A protocol goes on without a site it lost (a worker gone, a cluster that did not answer), and its numbers
    change with it: a learning test compares only runs that kept every site."""
    for run in runs:
        lost = run.history[run.history["event"] == "lost"]
        assert lost.empty, lost[["round", "site", "error"]].to_string()


@pytest.mark.learning
def test_cyclic_and_fedavg_learn_nearly_as_well_as_pooling(tmp_path_factory, cluster3, learning_seed):
    """Cyclic and fedavg end within 0.1 mean test AUROC of pooled training with the same 8 epochs of data, and
    well above the weaker protocols (ensemble: 2 epochs per site, incremental: 1 epoch per site), which learn.

    Measured over seeds 0-4 (1500 images, three sites, 4 rounds of 2 local epochs; test AUROC):

    ====  ======  ======  ======  ========  ===========
    seed  pooled  cyclic  fedavg  ensemble  incremental
    ====  ======  ======  ======  ========  ===========
    0     0.865   0.840   0.832   0.725     0.724
    1     0.888   0.846   0.857   0.634     0.692
    2     0.895   0.830   0.820   0.706     0.652
    3     0.899   0.870   0.862   0.678     0.638
    4     0.915   0.913   0.868   0.744     0.646
    ====  ======  ======  ======  ========  ===========

    Cyclic trails pooling by 0.002-0.065 and fedavg by 0.031-0.075; the weaker of the two beats the better of
    ensemble and incremental by 0.107-0.184; those two reach 0.634-0.744 (chance: 0.5).
    """
    data = synthetic_sites(tmp_path_factory.mktemp("hospitals"), n_images=1500, seed=learning_seed, client=cluster3)
    sites, test = _datasets(data.stores), dask_dl.open_dataset(data.test)
    options = dict(model="small_cnn", batch_size=16, lr=0.05, optimizer="sgd", seed=learning_seed)
    pooled = dask_dl.fit(dask_dl.open_dataset(data.pooled), epochs=8, trainers=1, client=cluster3, **options)
    spec = ModelSpec(name="small_cnn", labels=tuple(pooled.checkpoint()["labels"]), task="multilabel", input_size=32)
    baseline = score(data.test, test.sample.values, [pooled.checkpoint()["model"]], spec)["auroc_mean"]
    assert baseline > 0.8, baseline
    results = {}
    for protocol in ("cyclic", "fedavg"):
        run = dask_dl.fit_sites(
            sites, protocol=protocol, rounds=4, local_epochs=2, test=test, client=cluster3, **options
        )
        results[protocol] = run.curves["test"].iloc[-1]
        assert list(run.curves.index) == [0, 1, 2, 3]
        _no_site_lost(run)
    ensemble = dask_dl.fit_sites(
        sites, protocol="ensemble", rounds=1, local_epochs=2, test=test, client=cluster3, **options
    )
    incremental = dask_dl.fit_sites(sites, protocol="incremental", rounds=1, test=test, client=cluster3, **options)
    results["ensemble"] = ensemble.curves["test"].iloc[-1]
    results["incremental"] = incremental.curves["test"].iloc[-1]
    _no_site_lost(ensemble, incremental)
    print(f"pooled {baseline:.3f}", {k: round(float(v), 3) for k, v in results.items()})
    for protocol in ("cyclic", "fedavg"):
        assert results[protocol] >= baseline - 0.1, (protocol, results, baseline)
        assert results[protocol] > max(results["ensemble"], results["incremental"]) + 0.05, (protocol, results)
    # the weaker protocols learn, and are worse than pooling: recorded, not hidden
    for protocol in ("ensemble", "incremental"):
        assert 0.55 < results[protocol] < baseline, (protocol, results, baseline)
