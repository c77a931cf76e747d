#!/usr/bin/env bash
# Issue 22 on a GPU: the server's engine under bench_server.py's load (benchmarks/engine_load.py, no HTTP) with the
# shipped drafter and without one, once per MLX CUDA setting, each in a fresh process (MLX reads them at start):
#   (default)                       CUDA graphs of up to 30 ops (H100), 400 graph executables cached per stream
#   MLX_CUDA_GRAPH_CACHE_SIZE=4000  more cached executables: a drafter's rows make more distinct op sequences
#                                   (compactions, flushes, trial widths), and a miss re-instantiates its graphs
#   MLX_USE_CUDA_GRAPHS=0           every kernel launched on its own
# Session 49's question: why the drafter's plain batched steps took 14.3 ms in the server against 10.9 ms without a
# drafter while one process ran them level; whether MLX's graph cache is the answer is not measured yet.
#   bash benchmarks/gpu/engine_ab.sh [engine_load.py args]     (from the repository root on the device; after
#                                                              benchmarks/gpu/server.sh made $TMPDIR/smol-q4)
# Env: M (the model directory, default $TMPDIR/smol-q4), D (the drafter, default the shipped one), OUT, PY,
# VARIANTS (space-separated NAME=VALUE settings, "-" for the default; default the three above), T_EACH (seconds per
# variant, default 170).
set -u
PY=${PY:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MLX_CUDA_USE_CUDNN_SDPA=0 MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/ptx}
T=${TMPDIR:-/tmp}; OUT=${OUT:-$T/out}; M=${M:-$T/smol-q4}; mkdir -p "$OUT"
[ -d "$M" ] || { echo "engine_ab: no model directory $M (run benchmarks/gpu/server.sh first, or set M)" >&2; exit 2; }
D=${D:-mlx_dflash2/drafters/smollm2-135m-instruct}
status=0
for v in ${VARIANTS:-- MLX_CUDA_GRAPH_CACHE_SIZE=4000 MLX_USE_CUDA_GRAPHS=0}; do
  name=$([ "$v" = - ] && echo default || echo "${v%%=*}-${v#*=}")
  echo "== engine_ab: $name"
  # shellcheck disable=SC2046
  env $([ "$v" = - ] || echo "$v") timeout -k 10 "${T_EACH:-170}" $PY benchmarks/engine_load.py --model "$M" \
    --config "$D" --config none --deliver asyncio --server-arg=--dtype --server-arg=bfloat16 \
    --out "$OUT/engine-$name.json" "$@" 2>&1 | grep -v "gated in" | tail -8
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit $status
