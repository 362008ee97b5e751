"""What do SIGKILLed workers and memory pauses cost the whole path, and does anything get lost?

Each stage runs twice in the same cluster, calm and under chaos, and the two results are compared exactly:

- **ingest**: a synthetic NIH collection (``--images``, a few corrupt files) into a store, while
  :class:`dask_dl.testing.chaos.WorkerKiller` SIGKILLs a random worker of ``--workers`` every ``--every`` seconds
  (one down at a time: its nanny's replacement is up before the next kill). Compared: the image array, the valid
  mask and the rejects table.
- **predict**: small_cnn exported to ONNX, scores of the store under the same killer. Compared: every score.
- **fit**: 2 trainers and a spare worker, small_cnn with onebit compression and step checkpoints every 3 steps, on
  the squares collection; a trainer's worker is killed once per epoch (``--epochs``). Compared: the weights with an
  uninterrupted run's (``torch.equal``), and one restart row per kill.
- **sweep**: 4 trials of small_cnn (a grid of learning rates, no pruning) on 2 one-trainer groups, while a worker
  of a running trial is SIGKILLed every ``--sweep-every`` seconds (``--sweep-kills`` at most): each trial goes on
  from its newest epoch checkpoint on another group. Compared: every trial complete, with the calm sweep's metric
  per epoch.
- **memory**: ``--large`` images of 7000 px into a store on 2 workers whose pause threshold is their idle memory
  plus half an image's decode buffer (``distributed.worker.memory.pause``): they pause and resume. Compared with the
  same images ingested on workers without a threshold.

Prints, per stage, the kills survived (or pauses), the calm and chaos seconds, the seconds lost and whether
everything matched. The first run of each stage warms the workers' imports; the seconds are noisy on a shared
machine.

    python bench/chaos.py                            # 3000 images at 224 px, a kill every second
    python bench/chaos.py --images 1000 --source-size 64 --size 64 --every 2 --workers 3
    python bench/chaos.py --stages fit memory
    python bench/chaos.py --stages sweep --epochs 3
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def timed(function):
    started = time.time()
    result = function()
    return result, started, time.time()


def landed(kills, started: float, ended: float) -> int:
    return sum(started <= kill.at <= ended for kill in kills)


def ingest_and_predict(root: Path, args) -> list[dict]:
    import numpy as np
    import torch
    from distributed import Client, LocalCluster

    import dask_dl
    from dask_dl.models import build_model
    from dask_dl.normalize import normalize
    from dask_dl.testing.chaos import WorkerKiller, store_differences

    chaos = dict(every=args.every, max_seconds=3600, keep=args.workers - 1)
    options = dict(size=args.size, chunk=16, shard=2, progress=False)
    rows = []
    with (
        LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        dask_dl.synthesize(
            root / "nih", n_images=args.images, size=args.source_size, seed=2, corrupt_fraction=0.01, client=client
        )
        catalog = dask_dl.read_catalog(root / "nih")
        dask_dl.ingest(catalog, str(root / "warm.zarr"), client=client, **options)  # imports, caches
        calm, started, ended = timed(lambda: dask_dl.ingest(catalog, str(root / "calm.zarr"), client=client, **options))
        calm_s = ended - started
        with WorkerKiller(client, seed=1, max_kills=args.ingest_kills, **chaos) as killer:
            _, started, ended = timed(
                lambda: dask_dl.ingest(catalog, str(root / "chaos.zarr"), client=client, **options)
            )
        differ = store_differences(str(root / "calm.zarr"), str(root / "chaos.zarr"))
        rows.append(
            dict(
                stage="ingest",
                kills=landed(killer.kills, started, ended),
                calm_s=calm_s,
                chaos_s=ended - started,
                matched=not differ,
                differs=", ".join(differ),
            )
        )
        print(rows[-1], flush=True)

        dataset = dask_dl.open_dataset(str(root / "calm.zarr"))
        torch.manual_seed(0)
        net = build_model("small_cnn", num_outputs=dataset.sizes["finding"], width=8)
        with torch.no_grad():
            net(normalize(dataset.image[:16].values))
        model = str(root / "cxr.onnx")
        dask_dl.export_onnx(net.eval(), model, labels=list(dataset.finding.values), input_size=args.size)
        client.wait_for_workers(args.workers, timeout=300)
        dask_dl.predict(dataset, model, client=client).compute()  # sessions on every worker
        expected, started, ended = timed(lambda: dask_dl.predict(dataset, model, client=client).compute())
        calm_s = ended - started
        with WorkerKiller(client, seed=2, max_kills=args.predict_kills, **chaos) as killer:
            scores, started, ended = timed(lambda: dask_dl.predict(dataset, model, client=client).compute())
        matched = bool(np.array_equal(scores, expected))
        rows.append(
            dict(
                stage="predict",
                kills=landed(killer.kills, started, ended),
                calm_s=calm_s,
                chaos_s=ended - started,
                matched=matched,
                differs="" if matched else "scores",
            )
        )
        print(rows[-1], flush=True)
        client.wait_for_workers(args.workers, timeout=300)  # a worker closed while it starts may hang the close
    return rows


def fit(root: Path, args) -> dict:
    import torch
    from distributed import Client, LocalCluster

    import dask_dl
    from dask_dl.testing.chaos import WorkerKiller
    from dask_dl.testing.train import squares_collection

    options = dict(
        model="small_cnn",
        model_kwargs={"width": 8},
        epochs=args.epochs,
        batch_size=1,
        trainers=2,
        lr=0.05,
        compression="onebit",
        warmup_steps=2,
        seed=5,
        max_restarts=args.epochs,
    )
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        store = str(root / "squares.zarr")
        catalog = squares_collection(root / "squares", n_train=args.fit_images, n_val=32)
        dask_dl.ingest(catalog, store, size=32, chunk=8, shard=2, client=client, progress=False)
        dataset = dask_dl.open_dataset(store)
        client.run(lambda: __import__("dask_dl.train.actor"))
        straight, started, ended = timed(lambda: dask_dl.fit(dataset, client=client, **options))
        calm_s = ended - started
        ck = root / "ck"
        started = time.time()
        run = dask_dl.fit(
            dataset, client=client, **options, checkpoint_dir=str(ck), checkpoint_every_steps=3, wait=False
        )
        killer = WorkerKiller(client, among=lambda: run.workers, keep=0)
        for epoch in range(args.epochs):
            while not list(ck.glob(f"step-{epoch:04d}-*.pt")) and not run.done:
                time.sleep(0.01)
            while not run.done and killer.kill() is None:  # a nanny's restart under way
                time.sleep(0.01)
            if run.done:
                break
            while len(run.restarts) <= epoch and not run.done:
                time.sleep(0.01)
        run.wait(timeout=3600)
        chaos_s = time.time() - started
        a, b = straight.checkpoint()["model"], run.checkpoint()["model"]
        differ = [name for name in a if not torch.equal(a[name], b[name])]
        if len(run.restarts) != len(killer.kills):
            differ.append(f"{len(run.restarts)} restart rows for {len(killer.kills)} kills")
        if set(run.restarts["world_size"]) != {2}:
            differ.append(f"world sizes {sorted(set(run.restarts['world_size']))}")
        client.wait_for_workers(3, timeout=300)
    return dict(
        stage="fit",
        kills=len(killer.kills),
        calm_s=calm_s,
        chaos_s=chaos_s,
        matched=not differ,
        differs=", ".join(differ[:3]),
    )


def sweep(root: Path, args) -> dict:
    from distributed import Client, LocalCluster
    from optuna.distributions import CategoricalDistribution

    import dask_dl
    from dask_dl.testing.chaos import WorkerKiller
    from dask_dl.testing.train import squares_collection

    options = dict(model="small_cnn", model_kwargs={"width": 8}, batch_size=2, optimizer="sgd", seed=0)
    space = {"lr": CategoricalDistribution([0.02, 0.05, 0.1, 0.2])}
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        store = str(root / "sweep-squares.zarr")
        catalog = squares_collection(root / "sweep-squares", n_train=args.fit_images, n_val=32)
        dask_dl.ingest(catalog, store, size=32, chunk=8, shard=2, client=client, progress=False)
        dataset = dask_dl.open_dataset(store)

        def run_sweep(folder: str, **kwargs):
            return dask_dl.sweep(
                dataset,
                space,
                trials=4,
                sampler="grid",
                pruner="none",
                epochs=args.epochs,
                checkpoint_dir=str(root / folder),
                client=client,
                **options,
                **kwargs,
            )

        calm, started, ended = timed(lambda: run_sweep("calm"))
        calm_s = ended - started
        started = time.time()
        chaotic = run_sweep("chaos", wait=False)

        def running() -> list[str]:
            records = list(chaotic._scheduler.records.values())
            return [a for r in records if r.state == "running" and r.run is not None for a in r.group]

        killer = WorkerKiller(client, among=running, keep=0)
        while not list((root / "chaos").glob("trial-*/epoch-0000.pt")) and not chaotic.done:
            time.sleep(0.01)  # the first kill once a trial has a checkpoint to go on from
        while not chaotic.done:
            if len(killer.kills) < args.sweep_kills:
                killer.kill()
            time.sleep(args.sweep_every)
        chaotic.wait()
        chaos_s = time.time() - started
        differ = []
        a, b = (r.set_index("params_lr") for r in (calm.results, chaotic.results))
        for lr in a.index:
            if b.loc[lr, "state"] != "complete":
                differ.append(f"lr {lr}: {b.loc[lr, 'state']} ({b.loc[lr, 'error']})")
            elif list(a.loc[lr, "val_auroc_mean"]) != list(b.loc[lr, "val_auroc_mean"]):
                differ.append(f"lr {lr}: metrics differ")
        client.wait_for_workers(2, timeout=300)
    return dict(
        stage="sweep",
        kills=len(killer.kills),
        calm_s=calm_s,
        chaos_s=chaos_s,
        matched=not differ,
        differs=", ".join(differ[:3]),
    )


def memory(root: Path, args) -> dict:
    import dask
    from distributed import Client, LocalCluster

    import dask_dl
    from dask_dl.testing.chaos import large_images, pause_workers_above, paused_workers, store_differences

    side = 7000
    root = root / "memory"
    catalog = large_images(root / "large", args.large, side=side)
    options = dict(size=64, chunk=1, shard=2, progress=False)
    seconds = {}
    for kind in ("calm", "paused"):
        # the nanny would restart a worker at 95 % of its limit: pausing is what is measured here, not that
        with dask.config.set({"distributed.worker.memory.terminate": False}):
            cluster = LocalCluster(
                n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", memory_limit="4 GiB"
            )
        with cluster, Client(cluster) as client:
            # a large image on every worker first: what a worker keeps after one (codecs, glibc's arenas) is idle
            warm = catalog.iloc[:6]
            dask_dl.ingest(warm, str(root / f"warm-{kind}.zarr"), client=client, **{**options, "shard": 1})
            if kind == "paused":
                pause_workers_above(client, side * side // 2)
            _, started, ended = timed(
                lambda k=kind, c=client: dask_dl.ingest(catalog, str(root / f"{k}.zarr"), client=c, **options)
            )
            seconds[kind] = ended - started
            pauses = sum(paused_workers(client).values())
    differ = store_differences(str(root / "calm.zarr"), str(root / "paused.zarr"))
    return dict(
        stage="memory",
        kills=0,
        pauses=pauses,
        calm_s=seconds["calm"],
        chaos_s=seconds["paused"],
        matched=not differ,
        differs=", ".join(differ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=3000, help="synthetic images to ingest and score")
    parser.add_argument("--source-size", type=int, default=256, help="side of the synthetic PNGs")
    parser.add_argument("--size", type=int, default=224, help="side of the ingested images")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for ingest and predict")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between kills (ingest, predict)")
    parser.add_argument("--ingest-kills", type=int, default=15, help="most kills during the ingest")
    parser.add_argument("--predict-kills", type=int, default=7, help="most kills during predict")
    parser.add_argument("--epochs", type=int, default=4, help="fit epochs, one kill in each")
    parser.add_argument("--fit-images", type=int, default=128, help="training images (steps per epoch: half)")
    parser.add_argument("--sweep-every", type=float, default=3.0, help="seconds between kills in the sweep stage")
    parser.add_argument("--sweep-kills", type=int, default=3, help="most kills during the sweep")
    parser.add_argument("--large", type=int, default=16, help="7000 px images for the memory stage")
    parser.add_argument(
        "--stages",
        nargs="+",
        default=["ingest", "predict", "fit", "sweep", "memory"],
        choices=["ingest", "predict", "fit", "sweep", "memory"],
        help="stages to run (ingest and predict run together)",
    )
    args = parser.parse_args()

    import pandas as pd

    root = Path(tempfile.mkdtemp(prefix="dask-dl-bench-chaos-"))
    rows = []
    try:
        stages = {"ingest, predict": ingest_and_predict, "fit": fit, "sweep": sweep, "memory": memory}
        for stage, run in stages.items():
            if not set(stage.split(", ")) & set(args.stages):
                continue
            try:
                done = run(root, args)
            except Exception as exc:  # a stage that fails is a finding: show it in the table, go on with the next
                done = dict(stage=stage, matched=False, differs=f"failed: {type(exc).__name__}: {exc}"[:100])
            if not isinstance(done, list):  # ingest_and_predict prints its rows as they come
                print(done, flush=True)
            rows += done if isinstance(done, list) else [done]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = pd.DataFrame(rows).set_index("stage")
    table["lost_s"] = table["chaos_s"] - table["calm_s"]
    for counted in ("pauses", "kills"):  # a stage that has none of them leaves its column out
        table[counted] = table.get(counted, pd.Series(0, index=table.index)).fillna(0).astype(int)
    columns = ["kills", "pauses", "calm_s", "chaos_s", "lost_s", "matched", "differs"]
    print(
        f"\nchaos: {args.images} images ({args.source_size} px, ingested at {args.size}) on {args.workers} workers, "
        f"a kill every {args.every} s; fit: a trainer killed in each of {args.epochs} epochs; memory: "
        f"{args.large} images of 7000 px on paused workers; sweep: 4 trials, a kill every {args.sweep_every} s"
    )
    print(table[columns].to_string(float_format=lambda v: f"{v:.1f}"))


if __name__ == "__main__":
    main()
