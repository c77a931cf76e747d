"""Compile-only checks of the kernel sources, without a GPU.

* **CUDA twins**: the exact source ``mx.fast.cuda_kernel`` would hand to NVRTC (our header, the
  generated signature, the template constants, the body; MLX's own device header replaced by the
  standard CUDA headers it includes), compiled for ``sm_90`` with NVRTC from the ``nvidia-cuda-nvrtc``
  and ``nvidia-cuda-runtime`` wheels (a test extra on Linux). A real compiler: syntax, types,
  templates and inline PTX constraints are checked.
* **Metal sources**: the kernel's header and body as one C++17 function against
  ``metal/shim/metal_shim.h``, compiled with ``-fsyntax-only`` by the host C++ compiler: a syntax and
  type check only (no Metal compiler exists off macOS; ``mlx_dflash2.selftest`` runs the real one).

``python -m mlx_dflash2.kernels.check`` prints one line per op, backend and instantiation.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .registry import KernelSpec, _source_dir, cuda_header, source_text

__all__ = ["cuda_source", "metal_source", "compile_cuda", "compile_metal", "nvrtc_available", "cxx_available",
           "check_all"]

_CUDA_TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float", "uint32": "uint32_t",
               "int32": "int32_t"}
_METAL_TYPES = {"bfloat16": "bfloat16_t", "float16": "half", "float32": "float", "uint32": "uint", "int32": "int"}
_METAL_ATTRS = {"thread_position_in_grid": "uint3", "threadgroup_position_in_grid": "uint3",
                "thread_position_in_threadgroup": "uint3", "simdgroup_index_in_threadgroup": "uint",
                "thread_index_in_simdgroup": "uint"}


def _tval(v) -> str:
    return "true" if v is True else "false" if v is False else str(v)


def cuda_source(spec: KernelSpec, example: dict) -> str:
    """The CUDA text ``mx.fast.cuda_kernel`` builds for ``spec`` with template args ``example`` (MLX's
    device header and ``cooperative_groups``, which our kernels do not use, left out; our header as
    :func:`~.registry.cuda_header` gives it: an ``#include`` of the written file where it can be)."""
    types = {k: _CUDA_TYPES[v] for k, v in example.items() if isinstance(v, str)}

    def ty(t):
        return types.get(t) or _CUDA_TYPES[t]

    sig = []
    for n, t in spec.inputs:  # as MLX: a pointer, then shape / strides / ndim where the body names them
        sig.append(f"    const {ty(t)}* {n}")
        if f"{n}_shape" in spec.body:
            sig.append(f"    const __grid_constant__ Shape {n}_shape")
        if f"{n}_strides" in spec.body:
            sig.append(f"    const __grid_constant__ Strides {n}_strides")
        if f"{n}_ndim" in spec.body:
            sig.append(f"    const __grid_constant__ int {n}_ndim")
    sig += [f"    {ty(t)}* {n}" for n, t in spec.outputs]
    consts = [f"  using {k} = {types[k]};" if isinstance(v, str) else f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {_tval(v)};"
              for k, v in example.items()]
    return ("typedef unsigned int uint32_t;\ntypedef int int32_t;\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
            + _CUDA_STUB + cuda_header(spec.header) +
            "namespace mlx::core::cu {\n__global__ void custom_kernel_" + spec.name + "(\n" +
            ",\n".join(sig) + ") {\n" + "\n".join(consts) + "\n" + spec.body + "\n}\n}\n")


# what MLX's device header (mlx/backend/cuda/device/utils.cuh) gives a kernel signature: Shape and Strides
# (there cuda::std::arrays of MAX_NDIM entries); read-only here, indexed like arrays
_CUDA_STUB = """namespace mlx { namespace core { namespace cu {
struct Shape { int v[10]; __device__ const int& operator[](int i) const { return v[i]; } };
struct Strides { long long v[10]; __device__ const long long& operator[](int i) const { return v[i]; } };
} } }
"""


def metal_source(spec: KernelSpec, example: dict) -> str:
    """C++ text standing for the Metal kernel (shim types) for a syntax/type check."""
    types = {k: _METAL_TYPES[v] for k, v in example.items() if isinstance(v, str)}

    def ty(t):
        return types.get(t) or _METAL_TYPES[t]

    header = "\n".join(line for line in source_text(spec.header).splitlines()
                       if not line.strip().startswith("#include <metal"))
    params = []
    for n, t in spec.inputs:  # as MLX's metal_kernel: shape / strides / ndim where the body names them
        params.append(f"const device {ty(t)}* {n}")
        if f"{n}_shape" in spec.body:
            params.append(f"const constant int* {n}_shape")
        if f"{n}_strides" in spec.body:
            params.append(f"const constant int64_t* {n}_strides")
        if f"{n}_ndim" in spec.body:
            params.append(f"const constant int& {n}_ndim")
    params += [f"device {ty(t)}* {n}" for n, t in spec.outputs]
    params += [f"{t} {a}" for a, t in _METAL_ATTRS.items() if a in spec.body]
    consts = [f"  using {k} = {types[k]};" if isinstance(v, str) else f"  constexpr int {k} = {_tval(v)};"
              for k, v in example.items()]
    return (f'#include "{_source_dir() / "shim" / "metal_shim.h"}"\n' + header +
            f"\nvoid custom_kernel_{spec.name}(" + ", ".join(params) + ") {\n" + "\n".join(consts) + "\n" + spec.body + "\n}\n")


def _nvrtc_paths() -> tuple[str, str] | None:
    """``(libnvrtc path, CUDA include dir)`` from the nvidia-cuda-* wheels or ``$CUDA_HOME``."""
    roots = [Path(p) for p in sys.path if p] + [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))]
    for root in roots:
        for lib in sorted(glob.glob(str(root / "nvidia" / "cu1*" / "lib" / "libnvrtc.so.*"))) + \
                sorted(glob.glob(str(root / "lib64" / "libnvrtc.so*"))):
            if "builtins" in lib:
                continue
            inc = Path(lib).parent.parent / "include"
            if (inc / "cuda_bf16.h").is_file():
                return lib, str(inc)
    return None


