#!/usr/bin/env bash
# The GPU check (see benchmarks/gpu_check.py): every CUDA/NCCL path of `shardwise train` on one GPU
# through a real NCCL process group of world 1 (torchrun --nproc-per-node 1). ~3-4 minutes.
#   bash benchmarks/gpu_check.sh [--cases a,b] [--out DIR]     (--cpu: smoke-run it on the CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
