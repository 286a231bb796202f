#!/usr/bin/env bash
# The prepared run for a lent GPU machine (issue 21), one call of the device tool per part:
#   here, once:  make gpu-wheels            (the packages the machine's image lacks, into .whl/)
#   device run:  bash bench/gpu_check.sh all     carry [".whl"], timeout_s 590 (~6-9 min on an H200)
#                (or "tests" then "bench" in two calls on the warm machine)
# It installs the carried wheels and this checkout (editable, no dependencies: the image's torch
# stays) into the machine's Python, then
#   tests: every gpu-marked test (codecs, exact gradients, bf16, compiled layers, outer steps, a
#          2-stage swarm over gRPC with rotations and snapshot cuts, generation, snapshot restore);
#   bench: the precision section (150m preset on CUDA: tokens/s and MFU, fp32/bf16, eager/compiled,
#          one stage and four).
# Everything it writes lands in $OUT (the device tool's folder), else bench/results/gpu.
# PYTHON picks the interpreter (default python3); GPU_CHECK_INSTALL=0 skips the installation.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
out=${OUT:-bench/results/gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

. bench/gpu_install.sh
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$py" -c "import torch, grpc, google.protobuf as pb, hivemind, swarm.node.cli
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
print('grpcio', grpc.__version__, 'protobuf', pb.__version__, 'hivemind', hivemind.__version__)"
} 2>&1 | tee "$out/device.txt"

status=0
if [ "$part" = "all" ] || [ "$part" = "tests" ]; then
  timeout 330 "$py" -m pytest -p no:cacheprovider -q -rs -m gpu --timeout 240 2>&1 | tee "$out/gpu-tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "$part" = "all" ] || [ "$part" = "bench" ]; then
  timeout 300 "$py" -m swarm.cli bench --only precision 2>&1 | tee "$out/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  cp bench/results/results.json bench/results/results.md "$out/"
fi
exit "$status"
