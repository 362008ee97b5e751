"""What does 1-bit compression cost through the comm hook, bucket by bucket as DDP hands the buckets over?

One gloo rank, one thread (torch and numba). A model with dask_dl's AlexNet parameter shapes (``ALEXNET``: 45.5M
float32 values, 182 MB; ``--model resnet50`` etc. for another registered model's) whose loss is ``sum(p * g)``,
so its gradient is a fixed random ``g``, is wrapped in real ``DistributedDataParallel`` with ``bucket_cap_mb=3``:
DDP hands its hook 5 AlexNet buckets a step (ResNet-50: 19). The compressor is
registered as the trainer registers it (``Compressor.register``), its hook wrapped to time each call. Beside it,
in the same run and round robin: one copy of the whole gradient into allocated memory (the unit), and the same
compressor driven with :class:`~dask_dl.testing.compression.FakeBucket` as ``bench/compression.py --no-exchange``
does (fresh buckets each step), in DDP's 5 layouts and in ``ddp_buckets``' (bench/compression.py's).

Printed: each path's best step as a multiple of the copy; the fixed cost of a hook call (DDP's last bucket);
per bucket, the hook's time and its parts: the numba kernels, their Python wrappers (``kernels.quantize`` and
``decode`` around them) and the hook's own work (layout, names, plan, residual views, the future); per step, the
NumPy allocation peak (tracemalloc, in a separate untimed step) and how many kept buffers moved (``data_ptr``).
Times are this thread's CPU time unless ``--clock wall``: other processes on a busy machine do not add to it.

    python bench/hook.py                 # 10 steps round robin (~30 s; ResNet-50 ~1 min)
    python bench/hook.py --steps 12 --clock wall
    python bench/hook.py --model resnet50   # 1x1 convolutions: groups are columns, cut in bands
"""

from __future__ import annotations

import argparse
import math
import time
import tracemalloc
from collections import defaultdict

from dask_dl.testing.compression import ALEXNET, FakeBucket, ddp_buckets, model_shapes, shaped_model
from dask_dl.testing.train import one_rank_group

COMPRESSORS = ("onebit", "onebit2")
# The clock of every figure: this thread's CPU time by default, which a busy machine's other processes do not
# add to (they do still share the memory bandwidth); --clock wall for wall-clock time.
clock = time.thread_time
BUCKET_CAP_MB = 3  # DDP then cuts ALEXNET into 5 buckets (fc8+fc7, fc6, conv5+conv4, conv3+conv2, conv1)


class Timed:
    """Wraps a hook, ``kernels.quantize`` and ``kernels.decode`` (module attributes, looked up at each call by the
    fused path) and the numba kernels they call, recording seconds per call under the bucket being handled."""

    def __init__(self) -> None:
        self.hook_s: dict[int, float] = defaultdict(float)
        self.kernel_s: dict[int, float] = defaultdict(float)
        self.numba_s: dict[int, float] = defaultdict(float)
        self.bucket = -1
        self.shapes: dict[int, tuple] = {}  # DDP's bucket layouts, as its hook sees them

    def wrap_hook(self, hook):
        def timed_hook(state, bucket):
            self.bucket = bucket.index()
            if self.bucket not in self.shapes:
                self.shapes[self.bucket] = tuple(tuple(g.shape) for g in bucket.gradients())
            start = clock()
            future = hook(state, bucket)
            self.hook_s[self.bucket] += clock() - start
            return future

        return timed_hook

    def wrap_kernel(self, function, into: str = "kernel_s"):
        def timed(*args, **kwargs):
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                getattr(self, into)[self.bucket] += clock() - start

        return timed

    def reset(self) -> None:
        self.hook_s.clear()
        self.kernel_s.clear()
        self.numba_s.clear()

    def buckets(self) -> dict[int, tuple[float, float, float, float]]:
        """Bucket -> (hook, kernels' Python wrappers, numba kernels, the hook's own work) seconds of the last step."""
        return {
            b: (h, self.kernel_s[b] - self.numba_s[b], self.numba_s[b], h - self.kernel_s[b])
            for b, h in sorted(self.hook_s.items())
        }


def kept_pointers(state) -> dict:
    """data_ptr of every tensor or array the hook's state keeps between steps."""
    out = {}
    for key, value in list(state.workspace.items()) + list(state.flats.items()):
        if hasattr(value, "flat"):  # a message buffer (fused._Message)
            out[key] = value.flat.data_ptr()
        elif hasattr(value, "data_ptr"):
            out[key] = value.data_ptr()
        elif isinstance(value, tuple) and value and hasattr(value[0], "data_ptr"):
            out[key] = value[0].data_ptr()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per path (best is kept), round robin")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="thread CPU time, or wall-clock")
    parser.add_argument("--model", default="alexnet", help="alexnet (ALEXNET's shapes), or a registered model")
    args = parser.parse_args()
    global clock
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    shapes = ALEXNET if args.model == "alexnet" else model_shapes(args.model)

    import numba
    import torch

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    with one_rank_group():
        measured = measure(args, shapes)
    report(args, shapes, *measured)


