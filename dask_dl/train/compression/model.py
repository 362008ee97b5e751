"""The scale-out model: the step time of N data-parallel trainers as compute plus each compressor's exchange.

A step is the forward pass, then the backward pass, during which DDP hands its gradient buckets (about 25 MB each,
in reverse parameter order) to the compressor's comm hook as they become ready. Each hook has a synchronous part,
run on the trainer's own thread (it delays the rest of the backward pass), and an asynchronous part, run on the
one communication stream in bucket order (it overlaps the backward pass). The step ends when both are done::

    t = forward;  free = 0;  busy = 0      # busy: until when the link carries the last collective
    for each bucket b:
        t += backward * share(b) + sync(b)
        (onebit2: t = busy = max(t, busy) + all_to_all(b);  t += its stripe's work)
        busy = max(t, free) + collective(b);  free = busy + async work(b)
    step = max(t, free)

The link carries one collective at a time: a collective that the trainer's thread waits for (``onebit2``'s
all-to-all) starts when the one before it on the communication stream (the last bucket's all-gather) has left
the link, as on NCCL's one stream per group, and as on gloo, where the two would share the link's bandwidth.

The collectives cost what the usual algorithms cost on ``N`` ranks with a latency ``alpha`` per message and a
bandwidth ``B`` per rank and direction: ring all-reduce ``2 (N-1) alpha + 2 (N-1)/N bytes / B`` (or a tree's
``2 log2(N) (alpha + bytes / B)`` when shorter), all-gather ``(N-1) (alpha + input / B)``, all-to-all
``(N-1) alpha + (N-1)/N input / B``, with the all-gathers' and all-to-alls' ``alpha`` and ``B`` each fitted to
two sizes of the 1-bit compressors' messages (:class:`Link`). The compressors' own work is a time
per value of each kernel (:class:`Kernels`): the 1-bit quantize sweep, the decode of one message, the casts, the
sums inside an all-reduce, PowerSGD's work. What each compressor sends and does:

========== ================================== ================================================ ======================
name       synchronous (trainer's thread)     asynchronous (communication stream)              bytes per rank
========== ================================== ================================================ ======================
none       divide by N                        ring all-reduce, summing (N-1)/N of the values   ``4 n``
bf16/fp16  cast to 16 bits, divide by N       all-reduce in 16 bits, cast back                 ``2 n``
powersgd   wait for the bucket before, P = MQ all-reduce of the rest, P, Q; orthogonalize,     ``4 r (rows + cols)``
                                              Q = M^T P, M = P Q^T                             and the rest
onebit     quantize                           all-gather, decode N messages                    ``n/8 + 8 columns``
onebit2    quantize, all-to-all, decode N     all-gather of the stripes, decode                ``n/8 + 8 columns``
           stripe messages, re-quantize
========== ================================== ================================================ ======================

Nothing here imports torch: ``bench/projection.py`` projects with it and ``compression="auto"``
(:mod:`dask_dl.train.compression.auto`) decides with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

__all__ = [
    "AUTO_CANDIDATES",
    "CPU_CANDIDATES",
    "CPU_KERNELS",
    "H200_KERNELS",
    "Choice",
    "Kernels",
    "Link",
    "buckets",
    "choose",
    "exchange_time",
    "step_time",
]

#: what ``compression="auto"`` chooses among, in order of preference when their times are within the margin:
#: the fewer values a compressor changes, the earlier (powersgd and fp16 are left to an explicit choice: the
#: first needs a rank and warm-up steps that change what is learned, the second is bf16 with less range)
AUTO_CANDIDATES = ("none", "bf16", "onebit2", "onebit")
#: on CPU trainers bf16 is left out: gloo's 16-bit path costs twice what its kernels measured alone say (the
#: calibration's bf16 errors, docs/scale-out.md), and it lost to none or to onebit on every link measured here
CPU_CANDIDATES = ("none", "onebit2", "onebit")

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
BACKWARD_SHARE = 2 / 3  # of a step's compute: the backward pass costs about twice the forward


@dataclass(frozen=True)
class Link:
    """The network between the trainers: ``alpha`` seconds per message, ``bandwidth`` bytes/s per rank and way.

    ``add16``: seconds per value summed in a 16-bit all-reduce, when the probe measured it (gloo sums bfloat16 one
    value at a time on CPU, an order of magnitude slower than float32); None: the kernels' figure.
    ``gather``: bytes/s per rank and way of the all-gathers of the 1-bit compressors' messages (about 1 MB a rank
    for one 25 MB DDP bucket, a few MB for AlexNet's big layers), when the probe measured it; None: ``bandwidth``.
    Messages that small get less of a link than a 32 MB all-reduce does (on loopback gloo, about half; on a
    1 Gbit/s link two ranks that send to each other at once, about 0.6 of it), and the all-gathers and
    all-to-alls of ``onebit`` and ``onebit2`` are made of them. The probe times two sizes, 1 and 4 MB a rank
    (:data:`dask_dl.train.compression.auto.GATHER_BYTES`), and fits a line through them: ``gather`` is its slope's
    rate and ``gather_alpha`` its seconds per message where the line meets zero bytes. That term is negative on a
    link that lets a first burst through faster than its rate (``tc``'s token bucket): the model never lets a
    collective take less than ``alpha`` per message.
    ``all_to_all``, ``all_to_all_alpha``: the same for an all-to-all of those sizes a rank, when measured; None:
    the all-gathers' figures (gloo's all-to-all got 0.8 of its all-gather's rate on two ranks of a 1 Gbit/s link
    here, 0.6-0.7 on four).
    """

    alpha: float
    bandwidth: float
    add16: float | None = None
    gather: float | None = None
    all_to_all: float | None = None
    gather_alpha: float | None = None
    all_to_all_alpha: float | None = None

    @classmethod
    def gbit(cls, gbit_per_s: float, *, alpha: float = 20e-6) -> Link:
        """A link of ``gbit_per_s`` Gbit/s (e.g. ``Link.gbit(10)``), ``alpha`` seconds per message."""
        return cls(alpha=alpha, bandwidth=gbit_per_s * 1e9 / 8)

    def to_dict(self) -> dict[str, float | None]:
        return {
            "alpha_s": self.alpha,
            "bandwidth_bytes_per_s": self.bandwidth,
            "add16_s": self.add16,
            "gather_bytes_per_s": self.gather,
            "all_to_all_bytes_per_s": self.all_to_all,
            "gather_alpha_s": self.gather_alpha,
            "all_to_all_alpha_s": self.all_to_all_alpha,
        }

    @classmethod
    def from_dict(cls, figures: Mapping[str, float]) -> Link:
        """The link of :meth:`to_dict`'s figures (extra keys ignored, missing optional ones None)."""

        def optional(key: str) -> float | None:
            value = figures.get(key)
            return None if value is None else float(value)

        return cls(
            alpha=float(figures["alpha_s"]),
            bandwidth=float(figures["bandwidth_bytes_per_s"]),
            add16=optional("add16_s"),
            gather=optional("gather_bytes_per_s"),
            all_to_all=optional("all_to_all_bytes_per_s"),
            gather_alpha=optional("gather_alpha_s"),
            all_to_all_alpha=optional("all_to_all_alpha_s"),
        )

    @property
    def small(self) -> float:
        """Bytes/s per rank of the compressed collectives' messages: ``gather`` when measured, else ``bandwidth``."""
        return self.bandwidth if self.gather is None else self.gather

    @property
    def spread(self) -> float:
        """Bytes/s per rank of the compressed all-to-alls: ``all_to_all`` when measured, else :attr:`small`."""
        return self.small if self.all_to_all is None else self.all_to_all

    @property
    def small_alpha(self) -> float:
        """Seconds per message of the compressed all-gathers: ``gather_alpha`` when measured, else ``alpha``."""
        return self.alpha if self.gather_alpha is None else self.gather_alpha

    @property
    def spread_alpha(self) -> float:
        """Seconds per message of the compressed all-to-alls: ``all_to_all_alpha`` when measured, else
        :attr:`small_alpha` where the all-to-alls take the all-gathers' rate, else ``alpha``."""
        if self.all_to_all_alpha is not None:
            return self.all_to_all_alpha
        return self.small_alpha if self.all_to_all is None else self.alpha


