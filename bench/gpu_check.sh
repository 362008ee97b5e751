#!/usr/bin/env bash
# The GPU check (issues 9 and 29), one prepared script for a machine with NVIDIA GPUs, about 9 minutes:
#   1. an environment with a CUDA build of torch, dask-cuda, cudf/dask-cudf and onnxruntime-gpu: the wheels of
#      bench/gpu_wheels.sh when .whl/ was carried (this workplace's GPU machines reach no index), else installed
#      into a fresh venv when an index is reachable,
#   2. the gpu-marked tests (make("cuda"), NCCL training, scoring on the GPU workers with onnxruntime's CUDA
#      provider, catalogs and score tables as cudf-backed Dask DataFrames, pinned batches fed ahead and augmented
#      on the GPU),
#   2b. bench/loader.py --device cuda: images/s per core of decode, CPU and device augmentation, the cores one GPU
#      needs, and the GPU's side: device augmentation's images/s, pinned vs pageable copies, an epoch fed pinned
#      and ahead against pageable copies of CPU-augmented batches,
#   3. bench/gpu.py: images/s of dask_dl training (ResNet-18, AlexNet; 224 px, batch 256) against a plain
#      PyTorch loop on the same GPU and images (float32, and bf16 autocast + channels_last), and GPU vs CPU;
#      ResNet-18 also fit with augmentation on the trainer's CPU and on the GPU.
# Results go to stdout and to $OUT/gpu_check.txt when OUT is set.
#   bash bench/gpu_check.sh            # PYTHON=/path/to/python to use an environment that has it all already
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-/tmp}/gpu_check.txt
exec > >(tee "$log") 2>&1
started=$(date +%s)
step() { echo "== $(( $(date +%s) - started )) s: $*"; }

step "machine"
nvidia-smi -L || { echo "no NVIDIA GPU (nvidia-smi -L failed): this check needs one"; exit 2; }
nproc; free -g | head -2

PYTHON=${PYTHON:-python3}
cuda_ok() { "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
if [ -d .whl ]; then
    # wheels carried from bench/gpu_wheels.sh, onto the image's own Python and torch (no index reachable there)
    step "installing the carried wheels (.whl) beside the image's packages; dask_dl from this tree"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || echo "the carried wheels could not be installed"
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
elif ! cuda_ok || ! "$PYTHON" -c "import dask_cuda, dask_dl" 2>/dev/null; then
    step "installing: a venv with torch (CUDA build) and dask-dl[gpu,dev]"
    "$PYTHON" -m venv /tmp/gpu-venv && PYTHON=/tmp/gpu-venv/bin/python
    "$PYTHON" -m pip install -q --upgrade pip
    "$PYTHON" -m pip install -q "torch==2.13.*" || echo "torch (CUDA build) could not be installed"
    "$PYTHON" -m pip install -q -e '.[gpu,dev]' || "$PYTHON" -m pip install -q -e '.[dev]' dask-cuda \
        || echo "dask-dl[gpu] could not be installed"
    # onnxruntime-gpu replaces onnxruntime (one module, two packages): swap only once its wheel is here
    if "$PYTHON" -m pip download -q --no-deps -d /tmp/ort-gpu onnxruntime-gpu; then
        "$PYTHON" -m pip uninstall -q -y onnxruntime && "$PYTHON" -m pip install -q --no-deps /tmp/ort-gpu/*.whl
    else
        echo "onnxruntime-gpu could not be downloaded: scoring on the GPU workers is tested with the CPU provider"
    fi
fi
cuda_ok || { echo "torch in $PYTHON has no CUDA: set PYTHON to an environment with a CUDA build of torch"; exit 2; }
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.device_count(), 'GPU(s)')"
"$PYTHON" -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
"$PYTHON" -c "import cudf, dask_cudf; print('cudf', cudf.__version__)" || echo "no cudf: the cudf table test skips"
export DASK_CONFIG=${DASK_CONFIG:-$(mktemp -d)}

step "gpu tests"
# the files that hold gpu tests: the others import extras (optuna, pydicom, ...) a GPU machine's image may lack
timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu $(grep -rl "mark.gpu" tests) \
    -o addopts="--strict-markers -ra" || echo "gpu tests failed (exit $?)"

step "loader: device augmentation and pinned prefetch"
timeout 120 "$PYTHON" bench/loader.py --device cuda --n 2048 --batch-size 256 --naive-limit 256 \
    || echo "loader benchmark failed or ran out of time (exit $?)"

step "benchmark"
timeout 330 "$PYTHON" bench/gpu.py --models resnet18,alexnet --size 224 --batch-size 256 --images 3200 \
    --steps 8 --cpu-steps 2 --epochs 2 --augment-models resnet18 || echo "benchmark failed or ran out of time (exit $?)"
step "done"
