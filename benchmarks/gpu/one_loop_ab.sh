#!/usr/bin/env bash
# Issue 22 on the device: the old solo loop against the batch-of-one generator, bench_generate.py in both trees,
# alternated (old, new, old, new), on the SmolLM2 Q4_1 weights (converted once, bf16 scales) with the shipped
# drafter and lookup. The old tree is a package-only export beside the checkout (untracked; it travels with the call):
#   mkdir -p abold && git archive a1b9f22 mlx_dflash2 metal ':!mlx_dflash2/drafters' | tar x -C abold
# usage from the repository root on the device: bash benchmarks/gpu/one_loop_ab.sh [OLD_TREE] (default abold);
# BUDGET (s, default 560) bounds the whole script; results: $OUT/gen-{warm,old,new,old2,new2}.{json,log}.
set -u
export PYTHONUNBUFFERED=1 MLX_CUDA_USE_CUDNN_SDPA=0 MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/ptx}
OLD=$PWD/${1:-abold}; P=${PAYLOAD:-$HOME/payload}; T=${TMPDIR:-/tmp}; OUT=${OUT:-$T/out}; T0=$(date +%s)
mkdir -p "$OUT" "$MLX_PTX_CACHE_DIR"
[ -d "$OLD/mlx_dflash2" ] || { echo "one_loop_ab: no old tree at $OLD (see the header)" >&2; exit 2; }
. benchmarks/gpu/smol_prep.sh  # (M, D)
run() {  # tree, name, repeats, timeout cap
  local left=$(( ${BUDGET:-560} - ($(date +%s) - T0) - 5 )) t=$4
  [ "$left" -lt "$t" ] && t=$left
  [ "$t" -lt 30 ] && { echo "== $2: skipped ($left s left)"; return; }
  echo "== $2 ($1, timeout $t s)"
  PYTHONPATH=$1 timeout -k 5 "$t" python3 benchmarks/bench_generate.py --model "$M" --drafter "$D" --drafter lookup \
    --max-tokens 128 --repeats "$3" --prompts chat,code --out "$OUT/gen-$2.json" 2>&1 | tail -24 | tee "$OUT/gen-$2.log"
}
run "$PWD" warm 1 240   # the machine's first forwards build MLX's kernels (both trees share them)
run "$OLD" old 3 110
run "$PWD" new 3 110
run "$OLD" old2 3 110
run "$PWD" new2 3 110
echo "one_loop_ab: $(( $(date +%s) - T0 )) s"
