#!/usr/bin/env bash
# The GPU check in one command, for a lent GPU: bench/gpu_check.py's steps (the engine against
# HF generate, mixed LoRA adapters against HF + PEFT, the tiny MoE; speculative decoding; the
# simulator against the engine on a Llama-2-7B-shaped model; decode bandwidth and throughput
# against their goals; kernel configurations and the LoRA kernel against the oracle), each
# under its own budget, the whole within 9 minutes; results stream as a table
# and go to $OUT (a lent machine's output folder; else gpu_check_out/): gpu_check.json,
# gpu_check.log (this output), fidelity.md and fidelity.json, the 7B profile.
#
#   bash bench/gpu_check.sh                     # check with $PYTHON (default python3) as it is
#   bash bench/gpu_check.sh --smoke             # every step at toy sizes on this CPU (Triton's
#                                               # interpreter): proves the script, not a GPU
#   bash bench/gpu_check.sh --carried DIR       # a lent machine (the image's CUDA torch): first
#                                               # pip-install the wheels in DIR into a throwaway
#                                               # folder on PYTHONPATH (bench/gpu_check_wheels.sh
#                                               # DIR makes them on a machine with network)
#   bash bench/gpu_check.sh --install           # first make .venv-gpu: the environment's torch
#                                               # (a CUDA build, else one from the PyTorch index),
#                                               # the project and its dependencies; then check
#   bash bench/gpu_check.sh --install --wheels DIR   # the same without network: pip installs
#                                               # only from the wheels in DIR (pip download -d
#                                               # DIR 'transformers>=5.24,<5.25' ... on a machine
#                                               # with network; docs/validation-results.md)
#
# Exit status: 0 every step passed; 1 a check failed, or a step crashed, overran or did not
# run; 2 this environment cannot run the check (one line says what is missing and the command
# that installs it); 3 no GPU here, nothing checked.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
install=0
wheels=""
smoke=0
carried=""
while [ $# -gt 0 ]; do
    case "$1" in
        --install) install=1 ;;
        --smoke) smoke=1 ;;
        --carried) carried=${2:-}; shift
                   if [ -z "$carried" ] || ! ls "$carried"/*.whl >/dev/null 2>&1; then
                       echo "gpu_check: --carried needs a folder of wheels (bash bench/gpu_check_wheels.sh DIR makes it), got '${carried}'"; exit 2
                   fi ;;
        --wheels) wheels=${2:-}; shift
                  if [ -z "$wheels" ] || [ ! -d "$wheels" ]; then
                      echo "gpu_check: --wheels needs a folder of wheels, got '${wheels}'"; exit 2
                  fi ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1' (--install, --wheels DIR, --carried DIR, --smoke)"; exit 2 ;;
    esac
    shift
done
if [ -n "$wheels" ] && [ $install -eq 0 ]; then
    echo "gpu_check: --wheels DIR goes with --install"; exit 2
fi

out=${OUT:-gpu_check_out}
if [ $smoke -eq 1 ]; then
    mkdir -p "$out"
    env PYTHONUNBUFFERED=1 "$PYTHON" bench/gpu_check.py --smoke --out "$out" 2>&1 \
        | tee "$out/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no GPU here, nothing checked (nvidia-smi finds none)"
    exit 3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ -n "$carried" ]; then
    # The device README's recipe: no venv, no network; the image's torch and triton stay.
    site=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$carried"/*.whl || {
        echo "gpu_check: cannot install the wheels in $carried (see pip's lines above)"; exit 2; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ $install -eq 1 ]; then
    venv=.venv-gpu
    # The system's packages stay visible: a lent machine's CUDA torch and triton are used as
    # they are, never downloaded again.
    if [ ! -x "$venv/bin/python" ]; then
        "$PYTHON" -m venv --system-site-packages "$venv" || {
            echo "gpu_check: cannot create $venv with $PYTHON (python3 -m venv)"; exit 2; }
    fi
    pip=("$venv/bin/python" -m pip install -q)
    if [ -n "$wheels" ]; then
        pip+=(--no-index --find-links "$(cd "$wheels" && pwd)")
    else
        pip+=(--retries 1 --timeout 20)  # without network: fail in seconds, not minutes
    fi
    has_cuda_torch='import sys, torch; sys.exit(0 if torch.version.cuda else 1)'
    if ! "$venv/bin/python" -c "$has_cuda_torch" 2>/dev/null; then
        if [ -n "$wheels" ]; then
            "${pip[@]}" torch || {
                echo "gpu_check: no CUDA build of torch here or in $wheels: add its wheel (pip download torch --index-url https://download.pytorch.org/whl/cu130 -d $wheels)"; exit 2; }
        else
            "${pip[@]}" torch --index-url https://download.pytorch.org/whl/cu130 || {
                echo "gpu_check: cannot install a CUDA build of torch (no network? use --wheels DIR)"; exit 2; }
        fi
    fi
    # The project and what it needs beyond torch (transformers in the pinned range among them);
    # --no-build-isolation: setuptools comes from the environment, not the network.
    "${pip[@]}" --no-build-isolation -e . || {
        echo "gpu_check: cannot install the project's dependencies${wheels:+ from $wheels} (pip install -e . needs them; see the lines above for which)"; exit 2; }
    # peft, the multi-LoRA checks' reference, is a test extra: its pin alone, not the extra.
    peft=$(grep -o '"peft[^"]*"' pyproject.toml | tr -d '"')
    "${pip[@]}" "$peft" || {
        echo "gpu_check: cannot install $peft${wheels:+ from $wheels} (the multi-LoRA checks' reference; pip download -d DIR '$peft')"; exit 2; }
    PYTHON=$venv/bin/python
fi

mkdir -p "$out"
env PYTHONUNBUFFERED=1 "$PYTHON" bench/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
