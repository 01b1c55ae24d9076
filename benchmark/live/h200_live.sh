#!/bin/bash
# Live SGLang 0.5.23 runs on the 1x H200 development machine (SM90): the plugin's managed path in
# a real server under the validation mode (SGLANG_SM120_ANY_ARCH=1), and upstream alone without.
#
#   bash benchmark/live/h200_live.sh STEP OUT
#
# Run from the repository root on the GPU machine. ../shared/tools/sglang-device-pack's parts are
# carried one per call, each copied at once to /tmp/parts (a call's carried paths do not stay in
# the checkout there; /tmp does while the machine is warm), the last with setup.sh and the two
# wheels of this checkout (`pip wheel --no-deps . ./sgl-kernel-sm120 -w .devrun/wheels`). Steps,
# each writing its JSON and logs to OUT and printing its time:
#   setup     unpack /tmp/parts into /tmp/site, install both wheels there, print versions
#   inspect   doctor (text and --json, with and without validation mode), p2p, warmup
#   doctor    doctor text and --json with and without validation mode (its checks reused
#             after the first of each), and `tune --tp 2` on one GPU (what it could not measure)
#   gpu       the test/gpu suite (the kernel library required), its summary in gpu-tests.txt
#   bench     benchmark/bench_cli.py: plan, a refused flag, doctor timed in fresh processes
#   selftest  FIXTURE ANY_ARCH [EXTRA...]: one selftest --tp 1 (ANY_ARCH 1 or 0)
#   e2e       the test/e2e suite at TP1 in validation mode (backend auto)
# Servers get --attention-backend triton: the pack has no FA3 (sglang's SM90 default).
set -uo pipefail
STEP=${1:?usage: h200_live.sh STEP OUT}; OUT=${2:?usage: h200_live.sh STEP OUT}; shift 2
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export PATH=/tmp/site/bin:$PATH
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
TRITON=--server-arg=--attention-backend=triton
t0=$SECONDS
took() { echo "[$STEP] $1: $((SECONDS - t0)) s" | tee -a "$OUT/times.txt"; }

case $STEP in
setup)
  bash /tmp/parts/setup.sh /tmp/parts 2>&1 | tail -n 6
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
      .devrun/wheels/*.whl
  sglang-sm120 --version | tee "$OUT/version.txt"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/version.txt"
  took "setup"
  ;;
inspect)
  sglang-sm120 doctor > "$OUT/doctor.txt" 2>&1; took "doctor (plugin default)"
  SGLANG_SM120_ANY_ARCH=1 sglang-sm120 doctor > "$OUT/doctor-anyarch.txt" 2>&1
  SGLANG_SM120_ANY_ARCH=1 sglang-sm120 doctor --json > "$OUT/doctor-anyarch.json" 2> "$OUT/doctor-anyarch.err"
  took "doctor (validation mode, text and json)"
  sglang-sm120 p2p > "$OUT/p2p.txt" 2>&1; echo "p2p exit status $?" >> "$OUT/p2p.txt"
  took "p2p"
  timeout 420 sglang-sm120 warmup > "$OUT/warmup.txt" 2>&1; echo "warmup exit status $?" >> "$OUT/warmup.txt"
  took "warmup"
  ;;
doctor)
  for any in 0 1; do
    for form in text json; do
      flag=$([ $form = json ] && echo --json)
      SGLANG_SM120_ANY_ARCH=$any sglang-sm120 doctor $flag > "$OUT/doctor-anyarch$any.$form" 2> "$OUT/doctor-anyarch$any-$form.err"
      took "doctor ANY_ARCH=$any $form"
    done
  done
  SGLANG_SM120_ANY_ARCH=1 sglang-sm120 tune --tp 2 --tokens 1 8 64 > "$OUT/tune-tp2-one-gpu.txt" 2>&1
  echo "tune exit status $?" >> "$OUT/tune-tp2-one-gpu.txt"
  took "tune --tp 2 on one GPU"
  ;;
gpu)
  SGLANG_SM120_KERNEL_REQUIRED=1 python3 -m pytest -q -p no:cacheprovider test/gpu -rfE \
      > "$OUT/gpu-tests.txt" 2>&1
  echo "pytest exit status $?" >> "$OUT/gpu-tests.txt"
  took "test/gpu"
  ;;
bench)
  python3 benchmark/bench_cli.py --out "$OUT/bench_cli.json" "$@" > "$OUT/bench_cli.txt" 2>&1
  echo "exit status $?" >> "$OUT/bench_cli.txt"
  took "bench_cli"
  ;;
selftest)
  FIXTURE=${1:?fixture}; ANY=${2:?0 or 1}; shift 2
  name=selftest-$FIXTURE-anyarch$ANY
  SGLANG_SM120_ANY_ARCH=$ANY sglang-sm120 selftest --tp 1 --fixture "$FIXTURE" "$TRITON" "$@" \
      --keep-logs "$OUT/$name-logs" --json > "$OUT/$name.json" 2> "$OUT/$name.err"
  echo "exit status $?" >> "$OUT/$name.err"
  took "$name"
  ;;
e2e)
  SGLANG_SM120_ANY_ARCH=1 SGLANG_SM120_E2E_TP=1 SGLANG_SM120_E2E_BACKENDS=auto \
  SGLANG_SM120_E2E_SERVER_ARGS="--attention-backend triton $*" \
  SGLANG_SM120_E2E_LOG_DIR="$OUT/e2e-logs" \
      python3 -m pytest -q -p no:cacheprovider test/e2e -rA > "$OUT/e2e.txt" 2>&1
  echo "pytest exit status $?" >> "$OUT/e2e.txt"
  took "e2e"
  ;;
*) echo "unknown step $STEP" >&2; exit 2 ;;
esac
