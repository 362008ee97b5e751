"""What would N trainers give? The scale-out model (dask_dl.train.compression.model), checked here and projected.

``--check`` calibrates and checks the model on this machine: the kernels' time per value measured on one thread,
then every compressor's exchange of an AlexNet-shaped gradient (45.5M values in DDP-like buckets, hooks called
back to back as in ``bench/compression.py``) timed on 2, 3 and 4 gloo ranks over veth links rate-limited with
``tc`` (bench/compression.py's namespaces), beside the model's prediction from the link that ``auto``'s probe
(all-reduces, and all-gathers and all-to-alls of 1 and 4 MB a rank: their rates under ``gather`` and ``a2a``,
their seconds per message on the ``link:`` lines) measures in the same group. It prints the model's error at each
point and, last, ``max error X%`` over them.
The ranks share this machine's cores: every rank measures the kernels again, all in step, before the exchanges,
and the model is given the slowest rank's figures (its time per value under that world's contention). Beside
each point it prints the CPU seconds all ranks spent in that step (every thread, system time included) and
``busy``, that CPU over what the machine's cores could give in the step's time: near 100%, the exchange is bound
by the cores the ranks share, which the model (ranks with cores of their own) leaves out.

``--auto`` answers the default question: real DDP training steps of dask_dl's alexnet (``--model``; 64 px, 4
images a rank) on 2 ranks, with each fixed compressor and with ``auto`` (which measures and chooses as ``fit``
does), on loopback and the veth links; it prints each choice's step time, auto's loss against the best fixed
choice, and, last, ``worst auto loss X%``.

Without either, it projects N = 8 to 256 trainers on 10, 25 and 100 Gbit/s links for small_cnn, resnet18,
resnet50 and alexnet with an H200's step time (published figures, see ``H200_IMAGES_PER_S``), prints the table
and draws docs/img/projection.png.

    python bench/projection.py --check        # root for the namespaces; 10-15 min on a loaded 2-core machine
    python bench/projection.py --auto         # root; ~6 min
    python bench/projection.py                # the projection table and plot (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from compression import _options, run_steps, run_world, teardown  # noqa: E402

from dask_dl.testing.compression import ALEXNET, ddp_buckets, model_shapes  # noqa: E402
from dask_dl.train.compression.model import (  # noqa: E402
    H200_KERNELS,
    Kernels,
    Link,
    exchange_time,
    step_time,
)

CHECKED = ("none", "bf16", "powersgd", "onebit", "onebit2")
FIXED = ("none", "bf16", "onebit", "onebit2")
PROJECTED = ("none", "bf16", "powersgd", "onebit", "onebit2")

#: images/s of one H200 at 224 px, batch 256, mixed precision. ResNet-50: NVIDIA's published training throughput
#: of an H100/H200-class GPU, ~3,000 images/s (NVIDIA Deep Learning Performance, "Training" table,
#: developer.nvidia.com/deep-learning-performance-training-inference/training; the issue's figure). The others
#: are scaled from it by forward FLOPs per image (ResNet-18 1.8 G, AlexNet 0.71 G, ResNet-50 4.1 G, He et al.
#: 2016; Krizhevsky et al. 2012), at most 5x ResNet-50's rate (kernel launches and memory bound layers keep the
#: small models from their FLOP ratio). small_cnn is given the same cap.
H200_IMAGES_PER_S = {"resnet50": 3000.0, "resnet18": 3000.0 * 4.1 / 1.8, "alexnet": 15000.0, "small_cnn": 15000.0}
BATCH = 256
#: seconds per message: TCP on 10 and 25 Gbit/s Ethernet, RDMA (RoCE/InfiniBand) on 100 Gbit/s
LINKS = {10: Link.gbit(10, alpha=30e-6), 25: Link.gbit(25, alpha=20e-6), 100: Link.gbit(100, alpha=5e-6)}
WORLDS = (8, 16, 32, 64, 128, 256)


# ---- the kernels, measured here -----------------------------------------------------------------------------


def _best(f, repeats: int = 3, sync=None) -> float:
    f()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_kernels(n: int = 2**23, *, lowrank: float | None = None, sync=None) -> Kernels:
    """Seconds per value of each kernel the model uses, one thread: the sums, division and cast on ``n`` values,
    the 1-bit kernels and PowerSGD on the AlexNet-shaped buckets (their per-value cost depends on the shapes).
    ``sync`` is called before each timed run: ranks that pass a barrier measure their kernels in step, so that
    every run meets the contention of all the others."""
    import torch

    from dask_dl.train.compression import kernels
    from dask_dl.train.compression.fused import warm_up
    from dask_dl.train.compression.plan import plan_stripes

    torch.set_num_threads(1)
    warm_up()
    a, b = torch.randn(n), torch.randn(n)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    work = []
    for i, shapes in enumerate(ddp_buckets(ALEXNET)):
        plan = plan_stripes(shapes, [f"p{i}.{j}" for j in range(len(shapes))], 1)
        size = sum(math.prod(s) for s in shapes)
        grad, residual = np.random.default_rng(i).standard_normal(size, np.float32), np.zeros(size, np.float32)
        message, owed = np.zeros((1, plan.size), np.uint8), kernels.owed_means(1, plan.columns)  # as the hook
        kernels.quantize(plan.tasks, message, plan.columns, grad=grad, vals=residual, owed=owed)
        work.append((plan, grad, residual, message, np.repeat(message, 4, axis=0), owed))
    values = sum(w[1].size for w in work)

    def quantize():
        for plan, grad, residual, message, _, owed in work:
            kernels.quantize(plan.tasks, message, plan.columns, grad=grad, vals=residual, owed=owed)

    def decode():
        for plan, grad, _, _, four, _ in work:
            kernels.decode(plan.tasks, four, plan.columns.repeat(4), grad, average=True)

    return Kernels(
        add=_best(lambda: a.add_(b), sync=sync) / n,
        add16=_best(lambda: a16.add_(b16), sync=sync) / n,
        div=_best(lambda: a.div_(1.0), sync=sync) / n,
        cast=_best(lambda: a.copy_(a.to(torch.bfloat16).div_(2.0)), sync=sync) / n,  # as torch's bf16 hook
        quantize=_best(quantize, sync=sync) / values,
        decode=_best(decode, sync=sync) / (4 * values),
        lowrank=_lowrank() if lowrank is None else lowrank,
    )


def powersgd_work(group=None, sync=None) -> float:
    """PowerSGD's work per value: its hook on the AlexNet-shaped buckets on a one-rank ``group`` (None: the default
    group, of one rank), best of two steps; ``sync`` is called before each step, as in :func:`measure_kernels`."""
    import torch

    from dask_dl.train.compression import make_compressor

    buckets = ddp_buckets(ALEXNET)
    grads = [torch.randn(sum(math.prod(s) for s in b)) for b in buckets]
    options, warm = _options("powersgd")
    compressor = make_compressor("powersgd", process_group=group, **options)
    run_steps(compressor, buckets, grads, warm + 1, sync)
    seconds = min(s[0] for s in run_steps(compressor, buckets, grads, 2, sync))
    return seconds / sum(g.numel() for g in grads)


def _lowrank() -> float:
    """:func:`powersgd_work` alone: in a one-rank gloo group of its own."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        return powersgd_work()
    finally:
        dist.destroy_process_group()


