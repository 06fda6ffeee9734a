#!/usr/bin/env bash
# For a lent GPU, under 5 minutes: kernel correctness at Llama-2-7B shapes (bf16) against the loop
# oracle, decode kernels' achieved bandwidth against the device's copy bandwidth, the engine
# throughput bench on the GPU; the kernel table is printed last. Record it in the README's
# performance section with the date and the device.
#
#   bash bench/gpu_check.sh            (PYTHON=... to choose the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

has_cuda="import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
if ! "$PYTHON" -c "$has_cuda" 2>/dev/null; then
    echo "gpu_check: no CUDA device (or no torch) for $PYTHON; nothing to check."
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
    --format=csv 2>/dev/null

status=0
table=$(mktemp)
trap 'rm -f "$table"' EXIT

echo "== 1. kernels: correctness, bandwidth =="
PYTHONUNBUFFERED=1 timeout 170 "$PYTHON" bench/gpu_check.py | tee "$table" || status=1

# ---- 2. engine throughput (PLACEHOLDER: the lead wires in bench/engine_throughput.py) --------
echo "== 2. engine throughput =="
if [ -f bench/engine_throughput.py ]; then
    timeout 110 "$PYTHON" bench/engine_throughput.py --device cuda || status=1
else
    echo "bench/engine_throughput.py does not exist yet: skipped"
fi
# -----------------------------------------------------------------------------------------------

echo
sed -n '/^## twinserve kernel check/,$p' "$table"
exit $status
