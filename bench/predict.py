"""How fast is dask_dl.predict on a LocalCluster, against one onnxruntime session and against torch?

    python bench/predict.py [--model resnet18] [--size 128] [--n 512] [--workers 2] [--chunk 64] [--batch-size 32]

Writes N random images to a Zarr array in a temporary directory (the workers read their chunks from it, as they
would from an ingested store), exports the model to ONNX, and measures images/s of:

- ``predict`` on a LocalCluster of W worker processes x 1 thread (sessions with 1 intra-op thread each, as
  ``dask-dl.predict.threads`` sets), timed on a second run so that session creation is left out (it is printed);
- the baseline: one onnxruntime session in this process with 1 intra-op thread, same batches, images in memory;
- one onnxruntime session with onnxruntime's default threads (all cores);
- torch inference of the same model in this process (torch's default threads), same batches.

It prints images/s and the ratios; parallel efficiency = (predict / one 1-thread session) / W.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import dask.array as da
import numpy as np
import onnxruntime as ort
import torch
import zarr
from distributed import Client, LocalCluster

from dask_dl.export import INPUT_NAME, OUTPUT_NAME, export_onnx
from dask_dl.inference import predict
from dask_dl.models import build_model, normalize


def _session(path: str, threads: int | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])


def _run_session(session: ort.InferenceSession, images: np.ndarray, batch: int) -> float:
    start = time.perf_counter()
    for b in range(0, len(images), batch):
        session.run([OUTPUT_NAME], {INPUT_NAME: images[b : b + batch, None].astype(np.float32)})
    return time.perf_counter() - start


def _run_torch(model: torch.nn.Module, images: np.ndarray, batch: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(images), batch):
            torch.sigmoid(model(normalize(images[b : b + batch])))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    n, size, batch, w = args.n, args.size, args.batch_size, args.workers

    with tempfile.TemporaryDirectory() as tmp:
        images = np.random.default_rng(0).integers(0, 256, (n, size, size), dtype=np.uint8)
        store = os.path.join(tmp, "images.zarr")
        zarr.create_array(store, data=images, chunks=(args.chunk, size, size))
        torch.manual_seed(0)
        model = build_model(args.model, num_outputs=14).eval()
        path = str(
            export_onnx(model, os.path.join(tmp, "model.onnx"), labels=[f"l{i}" for i in range(14)], input_size=size)
        )

        print(
            f"{args.model} at {size} px, {n} images in chunks of {args.chunk}, batches of {batch}, "
            f"{os.cpu_count()} cores"
        )
        one = _session(path, threads=1)
        _run_session(one, images[:batch], batch)  # warm-up
        t_one = _run_session(one, images, batch)
        every = _session(path, threads=None)
        _run_session(every, images[:batch], batch)
        t_every = _run_session(every, images, batch)
        _run_torch(model, images[:batch], batch)
        t_torch = _run_torch(model, images, batch)

        cluster = LocalCluster(n_workers=w, threads_per_worker=1, processes=True, dashboard_address=":0")
        with cluster, Client(cluster) as client:
            data = da.from_zarr(store)
            start = time.perf_counter()
            client.compute(predict(data, path, batch_size=batch)).result()
            t_first = time.perf_counter() - start
            start = time.perf_counter()
            client.compute(predict(data, path, batch_size=batch)).result()
            t_predict = time.perf_counter() - start

    rate = {
        name: n / t
        for name, t in [
            ("predict", t_predict),
            ("one", t_one),
            ("every", t_every),
            ("torch", t_torch),
            ("first", t_first),
        ]
    }
    print(
        f"  predict, {w} workers x 1 thread      {rate['predict']:8.1f} images/s "
        f"(first run, with session creation: {rate['first']:.1f})"
    )
    print(f"  one onnxruntime session, 1 thread    {rate['one']:8.1f} images/s")
    print(f"  one onnxruntime session, all threads {rate['every']:8.1f} images/s")
    print(f"  torch, this process                  {rate['torch']:8.1f} images/s")
    ratio = rate["predict"] / rate["one"]
    print(f"ratio predict / one 1-thread session   {ratio:.2f}  (parallel efficiency {ratio / w:.2f} at W={w})")
    print(f"ratio predict / one all-thread session {rate['predict'] / rate['every']:.2f}")
    print(f"ratio predict / torch                  {rate['predict'] / rate['torch']:.2f}")
    print(f"ratio one all-thread session / torch   {rate['every'] / rate['torch']:.2f}")


if __name__ == "__main__":
    main()
