"""What do the gradient compressors save? Bytes and exchange time per step against plain allreduce (``none``).

An AlexNet-shaped gradient (dask_dl's alexnet with a 5x5 last feature map: 45.5M values, 182 MB in float32),
cut into DDP-like 25 MB buckets, is handed to each compressor's comm hook on 2 and 4 gloo ranks of this
machine, first over loopback, then over links limited to 1 Gbit/s and 10 Gbit/s: every rank runs in its own
network namespace with a veth pair into a bridge and a ``tc tbf`` rate limit on both ends of its veth.

Printed per network and rank count: bytes per worker per step handed to torch.distributed and an estimate of the
bytes that leave the worker (ring allreduce 2(N-1)/N, all-gather N-1 inputs, all-to-all (N-1)/N), both as ratios
to ``none``; the exchange time of a step (all buckets' hooks, compression included) as a ratio to ``none``.
Then each compressor's compress + decompress time alone (one rank, one thread, no network) as a ratio to one copy
of the gradient into allocated memory (measured beside each step, under the same load), and for onebit/onebit2
the same for their eager torch reference. The ranks share this machine's cores, so on a small machine
compute-heavy compressors look slower than they would on one core per rank.

    python bench/compression.py                     # everything (root for the namespaces; ~5 min on 2 cores)
    python bench/compression.py --networks loopback --worlds 2
    python bench/compression.py --steps 3           # steadier times, longer
    python bench/compression.py --no-exchange       # compress + decompress vs a copy only (~1 min)
    python bench/compression.py --compressors none,onebit,onebit-eager   # the eager reference beside the kernels
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from dask_dl.testing.compression import ALEXNET, FakeBucket, ddp_buckets

COMPRESSORS = ("none", "bf16", "powersgd", "onebit", "onebit2")
RATES = {"1gbit": "1gbit", "10gbit": "10gbit"}
BRIDGE = "ddlbench0"


def _options(name):
    return ({"warmup_steps": 2, "rank": 1}, 2) if name == "powersgd" else ({"warmup_steps": 0}, 0)


def run_steps(compressor, buckets, grads, steps, barrier=None):
    """Run ``steps`` steps of all buckets' hooks; return, for each step, its seconds, the bytes handed to the
    collectives and put on the wire, and this process's CPU seconds in it (every thread: the hooks' own, gloo's
    and the sockets' system time).

    The buckets are kept from step to step, as DDP keeps its bucket buffers, and each step copies the gradients
    into them before the clock starts: new buckets at every step would free the last step's inside the timed
    hooks (about 180 MB for AlexNet's gradient, 10-25 ms of unmapping on this machine).
    """
    out = []
    inputs = [g.clone() for g in grads]
    for _ in range(steps):
        for x, g in zip(inputs, grads, strict=True):
            x.copy_(g)
        if barrier:
            barrier()
        sent, wire = compressor.bytes_sent, compressor.wire_bytes
        start, cpu = time.perf_counter(), time.process_time()
        futures = [
            compressor.hook(compressor.state, FakeBucket(shapes, x, i, last=i == len(buckets) - 1))
            for i, (shapes, x) in enumerate(zip(buckets, inputs, strict=True))
        ]
        for f in futures:
            f.wait()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        out.append((seconds, compressor.bytes_sent - sent, compressor.wire_bytes - wire, cpu))
    return out


def worker(args) -> None:
    """One rank: join the group, measure every compressor, rank 0 writes the results."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dask_dl.train.compression import make_compressor
    from dask_dl.train.compression.fused import warm_up

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=120),
    )
    buckets = ddp_buckets(ALEXNET)
    gen = torch.Generator().manual_seed(args.rank)
    grads = [torch.randn(sum(math.prod(s) for s in b), generator=gen) * 1e-3 for b in buckets]
    results = {}
    for name in args.compressors.split(","):
        options, warm = _options(name)
        compressor = make_compressor(name.removesuffix("-eager"), **options)
        if name.endswith("-eager"):  # the eager torch reference of onebit/onebit2, e.g. onebit-eager
            compressor.state.fused = False
        elif getattr(compressor.state, "fused", False):
            warm_up()
        run_steps(compressor, buckets, grads, warm + 1, dist.barrier)  # warm-up (and first-touch) steps
        steps = run_steps(compressor, buckets, grads, args.steps, dist.barrier)
        times = torch.tensor([s[0] for s in steps])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts until the slowest rank is done
        results[name] = {"s": float(times.median()), "sent": steps[-1][1], "wire": steps[-1][2]}
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def local_costs(steps: int) -> dict[str, float]:
    """Compress + decompress seconds per step on one rank (no network), and one copy of the gradient into
    allocated memory; for onebit/onebit2 also their eager torch reference (``name-eager``)."""
    import torch
    import torch.distributed as dist

    from dask_dl.train.compression import make_compressor
    from dask_dl.train.compression.fused import warm_up

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    buckets = ddp_buckets(ALEXNET)
    grads = [torch.randn(sum(math.prod(s) for s in b)) for b in buckets]
    flat, copy = torch.cat(grads), torch.empty(sum(g.numel() for g in grads))
    copy.copy_(flat)  # first touch

    def memcpy() -> float:
        start = time.perf_counter()
        copy.copy_(flat)
        return time.perf_counter() - start

    costs, copies = {}, []
    for name in COMPRESSORS:
        for fused in (True, False) if name.startswith("onebit") else (True,):
            options, warm = _options(name)
            compressor = make_compressor(name, **options)
            if hasattr(compressor.state, "fused"):
                compressor.state.fused = fused
                if fused:
                    warm_up()
            run_steps(compressor, buckets, grads, warm + 1)
            times = []
            for _ in range(steps):  # a copy measured beside each step: the same load on the machine
                copies.append(memcpy())
                times.append(run_steps(compressor, buckets, grads, 1)[0][0])
            costs[name if fused else f"{name}-eager"] = float(np.median(times))
    costs["memcpy"] = float(np.median(copies))
    dist.destroy_process_group()
    return costs


