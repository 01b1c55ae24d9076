#!/usr/bin/env bash
# Kernel sources side by side on one GPU, in one run: each variant's all_reduce.cu is built for
# this GPU, then bench_allreduce.py runs with each library in turn, ROUNDS times in
# alternation (base, candidate, base, candidate, ...), so that drift during the run shows as
# spread between a variant's rounds rather than as a difference between variants. Prints, per
# world size and token count, every variant's AR / fused / AR + norm (median over rounds, us)
# with fused - AR and fused / (AR + norm), and the spread over rounds.
#
#   benchmark/ab_kernels.sh OUT NAME=SOURCE[:PRELUDE] ... -- [bench_allreduce.py args]
#
# SOURCE is an all_reduce.cu (a base revision's: `git show REV:sgl-kernel-sm120/csrc/all_reduce.cu
# > .out/base.cu`, in an ignored folder carried with the call). PRELUDE, a Python file, runs in
# the bench process first (e.g. to set a sgl_kernel_sm120.config rule for that variant). The
# variants share this checkout's sk_api.h and Python packages (installed, or these sources).
# ROUNDS (default 2); the libraries are built in AB_WORK (default: a new folder in /tmp) as
# NAME.so, once per SOURCE (variants that differ only in their prelude share one build).
# Writes OUT/ab.txt (the table), OUT/bench-NAME.txt (every round's output) and
# OUT/ab-json.tar.gz (every run's JSON and PNG).
set -uo pipefail
OUT=${1:?usage: ab_kernels.sh OUT NAME=SOURCE[:PRELUDE] ... -- [bench args]}
shift
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
ROUNDS=${ROUNDS:-2}
work=${AB_WORK:-$(mktemp -d /tmp/ab.XXXX)}
mkdir -p "$work" "$OUT"
cc=$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())') || exit 1
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER

names=()
declare -A preludes  # NAME -> its prelude's Python ("pass" for none)
declare -A built  # SOURCE -> the library already built from it (one build per source)
for spec in "${variants[@]}"; do
  name=${spec%%=*}
  rest=${spec#*=}
  src=${rest%%:*}
  names+=("$name")
  preludes[$name]="pass"
  [[ $rest == *:* ]] && preludes[$name]="exec(open('${rest#*:}').read())"
  if [ -n "${built[$src]:-}" ]; then
    cp "${built[$src]}" "$work/$name.so" || exit 1
    continue
  fi
  built[$src]=$work/$name.so
  if ! ${CUDACXX:-nvcc} -shared -O3 -std=c++17 --cudart static -Xcompiler=-fPIC,-fvisibility=hidden \
    "--generate-code=arch=compute_$cc,code=sm_$cc" -I sgl-kernel-sm120/csrc \
    -o "$work/$name.so" "$src" > "$work/$name.build" 2>&1; then
    cat "$work/$name.build"
    exit 1
  fi
done

for round in $(seq 1 "$ROUNDS"); do
  for name in "${names[@]}"; do
    echo "== $name, round $round" | tee -a "$OUT/bench-$name.txt"
    SGLANG_SM120_KERNEL_LIBRARY="$work/$name.so" python3 -c "
import runpy, sys
sys.path += ['sgl-kernel-sm120/python', 'python']  # where the packages are not installed
${preludes[$name]}
sys.argv = ['bench_allreduce.py', '--out-dir', '$work/$name-$round', *sys.argv[1:]]
runpy.run_path('benchmark/bench_allreduce.py', run_name='__main__')
" "$@" >> "$OUT/bench-$name.txt" 2>&1 || { tail -20 "$OUT/bench-$name.txt"; exit 1; }
  done
done

python3 - "$work" "$ROUNDS" "${names[@]}" <<'EOF' | tee "$OUT/ab.txt"
import json, statistics, sys
from pathlib import Path
work, rounds, names = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
cells = {}  # (world, tokens) -> name -> column -> [us per round]
for name in names:
    for r in range(1, rounds + 1):
        for result in json.loads((work / f"{name}-{r}" / "bench_allreduce.json").read_text())["results"]:
            for row in result["rows"]:
                cell = cells.setdefault((result["world_size"], row["tokens"]), {}).setdefault(name, {})
                for col in ("ours_plain", "ours_fused", "ours_unfused"):
                    cell.setdefault(col, []).append(row[col])
print("us per call, median over rounds (spread over rounds in brackets); ratio = fused / (AR + norm)")
print(f"{'world':>5} {'tokens':>6}  " + "  ".join(f"{n + ': AR / fused / AR+norm  f-AR  ratio':<44}" for n in names))
for (world, tokens), by_name in sorted(cells.items()):
    parts = []
    for name in names:
        c = by_name[name]
        ar, fu, un = (statistics.median(c[k]) for k in ("ours_plain", "ours_fused", "ours_unfused"))
        spread = max(max(v) - min(v) for v in c.values())
        parts.append(f"{ar:5.1f} / {fu:5.1f} / {un:5.1f} {fu - ar:+5.1f} {fu / un:5.2f} [{spread:.1f}]".ljust(44))
    print(f"{world:>5} {tokens:>6}  " + "  ".join(parts))
EOF
tar -czf "$OUT/ab-json.tar.gz" -C "$work" $(cd "$work" && ls -d */)
