#!/usr/bin/env bash
# Issue 35, eleventh round, prepared and not run (README.md). On the GPU machine, from the
# repository root of a checkout whose all_reduce.cu is still the one these diffs apply to:
#
#   bash benchmark/results/prepared-2026-12-07-issue35/run.sh ab OUT
#       trig (the committed kernel), tail and rs256 side by side, ranks as streams of one
#       process, 1-16 tokens (or TOKENS), ROUNDS rounds in alternation (default 3)
#   bash benchmark/results/prepared-2026-12-07-issue35/run.sh tests OUT NAME
#       all of test/gpu on .out/variants/NAME.cu
#   bash benchmark/results/prepared-2026-12-07-issue35/run.sh full OUT NAME
#       trig and NAME at every token count bench_allreduce runs, one round each: the issue's
#       before / after table
#   bash benchmark/results/prepared-2026-12-07-issue35/run.sh timeline OUT [NAME]
#       block 0's phase times and each rank's start, 1 token, world 2 / 4 / 8 (NAME: trig)
#
# Each step first writes .out/variants/{trig,tail,rs256}.cu (the committed source and the
# diffs here) and applies rs256-python.diff to this checkout. It leaves OUT as one archive,
# OUT.tar.gz (the built libraries left out), also when the call's time limit cuts it short,
# so that what finished comes back as one file.
set -uo pipefail
here=$(dirname "$0")
STEP=${1:?usage: run.sh ab|tests|full|timeline OUT [NAME]}
OUT=$(realpath -m "${2:?usage: run.sh ab|tests|full|timeline OUT [NAME]}")
NAME=${3:-}
mkdir -p .out/variants "$OUT"
cp sgl-kernel-sm120/csrc/all_reduce.cu .out/variants/trig.cu
patch -s -o .out/variants/tail.cu sgl-kernel-sm120/csrc/all_reduce.cu < "$here/tail-on-trig.diff" \
  && patch -s -o .out/variants/rs256.cu .out/variants/tail.cu < "$here/rs256-on-tail.diff" \
  || { echo "the diffs no longer apply to this all_reduce.cu"; exit 2; }
# rs256 refuses slices past 512 vectors; the Python rule that never asks for one (no change at
# hidden 7168, where a slice is at most 448), into this checkout for every variant.
grep -q MAX_ROW_SLICE_VECTORS sgl-kernel-sm120/python/sgl_kernel_sm120/config.py \
  || patch -s -p1 < "$here/rs256-python.diff" || { echo "rs256-python.diff does not apply"; exit 2; }
pack() {
  (cd "$(dirname "$OUT")" && tar czf "$OUT.tar.gz" --exclude='*.so' "$(basename "$OUT")") \
    && rm -rf "$OUT"
}
trap pack EXIT
run=benchmark/results/1xH200-2026-12-06b-issue35/run.sh
export AB_WORK=$OUT/abw
case $STEP in
ab) TOKENS=${TOKENS:-1 2 4 8 16} ROUNDS=${ROUNDS:-3} bash $run ab "$OUT" trig tail rs256 ;;
tests) bash $run tests "$OUT" "${NAME:?tests needs a NAME}" ;;
full) TOKENS= ROUNDS=1 bash $run ab "$OUT" trig "${NAME:?full needs a NAME}" ;;
timeline)
  cc=$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())') || exit 1
  lib=$OUT/${NAME:-trig}.so
  nvcc -shared -O3 -std=c++17 --cudart static -Xcompiler=-fPIC,-fvisibility=hidden \
    "--generate-code=arch=compute_$cc,code=sm_$cc" -I sgl-kernel-sm120/csrc \
    -o "$lib" ".out/variants/${NAME:-trig}.cu" || exit 1
  PYTHONPATH=$PWD/sgl-kernel-sm120/python:$PWD/python SGLANG_SM120_KERNEL_LIBRARY=$lib \
    python3 benchmark/phase_timeline_local.py --world-sizes 2 4 8 --hidden 7168 8 \
    2>&1 | tee "$OUT/timeline.txt"
  ;;
*) echo "unknown step $STEP (ab, tests, full or timeline)"; exit 2 ;;
esac
