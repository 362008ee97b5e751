"""How fast does dask_dl train on a GPU, against a plain PyTorch loop on the same GPU and the same images?

One trainer on a GPU worker (``make("cuda")``; with ``--device cpu`` a GPU-tagged CPU worker stands in, for a smoke
run without a GPU). Three figures per model, all images/s over the same uint8 images of one Zarr store:

- dask_dl ``fit`` (its own precision and memory format; best epoch after the first),
- a plain PyTorch loop on the same worker in float32 (like for like: the ratio dask_dl / plain is the overhead),
- the plain loop with bf16 autocast and channels_last (what the GPU gives a tuned script: the headroom),

and the GPU-vs-CPU speedup of the plain float32 loop (a few steps on the CPU workers' cores). For the models in
``--augment-models``, also ``fit(augment=True)`` with the augmentation on the trainer's CPU cores and on the GPU
(``augment_on="cpu"`` / ``"device"``, :mod:`dask_dl.train.feed`).

    python bench/gpu.py                                         # resnet18 and alexnet, 224 px, batch 256, CUDA
    python bench/gpu.py --device cpu --size 64 --batch-size 8 --images 160 --steps 2   # smoke run, no GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from overhead import make_store  # noqa: E402


def plain_images_per_s(store: str, *, model: str, batch_size: int, steps: int, device: str, fast: bool) -> float:
    """Images/s of a plain PyTorch training loop on ``device`` over in-memory uint8 batches of ``store``."""
    import torch
    import torch.nn.functional as F
    import zarr

    from dask_dl.models import build_model, normalize

    group = zarr.open_group(store, mode="r")
    n = min(group["image"].shape[0], batch_size * steps)
    images = torch.from_numpy(np.asarray(group["image"][:n]))
    labels = torch.from_numpy(np.asarray(group["label"][:n], dtype=np.float32))
    torch.manual_seed(0)
    net = build_model(model, num_outputs=labels.shape[1]).to(device)
    if fast:
        net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    batches = [(images[i : i + batch_size], labels[i : i + batch_size]) for i in range(0, n, batch_size)]
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=fast)

    def one_pass() -> float:
        start = time.perf_counter()
        for pixels, y in batches:
            x = normalize(pixels.to(device, non_blocking=True))
            x = x.contiguous(memory_format=torch.channels_last) if fast else x
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = F.binary_cross_entropy_with_logits(net(x).float(), y.to(device))
            loss.backward()
            opt.step()
        float(loss.detach())  # waits for the device
        return n / (time.perf_counter() - start)

    one_pass()  # warm-up: kernels, allocator, cudnn autotuning
    return max(one_pass() for _ in range(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet18,alexnet")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--images", type=int, default=3200, help="images in the synthetic collection")
    parser.add_argument("--steps", type=int, default=8, help="steps of a plain-loop pass on the GPU")
    parser.add_argument("--cpu-steps", type=int, default=2, help="steps of the plain loop on the CPU")
    parser.add_argument("--epochs", type=int, default=2, help="dask_dl epochs (the first warms up)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--augment-models", default="", help="models also fit with augmentation, on CPU and GPU")
    parser.add_argument("--cpu-workers", type=int, default=4)
    parser.add_argument("--root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "dask-dl-bench"))
    args = parser.parse_args()

    import torch

    import dask_dl
    from dask_dl.cluster import connect, cpu_workers, gpu_workers

    if args.device == "cuda":
        options = {"kind": "cuda", "cpu_workers": args.cpu_workers, "threads_per_worker": 4}
    else:  # a GPU-tagged CPU worker stands in for the GPU worker
        options = {"kind": "local", "n_workers": 1, "tagged_workers": 1}
    with connect(**options) as client:
        store = make_store(args.root, images=args.images, size=args.size, client=client)
        trainer, cpus = gpu_workers(client)[:1], cpu_workers(client)
        gpu_name = client.run(
            lambda: torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", workers=trainer
        )[trainer[0]]
        print(f"{args.size} px, batch {args.batch_size}, device {gpu_name}, torch {torch.__version__}")

        def fit_rate(model: str, **options) -> float:
            run = dask_dl.fit(
                dask_dl.open_dataset(store),
                model=model,
                epochs=args.epochs,
                batch_size=args.batch_size,
                trainers=1,
                lr=0.01,
                client=client,
                **options,
            )
            h = run.history.iloc[1:] if len(run.history) > 1 else run.history
            return float(h["images_per_s"].max())

        for model in args.models.split(","):
            ours = fit_rate(model)
            common = dict(model=model, batch_size=args.batch_size, device=args.device, pure=False, workers=trainer)
            plain = client.submit(plain_images_per_s, store, steps=args.steps, fast=False, **common).result()
            fast = client.submit(plain_images_per_s, store, steps=args.steps, fast=True, **common).result()
            cpu = client.submit(
                plain_images_per_s,
                store,
                model=model,
                batch_size=args.batch_size,
                steps=args.cpu_steps,
                device="cpu",
                fast=False,
                pure=False,
                workers=cpus[:1] if cpus else trainer,
            ).result()
            print(
                f"{model:10s} dask_dl {ours:9.1f} img/s | plain fp32 {plain:9.1f} | plain bf16+channels_last "
                f"{fast:9.1f} | plain fp32 on one CPU worker {cpu:8.1f}"
            )
            print(
                f"{model:10s} dask_dl / plain fp32 {ours / plain:6.3f}   dask_dl / plain bf16 {ours / fast:6.3f}   "
                f"GPU / CPU (plain fp32) {plain / cpu:8.1f}x"
            )
            if model in args.augment_models.split(","):
                on_cpu = fit_rate(model, augment=True, augment_on="cpu")
                on_gpu = fit_rate(model, augment=True, augment_on="device")
                print(
                    f"{model:10s} dask_dl augmented on the trainer's CPU {on_cpu:9.1f} img/s | on its device "
                    f"{on_gpu:9.1f} | device / CPU augmentation {on_gpu / on_cpu:6.2f}   "
                    f"unaugmented / device-augmented {ours / on_gpu:6.3f}"
                )


if __name__ == "__main__":
    main()
