#!/usr/bin/env bash
# Issue 35, twelfth round, on the GPU machine from the repository root. rs256 (the prepared
# 256-thread row split, ../prepared-2026-12-07-issue35, now committed) lost 0.6 us at world 2,
# 32 tokens: there a row is 2 slices of 448 vectors (the 64-block row-split cap,
# MAX_ROW_SPLIT_BLOCKS), two per thread of a 256-thread block. A cap of 64 512-thread blocks
# is one of 128 256-thread blocks.
#
#   bash benchmark/results/1xH100-2026-12-07-issue35/run.sh cap OUT
#       trig (WITH_TRIG=0: left out), rs256 and rs256 with MAX_ROW_SPLIT_BLOCKS = 128 (a
#       prelude), ROUNDS (3) rounds, TOKENS (16 32 64 128), then each library's plan at both
#       caps (splits.py)
#   bash benchmark/results/1xH100-2026-12-07-issue35/run.sh tests OUT
#       all of test/gpu on rs256 with MAX_ROW_SPLIT_BLOCKS = 128 in this checkout's config.py
#
# Leaves OUT as OUT.tar.gz (the built libraries left out).
set -uo pipefail
here=$(dirname "$0")
prep=benchmark/results/prepared-2026-12-07-issue35
STEP=${1:?usage: run.sh cap|tests OUT}
OUT=$(realpath -m "${2:?usage: run.sh cap|tests OUT}")
mkdir -p .out/variants "$OUT"
# rs256 is the committed kernel (4d920cd); trig, the one before it, is that with the prepared
# diffs taken back. Since b30c60d they no longer take back: WITH_TRIG=0 skips them.
cp sgl-kernel-sm120/csrc/all_reduce.cu .out/variants/rs256.cu
if [ "${WITH_TRIG:-1}" != 0 ]; then
  patch -s -R -o .out/variants/tail.cu .out/variants/rs256.cu < "$prep/rs256-on-tail.diff" \
    && patch -s -R -o .out/variants/trig.cu .out/variants/tail.cu < "$prep/tail-on-trig.diff" \
    || { echo "the diffs do not take back from this all_reduce.cu"; exit 2; }
fi
pack() {
  (cd "$(dirname "$OUT")" && tar czf "$OUT.tar.gz" --exclude='*.so' "$(basename "$OUT")") \
    && rm -rf "$OUT"
}
trap pack EXIT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER AB_WORK=$OUT/abw
export PYTHONPATH=$PWD/sgl-kernel-sm120/python:$PWD/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
case $STEP in
cap)
  # As ruff wants it: the file comes back with the results and is committed with them.
  printf 'import sgl_kernel_sm120.config as c\n\nc.MAX_ROW_SPLIT_BLOCKS = 128\n' > "$OUT/cap128.py"
  v=.out/variants
  specs=(rs256=$v/rs256.cu "rs256c128=$v/rs256.cu:$OUT/cap128.py")
  [ "${WITH_TRIG:-1}" = 1 ] && specs=(trig=$v/trig.cu "${specs[@]}")
  ROUNDS=${ROUNDS:-3} bash benchmark/ab_kernels.sh "$OUT" "${specs[@]}" -- --mode local \
    --skip-baselines --tokens ${TOKENS:-16 32 64 128} > "$OUT/ab-log.txt" 2>&1
  tail -n 14 "$OUT/ab-log.txt"
  for name in rs256 $([ "${WITH_TRIG:-1}" = 1 ] && echo trig); do
    echo "== $name" | tee -a "$OUT/splits.txt"
    SGLANG_SM120_KERNEL_LIBRARY=$AB_WORK/$name.so python3 "$here/splits.py" 64 128 2>&1 \
      | tee -a "$OUT/splits.txt"
  done
  ;;
tests)
  sed -i 's/^MAX_ROW_SPLIT_BLOCKS = 64$/MAX_ROW_SPLIT_BLOCKS = 128/' \
    sgl-kernel-sm120/python/sgl_kernel_sm120/config.py
  grep -q '^MAX_ROW_SPLIT_BLOCKS = 128$' sgl-kernel-sm120/python/sgl_kernel_sm120/config.py \
    || { echo "MAX_ROW_SPLIT_BLOCKS not set"; exit 2; }
  bash benchmark/results/1xH200-2026-12-06b-issue35/run.sh tests "$OUT" rs256
  ;;
*) echo "unknown step $STEP (cap or tests)"; exit 2 ;;
esac
