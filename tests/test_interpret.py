"""Pictures of a collection, a model and runs, on a real LocalCluster: every figure rendered to PNG and checked.

One module-scoped collection (320 synthetic radiographs with Effusion and Mass on 40% of them, ingested at 64 px in
chunks of 32), one small_cnn trained on it in this process, its ONNX export, and one real two-trainer run serve
every test. Each figure is checked for what it claims (which image, which curve, which number), then rendered to
PNG and checked not to be blank.
"""

from __future__ import annotations

import io
import sys
import traceback

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from PIL import Image  # noqa: E402

import dask_dl  # noqa: E402
from dask_dl import ConfigurationError, DatasetError, MissingDependencyError  # noqa: E402
from dask_dl.interpretation import curves  # noqa: E402
from dask_dl.interpretation.runs import plot_run  # noqa: E402
from dask_dl.metrics import auroc  # noqa: E402
from dask_dl.testing.browser import Browser, find_chromium  # noqa: E402
from dask_dl.testing.explain import boxed_collection, train_small_cnn  # noqa: E402

SIZE = 64


@pytest.fixture(scope="module")
def collection(tmp_path_factory, cluster_client):
    root = tmp_path_factory.mktemp("pictures")
    catalog = boxed_collection(root / "raw", n_images=320, size=SIZE, seed=0)
    catalog.loc[180:239, "split"] = "val"  # fit validates on it
    catalog["age"] = (np.arange(len(catalog)) * 7) % 90
    store = str(root / "cxr.zarr")
    dask_dl.ingest(catalog, store, size=SIZE, chunk=32, shard=1, client=cluster_client, progress=False)
    ds = dask_dl.open_dataset(store)
    checkpoint = train_small_cnn(ds, epochs=3, width=8)
    onnx = dask_dl.export_onnx(checkpoint, root / "model.onnx")
    return {"root": root, "store": store, "ds": ds, "catalog": catalog, "checkpoint": checkpoint, "onnx": str(onnx)}


@pytest.fixture(scope="module")
def scored(collection, cluster_client):
    """The ONNX model's interpretation of the test split, and the same losses computed here from all the scores."""
    interp = dask_dl.interpret(collection["ds"], collection["onnx"], split="test", client=cluster_client)
    p = np.clip(interp.probs.compute().astype(np.float64), 1e-7, 1 - 1e-7)
    y = interp.ds["label"].sel(finding=interp.labels).values.astype(np.float64)
    losses = -(y * np.log(p) + (1 - y) * np.log(1 - p)).mean(axis=1)
    return interp, losses


@pytest.fixture(scope="module")
def run(collection, cluster_client):
    return dask_dl.fit(
        collection["ds"],
        model="small_cnn",
        model_kwargs={"width": 8},
        epochs=2,
        batch_size=32,
        trainers=2,
        lr=3e-3,
        warmup_steps=0,
        checkpoint_dir=str(collection["root"] / "ck"),
        client=cluster_client,
    )


