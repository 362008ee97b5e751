#!/usr/bin/env bash
# The GPU check (issue 9), one prepared script for a machine with NVIDIA GPUs, under 8 minutes:
#   1. an environment with a CUDA build of torch and dask-cuda (installs them when an index is reachable),
#   2. the gpu-marked tests (make("cuda"), NCCL training, CUDA scoring),
#   3. bench/gpu.py: images/s of dask_dl training (ResNet-18, AlexNet; 224 px, batch 256) against a plain
#      PyTorch loop on the same GPU and images (float32, and bf16 autocast + channels_last), and GPU vs CPU.
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
if ! cuda_ok || ! "$PYTHON" -c "import dask_cuda, dask_dl" 2>/dev/null; then
    step "installing: a venv with torch (CUDA build) and dask-dl[gpu,dev]"
    "$PYTHON" -m venv /tmp/gpu-venv && PYTHON=/tmp/gpu-venv/bin/python
    "$PYTHON" -m pip install -q --upgrade pip
    "$PYTHON" -m pip install -q "torch==2.13.*" || echo "torch (CUDA build) could not be installed"
    "$PYTHON" -m pip install -q -e '.[gpu,dev]' || "$PYTHON" -m pip install -q -e '.[dev]' dask-cuda \
        || echo "dask-dl[gpu] could not be installed"
fi
cuda_ok || { echo "torch in $PYTHON has no CUDA: set PYTHON to an environment with a CUDA build of torch"; exit 2; }
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.device_count(), 'GPU(s)')"
export DASK_CONFIG=${DASK_CONFIG:-$(mktemp -d)}

step "gpu tests"
timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests \
    -o addopts="--strict-markers -ra" || echo "gpu tests failed (exit $?)"

step "benchmark"
timeout 330 "$PYTHON" bench/gpu.py --models resnet18,alexnet --size 224 --batch-size 256 --images 3200 \
    --steps 8 --cpu-steps 2 --epochs 2 || echo "benchmark failed or ran out of time (exit $?)"
step "done"
