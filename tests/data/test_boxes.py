"""Box tables: NIH's real BBox_List_2017.csv, the generic CSV, scaling to the store, the synthetic ground truth."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import dask_dl
from dask_dl import ConfigurationError, DatasetError
from dask_dl.data.boxes import attach_boxes, boxes_of, read_boxes
from dask_dl.data.radiograph import BOX_FINDINGS, draw, draw_with_boxes

NIH_COUNTS = {
    "Atelectasis": 180,
    "Cardiomegaly": 146,
    "Effusion": 153,
    "Infiltration": 123,
    "Mass": 85,
    "Nodule": 79,
    "Pneumonia": 120,
    "Pneumothorax": 98,
}


def test_real_nih_table_has_the_published_boxes(shared_data):
    path = shared_data / "nih" / "BBox_List_2017.csv.gz"
    if not path.exists():
        pytest.skip(f"{path} is absent")
    boxes = read_boxes(path)
    assert len(boxes) == 984
    assert boxes["finding"].value_counts().to_dict() == NIH_COUNTS  # 'Infiltrate' is read as 'Infiltration'
    assert boxes["image_id"].nunique() == 880
    assert boxes.attrs["size"] == 1024
    assert (boxes["x"] + boxes["w"]).max() <= 1024 and (boxes["y"] + boxes["h"]).max() <= 1024
    first = boxes.iloc[0]
    assert (first.image_id, first.finding) == ("00013118_008.png", "Atelectasis")
    np.testing.assert_allclose(
        first[["x", "y", "w", "h"]].to_numpy(float),
        [225.084745762712, 547.019216763771, 86.7796610169491, 79.1864406779661],
    )
    scaled = read_boxes(path, size=256)  # 1024 -> 256: a quarter
    np.testing.assert_allclose(scaled[["x", "y", "w", "h"]].to_numpy(), boxes[["x", "y", "w", "h"]].to_numpy() / 4)
    assert scaled.attrs["size"] == 256


def test_generic_csv_and_non_square_sources_scale_as_ingest_pads(tmp_path):
    path = tmp_path / "boxes.csv"
    path.write_text("image_id,finding,x,y,w,h\na.png,Mass,10,20,30,40\nb.png,Nodule,0,0,200,100\n")
    raw = read_boxes(path)
    assert raw.attrs["size"] is None and raw[["x", "w"]].to_numpy().tolist() == [[10, 30], [0, 200]]
    # a 200 x 100 source is padded 50 px top and bottom to 200 x 200, then scaled to 100
    scaled = read_boxes(path, size=100, image_size=(200, 100))
    np.testing.assert_allclose(scaled[["x", "y", "w", "h"]].to_numpy(), [[5, 35, 15, 20], [0, 25, 100, 50]])
    with pytest.raises(ConfigurationError, match="image_size"):
        read_boxes(path, size=100)


def test_bad_tables_are_refused_with_the_row(tmp_path):
    path = tmp_path / "boxes.csv"
    path.write_text("image_id,finding,x,y,w\na.png,Mass,1,2,3\n")
    with pytest.raises(DatasetError, match=r"lacks columns \['h'\]"):
        read_boxes(path)
    path.write_text("image_id,finding,x,y,w,h\na.png,Mass,1,2,3,4\nb.png,Mass,1,2,-3,4\n")
    with pytest.raises(DatasetError, match="box row 1"):
        read_boxes(path)
    with pytest.raises(dask_dl.StoreNotFoundError):
        read_boxes(tmp_path / "missing.csv")


@pytest.mark.parametrize("finding", BOX_FINDINGS)
def test_drawn_boxes_hold_what_the_finding_changes(finding):
    """The box is where the finding is: most of what it changes in the image lies inside its box(es)."""
    for key in range(3):
        with_it, boxes = draw_with_boxes(128, [finding], seed=7, key=(key,), strength=0.8)
        without = draw(128, [], seed=7, key=(key,))
        assert (with_it == draw(128, [finding], seed=7, key=(key,), strength=0.8)).all()
        assert boxes and all(b[0] == finding for b in boxes)
        change = np.abs(with_it.astype(float) - without)
        inside = np.zeros(change.shape, bool)
        for _, x, y, w, h in boxes:
            inside[int(y) : int(np.ceil(y + h)), int(x) : int(np.ceil(x + w))] = True
        assert inside.flat[np.argmax(change)], (finding, key, boxes)
        # the exposure's blur spreads a nodule's few pixels beyond its box
        assert change[inside].sum() > (0.45 if finding == "Nodule" else 0.7) * change.sum(), (finding, key, boxes)
        assert inside.mean() < 0.5  # and the box is not the whole chest


def test_synthesize_writes_nih_box_table(tmp_path):
    table = dask_dl.synthesize(tmp_path, n_images=60, size=64, seed=2, corrupt_fraction=0.05)
    text = (tmp_path / "BBox_List_2017.csv").read_text().splitlines()
    assert text[0] == "Image Index,Finding Label,Bbox [x,y,w,h],,,"
    labels = {line.split(",")[1] for line in text[1:]}
    assert labels <= set(NIH_COUNTS) - {"Infiltration"} | {"Infiltrate"}
    catalog = dask_dl.read_catalog(tmp_path)
    boxes = read_boxes(tmp_path / "BBox_List_2017.csv", catalog=catalog)  # image sizes read from the PNG headers
    assert boxes.equals(read_boxes(tmp_path / "BBox_List_2017.csv", image_size=64)) and len(boxes) > 10
    truth = table.set_index("image_id")
    for box in boxes.itertuples():
        assert truth.loc[box.image_id, box.finding] == 1 and not truth.loc[box.image_id, "corrupt"]
        assert box.x >= 0 and box.x + box.w <= 64 and box.y >= 0 and box.y + box.h <= 64
    drawn = {(i, f) for i, row in truth.iterrows() for f in NIH_COUNTS if row[f] and not row["corrupt"]}
    assert drawn == set(zip(boxes["image_id"], boxes["finding"], strict=True))


def test_boxes_of_smaller_images_are_not_scaled_as_nih_pixels_without_a_word(tmp_path, shared_data):
    """A synthetic collection's NIH-form table is in its own size; scaled from NIH's 1024 it would score 0."""
    dask_dl.synthesize(tmp_path, n_images=120, size=128, seed=4)
    path = tmp_path / "BBox_List_2017.csv"
    raw = read_boxes(path)  # no scaling asked: no frame needed
    extent = max((raw["x"] + raw["w"]).max(), (raw["y"] + raw["h"]).max())
    assert len(raw) >= 20 and extent <= 128
    said = rf"all {len(raw)} boxes of '{path}' end within {extent:g} pixels of the top-left corner of the 1024 x 1024 "
    with pytest.raises(DatasetError, match=said + r"frame .* Pass image_size=<the side of those images>"):
        read_boxes(path, size=64)
    halved = read_boxes(path, size=64, image_size=128)
    np.testing.assert_allclose(halved[["x", "y", "w", "h"]].to_numpy(), raw[["x", "y", "w", "h"]].to_numpy() / 2)
    assert len(read_boxes(path, size=64, image_size=1024)) == len(raw)  # said on purpose: taken as NIH's pixels
    few = tmp_path / "few.csv"  # a few boxes may well sit in one corner of NIH's images
    few.write_text("\n".join(path.read_text().splitlines()[:20]) + "\n")
    np.testing.assert_allclose(read_boxes(few, size=64)[["x", "w"]].to_numpy(), raw[["x", "w"]].head(19) / 16)
    nih = shared_data / "nih" / "BBox_List_2017.csv.gz"
    if nih.exists():  # NIH's own boxes cover the whole frame
        assert len(read_boxes(nih, size=64)) == 984


@pytest.mark.slow
def test_boxes_attach_to_a_dataset_by_image_id(tmp_path, cluster_client):
    dask_dl.synthesize(tmp_path / "raw", n_images=40, size=64, seed=3)
    catalog = dask_dl.read_catalog(tmp_path / "raw")
    dask_dl.ingest(catalog, tmp_path / "s.zarr", size=32, chunk=8, shard=1, client=cluster_client, progress=False)
    ds = dask_dl.open_dataset(tmp_path / "s.zarr", split="test")
    with_boxes = attach_boxes(ds, tmp_path / "raw" / "BBox_List_2017.csv", image_size=64)
    table = boxes_of(with_boxes)
    full = read_boxes(tmp_path / "raw" / "BBox_List_2017.csv", image_size=64, size=32)
    want = full[full["image_id"].isin(ds["image_id"].values)]
    assert set(map(tuple, table[["image_id", "finding"]].to_numpy())) == set(
        map(tuple, want[["image_id", "finding"]].to_numpy())
    )
    np.testing.assert_allclose(np.sort(table["x"].to_numpy()), np.sort(want["x"].to_numpy()), rtol=1e-6)
    # ordered like the images; boxes of 64 px images refused for a 32 px dataset
    order = pd.Index(ds["image_id"].values).get_indexer(table["image_id"])
    assert (np.diff(order) >= 0).all()
    with pytest.raises(DatasetError, match="size=32"):
        attach_boxes(ds, read_boxes(tmp_path / "raw" / "BBox_List_2017.csv", image_size=64, size=64))
