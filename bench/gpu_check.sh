#!/usr/bin/env bash
# GPU checks for the tiered runtime (issue B), <= 8 minutes on one GPU:
# exactness on CUDA, then a 1b model streamed from host with GPU memory capped at 8 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
make install >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
timeout 240 .venv/bin/python -m pytest -q tests/gpu -p no:cacheprovider
timeout 240 .venv/bin/python bench/gpu_stream.py --model-size 1b --gpu-cap-gib 8 --steps 4
