#!/usr/bin/env bash
# Issue 19's GPU check, for the lent GPU machine (python3 there has a CUDA torch but not
# ranktrace's other dependencies: they travel as wheels in .whl/, see the device README):
# a GPT-like 1B-class DDP job on NCCL, world size 1, with and without `ranktrace run`.
#   [PAIRS=2 STEPS=14] bash benchmarks/gpu_check.sh OUT_DIR
set -euo pipefail
out=${1:-/tmp/gpu-check}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
# `ranktrace.*` over this (throwaway) copy of the tree without installing it: the folders
# linked into ranktrace/, as an install maps them
for folder in trainer telemetry analysis app importers tools; do
    ln -sfn "../$folder" "ranktrace/$folder"
done
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
python3 benchmarks/run_overhead.py --gpu --pairs "${PAIRS:-2}" --steps "${STEPS:-14}" -- --width 2048 --layers 16 \
    --heads 16 --seq 1024 --batch 8 --vocab 32000 2>&1 | tee "$out/gpu_check.log"
