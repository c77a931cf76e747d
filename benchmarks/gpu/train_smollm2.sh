#!/usr/bin/env bash
# The recipe of the SmolLM2-135M-Instruct drafters (session 10's d6 ships in the package; benchmarks/README.md),
# run on the lent H200 (MLX CUDA backend).
# Stages (one device call each, back to back; the machine keeps $WORK while warm):
#   setup | data TARBALL... | selfinstruct N | regen SECONDS | train ARCH OUTNAME (SECONDS | steps:N) | eval RUN... | bench RUN|DIR |
#   quantize NAME | bg NAME STAGE ARGS... [--then STAGE ARGS...] (detached chain; outlives the call) |
#   wait SECONDS NAME... (an ended chain's outputs and COLLECT's paths come back with the call) | pack NAME PATH...
# Env: SKIP (regen: prompts answered by earlier runs), TEMPS (regen temperatures), PROMPTS (regen prompt
# file), REGEN_INTO (where regen's shards are added; default $WORK/responses), INIT (train: drafter to
# continue from; INIT=shipped: the packaged one, also when MODEL is a copy of the embedded GGUF), DATA (train: responses dir; default $WORK/responses), TRAIN_ARGS (more `fit` flags, e.g.
# "--labels target --kd-weight 1"), LAYERS / INTER / SEQ (train: drafter layers, its MLP width (default: the
# target's), sequences per step; defaults 4 / target's / 32: a drafter for a wider target, e.g. Qwen2.5-Coder-1.5B,
# takes INTER=3072 to stay within ~60 MB at 4 bits), REGEN_BS (selfinstruct/regen batch size; also regen's shard size), SI_ARGS (more self-instruct flags, e.g. "--kinds coding=3,completion=3,math=2 --max-tokens 256"), EVAL_BLOCKS (eval block sizes), EVAL_RTD (eval target flags; default RTD), BENCH_ARGS (more bench_generate.py flags, e.g. --adaptive), RTD (regen target flags; default the deployed Q4_1 weights).
# SMOKE=1 runs every stage at toy size on any machine (CPU included) to check the pipeline.
set -euo pipefail
# Env: WORK (work dir, default .cache/gpu-work in the checkout: keep it outside the checkout on the device
# machine, whose checkout is replaced each call), MODEL (target; default the embedded SmolLM2, which on the
# device machine is the GGUF that ../shared/gpu/prepare unpacked), PY (python), OUT (results).
cd "$(dirname "$0")/../.."
W=${WORK:-$PWD/.cache/gpu-work}
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
export PYTHONPATH="$PWD:$W/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # setup installs wheels to $W/site
PY=${PY:-python3}
MODEL=${MODEL:-$($PY -c "from mlx_dflash2.assets import embedded_model_path as p; print(p())" 2>/dev/null || true)}
case "${1:-}" in wait|pack) ;; *) [ -n "$MODEL" ] || { echo "MODEL is not set and the embedded SmolLM2 is not installed" >&2; exit 2; };; esac
SMOKE=${SMOKE:-0}
# TD: target settings for training (features); RTD: for generating responses (the deployed Q4_1 weights).
if [ "$SMOKE" = 1 ]; then N=24; MAXT=32; SIMAXT=16; BS=16; SEQ=4; ANCH=8; LAYERS=1; RANK=8; LIMIT=4; BLOCKS=4,8; MAXLEN=128
  TD="--dtype float32 --dequantize"; RTD="$TD"
else N=100000; MAXT=256; SIMAXT=128; BS=512; SEQ=${SEQ:-32}; ANCH=64; LAYERS=${LAYERS:-4}; RANK=32; LIMIT=-1; BLOCKS=4,8,16; MAXLEN=768
  TD="--dtype bfloat16 --dequantize"; RTD=${RTD:-}; fi
stage=$1; shift
case "$stage" in
setup)
  [ -d .whl ] && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" .whl/*.whl
  $PY -c "import mlx.core as mx, gguf, mlx_dflash2; print('MLX', mx.__version__, mx.default_device())"
  ;;
