#!/usr/bin/env bash
# Issue 35, fifteenth round (2026-12-07). On the GPU machine, from the repository root.
#
#   bash benchmark/results/1xH200-2026-12-07d-issue35/run.sh ab OUT
#       benchmark/ab_kernels.sh, ranks as streams of one process on this GPU, --mode local
#       --skip-baselines, TOKENS (default 1 4 8 16 32 64), ROUNDS (default 2), three kernels
#       carried in .out/variants:
#         base   7a43a38's all_reduce.cu (`git show 7a43a38:sgl-kernel-sm120/csrc/all_reduce.cu`):
#                the poll's loads wait for this rank's own vector (their registers are first
#                set to it)
#         first  base + polls/first.diff: the peers' loads go first, into registers that held
#                a constant; this rank's vector is loaded beside them
#         after  base + polls/after.diff: this rank's vector is loaded after the wait
#   bash benchmark/results/1xH200-2026-12-07d-issue35/run.sh timeline OUT
#       block 0's phase timeline of base, first and after (benchmark/phase_timeline_local.py,
#       1 token, world 2 and 8, hidden 7168 and 8), then their all-reduce GPU tests (not run)
#   bash benchmark/results/1xH200-2026-12-07d-issue35/run.sh tests OUT
#       all of test/gpu with this checkout's kernel required
#   (The issue's table before and after, prepared here as a fourth step and not run, ran in
#   the next round: benchmark/results/1xH100-2026-12-08-issue35/run.sh then-and-now.)
# Each step writes its output under OUT and packs it as OUT/<step>.tar.gz.
set -uo pipefail
STEP=${1:?usage: run.sh ab|timeline|tests OUT}
OUT=$(realpath -m "${2:?usage: run.sh ab|timeline|tests OUT}")
mkdir -p "$OUT/$STEP"
trap 'tar -C "$OUT" -czf "$OUT/$STEP.tar.gz" "$STEP"' EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
export PYTHONPATH=$PWD/sgl-kernel-sm120/python:$PWD/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/$STEP/machine.txt"
WORK=/tmp/issue35d
mkdir -p $WORK
cc=$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())') || exit 1

build() {  # build SOURCE NAME: $WORK/NAME.so for this GPU, unless an earlier step built it
  [ -f "$WORK/$2.so" ] && return 0
  nvcc -shared -O3 -std=c++17 --cudart static -Xcompiler=-fPIC,-fvisibility=hidden \
    "--generate-code=arch=compute_$cc,code=sm_$cc" -I sgl-kernel-sm120/csrc \
    -o "$WORK/$2.so" "$1"
}

case $STEP in
ab)
  AB_WORK=$WORK ROUNDS=${ROUNDS:-2} bash benchmark/ab_kernels.sh "$OUT/$STEP" \
    base=.out/variants/base.cu first=.out/variants/first.cu after=.out/variants/after.cu -- \
    --mode local --skip-baselines --tokens ${TOKENS:-1 4 8 16 32 64} \
    > "$OUT/$STEP/ab-log.txt" 2>&1
  tail -n 30 "$OUT/$STEP/ab-log.txt"
  ;;
timeline)
  for name in base first after; do
    build .out/variants/$name.cu $name || exit 1
    SGLANG_SM120_KERNEL_LIBRARY=$WORK/$name.so timeout 120 python3 \
      benchmark/phase_timeline_local.py --world-sizes 2 8 --hidden 7168 8 \
      > "$OUT/$STEP/timeline-$name.txt" 2>&1
  done
  grep -h "us/call" "$OUT/$STEP"/timeline-*.txt
  for name in first after; do
    SGLANG_SM120_KERNEL_LIBRARY=$WORK/$name.so SGLANG_SM120_KERNEL_REQUIRED=1 timeout 150 \
      python3 -m pytest -q -p no:cacheprovider test/gpu/test_sgl_kernel_allreduce.py 2>&1 \
      | tail -n 4 | tee "$OUT/$STEP/gpu-$name.txt"
  done
  ;;
tests)
  lib=$WORK/current.so
  build sgl-kernel-sm120/csrc/all_reduce.cu current || exit 1
  SGLANG_SM120_KERNEL_LIBRARY=$lib SGLANG_SM120_KERNEL_REQUIRED=1 \
    python3 -m pytest -q -p no:cacheprovider test/gpu 2>&1 | tail -n 40 | tee "$OUT/$STEP/gpu.txt"
  ;;
*) echo "unknown step $STEP (ab, timeline or tests)"; exit 2 ;;
esac
