"""PowerSGD (Vogels et al., NeurIPS 2019) through torch's own ``powerSGD_hook``, counted and checkpointable.

torch keeps PowerSGD's error-feedback memory and its warm-start Q matrices per *bucket index*, as flat tensors
laid out in that bucket's parameter order. DDP's first iteration after construction uses its initial buckets and
only then rebuilds them in gradient-ready order, so a checkpoint of the flat tensors would land misaligned in a
resumed run. Here the state is saved per parameter name and laid back out in whatever bucket a parameter is in
the first time that bucket comes through after a load, which makes resuming exact.
"""

# No ``from __future__ import annotations``: DDP checks the hook's real annotation objects.
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _powersgd

from dask_dl.errors import ConfigurationError
from dask_dl.train.compression.state import Future, HookState


class PowerSGDHookState(HookState):
    """State of :func:`powersgd_hook`: torch's :class:`PowerSGDState` plus our counters.

    torch starts PowerSGD at ``start_powerSGD_iter = warmup_steps``; with error feedback or warm start torch
    needs at least 2 uncompressed steps, because DDP rebuilds its buckets after the first iteration and the
    error and low-rank memories are kept per bucket index.
    """

    def __init__(
        self,
        *,
        rank: int = 1,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigurationError(f"powersgd rank must be an integer >= 1, got {rank!r}; pass e.g. rank=2")
        if (error_feedback or warm_start) and self.warmup_steps < 2:
            raise ConfigurationError(
                f"powersgd with error feedback or warm start needs warmup_steps >= 2, got {self.warmup_steps}: "
                "DDP rebuilds its buckets after the first step and torch's PowerSGD keeps its memories per "
                "bucket; pass warmup_steps=2 (or more), or error_feedback=False, warm_start=False"
            )
        self.powersgd = _powersgd.PowerSGDState(
            process_group=self.process_group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=self.warmup_steps,
            min_compression_rate=min_compression_rate,
            use_error_feedback=error_feedback,
            warm_start=warm_start,
            random_seed=seed,
        )
        self.previous: torch.futures.Future | None = None  # the future of the bucket before, this step
        self.layouts: dict[int, tuple[list[str], list[torch.Size]]] = {}  # bucket index -> names, shapes
        self.pending: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}  # loaded, not yet laid out

    def _q_slices(self, shapes: list[torch.Size]) -> list[tuple[int, int, int, int]]:
        """(position in bucket, rows, cols, rank) of the compressed tensors, in torch's Q memory order."""
        ps = self.powersgd
        groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
        for i, shape in enumerate(shapes):
            rows = shape[0]
            cols = int(np.prod(shape)) // rows
            rank = min(rows, cols, ps.matrix_approximation_rank)
            if _powersgd._should_compress(rows, cols, rank, ps.min_compression_rate)[0]:
                groups.setdefault((rows, cols), []).append((i, rows, cols, rank))  # torch batches by shape
        return [entry for group in groups.values() for entry in group]

    def _by_name(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Error memories and warm-start Qs per parameter name (loaded ones not laid out yet included)."""
        ps = self.powersgd
        error, q = dict(self.pending["error"]), dict(self.pending["q"])
        for index, (names, shapes) in self.layouts.items():
            if index in ps.error_dict:
                flat, offset = ps.error_dict[index], 0
                for name, shape in zip(names, shapes, strict=True):
                    k = int(np.prod(shape))
                    error[name] = flat[offset : offset + k].view(shape).clone()
                    offset += k
            if index in ps.q_memory_dict:
                flat, offset = ps.q_memory_dict[index], 0
                for i, _, cols, rank in self._q_slices(shapes):
                    q[names[i]] = flat[offset : offset + cols * rank].view(cols, rank).clone()
                    offset += cols * rank
        return error, q

    def _stash(self) -> None:
        """Move every bucket's memories to ``pending`` by name, to be laid out again bucket by bucket."""
        error, q = self._by_name()
        self.pending = {"error": error, "q": q}
        ps = self.powersgd
        ps.error_dict, ps.p_memory_dict, ps.q_memory_dict = {}, {}, {}
        self.layouts = {}

    def state_dict(self) -> dict[str, Any]:
        ps = self.powersgd
        error, q = self._by_name()
        _, keys, pos, has_gauss, cached = ps.rng.get_state()
        return {
            "iter": int(ps.iter),
            "error": error,
            "q": q,
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "numel_before": int(ps.total_numel_before_compression),
            "numel_after": int(ps.total_numel_after_compression),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        ps = self.powersgd
        ps.iter = int(saved["iter"])
        ps.error_dict, ps.p_memory_dict, ps.q_memory_dict = {}, {}, {}
        self.layouts = {}
        self.pending = {"error": dict(saved["error"]), "q": dict(saved["q"])}
        rng = saved["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        ps.rng.set_state(("MT19937", keys, rng["pos"], rng["has_gauss"], rng["cached_gaussian"]))
        ps.total_numel_before_compression = int(saved["numel_before"])
        ps.total_numel_after_compression = int(saved["numel_after"])

    def lay_out(self, bucket: dist.GradBucket) -> None:
        """Remember the bucket's parameters; put loaded memories for them into torch's per-bucket tensors."""
        names = self.names(bucket)
        shapes = [g.shape for g in bucket.gradients()]
        index = bucket.index()
        scalars = [name for name, shape in zip(names, shapes, strict=True) if len(shape) == 0]
        if scalars:
            raise ConfigurationError(
                f"torch's powerSGD_hook cannot compress 0-d parameters ({', '.join(scalars)}): it views every "
                "gradient as (shape[0], -1); make them 1-element tensors or use another compressor (e.g. onebit)"
            )
        if index in self.layouts and self.layouts[index][0] != names:
            self._stash()  # DDP rebuilt its buckets (after the first step of a resumed run): re-lay everything
        self.layouts[index] = (names, shapes)
        buffer = bucket.buffer()
        if any(name in self.pending["error"] for name in names):
            parts = [
                self.pending["error"].pop(name, torch.zeros(shape)).reshape(-1)
                for name, shape in zip(names, shapes, strict=True)
            ]
            self.powersgd.error_dict[index] = torch.cat(parts).to(buffer)
        slices = self._q_slices(shapes)
        if slices and all(names[i] in self.pending["q"] for i, *_ in slices):
            qs = [self.pending["q"].pop(names[i]).reshape(-1) for i, *_ in slices]
            self.powersgd.q_memory_dict[index] = torch.cat(qs).to(buffer)
            p_size = sum(rows * rank for _, rows, _, rank in slices)
            self.powersgd.p_memory_dict[index] = buffer.new_empty(p_size)


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> Future:
    """``powersgd``: torch's ``powerSGD_hook`` (layer-wise rank-r PowerSGD with error feedback), counted.

    torch's hook allreduces the uncompressed tensors (vectors, small matrices) as one flat tensor, then all Ps,
    then all Qs; the element count it adds to ``total_numel_after_compression`` is exactly what those three
    allreduces carry, so that is what is counted. It works with gloo on CPU with this torch: pytorch issue
    58467 (gloo refusing the allreduce of an empty uncompressed tensor when every tensor of a bucket is
    compressed) was fixed in gloo (facebookincubator/gloo#309), and the tests run a bias-free model that hits
    that case on real gloo ranks.
    """
    if state.process_group is None and not (dist.is_available() and dist.is_initialized()):
        raise ConfigurationError(
            "powersgd runs torch's powerSGD_hook, which needs a torch.distributed process group even for one "
            "rank; call torch.distributed.init_process_group first (DDP needs one anyway)"
        )
    ps = state.powersgd
    buffer = bucket.buffer()
    n = state.world_size
    if state.previous is not None:
        # torch's hook issues its later collectives from future callbacks; with several buckets in flight the
        # ranks could issue them in different orders, which gloo pairs wrongly. Finishing the previous bucket
        # first keeps the order the same on every rank (its communication still overlaps the backward pass).
        state.previous.wait()
    state.lay_out(bucket)
    before = ps.total_numel_after_compression
    warm = ps.iter < ps.start_powerSGD_iter
    future = _powersgd.powerSGD_hook(ps, bucket)
    elements = buffer.numel() if warm else ps.total_numel_after_compression - before
    if n > 1:
        state.count(torch.empty(elements, dtype=buffer.dtype, device="meta"), 2 * (n - 1) / n)
    state.end_bucket(bucket)
    state.previous = None if bucket.is_last() else future
    return future
