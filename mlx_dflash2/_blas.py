"""Use an optimized OpenBLAS for MLX's CPU backend on Linux, whatever way the package is started.

MLX's Linux CPU wheel bundles the slow reference BLAS: a 1024x1024 float32 matmul takes ~550 ms
there against ~25 ms with OpenBLAS on a 2-core host, and prefill, verify and training are matmuls.
Loading ``libopenblas`` with ``RTLD_GLOBAL`` *before* MLX's own library is loaded makes the dynamic
linker resolve MLX's ``cblas_*`` symbols to it (the global scope is searched before a library's own
dependencies). This module does that when the package is imported, so the console scripts, ``python
-m mlx_dflash2...`` and ``import mlx_dflash2`` all get the fast path; an ``LD_PRELOAD`` of it works too.

Where it looks, first hit wins:

1. ``MLX_DFLASH2_OPENBLAS``: a path to ``libopenblas.so*``; ``0`` / ``off`` / ``none`` turns this off;
2. ``<sys.prefix>/openblas``: the copy ``scripts/setup.sh`` (``make setup``) unpacks into the venv;
3. the system's OpenBLAS (Debian/Ubuntu ``libopenblas0-pthread``, Fedora ``openblas``).

If MLX was imported before this package, it is too late: one log line says so (import
``mlx_dflash2`` first, or start Python with ``LD_PRELOAD``). Nothing happens on macOS (MLX uses
Accelerate there) or when no OpenBLAS is found (MLX then runs, slower).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys

__all__ = ["preload", "status", "subprocess_env"]

ENV = "MLX_DFLASH2_OPENBLAS"
_SYSTEM = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_state: dict = {"path": None, "why": "not tried"}


def _candidates() -> list[str]:
    env = os.environ.get(ENV, "").strip()
    if env:
        return [] if env.lower() in ("0", "off", "none", "false") else [env]
    tree = os.path.join(sys.prefix, "openblas")
    found = sorted(glob.glob(os.path.join(tree, "usr", "lib", "*", "openblas-pthread", "libopenblas.so.0")))
    return found + [p for p in _SYSTEM if os.path.exists(p)]


def _already_mapped() -> str | None:
    """Path of an OpenBLAS already in this process (e.g. through ``LD_PRELOAD``), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libopenblas" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def preload() -> str | None:
    """Load an optimized OpenBLAS globally before MLX (see the module docstring). Idempotent.

    Returns:
        The loaded library's path, or ``None`` (not Linux, turned off, none found, or MLX already
        loaded); :func:`status` says why.
    """
    if _state["why"] != "not tried":
        return _state["path"]
    if not sys.platform.startswith("linux"):
        _state["why"] = "not Linux (MLX uses the platform's BLAS)"
        return None
    mapped = _already_mapped()
    if mapped:
        _state.update(path=mapped, why="already loaded (LD_PRELOAD or an earlier import)")
        return mapped
    cands = _candidates()
    if not cands:
        _state["why"] = f"turned off by {ENV}" if os.environ.get(ENV) else "no OpenBLAS found"
        return None
    if "mlx.core" in sys.modules:
        _state["why"] = "MLX was imported before mlx_dflash2"
        logging.getLogger("mlx_dflash2").warning(
            "MLX was imported before mlx_dflash2, so its CPU backend keeps its slow reference BLAS; "
            "import mlx_dflash2 first (or start Python with %s) for the optimized OpenBLAS",
            " ".join(f"{k}={v}" for k, v in subprocess_env(cands[0]).items()))
        return None
    errors = []
    for lib in cands:
        # a venv copy carries its own libgfortran beside it (…/usr/lib/<arch>/libgfortran.so.5): load it first
        for dep in sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(lib)), "libgfortran.so.*"))):
            try:
                ctypes.CDLL(dep, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                pass
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            errors.append(f"{lib}: {e}")
            continue
        _state.update(path=lib, why="loaded")
        return lib
    _state["why"] = "could not load " + "; ".join(errors)
    return None


def status() -> dict:
    """``{"path": loaded OpenBLAS or None, "why": a short reason}`` after :func:`preload`."""
    return dict(_state)


def subprocess_env(lib: str | None = None) -> dict:
    """Environment variables that give another Python process (e.g. ``mlx_lm.server``, started by a
    benchmark as the baseline) this OpenBLAS from its start: ``LD_PRELOAD`` of ``lib`` (default: the
    one :func:`preload` loaded) and, for a venv copy, ``LD_LIBRARY_PATH`` with its ``libgfortran``'s
    folder prepended. Empty when there is none (not Linux, none found)."""
    lib = lib or preload()
    if not lib:
        return {}
    env = {"LD_PRELOAD": lib}
    deps = os.path.dirname(os.path.dirname(lib))
    if glob.glob(os.path.join(deps, "libgfortran.so.*")):
        old = os.environ.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = deps + (os.pathsep + old if old else "")
    return env