# ---- the ranks ------------------------------------------------------------------------------------------------


def _join(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=300),
    )


def exchange_worker(args) -> dict:
    """The probe's link, then each compressor's exchange of all buckets (the slowest rank's, best of the steps)."""
    import torch
    import torch.distributed as dist

    from dask_dl.train.compression import make_compressor
    from dask_dl.train.compression.auto import probe_link

    link = probe_link()
    # the kernels on every rank at once, in step: their time per value under this world's contention for the cores
    # (PowerSGD's on a one-rank group of each rank's own: new_group is called by every rank for every group)
    own = [dist.new_group([r]) for r in range(args.world)][args.rank]
    here = measure_kernels(lowrank=powersgd_work(own, dist.barrier), sync=dist.barrier)
    slowest = torch.tensor(list(here.to_dict().values()), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    here = Kernels(**dict(zip(here.to_dict(), slowest.tolist(), strict=True)))
    buckets = ddp_buckets(ALEXNET)
    gen = torch.Generator().manual_seed(args.rank)
    grads = [torch.randn(sum(math.prod(s) for s in b), generator=gen) * 1e-3 for b in buckets]
    results, cpus = {}, {}
    for name in args.compressors.split(","):
        options, warm = _options(name)
        compressor = make_compressor(name, **options)
        run_steps(compressor, buckets, grads, warm + 1, dist.barrier)
        steps = run_steps(compressor, buckets, grads, args.steps, dist.barrier)
        times = torch.tensor([s[0] for s in steps])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts until the slowest rank is done
        cpu = torch.tensor([s[3] for s in steps], dtype=torch.float64)
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM)  # every rank's CPU: they share this machine's cores
        best = int(times.argmin())  # the step least disturbed by the machine's other work
        results[name], cpus[name] = float(times[best]), float(cpu[best])
    return {"link": link.to_dict(), "kernels": here.to_dict(), "seconds": results, "cpu_s": cpus}


