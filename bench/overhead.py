"""What does dask_dl add to a training step? One trainer against a plain PyTorch loop on the same worker.

Both run on the same Dask worker process (same torch thread count), with the same model, batch size, optimizer
and images: the plain loop steps over uint8 batches already in memory (no reading at all), dask_dl reads them
through its ChunkLoader from the Zarr store in its first epoch and keeps the decoded chunks for the next ones
(``dask-dl.train.cache``), and mixes and normalizes every batch.
The plain loop runs before and after dask_dl, as many timed passes over the same batches as dask_dl has timed
epochs. The ratio is printed of the medians and of the best passes (the usual way to compare timings on a machine
that runs other work too); on a shared machine, rerun it: other jobs move single passes by 20 % or more.

Prints the step-time ratio (target <= 1.03) and the share of the step spent waiting for data (target < 5 %).

    python bench/overhead.py                      # small_cnn, 64 px, batch 32
    python bench/overhead.py --cpu 1                # the worker pinned to one core
    python bench/overhead.py --model resnet18 --size 128 --batch-size 16
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def make_store(root: str, *, images: int, size: int, client) -> str:
    """A synthetic NIH-like collection ingested at ``size`` px (reused when it is already there)."""
    import dask_dl

    store = os.path.join(root, f"bench-{images}-{size}.zarr")
    if not os.path.exists(os.path.join(store, "zarr.json")):
        dask_dl.synthesize(os.path.join(root, f"nih-{images}"), n_images=images, size=max(size, 64), client=client)
        catalog = dask_dl.read_nih(os.path.join(root, f"nih-{images}"))
        dask_dl.ingest(catalog, store, size=size, chunk=32, shard=4, client=client, progress=False, overwrite=True)
    return store


def plain_loop(
    store: str, samples: np.ndarray, *, model: str, batch_size: int, steps: int, lr: float, seed: int, passes: int
) -> list[float]:
    """Seconds per step of each of ``passes`` passes of a plain PyTorch loop over in-memory batches, after one
    warm-up pass (run on the worker)."""
    import torch
    import torch.nn.functional as F
    import zarr
    from distributed import get_worker

    from dask_dl import allocator
    from dask_dl.models import build_model, normalize

    torch.set_num_threads(get_worker().state.nthreads)
    allocator.keep_freed_memory()  # as a trainer does (dask_dl/allocator.py): compare like with like
    group = zarr.open_group(store, mode="r")
    rows = np.sort(samples)[: steps * batch_size]
    images = np.asarray(group["image"][rows.min() : rows.max() + 1])[rows - rows.min()]
    labels = torch.from_numpy(np.asarray(group["label"][:], dtype=np.float32)[rows])
    # uint8 batches in memory, normalized in the loop as a plain script would (dask_dl's loader does it on its
    # background thread, overlapped with compute)
    batches = [
        (images[i : i + batch_size], labels[i : i + batch_size]) for i in range(0, steps * batch_size, batch_size)
    ]
    torch.manual_seed(seed)
    net = build_model(model, num_outputs=labels.shape[1])
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    times = []
    for _ in range(passes + 1):  # the first pass warms up the allocator and kernels
        start = time.perf_counter()
        for pixels, y in batches:
            opt.zero_grad(set_to_none=True)
            loss = F.binary_cross_entropy_with_logits(net(normalize(pixels)), y)
            loss.backward()
            opt.step()
            float(loss.detach())  # dask_dl reads the loss every step too
        times.append((time.perf_counter() - start) / len(batches))
    allocator.restore()
    return times[1:]


def pin_to(cpu: int) -> list[int]:
    """Pin every thread of this process (and the threads it starts later) to CPU ``cpu``: a 1-core worker."""
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    for tid in tids:
        os.sched_setaffinity(tid, {cpu})
    return tids


def training_parser(doc: str, *, epochs: int) -> argparse.ArgumentParser:
    """The options every training benchmark shares: model, image size, batch, data size, epochs, cache folder."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default="small_cnn")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--images", type=int, default=1500)
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "dask-dl-bench"))
    return parser


def main() -> None:
    parser = training_parser(__doc__, epochs=7)
    parser.add_argument("--threads", type=int, default=1, help="threads of the trainer's worker")
    parser.add_argument(
        "--cpu",
        type=int,
        default=None,
        help="pin the worker to this CPU (a 1-core worker: the loader's threads cannot borrow a "
        "second core the plain loop does not use); default: not pinned",
    )
    args = parser.parse_args()

    from distributed import Client, LocalCluster

    import dask_dl

    with (
        LocalCluster(n_workers=1, threads_per_worker=args.threads, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        store = make_store(args.root, images=args.images, size=args.size, client=client)
        if args.cpu is not None:
            client.run(pin_to, args.cpu)
        ds = dask_dl.open_dataset(store)
        train = ds.sample.values[ds.split.values == "train"]
        steps = len(train) // args.batch_size
        # as many timed passes of the plain loop (half before, half after) as dask_dl has timed epochs
        half = max(1, (args.epochs - 1) // 2)
        plain = dict(model=args.model, batch_size=args.batch_size, steps=steps, lr=0.01, seed=0, passes=half)
        before = client.submit(plain_loop, store, train, **plain, pure=False).result()
        run = dask_dl.fit(
            ds,
            model=args.model,
            epochs=args.epochs,
            batch_size=args.batch_size,
            trainers=1,
            lr=0.01,
            compression="none",
            client=client,
        )
        after = client.submit(plain_loop, store, train, **plain, pure=False).result()

    h = run.history.iloc[1:] if len(run.history) > 1 else run.history  # epoch 0 warms up
    steps_s = args.batch_size / h["images_per_s"].to_numpy()
    loop_s = h["compute_s"] + h["comm_s"] + h["data_wait_s"]
    wait_share = float(np.median(h["data_wait_s"] / loop_s))
    plain_s = np.array(before + after)
    print(
        f"model {args.model}, {args.size} px, batch {args.batch_size}, {steps} steps/epoch, "
        f"{args.threads} thread(s), pinned to CPU {args.cpu}, torch {__import__('torch').__version__}, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"plain PyTorch loop   {1000 * plain_s.min():8.2f} ms/step best, {1000 * np.median(plain_s):8.2f} median "
        f"({len(before)} passes before dask_dl, {len(after)} after)"
    )
    print(
        f"dask_dl, 1 trainer   {1000 * steps_s.min():8.2f} ms/step best, {1000 * np.median(steps_s):8.2f} median "
        f"(epochs 2..{args.epochs})"
    )
    inline = " (on one CPU the loader works in the trainer's thread: its mixing and normalizing)" if args.cpu else ""
    print(f"data wait share      {100 * wait_share:8.2f} % (target < 5 %){inline}")
    print(
        f"step-time ratio      {np.median(steps_s) / np.median(plain_s):8.3f} of the medians, "
        f"{steps_s.min() / plain_s.min():.3f} of the best   (target <= 1.03)"
    )


if __name__ == "__main__":
    main()