def drawn(fig) -> np.ndarray:
    """Render ``fig`` to PNG (then close it), check the picture is not blank and return its grey pixels."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=60)
    plt.close(fig)
    pixels = np.asarray(Image.open(buffer).convert("L"), dtype=np.float64)
    assert (pixels < 250).mean() > 0.01 and pixels.std() > 5, "a blank figure"
    return pixels


def legend(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


# ---- show_batch ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_show_batch_draws_the_images_that_match_with_their_labels(collection):
    ds, catalog = collection["ds"], collection["catalog"]
    fig = dask_dl.show_batch(ds, 6, where="Effusion == 1 and age > 60", catalog=catalog, seed=1)
    shown = [ax for ax in fig.axes if ax.images]
    ids = [ax.get_title().split("\n")[0] for ax in shown]
    matching = set(catalog.query("Effusion == 1 and age > 60")["image_id"])
    assert len(ids) == 6 and set(ids) <= matching and len(set(ids)) == 6
    position = {image_id: i for i, image_id in enumerate(ds["image_id"].values)}
    for ax, image_id in zip(shown, ids, strict=True):
        assert np.array_equal(ax.images[0].get_array(), ds["image"].values[position[image_id]])  # its own pixels
        lines = ax.get_title().split("\n")
        row = catalog.set_index("image_id").loc[image_id]
        assert "Effusion" in lines[1] and ("Mass" in lines[1]) == bool(row["Mass"])
        assert lines[2] == f"patient {row['patient_id']} · {row['split']}"
    drawn(fig)
    again = dask_dl.show_batch(ds, 6, where="Effusion == 1 and age > 60", catalog=catalog, seed=1)
    assert [ax.get_title() for ax in again.axes if ax.images] == [ax.get_title() for ax in shown]  # same seed
    plt.close(again)

    mass = dask_dl.show_batch(ds, 16, split="test", where=ds["label"].sel(finding="Mass") == 1, labels=["Mass"])
    titles = [ax.get_title().split("\n") for ax in mass.axes if ax.images]
    assert len(titles) == 16 and all(t[1] == "Mass" and t[2].endswith("· test") for t in titles)
    drawn(mass)


def test_show_batch_says_what_is_wrong(collection):
    ds = collection["ds"]
    with pytest.raises(ConfigurationError, match=r"cannot be evaluated.*'Effusion'.*catalog="):
        dask_dl.show_batch(ds, where="age > 60")  # the store has no age: the catalog does
    with pytest.raises(DatasetError, match="no image matches where='Effusion == 2'"):
        dask_dl.show_batch(ds, where="Effusion == 2")
    with pytest.raises(DatasetError, match=r"no image in split 'tset'; it has \['test', 'train', 'val'\]"):
        dask_dl.show_batch(ds, split="tset")
    with pytest.raises(DatasetError, match="one boolean per image"):
        dask_dl.show_batch(ds, where=np.ones(3, bool))
    with pytest.raises(ConfigurationError, match=r"labels \['Efusion'\] are not in the store; its labels are"):
        dask_dl.show_batch(ds, labels=["Efusion"])


# ---- interpret: top losses -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_top_losses_are_the_brute_force_top_k(scored):
    interp, losses = scored
    assert len(interp.losses.chunks[0]) > 1  # the reduction runs over several chunks
    table = interp.top_losses(10)
    expected = np.argsort(-losses, kind="stable")[:10]
    assert table["position"].tolist() == expected.tolist()
    np.testing.assert_allclose(table["loss"], losses[expected], rtol=1e-12)
    assert table["image_id"].tolist() == interp.ds["image_id"].values[expected].tolist()
    p = interp.probs.compute()
    np.testing.assert_array_equal(table[[f"p_{label}" for label in interp.labels]].to_numpy(), p[expected])
    bce = -(
        np.log(np.clip(p[expected], 1e-7, 1)) * table[interp.labels].to_numpy()
        + np.log(np.clip(1 - p[expected], 1e-7, 1)) * (1 - table[interp.labels].to_numpy())
    )
    assert table["worst"].tolist() == [interp.labels[j] for j in bce.argmax(axis=1)]
    assert len(interp.top_losses(10_000)) == interp.ds.sizes["sample"]  # k larger than the split: all of it


def test_an_interpretation_computes_on_its_own_client_whichever_client_is_current(collection, scored, cluster_client):
    """The scores are futures of the client that scored. Computed through the current client instead (here a
    second cluster's, as a notebook's ``with Client(...)`` block makes it), every question failed with Dask's "lost
    dependencies"; through a second client of the same scheduler, only when its graph overtook the scores'."""
    from distributed import Client, LocalCluster

    expected, losses = scored
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as elsewhere,
        Client(elsewhere) as current,
    ):
        interp = dask_dl.interpret(collection["ds"], collection["onnx"], split="test", client=cluster_client)
        assert interp.client is cluster_client
        pd.testing.assert_frame_equal(interp.scores, expected.scores)
        assert interp.top_losses(3)["position"].tolist() == np.argsort(-losses, kind="stable")[:3].tolist()
        assert current.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)) == 0  # nothing came here


