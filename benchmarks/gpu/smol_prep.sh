# Sourced by the device scripts of issue 22 (server.sh, lease22.sh, one_loop_ab.sh): what they need on a lease
# besides MLX, from the bundles' files in $PAYLOAD (default ~/payload): the gguf wheel; with SERVER_WHEELS=1 the
# server's wheels (srvwhl.tar: fastapi, uvicorn, pydantic, httpx); the shipped drafters (drafter.tgz, left out of a
# slimmed tree, unpacked in every call since an ignored folder does not survive the next call's sync); SmolLM2's
# Q4_1 GGUF converted once with bf16 scales into $M (default $TMPDIR/smol-q4, or SMOL_MLX; the GGUF SMOL_GGUF).
# Sets P, T, M, D (the shipped SmolLM2 drafter's directory). Uses $PY (default python3).
P=${PAYLOAD:-$HOME/payload}; T=${TMPDIR:-/tmp}; PY=${PY:-python3}
$PY -c "import gguf" 2>/dev/null || $PY -m pip install -q --no-index --no-deps "$P"/gguf-*.whl 2>&1 | tail -2
if [ "${SERVER_WHEELS:-0}" = 1 ]; then
  $PY -c "import fastapi, uvicorn, pydantic, httpx" 2>/dev/null || { mkdir -p "$T/srv" && tar xf "$P/srvwhl.tar" \
    -C "$T/srv" && $PY -m pip install -q --no-index --find-links "$T/srv" fastapi uvicorn pydantic httpx 2>&1 | tail -3; }
fi
[ -f mlx_dflash2/drafters/smollm2-135m-instruct/config.json ] || {
  mkdir -p mlx_dflash2/drafters && tar xzf "$P/drafter.tgz" -C mlx_dflash2/drafters; }
M=${SMOL_MLX:-$T/smol-q4}
[ -d "$M" ] || PYTHONPATH=$PWD $PY -m convert "${SMOL_GGUF:-$P/SmolLM2-135M-Instruct.Q4_1.gguf}" "$M" --dtype bfloat16 \
  --quiet
D=$PWD/mlx_dflash2/drafters/smollm2-135m-instruct
