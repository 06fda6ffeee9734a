#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for bench/gpu_check.sh (its image has CUDA torch, triton,
# numpy, matplotlib, tqdm, rich and transformers 5.17, but not the project's pin nor simpy and
# Hydra, nor peft with what it imports beyond transformers: the multi-LoRA checks' reference),
# for its Python 3.12, into DIR (default .whl; about 15 MB): run it on a machine with network,
# then on the lent machine `bash bench/gpu_check.sh --carried DIR` with DIR carried.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
PYTHON=${PYTHON:-python3}
mkdir -p "$dir"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" 'transformers==5.24.0' 'simpy==4.1.2' 'hydra-core==1.3.2' 'omegaconf==2.3.0' \
    'hydra-joblib-launcher==1.2.0' 'peft==0.21.2' 'accelerate==1.16.0' 'psutil==7.2.2'
# Hydra's parser runtime is published as a source archive only: built here (pure Python).
"$PYTHON" -m pip wheel -q --no-deps 'antlr4-python3-runtime==4.9.3' -w "$dir"
ls "$dir"
