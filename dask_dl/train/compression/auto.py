"""``compression="auto"``: the compressor the scale-out model predicts fastest, from figures measured at run start.

Every rank measures the group's link with a short probe (:func:`probe_link`: a one-value all-reduce for the latency,
a 32 MB one for the bandwidth, a bfloat16 one for gloo's 16-bit sums, all-gathers and all-to-alls of 1 and 4 MB a
rank for the 1-bit compressors' messages) and the compute time of its model on a batch of the run's shape
(:func:`probe_compute`: forward and backward, no exchange). Rank 0 takes the slowest rank's figures (a step waits
for it), lets :func:`dask_dl.train.compression.model.choose` decide, and broadcasts the choice, so that every rank
registers the same hook. DDP takes one comm hook, before its first step: the compute time is measured on batches of
the run's shape before training rather than on its first steps, and the model's buffers, gradients and random
generators are left as they were, so that the run trains as it would with the chosen compressor.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from dask_dl.train.compression.model import (
    AUTO_CANDIDATES,
    CPU_CANDIDATES,
    CPU_KERNELS,
    H200_KERNELS,
    Choice,
    Kernels,
    Link,
    choose,
)

__all__ = ["decide", "probe_compute", "probe_link"]

PROBE_BYTES = 32 * 2**20  # past a switch's (and tc's) burst allowance: the rate, not the buffer
#: bytes a rank all-gathers and all-to-alls in the small-message probe, and 4 times that: the 1-bit message of one
#: 25 MB DDP bucket (n/8 + scales), and of a large layer's bucket (AlexNet's biggest: 3.3 MB)
GATHER_BYTES = 2**20


def _shortest(collective: Any, tensor: torch.Tensor, repeats: int) -> float:
    """The shortest of ``repeats`` runs of ``collective()`` on ``tensor``'s device: the link's capability, not a
    pause of the machine."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        collective()
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        times.append(time.perf_counter() - start)
    return min(times)


def probe_link(
    *,
    device: torch.device | None = None,
    nbytes: int = PROBE_BYTES,
    gather_bytes: int = GATHER_BYTES,
    repeats: int = 3,
    kernels: Kernels | None = None,
) -> Link:
    """The default group's latency and bandwidth per rank, from all-reduces of one value and of ``nbytes``, the
    time per value of a bfloat16 all-reduce's sums, and the line through all-gathers and all-to-alls of
    ``gather_bytes`` and 4 ``gather_bytes`` a rank.

    A ring all-reduce of ``b`` bytes (``v`` values) on ``N`` ranks takes ``2 (N-1) alpha + 2 (N-1)/N b / B`` plus
    ``(N-1)/N v`` sums: the one-value all-reduce gives ``alpha``, the float32 one ``B`` (its sums, at the kernels'
    ``add`` per value, taken out), the bfloat16 one of as many values the 16-bit sums' time. An all-gather of ``m``
    bytes a rank takes ``(N-1) (alpha_gather + m / B_gather)``, an all-to-all ``(N-1) (alpha_all_to_all + m / N /
    B_all_to_all)``: the two sizes give each its ``B`` (the slope) and ``alpha`` (where the line meets zero
    bytes), which hold for the 1-bit compressors' messages between and around them. Every rank returns the slowest
    rank's figures.
    """
    device = device or torch.device("cpu")
    kernels = kernels or (H200_KERNELS if device.type == "cuda" else CPU_KERNELS)
    n, values = dist.get_world_size(), nbytes // 4
    small = torch.zeros(1, device=device)
    big = torch.zeros(values, device=device)
    half = torch.zeros(values, dtype=torch.bfloat16, device=device)
    probes = [  # (collective, its tensor, repeats: the small messages are noisier)
        (lambda: dist.all_reduce(small), small, 2 * repeats),
        (lambda: dist.all_reduce(big), big, repeats),
        (lambda: dist.all_reduce(half), half, repeats),
    ]
    sizes = (gather_bytes - gather_bytes % n, 4 * (gather_bytes - gather_bytes % n))  # N equal chunks
    for size, count in zip(sizes, (2 * repeats, repeats), strict=True):
        message = torch.zeros(size, dtype=torch.uint8, device=device)
        gathered, received = message.new_empty(n * size), torch.empty_like(message)
        probes.append((partial(dist.all_gather_single, gathered, message), message, count))  # as the 1-bit hooks
        probes.append((partial(dist.all_to_all_single, received, message), message, count))  # onebit2's stage 1
    for collective, tensor, _ in probes[1:]:
        _shortest(collective, tensor, 1)  # connections and first touch
    times = [_shortest(collective, tensor, count) for collective, tensor, count in probes]
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    t_small, t_big, t_half, t_gather, t_spread, t_gather4, t_spread4 = (float(v) for v in slowest.cpu())
    share = (n - 1) / n
    alpha = t_small / (2 * (n - 1))
    transfer = max(t_big - t_small - share * values * kernels.add, 1e-9)
    bandwidth = 2 * share * nbytes / transfer
    add16 = max(t_half - t_small - share * nbytes / bandwidth, 0.0) / (share * values)
    gather, gather_alpha = _line(sizes, (t_gather, t_gather4), n - 1, n - 1, alpha)
    all_to_all, all_to_all_alpha = _line(sizes, (t_spread, t_spread4), share, n - 1, alpha)
    return Link(
        alpha=alpha,
        bandwidth=bandwidth,
        add16=add16,
        gather=gather,
        all_to_all=all_to_all,
        gather_alpha=gather_alpha,
        all_to_all_alpha=all_to_all_alpha,
    )


