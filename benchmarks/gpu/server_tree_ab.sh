#!/usr/bin/env bash
# Issue 22 on the device: one server configuration from older trees against this one, alternated in one call, each
# tree's own bench_server.py (its own package: the server runs from the tree's root), on the SmolLM2 Q4_1 weights
# (converted once, bf16 scales), with `mlx_lm.server` once as the yardstick. Why: our server without a drafter ran
# 1.37-1.42x `mlx_lm.server` at 8 clients in sessions 46-47 and 0.94x in session 49, on other machines; this says
# whether the code or the machine moved. The old trees are package-only exports beside the checkout (untracked and
# ignored under .gpu/, so the call carries them):
#   for c in 3df2d81 1d56694; do mkdir -p .gpu/t-$c && git archive $c mlx_dflash2 metal convert \
#     benchmarks/bench_server.py ':!mlx_dflash2/drafters' | tar x -C .gpu/t-$c; done
# usage from the repository root on the device (after benchmarks/gpu/server.sh or run.sh server made the model):
#   bash benchmarks/gpu/server_tree_ab.sh TREE...        (a TREE is a directory; "." is this checkout)
# Env: SERVER (the --server value, default ours:none), ARGS (more bench_server.py arguments, default
# "--concurrency 8 --requests 5 --pool 8"), ROUNDS (passes over the trees, default 2), BUDGET (s, default 560),
# M (the model directory, default $TMPDIR/smol-q4), DTYPE (bfloat16), MAX_TOKENS (64).
# Results: $OUT/ab-<tree>-<pass>.{json,log}, $OUT/ab-mlx_lm.{json,log}.
# On this CPU (float32 SmolLM2, 8 clients x 3 requests, 48 tokens, one pass, session 51): this tree 55.1 tok/s,
# 3df2d81 57.5, 1d56694 57.2, mlx_lm.server 48.0 (level: a CPU step is its compute).
set -u
export PYTHONUNBUFFERED=1 MLX_CUDA_USE_CUDNN_SDPA=0 MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/ptx}
T=${TMPDIR:-/tmp}; OUT=${OUT:-$T/out}; M=${M:-$T/smol-q4}; T0=$(date +%s)
mkdir -p "$OUT"
[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu/server_tree_ab.sh TREE... (see the header)" >&2; exit 2; }
[ -d "$M" ] || { echo "server_tree_ab: no model directory $M (run benchmarks/gpu/server.sh first, or set M)" >&2; exit 2; }
for t in "$@"; do [ -f "$t/benchmarks/bench_server.py" ] || { echo "server_tree_ab: $t has no benchmarks/bench_server.py" >&2; exit 2; }; done
COMMON="--model $M --mlx-model $M --no-dequantize --dtype ${DTYPE:-bfloat16} --max-tokens ${MAX_TOKENS:-64} --max-batch 32 ${ARGS:---concurrency 8 --requests 5 --pool 8}"
run() {  # tree, server, name
  local left=$(( ${BUDGET:-560} - ($(date +%s) - T0) - 5 ))
  [ "$left" -lt 45 ] && { echo "== $3: skipped ($left s left)"; return; }
  echo "== $3 ($1, $2; +$(( $(date +%s) - T0 )) s)"
  # shellcheck disable=SC2086
  (cd "$1" && PYTHONPATH=$PWD timeout -k 5 "$left" python3 benchmarks/bench_server.py --server "$2" $COMMON \
    --out "$OUT/ab-$3.json") > "$OUT/ab-$3.log" 2>&1
  grep -E " c=[0-9]+" "$OUT/ab-$3.log" | tail -4
}
run . mlx_lm mlx_lm
for p in $(seq "${ROUNDS:-2}"); do
  for t in "$@"; do run "$t" "${SERVER:-ours:none}" "$(basename "$(cd "$t" && pwd)")-$p"; done
done
echo "server_tree_ab: $(( $(date +%s) - T0 )) s"
