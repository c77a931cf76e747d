#!/usr/bin/env bash
# Slim the checkout that the device tool sends with every call (at most 64 MiB per call, bundles included):
#   bash benchmarks/gpu/slim.sh on    a throw-away branch `gpu-slim` without benchmarks/results and the shipped
#                                     drafters in the index (both also in .git/info/exclude, so they are not sent);
#                                     the drafters packed as $TMPDIR/drafter.tgz, an EXTRA_FILE for
#                                     ../shared/gpu/prepare (which empties .gpu/); unpack on the device with
#                                     mkdir -p mlx_dflash2/drafters && tar xzf ~/payload/drafter.tgz -C mlx_dflash2/drafters
#   bash benchmarks/gpu/slim.sh off   back to the branch you were on; the branch and the exclude lines removed
# The files stay on disk throughout (only the index changes). Commit your work before `on`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
EX=.git/info/exclude
PATHS=(benchmarks/results mlx_dflash2/drafters)
case ${1:-} in
  on)
    [ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "commit or stash your changes first" >&2; exit 1; }
    git rev-parse --abbrev-ref HEAD > .git/slim-from
    git checkout -q -b gpu-slim
    git rm -r -q --cached "${PATHS[@]}"
    for p in "${PATHS[@]}"; do grep -qx "/$p/" "$EX" 2>/dev/null || echo "/$p/" >> "$EX"; done
    git commit -q -m "slim tree for device calls (throw-away)"
    tgz=${TMPDIR:-/tmp}/drafter.tgz
    tar czf "$tgz" -C mlx_dflash2/drafters .
    echo "slim: $(git ls-files -co --exclude-standard | xargs du -cb 2>/dev/null | tail -1 | cut -f1) bytes sent per call besides the bundle"
    echo "next: ../shared/gpu/prepare $tgz <the SmolLM2 GGUF> <the gguf wheel>   (benchmarks/README.md)"
    ;;
  off)
    from=$(cat .git/slim-from 2>/dev/null || echo main)
    git checkout -q "$from"
    git branch -D -q gpu-slim 2>/dev/null || true
    for p in "${PATHS[@]}"; do sed -i "\#^/$p/\$#d" "$EX"; done
    rm -f .git/slim-from
    git status --short | head -5
    echo "back on $from"
    ;;
  *) echo "usage: bash benchmarks/gpu/slim.sh on|off" >&2; exit 2 ;;
esac
