#!/usr/bin/env bash
# CUDA's kernels compiled without a GPU (make check-cuda): NVRTC and ptxas from NVIDIA's PyPI
# wheels, installed once into the cache (never committed), then scripts/nvrtc_gate.py.
set -euo pipefail
cd "$(dirname "$0")/.."
env=${CACHE:-$PWD/.cache}/nvrtc
if [ ! -x "$env/bin/python3" ] || ! "$env/bin/python3" -c 'import nvidia.cuda_nvrtc, nvidia.cuda_nvcc' 2>/dev/null; then
    python3 -m venv "$env"
    "$env/bin/pip" install -q nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86
fi
nv=$("$env/bin/python3" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0]))')
lib=$nv/cuda_nvrtc/lib
LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$env/bin/python3" scripts/nvrtc_gate.py "$lib/libnvrtc.so.12" "$nv/cuda_nvcc/bin/ptxas"