def training_worker(args) -> dict:
    """Real DDP steps of ``args.model`` with each fixed compressor and with auto, all models built first and stepped in
    turns (the machine's load drifts alike for all): the slowest rank's time of each, best of the steps."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from dask_dl.models import build_model
    from dask_dl.train.compression import make_compressor
    from dask_dl.train.compression.auto import decide
    from dask_dl.train.step import make_ddp

    gen = torch.Generator().manual_seed(args.rank)
    x, y = torch.randn(4, 1, 64, 64, generator=gen), torch.rand(4, 14, generator=gen).round()

    def loss_fn(logits, targets):
        return F.binary_cross_entropy_with_logits(logits, targets)

    trainers, auto = {}, None
    for name in args.compressors.split(","):
        torch.manual_seed(0)
        model = build_model(args.model, num_outputs=14, in_channels=1)
        ddp = make_ddp(model, device_ids=None)
        chosen = name
        if name == "auto":
            start = time.perf_counter()
            choice, figures = decide(model, x, y, loss_fn)
            auto = {"name": choice.name, "reason": choice.reason, "probe_s": time.perf_counter() - start}
            chosen = choice.name
        make_compressor(chosen).register(ddp)
        trainers[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), [])
    for _ in range(args.steps + 1):  # the first step allocates
        for ddp, optimizer, times in trainers.values():
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_fn(ddp(x), y).backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
    results = {}
    for name, (_, _, times) in trainers.items():
        seconds = torch.tensor(times[1:])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        results[name] = float(seconds.min())
    trainers.clear()
    return {"seconds": results, "auto": auto}


def worker(args) -> None:
    import torch.distributed as dist

    _join(args)
    out = training_worker(args) if "auto" in args.compressors.split(",") else exchange_worker(args)
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


# ---- the modes --------------------------------------------------------------------------------------------------


def check(args) -> None:
    kernels = measure_kernels()
    figures = ", ".join(f"{k} {v * 1e9:.2f} ns" for k, v in kernels.to_dict().items() if k != "share")
    print(f"kernels, seconds per value (one thread): {figures}")
    cores = len(os.sched_getaffinity(0))
    header = f"{'network':8} {'N':>2} {'probe Gbit/s':>12} {'gather':>6} {'a2a':>6} {'alpha us':>8} {'compressor':10} "
    print(header + f"{'measured s':>10} {'model s':>8} {'error':>7} {'CPU s':>6} {'busy':>5}")
    errors: list[tuple[int, float]] = []
    try:
        for network in args.networks.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                args.compressors = ",".join(CHECKED)
                try:
                    out = run_world(world, network, args, script=__file__)
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    print(f"{network:8} {world:>2} failed: {exc}", flush=True)
                    continue
                link, here = Link.from_dict(out["link"]), Kernels(**out["kernels"])
                print(
                    f"{network:8} {world:>2} kernels on the ranks: quantize {here.quantize * 1e9:.2f} ns, decode "
                    f"{here.decode * 1e9:.2f} ns ({here.quantize / kernels.quantize:.2f}x alone), PowerSGD "
                    f"{here.lowrank * 1e9:.2f} ns ({here.lowrank / kernels.lowrank:.2f}x alone)"
                )
                print(
                    f"{network:8} {world:>2} link: all-gathers {link.small * 8 / 1e9:.3f} Gbit/s and "
                    f"{link.small_alpha * 1e6:+.0f} us a message, all-to-alls {link.spread * 8 / 1e9:.3f} Gbit/s and "
                    f"{link.spread_alpha * 1e6:+.0f} us a message (1 and 4 MB a rank)"
                )
                for name, measured in out["seconds"].items():
                    model = exchange_time(name, ALEXNET, world=world, link=link, kernels=here)
                    error = model / measured - 1
                    errors.append((world, error))
                    cpu = out["cpu_s"][name]
                    point = f"{network:8} {world:>2} {link.bandwidth * 8 / 1e9:12.3f} {link.small * 8 / 1e9:6.3f} "
                    point += f"{link.spread * 8 / 1e9:6.3f} "
                    point += f"{link.alpha * 1e6:8.0f} {name:10} {measured:10.3f} {model:8.3f} {error:+7.1%} "
                    print(point + f"{cpu:6.3f} {cpu / (cores * measured):5.0%}", flush=True)
    finally:
        teardown()
    at4 = [abs(e) for w, e in errors if w == 4]
    if at4:
        print(f"max error at N=4 {max(at4):.1%} (target 15%)")
    print(f"max error {max(abs(e) for _, e in errors):.1%}" if errors else "max error nan% (no point measured)")


def auto(args) -> None:
    """auto's step against the best fixed compressor's (measured), and its choice's (the decision alone: auto
    runs the chosen hook, so the two differ by the machine's noise between identical steps)."""
    worst, worst_choice = None, None
    names = (*FIXED, "auto")
    print(f"ms a step, best of {args.steps}")
    print(f"{'network':8} {'N':>2} " + " ".join(f"{n:>8}" for n in names) + "  auto chose  loss  choice loss")
    try:
        for network in args.networks.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                args.compressors = ",".join(names)
                try:
                    out = run_world(world, network, args, script=__file__, extra=("--model", args.model))
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    print(f"{network:8} {world:>2} failed: {exc}", flush=True)
                    continue
                s, chosen = out["seconds"], out["auto"]["name"]
                best = min(s[n] for n in FIXED)
                loss, choice = s["auto"] / best - 1, s[chosen] / best - 1
                worst = loss if worst is None else max(worst, loss)
                worst_choice = choice if worst_choice is None else max(worst_choice, choice)
                print(
                    f"{network:8} {world:>2} "
                    + " ".join(f"{s[n] * 1e3:8.1f}" for n in names)
                    + f"  {chosen:10} {loss:+6.1%} {choice:+6.1%}   (probe {out['auto']['probe_s']:.1f} s)",
                    flush=True,
                )
                print(f"    {out['auto']['reason']}")
    finally:
        teardown()
    if worst is None:
        print("worst auto loss nan% (no point measured)")
        return
    print(f"worst choice loss {worst_choice:.1%}")
    print(f"worst auto loss {worst:.1%}")


