"""What does splitting the model cost and save? Memory per trainer and images/s of DDP, FSDP and a pipeline.

The same model (dask_dl's resnet18 by default, 1 channel, 2 labels) trains on random images with SGD + momentum
on N gloo ranks of this machine (one process each, one thread), wrapped as ``fit`` wraps it on its trainers:
``DistributedDataParallel``, ``parallel="fsdp"`` (:class:`dask_dl.train.parallel.fsdp.ShardedModel`) and
``parallel="pipeline"`` with ``stages=N`` (:class:`dask_dl.train.parallel.pipeline.PipelineModel`, 1F1B).

Printed per mode: the bytes the largest rank holds for parameters, gradients and optimizer state, measured on the
ranks after a step (FSDP: the local shards; pipeline: the stage), next to the estimate ``fit`` checks a
``memory_budget`` against (:func:`dask_dl.train.parallel.memory.estimate_memory`); and the images per second of
the whole run (every image counted once: DDP and FSDP ranks each take ``--batch`` images per step, a pipeline
takes ``--batch`` per step over all its stages). Ratios are against DDP. The ranks share this machine's cores,
so on a small machine the times say more about the schedules' overheads than about their scaling.

    python bench/model_parallel.py                       # resnet18 at 64 px, 2 ranks (~1-2 min on 2 cores)
    python bench/model_parallel.py --model small_cnn --size 32 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace


def _state_bytes(module, optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards of DTensors)."""
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def nbytes(tensors):
        return sum(local(t).numel() * local(t).element_size() for t in tensors if isinstance(t, torch.Tensor))

    params = list(module.parameters())
    states = [v for s in optimizer.state.values() for v in s.values()]
    return {
        "parameters": nbytes(params),
        "gradients": nbytes(p.grad for p in params if p.grad is not None),
        "optimizer": nbytes(states),
    }


def _rank(rank: int, args: argparse.Namespace, rendezvous: str, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from dask_dl.models import build_model
    from dask_dl.train.parallel.wrap import wrap_model

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=args.ranks, timeout=timedelta(seconds=300)
    )

    def loss_fn(logits, y):
        return F.binary_cross_entropy_with_logits(logits, y)

    results = {}
    for mode in ("ddp", "fsdp", "pipeline"):
        torch.manual_seed(0)
        model = build_model(args.model, num_outputs=2)
        spec = SimpleNamespace(
            parallel=mode,
            stages=args.ranks,
            microbatches=args.microbatches,
            schedule="1f1b",
            model_name=args.model,
            batch_size=args.batch,
            input_size=args.size,
        )
        if mode == "ddp":
            wrapped = DistributedDataParallel(model)
            module = model
        else:
            wrapped = wrap_model(spec, model, device=torch.device("cpu"), rank=rank, world_size=args.ranks)
            module = wrapped.module
        del model
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch, 1, args.size, args.size, generator=generator)
        y = (torch.rand(args.batch, 2, generator=generator) > 0.5).float()
        wrapped.train()
        times = []
        for step in range(args.steps + 1):  # the first step (shape inference, buffers) is not timed
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            if mode == "ddp":
                loss_fn(wrapped(x), y).backward()
            else:
                wrapped.forward_backward(x, y, loss_fn)
            optimizer.step()
            dist.barrier()
            if step:
                times.append(time.perf_counter() - start)
        held = _state_bytes(module, optimizer)
        gathered: list = [None] * args.ranks
        dist.all_gather_object(gathered, held)
        images = args.batch * (1 if mode == "pipeline" else args.ranks)  # every image once
        results[mode] = {"held": gathered, "images_per_s": images * len(times) / sum(times)}
        del wrapped, module, optimizer
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="images per rank and step (per pipeline: all stages)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    import torch
    import torch.multiprocessing as mp
    from dask.utils import format_bytes

    from dask_dl.models import build_model
    from dask_dl.train.parallel.memory import estimate_memory

    folder = tempfile.mkdtemp(prefix="dask-dl-bench-")
    out, rendezvous = os.path.join(folder, "results.json"), f"file://{folder}/rendezvous"  # no port to race for
    started = time.perf_counter()
    mp.spawn(_rank, args=(args, rendezvous, out), nprocs=args.ranks, join=True)
    with open(out) as f:
        results = json.load(f)
    with torch.device("meta"):
        model = build_model(args.model, num_outputs=2)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"{args.model} ({n / 1e6:.2f}M parameters) at {args.size} px, {args.ranks} gloo ranks x 1 thread, "
        f"batch {args.batch}, {args.steps} timed steps; pipeline: {args.ranks} stages, {args.microbatches} "
        f"micro-batches, 1f1b; wall {time.perf_counter() - started:.0f} s"
    )
    print(
        f"{'mode':9} {'params+grads+optim (largest rank)':>36} {'vs ddp':>7} {'estimate':>11} {'images/s':>9} "
        f"{'vs ddp':>7}"
    )
    base = None
    for mode, r in results.items():
        largest = max(r["held"], key=lambda h: sum(h.values()))
        total = sum(largest.values())
        estimate = estimate_memory(model, parallel=mode, trainers=args.ranks, stages=args.ranks).total
        if base is None:
            base = (total, r["images_per_s"])
        print(
            f"{mode:9} {format_bytes(total):>36} {total / base[0]:>7.2f} {format_bytes(estimate):>11} "
            f"{r['images_per_s']:>9.1f} {r['images_per_s'] / base[1]:>7.2f}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
