"""Tiny learnable collections for training tests: a bright square per positive label."""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dask_dl.data.schema import make_catalog

__all__ = ["RECOVERY_RUN", "SQUARES_RUN", "fit_squares", "one_rank_group", "paced_small_cnn", "squares_collection"]

#: The training tests' run on the squares store: a small CNN of width 8, one epoch, 2 trainers of 8 images a step,
#: plain SGD (the learning rate and the references in the tests are SGD's)
SQUARES_RUN = dict(
    model="small_cnn", model_kwargs={"width": 8}, epochs=1, batch_size=8, trainers=2, lr=0.05, optimizer="sgd"
)

#: The recovery and chaos tests' run: :data:`SQUARES_RUN` one image a step for 4 epochs (32 steps each on the
#: squares store), 1-bit compressed from the third step, seeded
RECOVERY_RUN = {**SQUARES_RUN, "epochs": 4, "batch_size": 1, "compression": "onebit", "warmup_steps": 2, "seed": 5}


def squares_collection(root: Path, *, n_train: int = 64, n_val: int = 32, seed: int = 0) -> pd.DataFrame:
    """Write 64 px PNGs under ``root/images`` and return their catalog (one patient per image).

    Label ``a`` is a bright square top left, ``b`` one bottom right, each present in about half the images, on
    Gaussian noise: a small CNN learns both within a couple of epochs at 32 px.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n_train + n_val):
        a, b = rng.random() < 0.5, rng.random() < 0.5
        pixels = rng.normal(80, 20, (64, 64))
        pixels[8:24, 8:24] += 120 * a
        pixels[40:56, 40:56] += 120 * b
        path = root / "images" / f"{i:04d}.png"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path)
        split = "train" if i < n_train else "val"
        rows.append(dict(image_id=path.name, path=str(path), patient_id=f"p{i}", site="A", split=split, a=a, b=b))
    frame = pd.DataFrame(rows).astype({"a": "uint8", "b": "uint8"})
    return make_catalog(frame, ["a", "b"])


def fit_squares(store: str, client: Any, **options: Any) -> Any:
    """``dask_dl.fit`` of :data:`SQUARES_RUN` on ``store`` with ``client``; ``options`` replace or add to it."""
    import dask_dl

    return dask_dl.fit(dask_dl.open_dataset(store), client=client, **{**SQUARES_RUN, **options})


@contextmanager
def one_rank_group() -> Iterator[None]:
    """A real one-rank gloo process group in this process, for real DDP models in a test.

    What the block made is collected before the group is destroyed. A DDP model that outlives its group ends it
    from the C++ destructor of its reducer, which holds the GIL while it waits for gloo's threads; a gloo thread
    that needs the GIL to let go of its last work then never ends, and the process hangs (pytorch#56297; seen
    once in a full test run). So free every DDP model inside the block: make it in a function the block calls.
    """
    import torch.distributed as dist

    from dask_dl.testing.servers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # DDP models in reference cycles: their reducers let go of the group while it exists
        dist.destroy_process_group()


def paced_small_cnn(num_outputs: int, in_channels: int = 1, *, seconds: float = 0.05, **options: Any) -> Any:
    """The registry's ``small_cnn``, that sleeps ``seconds`` before each forward pass.

    The same options and seed give it the same weights as ``small_cnn``, step after step: a run of it is one of
    ``small_cnn`` whose steps take long enough for a test to act between them (kill a trainer in a chosen epoch)
    at any speed of the machine's restarts, without more computation. ``fit(model="dask_dl.testing.train:
    paced_small_cnn", model_kwargs={"width": 8, "seconds": 0.05})``.
    """
    from dask_dl.models import build_model

    model = build_model("small_cnn", num_outputs=num_outputs, in_channels=in_channels, **options)
    model.register_forward_pre_hook(functools.partial(_pause, seconds))
    return model


def _pause(seconds: float, module: Any, args: Any) -> None:
    time.sleep(seconds)