def measure(args, shapes: list[tuple[int, ...]]) -> tuple:
    """Every path's steps in turns, the allocation steps and the fixed cost of a call (inside a one-rank group)."""
    import torch

    from dask_dl.train.compression import kernels, make_compressor
    from dask_dl.train.step import make_ddp

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    of_shape: dict = {}  # a gradient of each shape (the first parameter's)
    for s, g in zip(shapes, grads, strict=True):
        of_shape.setdefault(s, g)
    flat = torch.cat([g.view(-1) for g in grads])
    copy = torch.empty_like(flat)
    copy.copy_(flat)  # first touch

    timed = Timed()
    twins = ("QUANTIZE_TASKS", "REDUCE_COLUMNS", "SETTLE_TASKS", "DECODE_TASKS")  # every numba pair
    saved = {name: getattr(kernels, name) for name in ("quantize", "decode", *twins)}
    kernels.quantize, kernels.decode = timed.wrap_kernel(saved["quantize"]), timed.wrap_kernel(saved["decode"])
    for name in twins:
        setattr(kernels, name, tuple(timed.wrap_kernel(f, "numba_s") for f in saved[name]))

    ddps, layout = {}, None
    for name in COMPRESSORS:
        ddp = make_ddp(shaped_model(shapes), device_ids=None, bucket_cap_mb=BUCKET_CAP_MB)  # as the trainer's
        compressor = make_compressor(name)
        register = ddp.register_comm_hook
        ddp.register_comm_hook = lambda state, hook, register=register: register(state, timed.wrap_hook(hook))
        compressor.register(ddp)  # as the trainer does: names, kernels compiled, then DDP's register_comm_hook
        del ddp.register_comm_hook
        ddps[name] = (ddp, compressor)
        for _ in range(2):  # DDP rebuilds its buckets after the first step; first touch of the kept buffers
            timed.shapes.clear()
            ddp(grads).backward()
        layout = [timed.shapes[b] for b in sorted(timed.shapes)]
    layouts = {"ddp": layout, "bench": [tuple(b) for b in ddp_buckets(shapes)]}
    fakes = {(name, which): make_compressor(name) for name in COMPRESSORS for which in layouts}

    def fake_step(compressor, layout) -> float:
        inputs = [torch.cat([of_shape[s].view(-1) for s in b]) for b in layout]  # fresh, as bench's clones
        timed.reset()
        start = clock()
        futures = []
        for i, (bucket_shapes, x) in enumerate(zip(layout, inputs, strict=True)):
            timed.bucket = i
            t = clock()
            bucket = FakeBucket(bucket_shapes, x, i, last=i == len(layout) - 1)
            futures.append(compressor.hook(compressor.state, bucket))
            timed.hook_s[i] += clock() - t
        for f in futures:
            f.wait()
        return clock() - start

    def ddp_step(name) -> float:
        ddp, _ = ddps[name]
        loss = ddp(grads)
        timed.reset()
        loss.backward()
        return sum(timed.hook_s.values())

    def memcpy() -> float:
        start = clock()
        copy.copy_(flat)
        return clock() - start

    paths = [(name, "ddp") for name in COMPRESSORS] + [(name, f"fake {w}") for name in COMPRESSORS for w in layouts]
    for name, which in paths:  # warm-up: plans, kept buffers, first touch
        ddp_step(name) if which == "ddp" else fake_step(fakes[name, which[5:]], layouts[which[5:]])

    best: dict = defaultdict(lambda: math.inf)
    parts: dict = defaultdict(lambda: (math.inf,) * 4)  # (path, bucket) -> best (hook, wrapper, numba, own), each
    allocated, moved = {}, {}
    for _ in range(args.steps):
        for name, which in paths:
            best["copy"] = min(best["copy"], memcpy())  # a copy beside each step: the same load
            t = ddp_step(name) if which == "ddp" else fake_step(fakes[name, which[5:]], layouts[which[5:]])
            best[name, which] = min(best[name, which], t)
            for b, times in timed.buckets().items():
                parts[name, which, b] = tuple(min(a, c) for a, c in zip(parts[name, which, b], times, strict=True))
    for name, which in paths:  # allocation: one more step each, untimed (tracemalloc slows every allocation)
        state = ddps[name][1].state if which == "ddp" else fakes[name, which[5:]].state
        before = kept_pointers(state)
        tracemalloc.start()
        ddp_step(name) if which == "ddp" else fake_step(fakes[name, which[5:]], layouts[which[5:]])
        allocated[name, which] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        after = kept_pointers(state)
        moved[name, which] = sum(after.get(k) != v for k, v in before.items()) + len(set(after) - set(before))
    fixed = {name: fixed_cost(make_compressor(name), layout[-1], timed) for name in COMPRESSORS}
    for name, kept in saved.items():
        setattr(kernels, name, kept)
    return best, parts, allocated, moved, layouts, fixed