# ---- the network: namespaces, veth pairs, a bridge, tbf -----------------------------------------------------


def _ip(*cmd, check=True):
    return subprocess.run(["ip", *cmd], check=check, capture_output=True, text=True)


def teardown(world: int = 8) -> None:
    for r in range(world):
        _ip("netns", "del", f"ddlb{r}", check=False)
        _ip("link", "del", f"ddlb{r}h", check=False)
    _ip("link", "del", BRIDGE, check=False)


def setup_network(world: int, rate: str | None) -> list[str]:
    """Namespaces ddlb0..: rank r at 10.77.0.(r+1) on veth ddlb<r>n, limited to ``rate`` both ways."""
    teardown()
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("link", "set", BRIDGE, "up")
    for r in range(world):
        ns, host, inner = f"ddlb{r}", f"ddlb{r}h", f"ddlb{r}n"
        _ip("netns", "add", ns)
        _ip("link", "add", host, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", host, "master", BRIDGE)
        _ip("link", "set", host, "up")
        _ip("-n", ns, "addr", "add", f"10.77.0.{r + 1}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if rate:
            bits = {"1gbit": 1e9, "10gbit": 1e10}[rate]
            # a millisecond of the rate: tbf lets a full bucket through at the veth's own speed, so a bigger one lets
            # a message that follows a pause cross faster than the rate (10 ms: 1 MB at 6.6 Gbit/s on the 1 Gbit/s
            # link); with half a millisecond tbf falls short of the rate (0.74 Gbit/s)
            burst = f"{max(int(bits / 8 / 1000), 2**17)}b"
            for dev, where in ((inner, ["ip", "netns", "exec", ns]), (host, [])):
                subprocess.run(
                    [
                        *where,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        rate,
                        "burst",
                        burst,
                        "latency",
                        "100ms",
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                )
    return [f"ddlb{r}" for r in range(world)]


def run_world(world: int, network: str, args, *, script: str = __file__, extra: tuple[str, ...] = ()) -> dict:
    """Run ``script --worker`` on ``world`` ranks over ``network`` (``extra``: more arguments for the ranks);
    return what rank 0 wrote."""
    namespaces = setup_network(world, RATES.get(network)) if network != "loopback" else None
    master = "10.77.0.1" if namespaces else "127.0.0.1"
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free on loopback; the namespaces have nothing bound at all
    procs = []
    try:
        for r in range(world):
            cmd = [sys.executable, script, "--worker", "--rank", str(r), "--world", str(world)]
            cmd += ["--master", master, "--port", str(port), "--out", out, "--steps", str(args.steps)]
            cmd += ["--compressors", args.compressors, *extra]
            env = dict(os.environ, GLOO_SOCKET_IFNAME=f"ddlb{r}n" if namespaces else "lo", OMP_NUM_THREADS="1")
            # c10d warns at every connection that a namespace's peer has no host name: errors only
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            prefix = ["ip", "netns", "exec", namespaces[r]] if namespaces else []
            procs.append(subprocess.Popen(prefix + cmd, env=env))
        deadline = time.monotonic() + args.timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a rank failed on {network} with {world} ranks: {[p.returncode for p in procs]}")
        with open(out) as f:
            return json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        os.unlink(out)
        if namespaces:
            teardown(world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--networks", default="loopback,1gbit,10gbit")
    parser.add_argument("--compressors", default=",".join(COMPRESSORS))
    parser.add_argument("--steps", type=int, default=1, help="timed steps per compressor (after warm-up)")
    parser.add_argument("--timeout", type=float, default=150, help="seconds allowed for one network and world")
    parser.add_argument("--no-exchange", action="store_true", help="only compress + decompress vs a copy")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--rank", "--world", "--port"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    n = sum(math.prod(s) for s in ALEXNET)
    print(f"gradient: {n / 1e6:.1f}M float32 values ({4 * n / 1e6:.0f} MB) in {len(ddp_buckets(ALEXNET))} buckets")
    networks = [] if args.no_exchange else args.networks.split(",")
    if any(net != "loopback" for net in networks):
        problem = None
        if os.geteuid() != 0:
            problem = "needs root (ip netns add)"
        elif not (shutil.which("ip") and shutil.which("tc")):
            problem = "needs iproute2 (ip, tc): apt-get install iproute2"
        if problem:
            print(f"skipping the rate-limited links: {problem}")
            networks = [net for net in networks if net == "loopback"]
    header = f"{'network':9} {'N':>2} {'compressor':10} {'MB handed':>10} {'x none':>7} {'MB wire':>8} {'x none':>7}"
    print(header + f" {'exchange s':>10} {'x none':>7}")
    try:
        for network in networks:
            for world in (int(w) for w in args.worlds.split(",")):
                try:
                    results = run_world(world, network, args)
                except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                    print(f"{network:9} {world:>2} failed: {exc}")
                    continue
                base = results.get("none")
                for name, r in results.items():
                    ratios = {k: r[k] / base[k] if base and base[k] else float("nan") for k in ("sent", "wire", "s")}
                    print(
                        f"{network:9} {world:>2} {name:10} {r['sent'] / 1e6:10.2f} {ratios['sent']:7.4f} "
                        f"{r['wire'] / 1e6:8.2f} {ratios['wire']:7.4f} {r['s']:10.3f} {ratios['s']:7.3f}",
                        flush=True,
                    )
    finally:
        teardown()
    costs = local_costs(max(args.steps, 3))
    print(
        f"\ncompress + decompress on one rank, one thread, no network (a copy of the gradient into allocated memory: "
        f"{costs['memcpy'] * 1e3:.1f} ms)"
    )
    for name in COMPRESSORS:
        line = f"  {name:10} {costs[name]:8.3f} s  {costs[name] / costs['memcpy']:8.1f} x copy"
        if f"{name}-eager" in costs:
            eager = costs[f"{name}-eager"]
            line += f"   eager torch reference {eager:7.3f} s  {eager / costs['memcpy']:6.1f} x copy"
            line += f"   fused / eager {costs[name] / eager:5.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
