#!/usr/bin/env bash
# The device-call driver of issue 19's and issue 20's H200 measurements: run from the repository root on the lent
# machine after ../shared/gpu/prepare's bundles were stashed and installed (MLX CUDA + mlx-lm installed; the
# SmolLM2 GGUF and the gguf wheel in $PAYLOAD, default ~/payload).
#
#   bash benchmarks/gpu/run.sh PART...        PART: selftest check kernels scaling exactness sets hybrid probe trace build long
#                                                   batch server scripted batchx trainvocab
#
# Each part runs under `timeout` (T_<PART> seconds, below; never past RUN_BUDGET seconds from this script's
# start, so one device call ends inside its 600 s limit), its output tee'd to $OUT/<part>.log, its results in
# $OUT/ (the device tool brings back at most 8 files: keep to ~3 parts per call; with more than 8 files they are
# packed into $OUT/results.tar.gz). $OUT/run.log: nvidia-smi lines, each part's exit status and seconds.
#   selftest   python -m mlx_dflash2.selftest: every kernel against its reference on the GPU (exit 1 on a fallback)
#   check      tests/test_kernels.py tests/test_kernels_drafter.py with MLX's CPU as the default device (the
#              tests are written for the CPU: NVRTC compile checks of every CUDA instantiation with the device
#              image's nvrtc, the shared bodies in the CPU emulation; the GPU itself is selftest's)
#   kernels    benchmarks/bench_kernels.py --shapes $KERNEL_SHAPES --sweep -> kernels.json
#   scaling    benchmarks/bench_scaling.py --shapes $SCALING_SHAPES -> scaling.json, scaling.png
#   exactness  benchmarks/gpu/exactness.py --gguf $GGUF -> exactness.json (exit 1 on a mismatch with the kernels)
#   sets       benchmarks/gpu/smollm2_sets.py --model $GGUF -> sets.json
#   hybrid     benchmarks/bench_hybrid.py --shapes $HYBRID_SHAPES --contexts $HYBRID_CONTEXTS -> hybrid.json,
#              hybrid.png (issue 20: the random 27B GatedDeltaNet hybrid vs the dense 27B shape at 1K / 8K / 32K:
#              plain tok/s vs mlx-lm, the scripted round in mlx-lm steps with MLX's ops and with the kernels,
#              memory; one part per call: it wants most of a call, T_HYBRID=540 with RUN_BUDGET=570 alone)
#   probe      benchmarks/gpu/probe_routes.py --shape $PROBE_SHAPES -> probe.json (issue 20: which route moves the
#              routed target's logits, and how much the model itself moves between bf16 and float32 activations)
#   build      benchmarks/gpu/profile_build.py -> build.json, build.prof.txt (issue 19: the routed forward's host graph
#              build, routes added one by one, per-call costs, cProfile)
#   long       benchmarks/bench_long_context.py --model $GGUF -> long.json, long.png (issue 20: SmolLM2 with the
#              shipped drafter at 1K / 4K / 8K-token prompts: plain, the default schedule, the drafter every round)
#   trace      benchmarks/gpu/trace_chain.py --trace --forward -> trace.json (issue 19: a routed matmul's per-call
#              cost split into host build, encode + GPU and GPU kernel time; MLX's custom-kernel path itself)
#   batch      benchmarks/profile_batch.py --model $GGUF --dtype bfloat16 --concurrency 8 -> batch.json
#              (issue 22: batched rounds with the drafter on and off, every step's time, rows and width)
#   server     benchmarks/gpu/server.sh -> server.json, server.log (issue 22: ours with/without the drafter vs
#              mlx_lm.server on SmolLM2 converted once; needs $PAYLOAD/srvwhl.tar, see server.sh)
#   scripted   benchmarks/bench_batch_scripted.py -> batch-scripted.json, .png (issue 22 at the random Qwen3-8B shape:
#              batched rounds with a scripted drafter of tau 3 / 5 vs plain batching, ours and mlx-lm's
#              BatchGenerator, 1-32 requests)
#   batchx     benchmarks/gpu/batch_exactness.py --model $GGUF --dtype bfloat16 --rows 8,16,32 -> batch-exactness.json
#              (issue 22: the batched drafter forward, acceptance and verify vs each request alone; departures with
#              their solo margins: near-ties or a wrong batched forward)
#   trainvocab benchmarks/bench_train_vocab.py --shape qwen2.5-1.5b --sizes 0,32768 (the GPU batch: 8 x 64 anchors x 768
#              tokens) -> train-vocab.json (issue 21: a drafter training step with the whole vocabulary vs
#              fit --draft-vocab 32768, random weights: nothing to carry)
# Env: OUT (the device tool sets it), PAYLOAD (~/payload), GGUF, PY (python3), MLX_PTX_CACHE_DIR (default ~/ptx: it stays for
# the machine's lease, so only the first MLX process compiles; restored from $PAYLOAD/ptx*.tgz when empty; SAVE_PTX=1
# writes it to $OUT/ptx.tgz), RUN_BUDGET (default 570), T_SELFTEST (300: on a fresh machine NVRTC compiles every instantiation at
# first use, ~20 s each: session 18's 150 s reached 6 of the qmm cases; ARGS_SELFTEST=--quick halves the cases),
# T_CHECK (150), T_KERNELS (180), T_SCALING (420), T_EXACTNESS (240), T_SETS (300), T_HYBRID (400), T_PROBE (300), T_TRACE (240), T_BATCH (240), T_SERVER (400), T_SCRIPTED (400), T_BATCHX (300), T_TRAINVOCAB (300), PROBE_SHAPES (hybrid-27b,dense-27b), KERNEL_SHAPES
# (qwen3-8b), KERNEL_SWEEP (--sweep: the qmm geometry sweep; empty: none), SCALING_SHAPES (qwen3-8b,dense-27b), HYBRID_SHAPES (hybrid-27b,dense-27b), HYBRID_CONTEXTS
# (1024,8192,32768), ARGS_<PART> (more arguments for that part's script).
# SMOKE=1: every part at toy size on any machine (CPU included) to check this driver.
set -u
cd "$(dirname "$0")/../.."
T0=$(date +%s)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-${TMPDIR:-/tmp}/ptx}; else export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/ptx}; fi
PAYLOAD=${PAYLOAD:-$HOME/payload}
OUT=${OUT:-${TMPDIR:-/tmp}/out}
PY=${PY:-python3}
GGUF=${GGUF:-$PAYLOAD/SmolLM2-135M-Instruct.Q4_1.gguf}
RUN_BUDGET=${RUN_BUDGET:-570}
mkdir -p "$OUT" "$MLX_PTX_CACHE_DIR" 2>/dev/null || mkdir -p "$OUT"
RUNLOG="$OUT/run.log"
say() { echo "[run.sh $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$RUNLOG"; }
smi() { command -v nvidia-smi >/dev/null && say "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem,temperature.gpu,driver_version --format=csv,noheader 2>&1 | head -1)"; }

