#!/bin/bash
# Issue 63's whole GPU run, in one call of the device tool (about 10 of its 15 minutes):
#   mkdir -p .device && cp -r ../shared/gpu .device/gpu   # once, here (.device is ignored)
#   run(command="bash scripts/on_gpu.sh", carry=[".device"], timeout_s=600)
# The full-stack check (scripts/gpu_check.py), then the stall, cadence and peers
# (benchmarks.gpu); both results land in $OUT, to copy into benchmarks/results/.
set -u
source .device/gpu/on_device.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 | grep -E "^gpu_check|^  " | tail -n 80
python3 -m benchmarks.gpu --out "$OUT/gpu.json" --no-drop-caches --cadence-s 20 --rounds 2 \
    2>&1 | grep -E "^\[gpu" | tail -n 60