@dataclass(frozen=True)
class Kernels:
    """Seconds per value of the work a compressor does besides sending (one rank, one core).

    ``add``/``add16``: one float32/16-bit sum inside an all-reduce; ``div``: the division by N; ``cast``: one value
    to a new 16-bit tensor, divided there, and back (torch's fp16/bf16 hooks); ``quantize``: the 1-bit sweep over
    gradient and residual; ``decode``: one value of one received 1-bit message added up; ``lowrank``: PowerSGD's
    work per value of a bucket on one rank (error feedback, P and Q, orthogonalization, decompression).
    ``share``: the share of a core each rank gets (a machine with fewer cores than ranks slows every kernel).
    """

    add: float
    add16: float
    div: float
    cast: float
    quantize: float
    decode: float
    lowrank: float
    share: float = 1.0

    def per_value(self, name: str) -> float:
        return getattr(self, name) / self.share

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("add", "add16", "div", "cast", "quantize", "decode", "lowrank", "share")}


#: this project's 2-core CPU machine, one thread, measured alone (``python bench/projection.py --check`` prints them);
#: gloo's 16-bit sums are the probe's to measure (:class:`Link`)
CPU_KERNELS = Kernels(add=0.3e-9, add16=0.31e-9, div=0.2e-9, cast=0.9e-9, quantize=0.7e-9, decode=0.2e-9, lowrank=12e-9)

