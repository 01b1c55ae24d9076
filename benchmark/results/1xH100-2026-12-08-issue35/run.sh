#!/usr/bin/env bash
# Issue 35, sixteenth round (2026-12-08, README.md). On the GPU machine, from the repository
# root of a checkout whose all_reduce.cu is still the one gather/gather.diff applies to
# (79c0fba's):
#
#   bash benchmark/results/1xH100-2026-12-08-issue35/run.sh ab OUT
#       benchmark/ab_kernels.sh, ranks as streams of one process on this GPU, --mode local
#       --skip-baselines, world 4 and 8 (where the fused Lamport two-shot runs), TOKENS
#       (default 4 8 16 32 64), ROUNDS (default 3) in alternation:
#         base    this checkout's all_reduce.cu
#         gather  base + gather/gather.diff
#   bash benchmark/results/1xH100-2026-12-08-issue35/run.sh then-and-now OUT [NAME]
#       issue 35's table on one GPU: 1e70e21's tree (its kernel, Python and bench_allreduce.py,
#       carried as .out/old: `git archive 1e70e21 sgl-kernel-sm120/csrc sgl-kernel-sm120/python
#       python benchmark/bench_allreduce.py | tar -x -C .out/old`) and this checkout with
#       kernel NAME (base or gather, default base), each with its own bench_allreduce.py --mode
#       local --skip-baselines, ROUNDS (default 1) in alternation, TOKENS (default 1 4 16 64
#       128 256 2048)
#   bash benchmark/results/1xH100-2026-12-08-issue35/run.sh tests OUT [NAME]
#       all of test/gpu with kernel NAME (default gather) required
#
# Each step first writes .out/variants/{base,gather}.cu. It writes its output under OUT and
# packs it as OUT/<step>.tar.gz.
set -uo pipefail
here=$(dirname "$0")
STEP=${1:?usage: run.sh ab|then-and-now|tests OUT [NAME]}
OUT=$(realpath -m "${2:?usage: run.sh ab|then-and-now|tests OUT [NAME]}")
NAME=${3:-}
mkdir -p "$OUT/$STEP" .out/variants
trap 'tar -C "$OUT" -czf "$OUT/$STEP.tar.gz" "$STEP"' EXIT
cp sgl-kernel-sm120/csrc/all_reduce.cu .out/variants/base.cu
patch -s -o .out/variants/gather.cu sgl-kernel-sm120/csrc/all_reduce.cu < "$here/gather/gather.diff" \
  || { echo "gather.diff no longer applies to this all_reduce.cu"; exit 2; }
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
export PYTHONPATH=$PWD/sgl-kernel-sm120/python:$PWD/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/$STEP/machine.txt"
WORK=/tmp/issue35-16
mkdir -p $WORK/ab
cc=$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())') || exit 1

build() {  # build SOURCE INCLUDE NAME: $WORK/ab/NAME.so for this GPU, unless built already
  [ -f "$WORK/ab/$3.so" ] && return 0
  nvcc -shared -O3 -std=c++17 --cudart static -Xcompiler=-fPIC,-fvisibility=hidden \
    "--generate-code=arch=compute_$cc,code=sm_$cc" -I "$2" -o "$WORK/ab/$3.so" "$1"
}

case $STEP in
ab)
  # ab_kernels.sh builds NAME.so in AB_WORK, where the other steps find it
  AB_WORK=$WORK/ab ROUNDS=${ROUNDS:-3} bash benchmark/ab_kernels.sh "$OUT/$STEP" \
    base=.out/variants/base.cu gather=.out/variants/gather.cu -- \
    --mode local --skip-baselines --world-sizes 4 8 --tokens ${TOKENS:-4 8 16 32 64} \
    > "$OUT/$STEP/ab-log.txt" 2>&1
  tail -n 14 "$OUT/$STEP/ab-log.txt"
  ;;
then-and-now)
  now=${NAME:-base}
  build .out/old/sgl-kernel-sm120/csrc/all_reduce.cu .out/old/sgl-kernel-sm120/csrc old || exit 1
  build ".out/variants/$now.cu" sgl-kernel-sm120/csrc "$now" || exit 1
  for round in $(seq 1 "${ROUNDS:-1}"); do
    for tree in old "$now"; do
      root=$PWD; [ "$tree" = old ] && root=$PWD/.out/old
      echo "== $tree, round $round"
      (cd "$root" && PYTHONPATH=$root/sgl-kernel-sm120/python:$root/python \
        SGLANG_SM120_KERNEL_LIBRARY=$WORK/ab/$tree.so SGLANG_SM120_KERNEL_REQUIRED=1 \
        python3 benchmark/bench_allreduce.py --mode local --skip-baselines \
        --tokens ${TOKENS:-1 4 16 64 128 256 2048} --out-dir "$WORK/tan/$tree-$round") \
        > "$OUT/$STEP/bench-$tree-$round.txt" 2>&1 || tail -n 20 "$OUT/$STEP/bench-$tree-$round.txt"
    done
  done
  tar -C "$WORK/tan" -czf "$OUT/$STEP/json.tar.gz" .
  grep -h "ours AR" "$OUT/$STEP"/bench-*-1.txt
  ;;
tests)
  name=${NAME:-gather}
  build ".out/variants/$name.cu" sgl-kernel-sm120/csrc "$name" || exit 1
  SGLANG_SM120_KERNEL_LIBRARY=$WORK/ab/$name.so SGLANG_SM120_KERNEL_REQUIRED=1 \
    python3 -m pytest -q -p no:cacheprovider test/gpu 2>&1 | tail -n 40 | tee "$OUT/$STEP/gpu.txt"
  ;;
*) echo "unknown step $STEP (ab, then-and-now or tests)"; exit 2 ;;
esac
