#!/usr/bin/env bash
# Issue 35, fourteenth round: the Lamport two-shot. On the GPU machine, from the repository
# root, with the previous kernel carried as .out/variants/base.cu
# (`git show 7e238b7:sgl-kernel-sm120/csrc/all_reduce.cu`):
#
#   bash benchmark/results/1xH100-2026-12-07c-issue35/run.sh smoke OUT
#       this checkout's kernel built for this GPU; the Lamport two-shot's GPU tests alone
#   bash benchmark/results/1xH100-2026-12-07c-issue35/run.sh ab OUT
#       benchmark/ab_kernels.sh, ranks as streams of one process on this GPU, --mode local
#       --skip-baselines, TOKENS (default 1-256), ROUNDS (default 2), three libraries:
#         base     the previous kernel, two-shot with flags above the one-shot
#         flags    this kernel with the Lamport two-shot off (its bound at 16 bytes)
#         lamport  this kernel as configured by default
#   bash benchmark/results/1xH100-2026-12-07c-issue35/run.sh caps OUT
#       benchmark/ab_kernels.sh as above, this kernel with the row split's caps of this round
#       (newcaps: the clusters that fit bound them) and as before (oldcaps.py: the default
#       block cap too), TOKENS (default 1 4 8 16 32 64)
#   bash benchmark/results/1xH100-2026-12-07c-issue35/run.sh prefetch OUT
#       this kernel against .out/variants/prefetch.cu at 4 and 8 ranks, TOKENS (default 16 32
#       64), then the Lamport two-shot's and the early-launch tests with the latter
#   bash benchmark/results/1xH100-2026-12-07c-issue35/run.sh tests OUT
#       all of test/gpu with this checkout's kernel required
# Each step writes its output under OUT and packs it as OUT/<step>.tar.gz.
set -uo pipefail
STEP=${1:?usage: run.sh smoke|ab|caps|prefetch|tests OUT}
OUT=$(realpath -m "${2:?usage: run.sh smoke|ab|caps|prefetch|tests OUT}")
mkdir -p "$OUT/$STEP"
trap 'tar -C "$OUT" -czf "$OUT/$STEP.tar.gz" "$STEP"' EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
export PYTHONPATH=$PWD/sgl-kernel-sm120/python:$PWD/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/$STEP/machine.txt"
cc=$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())') || exit 1

build() {  # this checkout's kernel for this GPU, once
  lib=/tmp/issue35c/current.so
  [ -f "$lib" ] && return 0
  mkdir -p /tmp/issue35c
  nvcc -shared -O3 -std=c++17 --cudart static -Xcompiler=-fPIC,-fvisibility=hidden \
    "--generate-code=arch=compute_$cc,code=sm_$cc" -I sgl-kernel-sm120/csrc \
    -o "$lib" sgl-kernel-sm120/csrc/all_reduce.cu
}

case $STEP in
smoke)
  build || exit 1
  SGLANG_SM120_KERNEL_LIBRARY=$lib SGLANG_SM120_KERNEL_REQUIRED=1 timeout 300 \
    python3 -m pytest -q -x -p no:cacheprovider test/gpu/test_sgl_kernel_allreduce.py \
    -k "twoshot_lamport" 2>&1 | tail -n 30 | tee "$OUT/$STEP/smoke.txt"
  ;;
ab)
  printf 'import os\n\nos.environ["SGLANG_SM120_TWOSHOT_LAMPORT_MAX_BYTES"] = "16"\n' > /tmp/flags.py
  cp /tmp/flags.py "$OUT/$STEP/flags.py"
  ROUNDS=${ROUNDS:-2} bash benchmark/ab_kernels.sh "$OUT/$STEP" \
    base=.out/variants/base.cu:/tmp/flags.py \
    flags=sgl-kernel-sm120/csrc/all_reduce.cu:/tmp/flags.py \
    lamport=sgl-kernel-sm120/csrc/all_reduce.cu -- --mode local --skip-baselines \
    --tokens ${TOKENS:-1 2 4 8 16 32 64 128 256} > "$OUT/$STEP/ab-log.txt" 2>&1
  tail -n 45 "$OUT/$STEP/ab-log.txt"
  ;;
caps)
  ROUNDS=${ROUNDS:-2} bash benchmark/ab_kernels.sh "$OUT/$STEP" \
    oldcaps=sgl-kernel-sm120/csrc/all_reduce.cu:benchmark/results/1xH100-2026-12-07c-issue35/oldcaps.py \
    newcaps=sgl-kernel-sm120/csrc/all_reduce.cu -- --mode local --skip-baselines \
    --tokens ${TOKENS:-1 4 8 16 32 64} > "$OUT/$STEP/ab-log.txt" 2>&1
  tail -n 25 "$OUT/$STEP/ab-log.txt"
  ;;
prefetch)
  # .out/variants/prefetch.cu: the fused Lamport two-shot's block-per-row epilogue issues a
  # first load of each of its vectors with the residual and weight loads, then polls
  # (prefetch/prefetch.patch, on 68a9ad4's all_reduce.cu).
  AB_WORK=/tmp/pf ROUNDS=${ROUNDS:-2} bash benchmark/ab_kernels.sh "$OUT/$STEP" \
    current=sgl-kernel-sm120/csrc/all_reduce.cu prefetch=.out/variants/prefetch.cu -- \
    --mode local --skip-baselines --world-sizes 4 8 --tokens ${TOKENS:-16 32 64} \
    > "$OUT/$STEP/ab-log.txt" 2>&1
  tail -n 12 "$OUT/$STEP/ab-log.txt"
  SGLANG_SM120_KERNEL_LIBRARY=/tmp/pf/prefetch.so SGLANG_SM120_KERNEL_REQUIRED=1 timeout 200 \
    python3 -m pytest -q -p no:cacheprovider test/gpu/test_sgl_kernel_allreduce.py \
    test/gpu/test_sgl_kernel_early_launch.py -k "twoshot_lamport or early_launch" 2>&1 \
    | tail -n 4 | tee "$OUT/$STEP/gpu-prefetch.txt"
  ;;
tests)
  build || exit 1
  SGLANG_SM120_KERNEL_LIBRARY=$lib SGLANG_SM120_KERNEL_REQUIRED=1 \
    python3 -m pytest -q -p no:cacheprovider test/gpu 2>&1 | tail -n 40 | tee "$OUT/$STEP/gpu.txt"
  ;;
*) echo "unknown step $STEP (smoke, ab, caps, prefetch or tests)"; exit 2 ;;
esac