@pytest.mark.slow
def test_plot_top_losses_draws_the_worst_image_first_with_its_map(collection, scored, cluster_client):
    _, losses = scored
    interp = dask_dl.interpret(collection["ds"], collection["checkpoint"], split="test", client=cluster_client)
    fig = interp.plot_top_losses(4, columns=2)
    shown = [ax for ax in fig.axes if ax.images]
    worst = int(np.argmax(losses))
    assert np.array_equal(shown[0].images[0].get_array(), interp.ds["image"].values[worst])
    assert all(len(ax.images) == 2 for ax in shown)  # the image and its Grad-CAM
    assert "gradcam" in fig.texts[0].get_text()
    titles = [ax.get_title().split("\n") for ax in shown]
    assert titles[0][0] == interp.ds["image_id"].values[worst] and titles[0][1].startswith(f"loss {losses.max():.3f}")
    shown_losses = [float(t[1].split()[1]) for t in titles]
    assert shown_losses == sorted(shown_losses, reverse=True)
    drawn(fig)

    plain = scored[0].plot_top_losses(3, explain=False)
    assert [len(ax.images) for ax in plain.axes if ax.images] == [1, 1, 1]
    drawn(plain)


@pytest.mark.slow
def test_an_onnx_model_is_explained_by_occlusion(scored):
    fig = scored[0].plot_top_losses(2)
    assert "occlusion" in fig.texts[0].get_text() and all(len(ax.images) == 2 for ax in fig.axes if ax.images)
    drawn(fig)


# ---- interpret: curves -----------------------------------------------------------------------------------------


def test_roc_has_one_curve_per_label_with_both_classes_and_evaluates_auroc(collection, scored, cluster_client):
    interp, _ = scored
    expected = dask_dl.evaluate(interp.scores)
    fig = interp.plot_roc()
    ax = fig.axes[0]
    assert legend(ax) == [f"{label} (AUROC {expected[label]:.3f})" for label in interp.labels]
    for line, label in zip(ax.get_lines(), interp.labels, strict=False):
        fpr, tpr = line.get_data()
        assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0, 0, 1, 1)
        assert np.trapezoid(tpr, fpr) == pytest.approx(expected[label], abs=1e-12)
    drawn(fig)

    ds = collection["ds"]
    no_mass = ds.isel(sample=np.flatnonzero(ds["label"].sel(finding="Mass").values == 0))
    one_class = dask_dl.interpret(no_mass, collection["onnx"], split="test", client=cluster_client)
    fig = one_class.plot_roc()
    assert legend(fig.axes[0]) == [f"Effusion (AUROC {dask_dl.evaluate(one_class.scores)['Effusion']:.3f})"]
    assert np.isnan(one_class.per_label().loc["Mass", "auroc"])
    drawn(fig)


def test_pr_calibration_and_confusion_count_what_they_show(scored):
    interp, _ = scored
    scores = interp.scores
    fig = interp.plot_pr()
    texts = legend(fig.axes[0])
    assert len(texts) == len(interp.labels)
    for text, label in zip(texts, interp.labels, strict=True):
        y, s = scores[label].to_numpy(), scores[f"p_{label}"].to_numpy()
        order = np.argsort(-s)
        hits = np.cumsum(y[order])
        brute = np.mean([hits[i] / (i + 1) for i in np.flatnonzero(y[order])])  # precision at each positive
        assert text.startswith(f"{label} (AP {brute:.3f}, prevalence {y.mean():.2f})")
    drawn(fig)
    fig = interp.plot_calibration(bins=5)
    assert len([line for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]) == 2
    drawn(fig)

    table = interp.confusion("Effusion", threshold=0.3)
    y, predicted = scores["Effusion"].to_numpy() == 1, scores["p_Effusion"].to_numpy() >= 0.3
    assert table.to_numpy().tolist() == [
        [int((~y & ~predicted).sum()), int((~y & predicted).sum())],
        [int((y & ~predicted).sum()), int((y & predicted).sum())],
    ]
    with pytest.raises(ConfigurationError, match=r"unknown label 'Efusion': the model's labels are \['Effusion'"):
        interp.confusion("Efusion")


def test_roc_steps_once_per_distinct_score_and_its_area_is_the_auroc():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 500)
    s = np.round(rng.random(500) + 0.3 * y, 1)  # many ties
    fpr, tpr = curves.roc_curve(y, s)
    assert len(fpr) == len(np.unique(s)) + 1
    assert np.trapezoid(tpr, fpr) == pytest.approx(auroc(y, s), abs=1e-12)
    predicted, observed = curves.calibration(y, np.clip(s, 0, 1), bins=4)
    assert len(predicted) == 4 and np.all((observed >= 0) & (observed <= 1))