def nvrtc_available() -> bool:
    return _nvrtc_paths() is not None


def cxx_available() -> bool:
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def compile_cuda(source: str, arch: str = "sm_90") -> tuple[bool, str]:
    """Compile CUDA text with NVRTC; ``(ok, log)``.

    Raises:
        RuntimeError: NVRTC not found.
    """
    paths = _nvrtc_paths()
    if paths is None:
        raise RuntimeError("NVRTC not found (pip install nvidia-cuda-nvrtc nvidia-cuda-runtime)")
    lib = ctypes.CDLL(paths[0])
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None) != 0:
        return False, "nvrtcCreateProgram failed"
    opts = [f"--gpu-architecture={arch}", f"-I{paths[1]}", "--std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, buf.value.decode(errors="replace")


def compile_metal(source: str) -> tuple[bool, str]:
    """Syntax/type-check Metal-as-C++ text with the host compiler; ``(ok, log)``."""
    cxx = os.environ.get("CXX", "g++")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "kernel.cpp"
        f.write_text(source)
        r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Wno-everything" if "clang" in cxx else "-w", str(f)],
                           capture_output=True, text=True)
    return r.returncode == 0, r.stderr


def check_all(backends=("cuda", "metal"), verbose: bool = True) -> list[tuple]:
    """Compile every registered op's kernels for every example; ``[(op, backend, role, example, ok, log)]``."""
    from . import OPS

    rows = []
    for op in OPS.values():
        for be in backends:
            if be not in op.sources:
                continue
            if be == "cuda" and not nvrtc_available():
                continue
            if be == "metal" and not cxx_available():
                continue
            for role, spec in op.specs(be).items():
                for ex in spec.examples:
                    src = cuda_source(spec, ex) if be == "cuda" else metal_source(spec, ex)
                    ok, log = compile_cuda(src) if be == "cuda" else compile_metal(src)
                    rows.append((op.name, be, role, ex, ok, log))
                    if verbose:
                        print(f"{op.name:18s} {be:5s} {role:8s} {ex} {'ok' if ok else 'FAIL'}")
                        if not ok:
                            print(log[:4000])
    return rows


if __name__ == "__main__":
    rows = check_all()
    sys.exit(0 if rows and all(r[4] for r in rows) else 1)