def project(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = ("small_cnn", "resnet18", "resnet50", "alexnet")
    fig, axes = plt.subplots(len(models), len(LINKS), figsize=(9, 9), sharex=True, sharey=True)
    print(
        f"{'model':9} {'M values':>8} {'compute ms':>10} {'Gbit/s':>6} {'N':>4}  "
        + " ".join(f"{n:>8}" for n in PROJECTED)
        + "  fastest   x none"
    )
    for row, name in enumerate(models):
        shapes = model_shapes(name)
        values = sum(math.prod(s) for s in shapes)
        compute = BATCH / H200_IMAGES_PER_S[name]
        for col, (gbit, link) in enumerate(LINKS.items()):
            ax = axes[row, col]
            curves = {c: [] for c in PROJECTED}
            for world in WORLDS:
                t = {
                    c: step_time(c, shapes, world=world, link=link, compute_s=compute, kernels=H200_KERNELS)
                    for c in PROJECTED
                }
                for c in PROJECTED:
                    curves[c].append(compute / t[c])
                fastest = min(t, key=t.get)
                print(
                    f"{name:9} {values / 1e6:8.1f} {compute * 1e3:10.1f} {gbit:6} {world:4}  "
                    + " ".join(f"{t[c] * 1e3:8.1f}" for c in PROJECTED)
                    + f"  {fastest:8} {t['none'] / t[fastest]:6.2f}"
                )
            for c in PROJECTED:
                ax.plot(WORLDS, curves[c], marker="o", markersize=3, label=c)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"{gbit} Gbit/s")
            if col == 0:
                ax.set_ylabel(f"{name}\nscaling efficiency")
            if row == len(models) - 1:
                ax.set_xlabel("trainers (H200)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("Projected scaling efficiency (compute / step time) per compressor", fontsize=10)
    fig.tight_layout()
    out = args.plot
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=72)
    print(f"plot: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="calibrate and check the model on veth links")
    parser.add_argument("--auto", action="store_true", help="auto against each fixed compressor on real steps")
    parser.add_argument("--networks", default=None, help="default: 10gbit,1gbit (--check), +loopback (--auto)")
    parser.add_argument("--worlds", default=None, help="default: 2,3,4 (--check), 2 (--auto)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per compressor")
    parser.add_argument("--model", default="alexnet", help="--auto: the model trained (a dask_dl model name)")
    parser.add_argument("--timeout", type=float, default=420, help="seconds allowed for one network and world")
    parser.add_argument(
        "--plot", default=os.path.join(os.path.dirname(__file__), "..", "docs", "img", "projection.png")
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compressors", help=argparse.SUPPRESS)
    for hidden in ("--rank", "--world", "--port"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.check or args.auto:
        if os.geteuid() != 0:
            sys.exit("--check and --auto build veth links in network namespaces: run as root")
        args.networks = args.networks or ("10gbit,1gbit" if args.check else "loopback,10gbit,1gbit")
        args.worlds = args.worlds or ("2,3,4" if args.check else "2")
        return check(args) if args.check else auto(args)
    project(args)


if __name__ == "__main__":
    main()
