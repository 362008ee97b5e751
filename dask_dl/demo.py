"""The demo: raw images to a trained, exported and deployed model on a local cluster, with a report.

``dask-dl demo`` (and :func:`run_demo`) starts a local cluster, writes a synthetic chest X-ray collection in the
NIH ChestX-ray14 layout (or takes a real one with ``data=``), ingests it to Zarr, trains with several trainers and
1-bit gradient compression while showing live progress, evaluates per-label AUROC on the test split, exports to
ONNX, scores the test split with the ONNX model on the cluster and prints a short report.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dask_dl import config


@dataclass(frozen=True)
class DemoReport:
    """What the demo did and measured; ``str(report)`` is the printed report."""

    out: Path
    n_images: int
    n_rejected: int
    image_size: int
    store_bytes: int
    ingest_images_per_s: float
    train_images_per_s: float
    compute_s: float
    comm_s: float
    data_wait_s: float
    bytes_sent: int
    bytes_uncompressed: int
    steps: int
    compression: str
    trainers: int
    cost: float
    currency: str
    test_auroc: pd.Series
    history: pd.DataFrame = field(repr=False)
    files: dict[str, Path] = field(default_factory=dict)
    seconds: float = 0.0
    global_batch: int = 0

    @property
    def compression_ratio(self) -> float:
        """Bytes sent over the bytes an uncompressed (fp32 allreduce) exchange would have sent."""
        return self.bytes_sent / self.bytes_uncompressed if self.bytes_uncompressed else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """The report's numbers as plain Python values."""
        return {
            "n_images": self.n_images,
            "n_rejected": self.n_rejected,
            "image_size": self.image_size,
            "store_bytes": self.store_bytes,
            "ingest_images_per_s": self.ingest_images_per_s,
            "train_images_per_s": self.train_images_per_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "data_wait_s": self.data_wait_s,
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
            "steps": self.steps,
            "global_batch": self.global_batch,
            "compression_ratio": self.compression_ratio,
            "cost": self.cost,
            "test_auroc_mean": float(np.nanmean(self.test_auroc.to_numpy())),
            "test_auroc": {k: float(v) for k, v in self.test_auroc.items()},
            "files": {k: str(v) for k, v in self.files.items()},
            "seconds": self.seconds,
        }

    def __str__(self) -> str:
        from dask_dl.metrics import NO_AUROC_NOTE, auroc_text

        lines = [
            "dask_dl demo report",
            "===================",
            f"data      {self.n_images:,} images ({self.n_rejected} rejected), {self.image_size}x{self.image_size} "
            f"uint8, store {self.store_bytes / 2**20:.1f} MiB; ingest {self.ingest_images_per_s:,.0f} images/s",
            f"training  {self.trainers} trainers, global batch {self.global_batch}, compression {self.compression}: "
            f"{self.train_images_per_s:,.0f} images/s",
            f"time      compute {self.compute_s:.1f} s, communication {self.comm_s:.1f} s, "
            f"data wait {self.data_wait_s:.1f} s",
            f"network   {self.bytes_sent:,} bytes sent by the trainers in {self.steps} steps vs "
            f"{self.bytes_uncompressed:,} for fp32 allreduce (ratio {self.compression_ratio:.4f})",
            f"cost      {self.cost:.4f} {self.currency} (prices: dask-dl.cost in config)",
            f"test AUROC (mean {np.nanmean(self.test_auroc.to_numpy()):.3f}):",
        ]
        lines += [f"  {label:20s} {auroc_text(value)}" for label, value in self.test_auroc.items()]
        if self.test_auroc.isna().any():
            lines.append(f"  {NO_AUROC_NOTE}")
        lines.append("files:")
        lines += [f"  {k:12s} {v}" for k, v in self.files.items()]
        lines.append(f"total {self.seconds:.1f} s")
        return "\n".join(lines)


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def run_demo(
    out: str | os.PathLike = "dask-dl-demo",
    *,
    images: int = 4000,
    size: int = 64,
    epochs: int = 8,
    model: str = "small_cnn",
    trainers: int = 2,
    compression: str = "onebit",
    batch_size: int = 32,
    warmup_steps: int = 0,
    optimizer: str = "adamw",
    lr: float = 3e-3,
    data: str | os.PathLike | None = None,
    seed: int = 0,
    client=None,
    scheduler: str | None = None,
    workers: int | None = None,
    view: str = "auto",
    overwrite: bool = True,
) -> DemoReport:
    """Run the whole dask_dl story end to end and return its report.

    Parameters
    ----------
    out
        Folder for everything the demo writes (raw images, Zarr store, checkpoints, ONNX model, scores).
    images, size
        Synthetic collection size (images) and the training image size (pixels per side).
    epochs, model, trainers, compression, batch_size, warmup_steps, optimizer, lr
        Training settings (see :func:`dask_dl.fit`). The demo compresses from the first step, so that the bytes
        it reports are the compressor's own.
    data
        A real collection to use instead of the synthetic one (anything :func:`dask_dl.read_catalog` reads).
    client, scheduler, workers
        Cluster to run on: a client, a scheduler address, or the worker count of a new local cluster.
    view
        Progress display while training: ``auto``, ``notebook``, ``terminal``, ``log`` or ``none``.

    Returns
    -------
    DemoReport
    """
    from dask_dl.cluster import connect
    from dask_dl.data.catalog import read_catalog
    from dask_dl.data.dataset import open_dataset
    from dask_dl.data.ingest import ingest
    from dask_dl.data.synthetic import synthesize
    from dask_dl.export import export_onnx
    from dask_dl.inference import evaluate, predict, scores_table
    from dask_dl.models import build_model
    from dask_dl.train.run import fit

    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # closes, client first, only the cluster or connection it opened here
    with connect(client, scheduler=scheduler, n_workers=workers or max(trainers, 2)) as client:
        if data is None:
            data = out / "raw"
            if not (data / "Data_Entry_2017.csv").exists():
                synthesize(data, n_images=images, size=max(2 * size, 128), seed=seed, client=client)
        catalog = read_catalog(data)
        store = out / "cxr.zarr"
        ingested = ingest(catalog, store, size=size, client=client, overwrite=overwrite)

        ds = open_dataset(store)
        run = fit(
            ds,
            checkpoint_dir=out / "checkpoints",
            model=model,
            epochs=epochs,
            trainers=trainers,
            compression=compression,
            batch_size=batch_size,
            warmup_steps=warmup_steps,
            optimizer=optimizer,
            lr=lr,
            seed=seed,
            client=client,
            view=view,
        )
        history = run.history

        onnx_path = export_onnx(run, out / "model.onnx", overwrite=True)
        test = open_dataset(store, split="test")
        probs = predict(test, onnx_path, client=client)
        table = scores_table(test, probs)
        scores_path = out / "scores.parquet"
        table.to_parquet(scores_path)
        test_auroc = evaluate(table)

        labels = ds.attrs["dask_dl"]["labels"]
        n_params = sum(p.numel() for p in build_model(model, num_outputs=len(labels)).parameters())
        steps = int(history["steps"].sum())
        prices = config.get("cost")
        return DemoReport(
            out=out,
            n_images=ingested.n,
            n_rejected=ingested.n_rejected,
            image_size=size,
            store_bytes=_du(store),
            ingest_images_per_s=ingested.n / max(ingested.seconds, 1e-9),
            train_images_per_s=float(history["images_per_s"].mean()),
            compute_s=float(history["compute_s"].sum()),
            comm_s=float(history["comm_s"].sum()),
            data_wait_s=float(history["data_wait_s"].sum()),
            bytes_sent=int(history["bytes_sent"].sum()),
            # what the same steps would hand to torch.distributed uncompressed: each trainer's fp32 gradient
            bytes_uncompressed=4 * n_params * steps * trainers,
            steps=steps,
            compression=compression,
            trainers=trainers,
            cost=float(history["cost"].sum()) if "cost" in history else 0.0,
            currency=prices["currency"],
            test_auroc=test_auroc,
            history=history,
            files={
                "raw": Path(data),
                "store": store,
                "checkpoints": out / "checkpoints",
                "onnx": Path(onnx_path),
                "scores": scores_path,
            },
            seconds=time.perf_counter() - t0,
            global_batch=int(history["global_batch"].iloc[-1]),
        )
