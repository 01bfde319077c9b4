#!/usr/bin/env bash
# The GPU checks in one short run (about 5 minutes on one GPU): the Triton kernel against the
# torch path, pinned host->device bandwidth, a single-GPU ZeRO-3 load from page cache in GB/s,
# and transformers' from_pretrained against zload on the GPU. Results: benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# The GPU machine's image has no DeepSpeed: install the wheels benchmarks/device_wheels.sh collected
# (carried as .whl) into a private folder, unless DeepSpeed is already there.
if ! "$PY" -c "import deepspeed" >/dev/null 2>&1; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check: no deepspeed here and no .whl/: run benchmarks/device_wheels.sh and carry .whl" >&2
        exit 1
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/zload-site .whl/*.whl
    export PYTHONPATH=/tmp/zload-site${PYTHONPATH:+:$PYTHONPATH}
fi
# Both steps run whatever the other does (device time is scarce); the exit status says if either failed.
status=0
timeout 200 "$PY" -m benchmarks.gpu_check --size "${GPU_CHECK_SIZE:-4GB}" || status=$?
timeout 240 "$PY" -m benchmarks.load --size 1GB --world 1 --runs 3 --transformers-runs 1 \
    --out benchmarks/results || status=$?
exit "$status"
