#!/usr/bin/env bash
# The GPU checks in one short run (about 5 minutes on one GPU): the Triton kernel against the
# torch path, pinned host->device bandwidth, a single-GPU ZeRO-3 load from page cache in GB/s,
# and transformers' from_pretrained against zload on the GPU. Results: benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
timeout 200 "$PY" -m benchmarks.gpu_check --size "${GPU_CHECK_SIZE:-4GB}"
timeout 240 "$PY" -m benchmarks.load --size 1GB --world 1 --runs 3 --transformers-runs 1 --out benchmarks/results