def fixed_cost(compressor, shapes, timed, calls: int = 20, batches: int = 15) -> tuple[float, float]:
    """Seconds per hook call on the small bucket ``shapes`` (DDP's last), best batch of ``calls``: the whole
    call, and its part outside the numba kernels (what every bucket pays whatever its size)."""
    import torch

    values = torch.randn(sum(math.prod(s) for s in shapes))
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    bucket = FakeBucket(shapes, values, 0, params=params)
    compressor.state.param_names = {id(p): f"w{i}" for i, p in enumerate(params)}
    compressor.hook(compressor.state, bucket).wait()
    best = (math.inf, math.inf)
    for _ in range(batches):
        timed.reset()
        timed.bucket = 0
        start = clock()
        for _ in range(calls):
            compressor.hook(compressor.state, bucket).wait()
        total = (clock() - start) / calls
        best = min(best, (total, total - timed.numba_s[0] / calls))
    return best


def report(args, shapes, best, parts, allocated, moved, layouts, fixed) -> None:
    unit = best["copy"]
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    n = sum(math.prod(s) for s in shapes)
    values = f"{n / 1e6:.1f}M float32 values ({4 * n / 1e6:.0f} MB)"
    print(f"{args.model} gradient: {values}, one rank, one thread; load {load}")
    copied = f"{unit * 1e3:.1f} ms (best of {args.steps}, {args.clock} clock)"
    print(f"one copy of the gradient into allocated memory: {copied}")
    print("\nbest step as a multiple of the copy (sum of per-bucket bests in brackets)")
    print(f"{'compressor':10} {'DDP hook':>16} {'FakeBucket, DDP layout':>24} {'FakeBucket, bench layout':>26}")
    for name in COMPRESSORS:
        cells = []
        for which in ("ddp", "fake ddp", "fake bench"):
            buckets = sum(v[0] for k, v in parts.items() if k[:2] == (name, which))
            cells.append(f"{best[name, which] / unit:.2f}x ({buckets / unit:.2f}x)")
        print(f"{name:10} {cells[0]:>16} {cells[1]:>24} {cells[2]:>26}")
    last = sum(math.prod(s) for s in layouts["ddp"][-1])
    print(f"\nfixed cost of a hook call (DDP's last bucket, {last} values, best batch of 20 calls):")
    for name in COMPRESSORS:
        total, outside = fixed[name]
        print(
            f"  {name:8} {total * 1e6:6.0f} us a call, {outside * 1e6:6.0f} us of it outside the numba kernels; "
            f"x {len(layouts['ddp'])} buckets = {len(layouts['ddp']) * outside / unit:.3f} x copy a step"
        )
    for name in COMPRESSORS:
        print(f"\n{name}: per bucket, best of {args.steps} (ms), each column its own best")
        header = f"{'path':10} {'bucket':>6} {'values':>9} {'hook':>7} {'numba':>7} {'wrapper':>8} {'own':>6}"
        print(f"  {header}  parameters")
        for which in ("ddp", "fake ddp", "fake bench"):
            for (nm, wh, b), (hook, wrap, kern, own) in sorted(parts.items()):
                if (nm, wh) != (name, which):
                    continue
                bucket_shapes = layouts["bench" if which == "fake bench" else "ddp"][b]
                values = sum(math.prod(s) for s in bucket_shapes)
                ms = f"{hook * 1e3:7.2f} {kern * 1e3:7.2f} {wrap * 1e3:8.3f} {own * 1e3:6.3f}"
                print(f"  {which:10} {b:6} {values:9} {ms}  {' '.join('x'.join(map(str, s)) for s in bucket_shapes)}")
        for which in ("ddp", "fake ddp", "fake bench"):
            print(
                f"  {which}: per step, numpy allocation peak {allocated[name, which] / 1e3:.1f} kB (tracemalloc), "
                f"kept buffers reallocated {moved[name, which]}"
            )


if __name__ == "__main__":
    main()