def test_interpret_says_what_is_wrong(collection):
    with pytest.raises(DatasetError, match=r"no image in split 'tset'; it has \['test', 'train', 'val'\]"):
        dask_dl.interpret(collection["ds"], collection["onnx"], split="tset")
    no_labels = collection["ds"].drop_vars("label")
    with pytest.raises(DatasetError, match="has no labels"):
        dask_dl.interpret(no_labels, collection["onnx"])


# ---- runs ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_plot_draws_its_history_and_marks_restarts(run):
    history = run.history
    fig = run.plot()
    loss, auc, lr, speed = fig.axes
    lines = {line.get_label(): line.get_ydata() for line in loss.get_lines()}
    np.testing.assert_allclose(lines["train"], history["train_loss"])
    np.testing.assert_allclose(lines["validation"], history["val_loss"])
    np.testing.assert_allclose(auc.get_lines()[-1].get_ydata(), history["val_auroc_mean"])
    np.testing.assert_allclose(lr.get_lines()[0].get_ydata(), history["lr"])
    np.testing.assert_allclose(speed.get_lines()[0].get_ydata(), history["images_per_s"])
    assert len(auc.get_lines()) == 3  # one faint line per label, then the mean
    drawn(fig)

    restarted = pd.concat([history, history.assign(epoch=history["epoch"] + 2)], ignore_index=True)
    restarted["event"] = ["", "", "restarted", ""]
    fig = plot_run(restarted)
    marks = [line for line in fig.axes[0].get_lines() if line.get_label() in ("restarted", "_restarted")]
    assert len(marks) == 1 and marks[0].get_xdata()[0] == 1.5  # between epoch 1 and the restarted epoch 2
    drawn(fig)


def test_compare_draws_one_line_per_run(run):
    other = run.history.assign(val_auroc_mean=run.history["val_auroc_mean"] - 0.1)
    fig = dask_dl.compare([run, other])
    first = fig.axes[0]
    assert legend(first) == [run.run_id, "run 1"]
    np.testing.assert_allclose(first.get_lines()[1].get_ydata(), other["val_auroc_mean"])
    drawn(fig)
    named = dask_dl.compare({"a": other, "b": run.history}, metric="train_loss")
    assert legend(named.axes[0]) == ["a", "b"] and named.axes[0].get_ylabel() == "train_loss"
    plt.close(named)
    with pytest.raises(ConfigurationError, match=r"no 'val_acc' in its history; its columns are \['epoch'"):
        dask_dl.compare([run], metric="val_acc")
    with pytest.raises(ConfigurationError, match="at least one run"):
        dask_dl.compare([])


def test_missing_matplotlib_names_the_extra(run, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # import matplotlib.pyplot raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'dask-dl\[notebook\]'"):
        dask_dl.compare([run.history])


# ---- the report ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def page(collection, run, cluster_client):
    from dask_dl.cli import cli

    out = collection["root"] / "report.html"
    args = [
        "report",
        collection["store"],
        str(collection["root"] / "ck"),
        "--out",
        str(out),
        "--top",
        "4",
        "--scheduler",
        cluster_client.scheduler.address,
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output + "".join(traceback.format_exception(*result.exc_info))
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 1 and "--overwrite" in again.output  # one line, the page kept
    return out


@pytest.mark.slow
def test_report_is_one_page_with_its_images_inlined(page):
    text = page.read_text()
    assert text.count("<img ") == 4 and text.count("src='data:image/png;base64,") == 4
    assert "Effusion" in text and "average_precision" in text and "The 4 images with the highest loss" in text
    assert "src='http" not in text and "<script" not in text and "<link" not in text  # nothing to fetch


def test_report_opens_in_headless_chromium_with_every_image_loaded(page):
    if find_chromium() is None:
        pytest.skip("no Chromium on PATH (apt-get install chromium): the page is not opened in a browser")
    with Browser() as browser:
        loaded = "[...document.images].every(i => i.complete && i.naturalWidth > 0)"
        text = browser.open(page.as_uri()).wait_for(f"document.images.length === 4 && {loaded}")
    assert "dask_dl report" in text and "Per label" in text