data)
  # responses of earlier runs (tarballs of a responses/ dir, possibly split in parts): each run's shards
  # go to $W/responses under a distinct name prefix, so the trainer reads them all
  mkdir -p "$W/responses"; i=0
  for tb in "$@"; do
    i=$((i+1)); tmp=$(mktemp -d); cat $tb* | tar -xz -C "$tmp"
    for f in "$tmp"/responses/shard-*.jsonl; do mv "$f" "$W/responses/shard-r$i-$(basename "$f" | cut -d- -f2)"; done
  done
  ls "$W/responses" | wc -l
  # the self-instruct requests these responses answer, as a prompt file: selfinstruct's --exclude reads it
  $PY - "$MODEL" "$W/responses" "$W/prompts-self-data.jsonl" <<'PYEOF'
import sys, json, glob
rows = [r for f in sorted(glob.glob(sys.argv[2] + "/shard-*.jsonl")) for r in map(json.loads, open(f))
        if str(r.get("source", "")).startswith("self-instruct")]
if rows:  # the target only for its tokenizer, and only when there is something to decode (its load and first
    # kernel builds took 187 s of an H100 lease for Qwen2.5-Coder-1.5B data without self-instruct rows, session 30)
    from mlx_dflash2.loading import load_target
    _, tok, _ = load_target(sys.argv[1])
with open(sys.argv[3], "w") as fo:
    for r in rows:
        text = tok.decode(r["prompt_ids"])  # ChatML: the last user turn of the prompt
        user = text.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
        fo.write(json.dumps({"id": r["id"], "source": r["source"], "prompt": user}) + "\n")
print(len(rows), "self-instruct requests in the data ->", sys.argv[3])
PYEOF
  ;;
selfinstruct)
  # selfinstruct N: the target writes N user requests (Magpie; mlx_dflash2.train self-instruct) into
  # $W/prompts-self.jsonl (a copy goes to $OUT); answer them with PROMPTS=$W/prompts-self.jsonl TEMPS=0
  # REGEN_TAG=self regen SECONDS. SEED=K (K > 0): other requests, in $W/prompts-self-sK.jsonl, deduplicated
  # against the earlier prompts-self*.jsonl there (the data stage writes prompts-self-data.jsonl: the requests
  # of the unpacked responses)
  sf="$W/prompts-self.jsonl"; [ "${SEED:-0}" = 0 ] || sf="$W/prompts-self-s$SEED.jsonl"  # (a failing $(...) in an assignment ends a set -e script)
  ex=(); for f in "$W"/prompts-self*.jsonl; do if [ -e "$f" ] && [ "$f" != "$sf" ]; then ex+=(--exclude "$f"); fi; done
  $PY -m mlx_dflash2.train self-instruct --model "$MODEL" $RTD --n "$1" --out "$sf" \
      --batch-size ${REGEN_BS:-$BS} --max-tokens $SIMAXT --seed ${SEED:-0} "${ex[@]}" ${SI_ARGS:-}
  cp "$sf" "$OUT/"
  ;;
