#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on a lent GPU machine, downloaded here into .whl/ (git-ignored).
#
# Those machines reach no package index. Their image (/work/.library/device/KINDS.md) holds Python 3.12 with a
# CUDA build of torch, numpy, pandas, pyarrow, numba, scipy, scikit-image, onnx, onnxruntime, onnxscript, xarray,
# matplotlib, pytest, pytest-timeout and hypothesis, but not Dask, Zarr or the rest below: these travel with the
# working tree as wheels for CPython 3.12 on x86-64 Linux (about 47 MB: with the tree, under the device tool's
# 64 MiB), pinned to what pip resolved for dask-cuda and to .ci/constraints.txt for the others. Then, with the
# device tool:
#   bash bench/gpu_wheels.sh
#   run(carry=[".whl"], command="bash bench/gpu_check.sh", timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(
    # Dask as dask-cuda pins it (rapids-dask-dependency), and what distributed needs beyond the image
    dask-cuda==26.10.0 rapids-dask-dependency==26.10.0 dask==2026.7.1 distributed==2026.7.1 lazy-importer==0.1.0
    importlib-metadata==10.2.0 locket==1.0.0 partd==1.4.2 tblib==3.2.2 tornado==6.6.1 zict==3.0.0 tzdata==2026.6
    bokeh==3.9.2 xyzservices==2026.9.1
    # the store, and the PNG decoder
    zarr==3.1.6 numcodecs==0.16.6 google-crc32c==1.9.0 donfig==0.8.1.post1 imagecodecs==2026.3.6
    # what tests/conftest.py imports, and the GPU explanation test
    dask-gateway==2026.3.0 dask-jobqueue==0.9.0 captum==0.9.0
)
rm -rf .whl
mkdir .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
du -sh .whl