#: an H200 (4.8 TB/s of HBM3e): each kernel as the bytes it moves at half that bandwidth (they are memory bound;
#: PowerSGD's work as ten such sweeps)
H200_KERNELS = Kernels(
    add=12 / 2.4e12,
    add16=6 / 2.4e12,
    div=8 / 2.4e12,
    cast=12 / 2.4e12,
    quantize=16.25 / 2.4e12,
    decode=4.25 / 2.4e12,
    lowrank=80 / 2.4e12,
)


def buckets(shapes: Sequence[Sequence[int]], cap_bytes: int = BUCKET_BYTES) -> list[list[tuple[int, ...]]]:
    """Parameter shapes grouped as DDP does by default: reverse order, about ``cap_bytes`` per bucket."""
    out, current, size = [], [], 0
    for shape in reversed([tuple(int(d) for d in s) for s in shapes]):
        nbytes = 4 * math.prod(shape)
        if current and size + nbytes > cap_bytes:
            out.append(current)
            current, size = [], 0
        current.append(shape)
        size += nbytes
    return out + [current] if current else out


def _columns(shape: tuple[int, ...]) -> int:
    """Quantization groups of a parameter (as ``quantize.matrix_shape``: the longer side is a group)."""
    if not shape:
        return 1
    out, rest = shape[0], math.prod(shape[1:])
    return out if rest >= out else rest


def _allreduce(nbytes: float, n_values: int, world: int, link: Link, add: float) -> float:
    if world == 1:
        return 0.0
    ring = 2 * (world - 1) * link.alpha + 2 * (world - 1) / world * nbytes / link.bandwidth
    tree = 2 * math.ceil(math.log2(world)) * (link.alpha + nbytes / link.bandwidth)
    return min(ring, tree) + (world - 1) / world * n_values * add


class HookTimes(NamedTuple):
    """Seconds of one bucket's hook, in the order they run: ``sync`` on the trainer's thread, ``blocking`` (a
    collective the trainer's thread waits for: ``onebit2``'s all-to-all), ``after`` (the trainer's thread's work
    after it), ``exchange`` (the collective on the communication stream), ``then`` (the work that follows it
    there)."""

    sync: float
    exchange: float
    then: float = 0.0
    blocking: float = 0.0
    after: float = 0.0


def _all_gather(nbytes: float, world: int, link: Link) -> float:
    if world == 1:
        return 0.0
    return (world - 1) * max(link.small_alpha + nbytes / link.small, link.alpha)


