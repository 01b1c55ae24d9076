#!/usr/bin/env bash
# Issue 35, ninth round, on the GPU machine from the repository root, with this session's
# variants of sgl-kernel-sm120/csrc/all_reduce.cu carried in .out/variants/ (one device call
# each step):
#
#   bash benchmark/results/1xH200-2026-12-06b-issue35/run.sh ab OUT NAME...
#       benchmark/ab_kernels.sh over .out/variants/NAME.cu (ROUNDS, default 2), ranks as
#       streams of one process on this GPU, `--mode local --skip-baselines`, every token count
#       (or TOKENS); NAME@BYTES runs NAME.cu with SGLANG_SM120_BLOCK_BYTES=BYTES
#   bash benchmark/results/1xH200-2026-12-06b-issue35/run.sh tests OUT NAME
#       .out/variants/NAME.cu built for this GPU, then all of test/gpu with it required
set -uo pipefail
STEP=${1:?usage: run.sh ab|tests OUT NAME...}
OUT=$(realpath -m "${2:?usage: run.sh ab|tests OUT NAME...}")
shift 2
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
export PYTHONPATH=$PWD/sgl-kernel-sm120/python:$PWD/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
case $STEP in
ab)
  specs=()
  for name in "$@"; do
    src=.out/variants/${name%@*}.cu
    if [[ $name == *@* ]]; then
      echo "import os; os.environ['SGLANG_SM120_BLOCK_BYTES'] = '${name#*@}'" > "/tmp/$name.py"
      src=$src:/tmp/$name.py
    fi
    specs+=("$name=$src")
  done
  ROUNDS=${ROUNDS:-2} bash benchmark/ab_kernels.sh "$OUT" "${specs[@]}" -- --mode local \
    --skip-baselines ${TOKENS:+--tokens $TOKENS} > "$OUT/ab-log.txt" 2>&1
  tail -n 45 "$OUT/ab-log.txt"
  ;;
tests)
  cc=$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())') || exit 1
  lib=$(mktemp -d /tmp/tests.XXXX)/$1.so
  nvcc -shared -O3 -std=c++17 --cudart static -Xcompiler=-fPIC,-fvisibility=hidden \
    "--generate-code=arch=compute_$cc,code=sm_$cc" -I sgl-kernel-sm120/csrc \
    -o "$lib" ".out/variants/$1.cu" || exit 1
  SGLANG_SM120_KERNEL_LIBRARY=$lib SGLANG_SM120_KERNEL_REQUIRED=1 \
    python3 -m pytest -q -p no:cacheprovider test/gpu 2>&1 | tail -n 40 | tee "$OUT/gpu-$1.txt"
  ;;
*) echo "unknown step $STEP (ab or tests)"; exit 2 ;;
esac