def _line(
    sizes: tuple[int, int], times: tuple[float, float], sent: float, messages: int, alpha: float
) -> tuple[float, float]:
    """(bytes/s, seconds per message) of a collective that sends ``sent`` times its input a rank in ``messages``
    messages and took ``times`` on inputs of ``sizes``: the line through both points. When the larger took no
    longer (noise on a link faster than the ranks' CPU), the rate of the larger input alone and ``alpha``."""
    (m1, m2), (t1, t2) = sizes, times
    if t2 <= t1:
        return sent * m2 / max(t2 - messages * alpha, 1e-9), alpha
    rate = sent * (m2 - m1) / (t2 - t1)
    return rate, (t1 - sent * m1 / rate) / messages


def probe_compute(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any, *, repeats: int = 2) -> float:
    """Seconds of forward + backward of ``model`` on the batch ``(x, y)``, leaving the model as it was.

    Buffers (batch-norm statistics), gradients and the random generators are restored: the run that follows
    trains exactly as it would have without the probe.
    """
    buffers = [b.detach().clone() for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if x.is_cuda else None
    training = model.training
    model.train()
    times = []
    try:
        for _ in range(repeats + 1):  # the first pass allocates
            start = time.perf_counter()
            loss_fn(model(x), y).backward()
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            times.append(time.perf_counter() - start)
    finally:
        for p in model.parameters():
            p.grad = None
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        model.train(training)
    return min(times[1:])


def decide(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> tuple[Choice, dict[str, Any]]:
    """Measure, choose on rank 0, broadcast: every rank gets the same :class:`Choice` and figures.

    Returns the choice and the figures it was made from (link, compute seconds, kernels, world size).
    """
    world = dist.get_world_size()
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    link = probe_link(device=x.device)
    compute = torch.tensor([probe_compute(model, x, y, loss_fn)], dtype=torch.float64, device=x.device)
    dist.all_reduce(compute, op=dist.ReduceOp.MAX)
    kernels = H200_KERNELS if x.is_cuda else CPU_KERNELS
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        candidates = AUTO_CANDIDATES if x.is_cuda else CPU_CANDIDATES
        choice = choose(
            shapes, world=world, link=link, compute_s=float(compute), kernels=kernels, candidates=candidates
        )
        figures = {"world_size": world, **link.to_dict(), "compute_s": float(compute), "kernels": kernels.to_dict()}
        box[0] = (choice.to_dict(), figures)
    dist.broadcast_object_list(box, src=0)
    made, figures = box[0]
    return Choice(made["name"], made["reason"], made["predicted_s"]), figures
