"""The whole story on any cluster, small, with a record of which worker did what.

:func:`small_story` synthesizes a tiny collection, ingests it, trains a small model, exports it to ONNX and scores
the test split, all on the cluster of ``client``, and returns where each kind of task ran. The cluster tests run
it on a local heterogeneous cluster, over TLS, through dask-gateway and through SLURM, and with every file on S3.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["StoryResult", "small_story", "worker_of_tasks", "write_tls_files"]


@dataclass
class StoryResult:
    """What :func:`small_story` did and where: task prefixes mapped to the worker addresses that ran them."""

    store: str
    model: str
    trainers: list[str]
    images: int
    scores: Any
    ran_on: dict[str, set[str]] = field(default_factory=dict)
    history: Any = None


def worker_of_tasks(records: list[dict[str, Any]], prefix: str) -> set[str]:
    """Workers that ran tasks whose key starts with ``prefix``, from ``distributed.get_task_stream`` records."""
    found = set()
    for record in records:
        key = record["key"]
        name = key[0] if isinstance(key, tuple) else key
        if str(name).startswith(prefix):
            found.add(record["worker"])
    return found


def small_story(
    client: Client,
    workdir: str | os.PathLike,
    *,
    raw: str | os.PathLike | None = None,
    store: str | None = None,
    checkpoint_dir: str | None = None,
    model_path: str | None = None,
    trainers: int = 2,
    n_images: int = 48,
    upload_raw: str | None = None,
) -> StoryResult:
    """Synthesize, ingest, train one epoch, export and score on ``client``'s cluster.

    Parameters
    ----------
    client
        Client of the cluster under test.
    workdir
        Local folder for the raw collection and, unless given, the store, the checkpoints and the model.
    raw, store, checkpoint_dir, model_path
        Where to put each (paths or fsspec URLs); default under ``workdir``.
    trainers
        Data-parallel trainers.
    n_images
        Images in the synthetic collection (64 px, ingested at 32 px).
    upload_raw
        An fsspec URL to copy the raw collection to after synthesizing it; the catalog is then read from there, so
        the workers decode the images from that storage.

    Returns
    -------
    StoryResult
    """
    from distributed import get_task_stream

    import dask_dl
    from dask_dl.data.synthetic import synthesize

    workdir = os.fspath(workdir)
    raw = os.fspath(raw) if raw is not None else os.path.join(workdir, "raw")
    store = store or os.path.join(workdir, "story.zarr")
    checkpoint_dir = checkpoint_dir or os.path.join(workdir, "checkpoints")
    model_path = model_path or os.path.join(workdir, "story.onnx")
    with get_task_stream(client) as stream:
        synthesize(raw, n_images=n_images, size=64, seed=0, client=client)
        if upload_raw is not None:
            import fsspec

            fs, root = fsspec.core.url_to_fs(upload_raw)
            fs.put(raw.rstrip("/") + "/", root, recursive=True)
            raw = upload_raw
        catalog = dask_dl.read_catalog(raw)
        dask_dl.ingest(catalog, store, size=32, chunk=8, shard=1, client=client, progress=False)
        run = dask_dl.fit(
            dask_dl.open_dataset(store),
            model="small_cnn",
            model_kwargs={"width": 8},
            epochs=1,
            batch_size=8,
            trainers=trainers,
            lr=0.05,
            checkpoint_dir=checkpoint_dir,
            client=client,
        )
        dask_dl.export_onnx(run, model_path, overwrite=True)
        test = dask_dl.open_dataset(store, split="test")
        scores = client.compute(dask_dl.predict(test, model_path, client=client)).result()
    records = stream.data
    ran_on = {
        "synthesize": worker_of_tasks(records, "_write_block"),
        "ingest": worker_of_tasks(records, "ingest-shard"),
        "predict": worker_of_tasks(records, "predict"),
    }
    return StoryResult(
        store=store,
        model=model_path,
        trainers=list(run.workers),
        images=len(catalog),
        scores=scores,
        ran_on=ran_on,
        history=run.history,
    )


def write_tls_files(security: Any, folder: str | os.PathLike) -> dict[str, str]:
    """Write the PEM texts of a ``Security.temporary()`` to files, for ``--tls-ca/--tls-cert/--tls-key``.

    Returns
    -------
    dict
        ``{"ca": path, "cert": path, "key": path}``.
    """
    texts = {"ca": security.tls_ca_file, "cert": security.tls_client_cert, "key": security.tls_client_key}
    paths = {}
    for name, text in texts.items():
        path = os.path.join(os.fspath(folder), f"{name}.pem")
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o600)
        paths[name] = path
    return paths
