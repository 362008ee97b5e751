"""The data room: catalogs, synthetic collections, ingest to Zarr, datasets and the training loader."""
