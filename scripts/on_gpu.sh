#!/bin/bash
# Issue 63's whole GPU run, in one call of the device tool (about 8 of its 15 minutes):
#   mkdir -p .device && cp -r ../shared/gpu .device/gpu   # once, here (.device is ignored)
#   run(command="bash scripts/on_gpu.sh", carry=[".device"], timeout_s=600)
# The full-stack check (scripts/gpu_check.py, the suite's gpu tests beside its cases), then
# the stall, peers and cadence (benchmarks.gpu), its sections fitted to what is left of
# LEASE_S seconds. gpu_check.json and gpu.json land in $OUT, to copy into
# benchmarks/results/device/; the check's own record and the logs land beside them.
set -u
LEASE_S=${LEASE_S:-540}
source .device/gpu/on_device.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_check.py --out "$OUT/gpu_check_record.json" --result "$OUT/gpu_check.json" \
    --pytest-timeout-s 60 2>&1 | tee "$OUT/gpu_check.log" | grep -E "^gpu_check|^  " | tail -n 60
echo "on_gpu: check done at ${SECONDS}s"
python3 -m benchmarks.gpu --out "$OUT/gpu.json" --no-drop-caches --repeats 5 --cadence-s 20 \
    --rounds 2 --budget-s $((LEASE_S - SECONDS)) 2>&1 | tee "$OUT/gpu.log" | grep -E "^\[gpu" | tail -n 60
echo "on_gpu: done at ${SECONDS}s"
