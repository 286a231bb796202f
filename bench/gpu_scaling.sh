#!/usr/bin/env bash
# The scaling grid extended to d=2048 in bf16 on a lent GPU (issue 30), one device-tool call:
#   here, once:  make gpu-wheels
#   device run:  bash bench/gpu_scaling.sh     carry [".whl"], timeout_s 590 (aimed at ~9 min)
# Retunes at d=128 in bf16 (dense, subspace k=16 and k=32; a CPU's fp32 lrs do not carry over to
# another precision) and transfers under muP to d=2048: 1000 steps of 8 x 128 tokens, the CPU grid's
# settings otherwise. The runs are cached under $OUT/scaling-runs: copy them into
# bench/results/scaling-runs-gpu here, and rerun with --cached-only to report them.
# PYTHON picks the interpreter (default python3); GPU_CHECK_INSTALL=0 skips the installation.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/gpu-scaling}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
. bench/gpu_install.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$out/device.txt"
timeout 540 "$py" -m bench.scaling --out "$out" --precision bf16 --widths 128,2048 --ranks 16,32 \
  --check-widths '' --no-control 2>&1 | tee "$out/scaling.log"
exit "${PIPESTATUS[0]}"
