#!/usr/bin/env bash
# Collect into .whl/ the wheels the lent GPU machine lacks: DeepSpeed and the packages it needs
# beyond that machine's image (no package index can be reached from there). Run it here, where
# pip works, after ./dev test has created .venv; then carry .whl on the device call, where
# gpu_check.sh installs them (see benchmarks/README.md, "On a GPU machine").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "no .venv: run ./dev test first" >&2; exit 1; }
version() { "$PY" -c "from importlib.metadata import version; print(version('$1'))"; }

rm -rf .whl
mkdir -p .whl/src
# DeepSpeed publishes only a source archive: build a pure-Python wheel of the version tested here,
# with no prebuilt ops and CUDA as its accelerator (ZeRO-3 loading needs no compiled op).
"$PY" -m pip download -q --no-deps --no-binary=:all: -d .whl/src "deepspeed==$(version deepspeed)"
DS_ACCELERATOR=cuda DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl \
    .whl/src/deepspeed-*.tar.gz
rm -rf .whl/src
# The machine runs Python 3.12 on x86-64 and lacks these (versions as tested here).
wanted=()
for name in hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
    wanted+=("$name==$(version "$name")")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${wanted[@]}"
ls -l .whl