[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu/run.sh PART...   (selftest check kernels scaling exactness sets hybrid probe trace build long batch server scripted batchx trainvocab)" >&2; exit 2; }
for p in "$@"; do
  case $p in selftest|check|kernels|scaling|exactness|sets|hybrid|probe|trace|build|long|batch|server|scripted|batchx|trainvocab) ;; *) echo "unknown part: $p" >&2; exit 2;; esac
done
$PY -c "import gguf" 2>/dev/null || $PY -m pip install -q --no-index --no-deps "$PAYLOAD"/gguf-*.whl 2>&1 | tail -2
# the shipped drafters (left out of a slimmed tree, brought as $PAYLOAD/drafter.tgz): unpacked in every call, since
# the device's copy of an ignored folder does not survive the next call's sync (session 18 lost a part to that)
if [ ! -f mlx_dflash2/drafters/smollm2-135m-instruct/config.json ] && [ -f "$PAYLOAD/drafter.tgz" ]; then
  mkdir -p mlx_dflash2/drafters && tar xzf "$PAYLOAD/drafter.tgz" -C mlx_dflash2/drafters
fi
# a PTX cache carried from an earlier machine ($PAYLOAD/ptx*.tgz, from SAVE_PTX=1 below): a fresh machine's first
# server spent 8 minutes building MLX's CUDA kernels in session 25 (the same server 2 s of gates with the cache)
if [ -z "$(ls -A "$MLX_PTX_CACHE_DIR" 2>/dev/null)" ]; then
  for f in "$PAYLOAD"/ptx*.tgz; do
    [ -f "$f" ] && tar xzf "$f" -C "$MLX_PTX_CACHE_DIR" --strip-components=1 \
      && say "PTX cache: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) files from $(basename "$f")"
  done
