#!/usr/bin/env bash
# The GPU checks in one short run (about 8 minutes on one GPU, one 2.4 GB checkpoint shared by all):
# 1. zload.init + load_into on the GPU against zero.Init + load_into, transformers' from_pretrained
#    and the I/O and allocation floors, with GPU memory during construction;
# 2. the same load from a cold page cache: zload against PyTorch DCP's reader (GPU shards) and the
#    storage device's ceiling;
# 3. the Triton kernel against the torch path, pinned host->device bandwidth, a single-GPU load in GB/s.
# Results go to $GPU_CHECK_OUT (default benchmarks/results); the log is kept there as gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-benchmarks/results}
SIZE=${GPU_CHECK_SIZE:-2.4GB}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
# The GPU machine's image has no DeepSpeed: install the wheels benchmarks/device_wheels.sh collected
# (carried as .whl) into a private folder, unless DeepSpeed is already there.
if ! "$PY" -c "import deepspeed" >/dev/null 2>&1; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check: no deepspeed here and no .whl/: run benchmarks/device_wheels.sh and carry .whl" >&2
        exit 1
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/zload-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/zload-site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'deepspeed', \
deepspeed.__version__, 'transformers', transformers.__version__)" || exit 1
NAME=$("$PY" -c "from benchmarks.load.report import default_name; print(default_name())")
# Every step runs whatever the others do (device time is scarce); the exit status says if any failed.
status=0
timeout 220 "$PY" -m benchmarks.load --size "$SIZE" --world 1 --runs 3 --transformers-runs 1 \
    --methods floor alloc-floor zload zload+init transformers --out "$OUT_DIR" --name "$NAME" || status=$?
timeout 190 "$PY" -m benchmarks.load --cold --size "$SIZE" --world 1 --runs 5 \
    --methods ceiling dcp zload --out "$OUT_DIR" --name "$NAME-cold" || status=$?
timeout 80 "$PY" -m benchmarks.gpu_check --size "$SIZE" --out "$OUT_DIR" || status=$?
exit "$status"