def _all_to_all(nbytes: float, world: int, link: Link) -> float:
    if world == 1:
        return 0.0
    return (world - 1) * max(link.spread_alpha + nbytes / world / link.spread, link.alpha)


def _powersgd(bucket: list[tuple[int, ...]], rank: int = 1, min_rate: float = 2.0) -> tuple[int, int, int]:
    """(values sent uncompressed, values of P and Q, values of the compressed matrices), as torch decides."""
    rest = low = big = 0
    for shape in bucket:
        n = math.prod(shape)
        rows = shape[0] if shape else 1
        cols = n // rows
        r = min(rows, cols, rank)
        if len(shape) > 1 and rows * cols >= min_rate * (rows + cols) * r:
            low, big = low + (rows + cols) * r, big + n
        else:
            rest += n
    return rest, low, big


def bucket_times(name: str, bucket: list[tuple[int, ...]], *, world: int, link: Link, kernels: Kernels) -> HookTimes:
    """The :class:`HookTimes` of compressor ``name``'s hook on one bucket."""
    n = sum(math.prod(s) for s in bucket)
    k = kernels.per_value
    if world == 1:  # no collectives: the hooks do what the algorithm defines for one rank
        alone = {
            "none": 0.0,
            "fp16": k("cast"),
            "bf16": k("cast"),
            "powersgd": k("lowrank"),
            "onebit": k("quantize") + k("decode"),
            "onebit2": 2 * k("quantize") + 2 * k("decode"),
        }
        return HookTimes(alone[name] * n, 0.0)
    if name == "none":
        return HookTimes(n * k("div"), _allreduce(4 * n, n, world, link, k("add")))
    if name in ("fp16", "bf16"):  # torch's hook: a new 16-bit copy divided by N (3/4 of it), copied back after
        add16 = k("add16") if link.add16 is None else link.add16 / kernels.share
        return HookTimes(0.75 * n * k("cast"), _allreduce(2 * n, n, world, link, add16), 0.25 * n * k("cast"))
    if name == "powersgd":
        rest, low, _ = _powersgd(bucket)
        exchange = sum(_allreduce(4 * v, v, world, link, k("add")) for v in (rest, low // 2 or 1, low // 2 or 1))
        return HookTimes(n * k("lowrank") / 3, exchange, 2 * n * k("lowrank") / 3)
    message = sum((math.prod(s) + 7) // 8 + 8 * _columns(s) for s in bucket)
    if name == "onebit":
        return HookTimes(n * k("quantize"), _all_gather(message, world, link), world * n * k("decode"))
    if name == "onebit2":
        stripe = math.ceil(message / world)
        return HookTimes(
            sync=n * k("quantize"),
            blocking=_all_to_all(world * stripe, world, link),
            after=n * (k("decode") + k("quantize") / world),
            exchange=_all_gather(stripe, world, link),
            then=n * k("decode"),
        )
    raise ValueError(f"the scale-out model has no compressor {name!r}")


def step_time(
    name: str,
    shapes: Sequence[Sequence[int]],
    *,
    world: int,
    link: Link,
    compute_s: float,
    kernels: Kernels = CPU_KERNELS,
    cap_bytes: int = BUCKET_BYTES,
) -> float:
    """Seconds of one training step of a model with parameters of ``shapes`` on ``world`` ranks with ``name``.

    Parameters
    ----------
    name : str
        A compressor: ``none``, ``fp16``, ``bf16``, ``powersgd``, ``onebit``, ``onebit2``.
    shapes : sequence of shapes
        The model's trainable parameters, in registration order.
    world : int
        Ranks (trainers).
    link : Link
        Latency and bandwidth between them.
    compute_s : float
        Seconds of forward + backward of one rank's batch (0: only the exchange of all buckets, back to back).
    kernels : Kernels
        Seconds per value of the compressors' work.

    Examples
    --------
    >>> fc = [(4096, 4096), (4096,)]
    >>> slow = Link.gbit(1)
    >>> step_time("onebit", fc, world=4, link=slow, compute_s=0.1) < step_time("none", fc, world=4, link=slow,
    ...                                                                        compute_s=0.1)
    True
    """
    groups = buckets(shapes, cap_bytes)
    total = sum(math.prod(s) for b in groups for s in b) or 1
    backward = BACKWARD_SHARE * compute_s
    t, free, busy = compute_s - backward, 0.0, 0.0  # busy: until when the link carries the last collective
    for bucket in groups:
        hook = bucket_times(name, bucket, world=world, link=link, kernels=kernels)
        if name == "powersgd":  # its hook waits for the bucket before (dask_dl.train.compression.powersgd)
            t = max(t, free)
        t += backward * sum(math.prod(s) for s in bucket) / total + hook.sync
        if hook.blocking:
            t = busy = max(t, busy) + hook.blocking
        t += hook.after
        busy = max(t, free) + hook.exchange
        free = busy + hook.then
    return max(t, free)


def exchange_time(name: str, shapes: Sequence[Sequence[int]], *, world: int, link: Link, kernels: Kernels) -> float:
    """Seconds of all buckets' hooks called back to back, no compute (what ``bench/compression.py`` times)."""
    return step_time(name, shapes, world=world, link=link, compute_s=0.0, kernels=kernels)


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` chose: ``name``, the predicted seconds per step of every candidate, and why."""

    name: str
    reason: str
    predicted_s: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "reason": self.reason, "predicted_s": dict(self.predicted_s)}


def choose(
    shapes: Sequence[Sequence[int]],
    *,
    world: int,
    link: Link | None,
    compute_s: float,
    kernels: Kernels = CPU_KERNELS,
    candidates: Sequence[str] = AUTO_CANDIDATES,
    margin: float = 0.03,
) -> Choice:
    """The compressor the model predicts fastest for this model, world size, link and compute time.

    A candidate earlier in ``candidates`` wins over the fastest when it is predicted within ``margin`` of it: a
    compressor has to pay more than the model's error to be worth what it changes in the gradients.

    Examples
    --------
    >>> fc = [(4096, 6400), (4096,), (4096, 4096), (4096,)]
    >>> choose(fc, world=4, link=Link.gbit(1), compute_s=0.2).name
    'onebit2'
    >>> choose(fc, world=4, link=Link.gbit(100), compute_s=0.2).name
    'none'
    >>> choose(fc, world=1, link=None, compute_s=0.2).reason
    'one trainer: nothing to exchange'
    """
    if world == 1 or link is None:
        return Choice("none", "one trainer: nothing to exchange")
    predicted = {
        c: step_time(c, shapes, world=world, link=link, compute_s=compute_s, kernels=kernels) for c in candidates
    }
    best = min(predicted.values())
    name = next(c for c in candidates if predicted[c] <= best * (1 + margin))
    fastest = min(predicted, key=predicted.get)
    small = [
        f"{v * 8 / 1e9:.3g} on 1-4 MB {what}"
        for v, what in ((link.gather, "all-gathers"), (link.all_to_all, "all-to-alls"))
        if v
    ]
    rates = f" ({', '.join(small)})" if small else ""
    figures = (
        f"{world} trainers, {link.bandwidth * 8 / 1e9:.3g} Gbit/s{rates} and {link.alpha * 1e6:.0f} us per "
        f"message measured, compute {compute_s * 1e3:.1f} ms a step"
    )
    times = ", ".join(f"{c} {s * 1e3:.1f} ms" for c, s in sorted(predicted.items(), key=lambda kv: kv[1]))
    if name == fastest:
        reason = f"{name} is predicted fastest ({times}; {figures})"
    else:
        reason = (
            f"{name} is predicted within {margin:.0%} of the fastest, {fastest}, and changes the gradients less "
            f"({times}; {figures})"
        )
    return Choice(name, reason, predicted)


def with_share(kernels: Kernels, share: float) -> Kernels:
    """``kernels`` on ranks that get ``share`` of a core each."""
    return replace(kernels, share=share)