fi
if [ ! -f "$GGUF" ]; then  # elsewhere (a CPU smoke run): the embedded model's GGUF, if installed
  GGUF=$($PY -c "from mlx_dflash2.assets import embedded_model_path as p; print(p())" 2>/dev/null || echo "$GGUF")
fi
smi
say "$($PY -c "import mlx_dflash2, mlx.core as mx, mlx_lm; print('MLX', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device(), 'CUDNN_SDPA', __import__('os').environ.get('MLX_CUDA_USE_CUDNN_SDPA'))" 2>&1 | tail -1)"
say "parts: $*; budget ${RUN_BUDGET} s; OUT=$OUT; MLX_PTX_CACHE_DIR=$MLX_PTX_CACHE_DIR; GGUF=$GGUF"

if [ "$SMOKE" = 1 ]; then
  TINY=--tiny; KSHAPES=${KERNEL_SHAPES:-qwen2.5-0.5b}; SSHAPES=tiny; HSHAPES=hybrid-tiny,tiny; HCTX=128,512
else
  TINY=; KSHAPES=${KERNEL_SHAPES:-qwen3-8b}; SSHAPES=${SCALING_SHAPES:-qwen3-8b,dense-27b}
  HSHAPES=${HYBRID_SHAPES:-hybrid-27b,dense-27b}; HCTX=${HYBRID_CONTEXTS:-1024,8192,32768}
fi
PSHAPES=${PROBE_SHAPES:-$([ "$SMOKE" = 1 ] && echo hybrid-tiny,tiny || echo hybrid-27b,dense-27b)}

