#!/usr/bin/env bash
# Issue 22's measuring calls on a lease, one STAGE per device call (each bounded by BUDGET seconds, default 560, so
# it ends inside the call's 600 s), from the repository root on the device after the bundles were installed
# (benchmarks/README.md: bundle.sh's MLX wheels, the SmolLM2 GGUF, the gguf wheel, srvwhl.tar, drafter.tgz, a PTX
# cache). Session 51 wrote it down from session 50's unused plan; session 52 ran table, engine, table with
# MLX_USE_CUDA_GRAPHS=0, and 8b on an H100; session 53 ran table at ff851d9 (--cuda-graphs auto in process) on an
# H100, then got no machine again (benchmarks/README.md). Session 54 got none (no machine lent) and made drafting
# rounds repeat one sequence of kernels (round_graphs.py). Next: graphs (does the drafter's server now gain from CUDA
# graphs?), departures (two short runs: is the 6.375-nat departure real?), then 8b (its whole budget for the 8B
# shape: session 52's mlx_lm.server part did not fit).
#   bash benchmarks/gpu/lease22.sh STAGE
# Stages (what each answers):
#   engine  benchmarks/engine_load.py, the server's engine without HTTP, the shipped drafter against none at 8
#           clients x 5 requests, 2 phases each, in fresh processes: engine_ab.sh's MLX settings (the default,
#           MLX_CUDA_GRAPH_CACHE_SIZE=4000, MLX_USE_CUDA_GRAPHS=0), then delivery on the worker instead of the
#           HTTP thread's asyncio loop, and the warm-up on the loading thread (before 9be66c7). Where the drafter
#           server's plain steps lose (14.3 against 10.9 ms on session 49's H100, level in one process).
#   trees   benchmarks/gpu/server_tree_ab.sh . <3df2d81> <1d56694>: our plain server at 8 clients from the trees of
#           session 47 and before b1ec8a9 against this one (1.37-1.42x mlx_lm.server in sessions 46-47, 0.94x in
#           session 49); make the trees first (server_tree_ab.sh's header) and carry them.
#   8b      SHAPE=qwen3-8b server.sh: the scripted drafter (tau 3) against ours without one and mlx_lm.server at
#           the random Qwen3-8B shape, 1 and 8 clients x 3 requests.
#   table   the SmolLM2 table at 1, 2, 4, 8, 16, 32 clients x 5 requests (run.sh server): the issue's H200 table.
#   graphs  the drafter's server with --cuda-graphs on and off, ours without a drafter and mlx_lm.server, 1, 8 and
#           32 clients x 3 requests, in one run: since session 54 a batch's drafting rounds repeat one sequence of
#           kernels (the CPU proxy, round_graphs.py; the drafter forward evaluated apart where graphs run), so MLX's
#           graph cache should serve them; auto (off for a drafter's server) flips to on if on wins here.
#   departures  our plain server on SmolLM2 at 1 and 32 clients x 2 requests (pool[22] asked 3 times; at 32 clients
#           it departed in ~75 % of the tables' requests, at 16 in ~20 %), twice: as the table runs it (the answers
#           that depart from their solo ones by more than 1 nat kept, both texts), then with --token-strings (the
#           streamed tokens kept, so the departing token is found by token, not by character). Every 1-32-client
#           GPU table since session 46 had departures reported at 6.375 nats, all on pool[22] ("List three facts
#           about rainbows."), where the solo run has "\n\n" then "2" (6.375 ahead): a re-split "\n" + "\n" would
#           be reported there by characters. Is it that, or a real departure?
set -u
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/ptx} MLX_CUDA_USE_CUDNN_SDPA=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s); B=${BUDGET:-560}
el() { echo "== $* (+$(( $(date +%s) - T0 )) s)"; }
left() { echo $(( B - ($(date +%s) - T0) )); }
SERVER_WHEELS=1 . benchmarks/gpu/smol_prep.sh  # (T, M, D)
OUT=${OUT:-$T/out}; mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,clocks.sm,driver_version --format=csv,noheader
case ${1:-} in
  engine)  # the MLX settings through engine_ab.sh (asyncio delivery), then the worker's delivery and the old warm-up
    el "engine: MLX settings"; M=$M D=$D T_EACH=$(( (B - 200) / 3 )) bash benchmarks/gpu/engine_ab.sh --repeats 2 --no-solo
    for a in "--deliver direct" "--deliver asyncio --warm-up loading"; do
      [ "$(left)" -gt 40 ] || { el "skipped: $a"; continue; }
      el "engine: $a"
      # shellcheck disable=SC2086
      timeout $(( $(left) < 110 ? $(left) - 10 : 100 )) python3 benchmarks/engine_load.py --model "$M" \
        --server-arg=--dtype --server-arg=bfloat16 --config "$D" --config none $a --repeats 2 --no-solo \
        --out "$OUT/engine-$(echo "$a" | tr -c 'A-Za-z0-9\n' _).json" 2>&1 | grep -v "gated in" | tail -8
    done ;;
  trees)
    el trees; BUDGET=$(( $(left) - 5 )) bash benchmarks/gpu/server_tree_ab.sh . "${@:2}" ;;
  8b)
    el 8b; SHAPE=qwen3-8b NAME=server8b SAVE_PTX=0 RUN_BUDGET=$(( $(left) - 5 )) \
      ARGS_SERVER="--concurrency 1,8 --requests 3 --pool 8" bash benchmarks/gpu/run.sh server ;;
  table)
    el table; SAVE_PTX=0 RUN_BUDGET=$B T_SERVER=$(( B - 10 )) \
      ARGS_SERVER="--requests 5 --concurrency 1,2,4,8,16,32" bash benchmarks/gpu/run.sh server ;;
  graphs)
    d=mlx_dflash2/drafters/smollm2-135m-instruct
    el graphs; SERVERS="ours:$d@--cuda-graphs=on ours:$d@--cuda-graphs=off ours:none mlx_lm" NAME=graphs SAVE_PTX=0 \
      RUN_BUDGET=$(( $(left) - 5 )) T_SERVER=$(( $(left) - 15 )) \
      ARGS_SERVER="--requests 3 --concurrency 1,8,32" bash benchmarks/gpu/run.sh server ;;
  departures)
    for t in "" --token-strings; do  # the first run half the budget, the second (the decisive one) what is left
      el "departures ${t:-text}"
      b=$([ -z "$t" ] && echo $(( $(left) / 2 )) || echo $(( $(left) - 5 )))
      SERVERS=ours:none NAME=departures${t:+-tokens} SAVE_PTX=0 RUN_BUDGET=$b T_SERVER=$(( b - 10 )) \
        ARGS_SERVER="--requests 2 --concurrency 1,32 $t" bash benchmarks/gpu/run.sh server
    done ;;
  *) echo "usage: bash benchmarks/gpu/lease22.sh engine|trees TREE...|8b|table|graphs|departures" >&2; exit 2 ;;
esac
el end
