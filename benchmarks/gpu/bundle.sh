#!/usr/bin/env bash
# Bundles for a device lease that carries large files (issue 21: the 1.1 GB Qwen2.5-Coder-1.5B GGUF, a bf16 drafter):
# MLX's CUDA wheels (the versions of ../shared/gpu/prepare) and FILES as ONE tar stream cut in parts of PART bytes
# (default 63,000,000: a part plus a slim checkout stays under the 64 MiB a call carries), one part per bundle
# .gpu/bN, so no call carries a half-empty bundle (../shared/gpu/prepare splits file by file: 27 calls where this
# makes 23 for session 32's 1.43 GB).
#
#   bash benchmarks/gpu/bundle.sh FILE...       (from the checkout's root; `bash benchmarks/gpu/slim.sh on` first)
#
# Then one device call per bundle, back to back (the machine is given back ~30 s after a call):
#   carry [".gpu/bN"]                                     command: bash .gpu/bN/stash.sh        (N = 0 .. last-1)
#   carry [".gpu/bLAST", ".gpu/stash.sh", ".gpu/install.sh"]  command: bash .gpu/install.sh && ...
# install.sh reassembles the stream into $PAYLOAD (default ~/payload: FILES under their base names), installs
# the wheels there (mlx, mlx-cuda-13, mlx-lm and any other *.whl among FILES) and checks that MLX sees the GPU; a
# FILE named ptx-*.tgz (a saved MLX_PTX_CACHE_DIR, e.g. .cache/ptx-h200-mlx0.32.4-s31.tgz) is unpacked into
# $HOME, whose ptx/ folder then serves as MLX_PTX_CACHE_DIR (the first kernel builds of a fresh machine: minutes).
# NO_WHEELS=1 leaves MLX's wheels out (a machine that already has them).
set -euo pipefail
MLX_VERSION="${MLX_VERSION:-0.32.4}"
MLX_LM_VERSION="${MLX_LM_VERSION:-0.32.2}"
PART=${PART:-63000000}
[ $# -gt 0 ] || [ "${NO_WHEELS:-0}" = 0 ] || { echo "usage: bash benchmarks/gpu/bundle.sh FILE..." >&2; exit 2; }
files=(); for f in "$@"; do [ -f "$f" ] || { echo "bundle: no such file: $f" >&2; exit 2; }; files+=("$(realpath "$f")"); done
names=$(for f in "$@"; do basename "$f"; done | sort | uniq -d)
[ -z "$names" ] || { echo "bundle: two FILES share a base name: $names" >&2; exit 2; }
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/src
if [ "${NO_WHEELS:-0}" != 1 ]; then
  plat="--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    -d .gpu/src "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION"
fi
for f in ${files[@]+"${files[@]}"}; do ln -s "$f" ".gpu/src/$(basename "$f")"; done  # paths as given, from where it ran
tar -chf - -C .gpu/src . | split -b "$PART" -d -a 3 - .gpu/p
n=0
for p in $(ls .gpu | grep -E '^p[0-9]{3}$' | sort); do mkdir -p ".gpu/b$n" && mv ".gpu/$p" ".gpu/b$n/"; n=$((n+1)); done
last=$((n-1))
cat > .gpu/stash.sh <<'EOS'
#!/usr/bin/env bash
# one bundle's part of the tar stream into $STASH (the machine keeps it between calls while warm)
set -e
STASH=${STASH:-$HOME/gpu-stash}
mkdir -p "$STASH" && cp .gpu/b*/p[0-9][0-9][0-9] "$STASH/" && echo "stashed: $(ls "$STASH" | wc -l) parts"
EOS
for b in .gpu/b*/; do cp .gpu/stash.sh "$b"; done  # each bundle carries it: calls 1..N-1 carry only .gpu/bN
cat > .gpu/install.sh <<EOS
#!/usr/bin/env bash
# the last bundle: the stream's $n parts reassembled into \$PAYLOAD, wheels installed, MLX checked on the GPU
set -e
STASH=\${STASH:-\$HOME/gpu-stash}; PAYLOAD=\${PAYLOAD:-\$HOME/payload}
bash .gpu/stash.sh
have=\$(ls "\$STASH" | wc -l)
[ "\$have" = $n ] || { echo "install: \$have of $n parts stashed (a call was missed, or the machine was given back)" >&2; exit 1; }
mkdir -p "\$PAYLOAD"
cat \$(ls "\$STASH"/p[0-9][0-9][0-9] | sort) | tar -xf - -C "\$PAYLOAD" || { echo "install: the tar stream is broken (a stale or missing part)" >&2; exit 1; }
rm -rf "\$STASH"
cd "\$PAYLOAD"
ls ./*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile ./*.whl
python3 -c "import mlx.core as mx; assert mx.cuda.is_available(); print('MLX', mx.__version__, 'on', mx.default_device())"
for t in ptx-*.tgz; do [ -e "\$t" ] && tar -xzf "\$t" -C "\$HOME" && echo "PTX cache: \$HOME/ptx (\$(ls "\$HOME/ptx" | wc -l) files)"; done
ls -la "\$PAYLOAD"
EOS
chmod +x .gpu/*.sh
echo "bundles: $n ($(du -cb .gpu/b*/p* | tail -1 | cut -f1) bytes in parts of $PART), under .gpu/; calls, back to back:"
[ $last -gt 0 ] && echo "  calls 1-$last: carry [\".gpu/bN\"] (N = 0 .. $((last-1)))  command: bash .gpu/bN/stash.sh"
echo "  call $n: carry [\".gpu/b$last\", \".gpu/stash.sh\", \".gpu/install.sh\"]  command: bash .gpu/install.sh && ..."