status=0
for p in "$@"; do
  P=$(echo "$p" | tr a-z A-Z)
  def=$(eval echo "\${T_$P:-}")
  case $p in selftest) def=${def:-300};; check) def=${def:-150};; kernels) def=${def:-180};;
             scaling) def=${def:-420};; exactness) def=${def:-240};; sets) def=${def:-300};; hybrid) def=${def:-400};;
             probe) def=${def:-300};; trace) def=${def:-240};; build) def=${def:-200};; long) def=${def:-300};;
             batch) def=${def:-240};; server) def=${def:-400};; scripted) def=${def:-400};; batchx) def=${def:-300};;
             trainvocab) def=${def:-300};; esac
  left=$(( RUN_BUDGET - ($(date +%s) - T0) - 5 ))
  t=$(( def < left ? def : left ))
  if [ "$t" -lt 20 ]; then say "part $p: skipped (${left} s left of RUN_BUDGET)"; status=1; continue; fi
  b=$(( t - 25 ))  # the scripts' own budget: they stop starting work before the timeout kills them
  extra=$(eval echo "\${ARGS_$P:-}")
  say "part $p: timeout ${t} s"
  ts=$(date +%s)
  case $p in
    selftest)  cmd=($PY -m mlx_dflash2.selftest) ;;
    check)     cmd=($PY -c "import mlx_dflash2, mlx.core as mx, sys, pytest; mx.set_default_device(mx.cpu); sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_kernels.py', 'tests/test_kernels_drafter.py'] + sys.argv[1:]))") ;;
    kernels)   cmd=($PY benchmarks/bench_kernels.py --shapes "$KSHAPES" ${KERNEL_SWEEP---sweep} --out "$OUT/kernels.json") ;;
    scaling)   cmd=($PY benchmarks/bench_scaling.py --shapes "$SSHAPES" $TINY --budget "$b" --out "$OUT") ;;
    exactness) cmd=($PY benchmarks/gpu/exactness.py --gguf "$GGUF" $TINY --budget "$b" --out "$OUT/exactness.json") ;;
    sets)      cmd=($PY benchmarks/gpu/smollm2_sets.py --model "$GGUF" $TINY --budget "$b" --out "$OUT/sets.json") ;;
    hybrid)    cmd=($PY benchmarks/bench_hybrid.py --shapes "$HSHAPES" --contexts "$HCTX" --budget "$b" --out "$OUT/hybrid.json") ;;
    trace)     cmd=($PY benchmarks/gpu/trace_chain.py --trace --forward $TINY --out "$OUT/trace.json") ;;
    build)     cmd=($PY benchmarks/gpu/profile_build.py $([ "$SMOKE" = 1 ] && echo --shape tiny --repeats 3) --out "$OUT/build.json") ;;
    long)      cmd=($PY benchmarks/bench_long_context.py --model "$GGUF" $([ "$SMOKE" = 1 ] && echo --lengths 256,512 --max-tokens 16 --repeats 1) --out "$OUT/long.json") ;;
    probe)     cmd=($PY benchmarks/gpu/probe_routes.py $(printf -- '--shape %s ' ${PSHAPES//,/ }) --out "$OUT/probe.json") ;;
    batch)     cmd=($PY benchmarks/profile_batch.py --model "$GGUF" $([ "$SMOKE" = 1 ] && echo --concurrency 2 --max-tokens 8 --repeats 1 || echo --dtype bfloat16 --concurrency 8 --repeats 2 --no-profile) --verbose --out "$OUT/batch.json") ;;
    scripted)  cmd=($PY benchmarks/bench_batch_scripted.py $([ "$SMOKE" = 1 ] && echo --shape tiny --concurrency 1,4 --max-tokens 16 --repeats 1 --dtype float32) --budget "$((b - 60))" --out "$OUT/batch-scripted.json") ;;
    batchx)    cmd=($PY benchmarks/gpu/batch_exactness.py --model "$GGUF" $([ "$SMOKE" = 1 ] && echo --rows 2 --max-tokens 8 --blocks 4 --lengths 3 || echo --dtype bfloat16 --rows 8,16,32) --budget "$b" --out "$OUT/batch-exactness.json") ;;
    trainvocab) cmd=($PY benchmarks/bench_train_vocab.py $([ "$SMOKE" = 1 ] && echo --shape tiny --sizes 0,300 --repeats 1 || echo --shape qwen2.5-1.5b --sizes 0,32768 --batch-size 8 --anchors 64 --max-len 768 --repeats 3) --out "$OUT/train-vocab.json") ;;
    server)    cmd=(env T_SERVER="$b" PAYLOAD="$PAYLOAD" OUT="$OUT" SMOL_GGUF="$GGUF" bash benchmarks/gpu/server.sh $([ "$SMOKE" = 1 ] && echo --concurrency 1,2 --requests 1 --pool 2 --max-tokens 4 --dtype float32 || echo --concurrency 1,2,4,8,16,32 --requests 2)) ;;
  esac
  [ "$SMOKE" = 1 ] && [ "$p" = kernels ] && cmd=("${cmd[@]}" --rows 1,16 --kv 1024 --repeats 2)
  # shellcheck disable=SC2086
  timeout -k 10 "$t" "${cmd[@]}" $extra 2>&1 | tee "$OUT/$p.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && say "part $p: TIMED OUT after ${t} s (results written so far are in $OUT)"
  say "part $p: exit $rc, $(( $(date +%s) - ts )) s"
  [ "$rc" = 0 ] || status=1
  smi
done

if [ "${SAVE_PTX:-0}" = 1 ]; then  # the PTX cache for the next machine (carry it as an EXTRA_FILE named ptx*.tgz)
  tar czf "$OUT/ptx.tgz" -C "$(dirname "$MLX_PTX_CACHE_DIR")" "$(basename "$MLX_PTX_CACHE_DIR")" \
    && say "PTX cache saved: $OUT/ptx.tgz, $(du -k "$OUT/ptx.tgz" | cut -f1) KiB"
fi
n=$(find "$OUT" -maxdepth 1 -type f ! -name results.tar.gz | wc -l)
if [ "$n" -gt 8 ]; then
  say "$n files in $OUT (the device tool returns 8): packing them into results.tar.gz (run.log stays beside it)"
  list=$(mktemp)
  (cd "$OUT" && find . -maxdepth 1 -type f ! -name results.tar.gz ! -name run.log -printf '%P\n' > "$list" \
     && tar -czf results.tar.gz -T "$list" && xargs rm -f < "$list")
  rm -f "$list"
fi
say "done: exit $status, $(( $(date +%s) - T0 )) s"
exit $status
