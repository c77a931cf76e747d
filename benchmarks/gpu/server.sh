#!/usr/bin/env bash
# Issue 22 on the H200: bench_server.py with the SmolLM2 Q4_1 weights (converted once, bf16 scales) for ours and
# mlx_lm.server; usage from the repository root on the device: bash benchmarks/gpu/server.sh [bench_server args...]
# The device image has no fastapi/uvicorn/pydantic/httpx: bring their wheels as an EXTRA_FILE of ../shared/gpu/prepare,
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d "$TMPDIR/srvwhl" fastapi uvicorn "pydantic>=2.7" httpx &&
#   tar cf "$TMPDIR/srvwhl.tar" -C "$TMPDIR/srvwhl" .
# (with the SmolLM2 GGUF, the gguf wheel and slim.sh's drafter.tgz; benchmarks/README.md, session 23).
# Env: SERVERS (bench_server.py's --server values, space-separated; default our server with the shipped drafter, ours
# without, mlx_lm.server), NAME (the results' name in $OUT: NAME.json, NAME.log, NAME.png; default server), SHAPE
# (a random_targets shape, e.g. qwen3-8b: the servers run a random-weight target of it with SmolLM2's tokenizer,
# written once by scripted_server.py make; SERVERS then defaults to "scripted:3 ours:none mlx_lm", issue 22's
# speed-only runs).
set -u
PY=${PY:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MLX_CUDA_USE_CUDNN_SDPA=0 MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/ptx}
SERVER_WHEELS=1 . benchmarks/gpu/smol_prep.sh  # (P, T, M)
OUT=${OUT:-$T/out}; mkdir -p "$OUT"
if [ -n "${SHAPE:-}" ]; then  # a random-weight target of that shape with SmolLM2's tokenizer (scripted_server.py make)
  R=$T/random-$SHAPE; [ -d "$R" ] || $PY benchmarks/scripted_server.py make "$R" --tokenizer "$M" --shape "$SHAPE" || exit 1
  M=$R
fi
# (a random target: the scripted drafter, since the shipped one was trained for SmolLM2's hidden states)
DEF="ours:mlx_dflash2/drafters/smollm2-135m-instruct ours:none mlx_lm"
[ -z "${SHAPE:-}" ] || DEF="scripted:3 ours:none mlx_lm"
SERVERS=${SERVERS:-$DEF}; NAME=${NAME:-server}
# shellcheck disable=SC2046
timeout -k 10 "${T_SERVER:-540}" $PY benchmarks/bench_server.py $(printf -- '--server %s ' $SERVERS) \
  --model "$M" --mlx-model "$M" --no-dequantize --dtype bfloat16 --pool 24 --max-tokens 64 \
  --max-batch 32 --server-arg=--log-level --server-arg=INFO --out "$OUT/$NAME.json" "$@" 2>&1 | tee "$OUT/$NAME.log"
rc=${PIPESTATUS[0]}
echo "server.sh: exit $rc"
exit "$rc"
