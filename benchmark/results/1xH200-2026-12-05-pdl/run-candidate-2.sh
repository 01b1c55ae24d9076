#!/usr/bin/env bash
# The two device calls candidate 2 still needs, from the repository root of a GPU machine whose
# checkout holds candidate-2.diff (each fits one 600 s call; run them back to back):
#
#   bash benchmark/results/1xH200-2026-12-05-pdl/run-candidate-2.sh tests OUT
#       build the candidate's all_reduce.cu for this GPU, run its early-launch test file, then
#       all of test/gpu with the library required (OUT/early.txt, OUT/gpu.txt)
#   bash benchmark/results/1xH200-2026-12-05-pdl/run-candidate-2.sh ab OUT
#       benchmark/ab_kernels.sh, 3 rounds: base = this checkout's kernel with SGLANG_SM120_PDL=0
#       against pdl = the candidate's, `--mode local --skip-baselines` (OUT/ab.txt and the rest);
#       ROUNDS (default 3) and TOKENS (default: bench_allreduce's own list) to fit a shorter call
#
# The candidate is applied to a copy in /tmp, so the checkout stays as it is.
set -uo pipefail
STEP=${1:?usage: run-candidate-2.sh tests|ab OUT}
OUT=$(realpath -m "${2:?usage: run-candidate-2.sh tests|ab OUT}")
here=$(cd "$(dirname "$0")" && pwd)
repo=$PWD
work=$(mktemp -d /tmp/cand2.XXXX)
mkdir -p "$OUT" "$work/tree"
tar -C "$repo" --exclude=./.git -cf - . | tar -C "$work/tree" -xf -
cp "$repo/sgl-kernel-sm120/csrc/all_reduce.cu" "$work/base.cu"  # away from the old sk_api.h
cd "$work/tree" && { git apply "$here/candidate-2.diff" || patch -s -p1 < "$here/candidate-2.diff"; } \
  || { echo "candidate-2.diff does not apply"; exit 1; }
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
export PYTHONPATH=$work/tree/sgl-kernel-sm120/python:$work/tree/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"

case $STEP in
tests)
  cc=$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())') || exit 1
  nvcc -shared -O3 -std=c++17 --cudart static -Xcompiler=-fPIC,-fvisibility=hidden \
    "--generate-code=arch=compute_$cc,code=sm_$cc" -I sgl-kernel-sm120/csrc \
    -o "$work/pdl.so" sgl-kernel-sm120/csrc/all_reduce.cu || exit 1
  export SGLANG_SM120_KERNEL_LIBRARY=$work/pdl.so SGLANG_SM120_KERNEL_REQUIRED=1
  python3 -m pytest -q -x test/gpu/test_sgl_kernel_early_launch.py 2>&1 | tail -n 30 \
    | tee "$OUT/early.txt"
  python3 -m pytest -q test/gpu 2>&1 | tail -n 40 | tee "$OUT/gpu.txt"
  ;;
ab)
  echo 'import os; os.environ["SGLANG_SM120_PDL"] = "0"' > "$work/pdl_off.py"
  ROUNDS=${ROUNDS:-3} AB_WORK=$work/ab bash benchmark/ab_kernels.sh "$OUT" \
    "base=$work/base.cu:$work/pdl_off.py" \
    "pdl=sgl-kernel-sm120/csrc/all_reduce.cu" -- --mode local --skip-baselines \
    ${TOKENS:+--tokens $TOKENS}
  ;;
*) echo "unknown step $STEP (tests or ab)"; exit 2 ;;
esac