regen)
  budget=${1:-240}
  # one folder per slice (REGEN_TAG names it; default s$SKIP): regen resumes a folder only with the same prompts and settings
  rg="regen-${REGEN_TAG:-s${SKIP:-0}}"
  case "$rg" in */*) echo "REGEN_TAG must not hold a '/'" >&2; exit 2;; esac
  $PY -m mlx_dflash2.train regen --model "$MODEL" $RTD --prompts ${PROMPTS:-.cache/train/prompts.jsonl} --skip ${SKIP:-0} \
      --limit $N --out "$W/$rg" --max-tokens $MAXT --batch-size ${REGEN_BS:-$BS} --shard-size ${REGEN_BS:-512} --temps ${TEMPS:-0,0.7,1.0} \
      --time-budget "$budget"
  into=${REGEN_INTO:-$W/responses}; mkdir -p "$into"
  for f in "$W/$rg"/shard-*.jsonl; do cp "$f" "$into/shard-${REGEN_TAG:-s${SKIP:-0}}-$(basename "$f" | cut -d- -f2)"; done
  $PY - "$into" <<'PYEOF'
import sys, json, glob
rows = [json.loads(l) for f in sorted(glob.glob(sys.argv[1] + "/shard-*.jsonl")) for l in open(f)]
print(json.dumps({"sequences": len(rows), "response_tokens": sum(len(r["response_ids"]) for r in rows),
                  "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows)}))
PYEOF
  # $OUT files are limited to 16 MB each: the tarball comes back in parts (cat responses.tar.gz.part* | tar -xz)
  tar -czf - -C "$W" --transform "s,^$rg,responses," "$rg" | split -b 15000000 -d -a 1 - "$OUT/responses.tar.gz.part"
  ;;
train)
  arch=$1; name=$2; spec=$3
  if [[ "$spec" == steps:* ]]; then lim="--steps ${spec#steps:}"; else lim="--time-budget $spec"; fi
  $PY -m mlx_dflash2.train fit --model "$MODEL" $TD --data "${DATA:-$W/responses}" --out "$W/runs/$name" \
      --architecture "$arch" --num-layers $LAYERS ${INTER:+--intermediate-size $INTER} --num-taps 5 --block-size 16 --selector-rank $RANK \
      --anchors $ANCH --batch-size $SEQ --max-len $MAXLEN --lr 1e-3 --log-every 20 --save-every ${SAVE_EVERY:-100000} $lim \
      ${INIT:+--init "$INIT"} ${TRAIN_ARGS:-}
  X=${EXPORT:-$OUT}; mkdir -p "$X"  # EXPORT: where the bf16 drafter and the log go (default $OUT)
  $PY - "$W/runs/$name" "$X/$name" "$MODEL" <<'PYEOF'
import sys, shutil, mlx_dflash2, mlx.core as mx  # mlx_dflash2 first: the optimized CPU BLAS
from mlx_dflash2.loading import load_target
from mlx_dflash2.drafter import load_drafter, save_drafter
t, tok, _ = load_target(sys.argv[3])
d = load_drafter(sys.argv[1] + "/drafter", t, tok, dtype=mx.bfloat16)
save_drafter(d, sys.argv[2], overwrite=True, max_shard_mb=15)
vocab = sys.argv[1] + "/drafter/draft_vocab.json"  # a run trained on a draft vocabulary (fit --draft-vocab)
try:
    shutil.copyfile(vocab, sys.argv[2] + "/draft_vocab.json")
except FileNotFoundError:
    pass
PYEOF
  cp "$W/runs/$name/log.jsonl" "$X/$name-log.jsonl"; sed "s#$W#\$WORK#g" "$W/runs/$name/config.json" > "$X/$name-train-config.json"  # no machine paths
  ;;
eval)
  # EVAL_LIMIT / EVAL_MAXT override the prompt count per set and the response length; EVAL_LOOKUP=0
  # skips the second pass (first drafter fused with lookup; LOOKUP_BLOCKS: its block sizes)
  lim=${EVAL_LIMIT:-$LIMIT}; mt=${EVAL_MAXT:-$MAXT}
  args=()
  for d in "$@"; do args+=(--drafter "$d=$W/runs/$d/drafter"); done
  ert=${EVAL_RTD-$RTD}  # EVAL_RTD: eval's target flags when they differ from regen's (EVAL_RTD= : the deployed Q4_1)
  $PY -m mlx_dflash2.train eval --model "$MODEL" $ert "${args[@]}" --block-sizes ${EVAL_BLOCKS:-$BLOCKS} --max-tokens $mt \
      --limit $lim --cache-dir "$W/evalcache" --out "$OUT/tau.json"
  if [ "${EVAL_LOOKUP:-1}" = 1 ]; then
    $PY -m mlx_dflash2.train eval --model "$MODEL" $ert --drafter "$1=$W/runs/$1/drafter" --lookup --block-sizes ${LOOKUP_BLOCKS:-${EVAL_BLOCKS:-$BLOCKS}} \
        --max-tokens $mt --limit $lim --cache-dir "$W/evalcache" --out "$OUT/tau-lookup.json"
  fi
  ;;
bench)
  # bench RUN|DIR: speed of run RUN's drafter (or of the drafter directory DIR, e.g. the shipped
  # mlx_dflash2/drafters/smollm2-135m-instruct) against plain decoding and lookup; rows are saved as they finish
  d=$1; [ -d "$d" ] || d="$W/runs/$1/drafter"
  $PY benchmarks/bench_generate.py --model "$MODEL" --drafter "$d" --drafter lookup \
      --max-tokens 128 --repeats 3 --out "$OUT/generate-gpu.json" ${BENCH_ARGS:-}
  ;;
quantize)
  # quantize NAME [TAG [CONVERT FLAGS...]]: the drafter of run NAME with quantized linear layers as run NAME-TAG;
  # default TAG q4 and 4-bit g64 (what the package ships); e.g. `quantize c3 q4g32 --q-group-size 32` or
  # `quantize c3 q4fc8 --q-override 'fc$=8' --q-override 'hidden_projection=8'` (the converter's flags)
  n=$1; tag=${2:-q4}; shift; [ $# -gt 0 ] && shift
  rm -rf "$W/runs/$n-$tag/drafter"; mkdir -p "$W/runs/$n-$tag"
  # (python -m convert: mlx_dflash2.convert exists only in an installed package, and this checkout is not)
  $PY -m convert "$W/runs/$n/drafter" "$W/runs/$n-$tag/drafter" --from drafter --q-bits 4 --report-error "$@"
  ;;
bg)
  # bg NAME STAGE ARGS... [--then STAGE ARGS...]...: run stages one after the other, detached from this
  # device call, from a snapshot of the checkout in $W/src (each call replaces the checkout), logging to
  # $W/bg-NAME.log; it outlives the call while the machine stays warm, and stops at the first stage that
  # fails. A chain (e.g. train --then quantize --then eval --then bench) keeps the GPU busy without a
  # device call per stage. A train stage that fails within 120 s while TRAIN_ARGS has --compile is
  # retried once without it. One MLX process on the GPU at a time: two side by side both crashed
  # ("illegal memory access", session 5) or ran out of memory (session 4), so bg refuses to start
  # while another bg stage is alive.
  name=$1; shift
  for f in "$W"/bg-*.pid; do
    [ -e "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && { n=$(basename "$f" .pid); echo "bg: ${n#bg-} is still running" >&2; exit 2; }
  done
  segs=(); cur=""
  for a in "$@"; do
    if [ "$a" = "--then" ]; then segs+=("$cur"); cur=""; else cur+="${cur:+ }$(printf '%q' "$a")"; fi
  done
  segs+=("$cur")
  for sg in "${segs[@]}"; do
    [ -n "$sg" ] || { echo "bg: an empty stage in the chain" >&2; exit 2; }
    case "${sg%% *}" in setup|data|selfinstruct|regen|train|eval|bench|quantize) ;; *) echo "bg: unknown stage '${sg%% *}'" >&2; exit 2;; esac
  done
  rm -rf "$W/src" && mkdir -p "$W/src"
  tar -cf - --exclude=./.gpu --exclude=./.cache --exclude=./.venv . | tar -xf - -C "$W/src"
  rm -f "$W/bg-$name.rc"
  {
    echo "run() {"
    echo "  t0=\$(date +%s)"
    echo "  bash \"$W/src/benchmarks/gpu/train_smollm2.sh\" \"\$@\" && return 0"
    echo "  if [ \"\$1\" = train ] && [[ \" \${TRAIN_ARGS:-} \" == *\" --compile \"* ]] && [ \$((\$(date +%s) - t0)) -lt 120 ]; then"
    echo "    echo 'retrying without the compiled step'"
    echo "    TRAIN_ARGS=\"\${TRAIN_ARGS//--compile/}\" bash \"$W/src/benchmarks/gpu/train_smollm2.sh\" \"\$@\" && return 0"
    echo "  fi"
    echo "  return 1"
    echo "}"
    for sg in "${segs[@]}"; do
      printf 'echo %q; date -u +%%T\n' "== stage: $sg"
      printf 'run %s || { rc=$?; echo %q; echo "$rc" > %q; exit "$rc"; }\n' "$sg" \
        "== stage failed: $sg (the chain stopped here)" "$W/bg-$name.rc"
    done
    printf 'echo 0 > %q\n' "$W/bg-$name.rc"
  } > "$W/bg-$name.sh"
  export OUT="$W/out-$name" EXPORT="${EXPORT:-$W/export}"; mkdir -p "$OUT" "$EXPORT"  # the call's $OUT is emptied
  case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")";; esac  # the snapshot has no .venv
  export PY MODEL
  setsid nohup bash "$W/bg-$name.sh" > "$W/bg-$name.log" 2>&1 < /dev/null &
  echo $! > "$W/bg-$name.pid"; echo "started $name (pid $(cat "$W/bg-$name.pid")): ${#segs[@]} stage(s)"
  ;;
wait)
  # wait SECONDS NAME...: until the named background stages have ended or SECONDS have passed; log tails
  # (exit status 1 when a named chain failed or does not exist; 0 while running or when all stages are done)
  limit=$1; shift; t0=$(date +%s); ok=0
  while :; do
    alive=0; for n in "$@"; do [ -e "$W/bg-$n.pid" ] && kill -0 "$(cat "$W/bg-$n.pid")" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    [ $(( $(date +%s) - t0 )) -ge "$limit" ] && break
    sleep 5
  done
  for n in "$@"; do
    if [ ! -e "$W/bg-$n.pid" ]; then echo "== $n (no such background chain)"; ok=1; continue; fi
    if kill -0 "$(cat "$W/bg-$n.pid")" 2>/dev/null; then st=running
    elif [ "$(cat "$W/bg-$n.rc" 2>/dev/null)" = 0 ]; then st="ended: all stages done"
    else st="ended: FAILED (rc $(cat "$W/bg-$n.rc" 2>/dev/null || echo unknown))"; ok=1; fi
    echo "== $n ($st)"; tail -c 1500 "$W/bg-$n.log" | tr '\r' '\n' | tail -n 6
    # what an ended chain made comes back with this call: its $OUT files, its log, and COLLECT's paths
    # (relative to $W, e.g. "runs/c1-q4/drafter export/c1-log.jsonl"; in 15 MB parts, as `pack`). The machine
    # is given back ~30 s after a call: anything left on it after the last call is lost (session 13 lost a
    # trained drafter that way)
    if [ "$st" != running ]; then
      cp -r "$W/out-$n/." "$OUT/" 2>/dev/null || true; cp "$W/bg-$n.log" "$OUT/" 2>/dev/null || true
      if [ -n "${COLLECT:-}" ]; then
        # shellcheck disable=SC2086
        (cd "$W" && ls -d $COLLECT >/dev/null 2>&1) && tar -cf - -C "$W" $COLLECT | split -b 15000000 -d -a 1 - "$OUT/$n-collect.tar.part"
      fi
    fi
  done
  exit $ok
  ;;
pack)
  # pack NAME PATH...: PATHs (relative to $W) as a tarball in parts of 15 MB under $OUT/NAME.tar.part*
  # (files coming back from the device machine are limited to 16 MB each); unpack: cat NAME.tar.part* | tar -x
  name=$1; shift
  tar -cf - -C "$W" "$@" | split -b 15000000 -d -a 1 - "$OUT/$name.tar.part"; ls -la "$OUT"
  ;;
*) echo "unknown stage $stage" >&2; exit 2;;
esac
