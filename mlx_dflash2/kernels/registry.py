"""The kernel registry: every fused op with its pure-MLX reference, its Metal source and its CUDA twin.

Each op (:class:`KernelOp`) is called like a function. It runs its kernel only where one can run and
has been checked, and its reference otherwise:

* **backend**: the default device's backend: ``"metal"`` (Apple GPUs, ``mx.fast.metal_kernel``),
  ``"cuda"`` (NVIDIA, ``mx.fast.cuda_kernel``) or ``"cpu"`` (always the reference);
* **mode**: ``"auto"`` (kernel where it builds and passes its gate, else the reference with one
  warning), ``"reference"`` (never a kernel) or ``"kernel"`` (a kernel that fails to build or
  disagrees raises :class:`KernelError` instead of falling back: for tests and benchmarks). The
  environment variable ``MLX_DFLASH2_KERNELS`` sets the process default (read when an op first meets
  a call signature: decisions are cached per signature, since the host builds every layer's graph
  on a round's critical path); an op call (and ``mlx_dflash2.load(kernels=...)``) can pass its own;
* **numerics gate**: the first call of an op on a new *shape key* (what the kernel's code path
  depends on: dtypes, bit width, sizes) runs the kernel and the reference on random inputs of that
  key and compares them (``max |kernel - reference| <= tol * max(|reference|, 1)``; row-count
  invariance too for ops that promise it). A failure disables that key with one ``WARNING`` line of
  the ``mlx_dflash2`` logger per op and reason.

Sources live in the top-level ``metal/`` directory of the repository (installed as the data package
``mlx_dflash2.metal``): ``<op>.metal`` and ``<op>.cu`` hold the kernel's functions (the kernel
wrapper's header), the op passes a short body that calls them (``mx.fast.*_kernel`` generates the
signature). Where Metal and CUDA can share one body (simple SIMD/warp code), ``<op>.h`` holds it
with the macros of ``metal/dialect.h`` picking the dialect.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

__all__ = ["KernelOp", "KernelSpec", "KernelError", "GateResult", "backend", "default_mode", "MODES", "source_text", "ENV",
           "yardstick_device",
           "device_input", "CUDA_GRAPHS_VAR", "cuda_graphs_on"]

logger = logging.getLogger("mlx_dflash2")

ENV = "MLX_DFLASH2_KERNELS"
MODES = ("auto", "reference", "kernel")


class KernelError(RuntimeError):
    """A kernel failed to build or disagreed with its reference (raised in mode ``"kernel"``)."""


_backend_of: dict = {}


def backend() -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"``: where kernels of the default device would run (cached
    per default device: it is asked on every op call)."""
    # keyed by the device *type*: MLX's Device objects hash by identity (a new one per default_device() call),
    # so a Device key never hit this cache and grew it by one entry per op call
    key = mx.default_device().type
    be = _backend_of.get(key)
    if be is None:
        be = "cpu"
        if key != mx.cpu:
            cuda = getattr(mx, "cuda", None)
            if mx.metal.is_available():
                be = "metal"
            elif cuda is not None and cuda.is_available():
                be = "cuda"
        _backend_of[key] = be
    return be


#: MLX's CUDA backend reads this once per process, at its first GPU work (``use_cuda_graphs()``); on Metal and the
#: CPU it means nothing
CUDA_GRAPHS_VAR = "MLX_USE_CUDA_GRAPHS"


def cuda_graphs_on(environ=None) -> bool:
    """Whether MLX's CUDA backend runs CUDA graphs under ``environ`` (default ``os.environ``), read as MLX reads
    ``MLX_USE_CUDA_GRAPHS`` (``env::get_var``: C's ``atoi``, so ``0``, ``false``, ``true`` or ``""`` all mean off;
    unset means on). Only true of the process if nothing ran on the GPU before the variable was last written."""
    environ = os.environ if environ is None else environ
    if CUDA_GRAPHS_VAR not in environ:
        return True
    m = re.match(r"\s*([+-]?\d+)", environ[CUDA_GRAPHS_VAR])
    return bool(m and int(m.group(1)) != 0)


def default_mode() -> str:
    """The process default mode from ``MLX_DFLASH2_KERNELS`` (``auto`` if unset).

    Raises:
        ValueError: an unknown value (named).
    """
    v = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if v not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, got {v!r}")
    return v


def check_mode(mode: str | None) -> str:
    """``mode`` validated (``None``: :func:`default_mode`).

    Raises:
        ValueError: not one of :data:`MODES`.
    """
    if mode is None:
        return default_mode()
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _source_dir() -> Path:
    try:
        from importlib.resources import files

        p = Path(str(files("mlx_dflash2.metal")))
        if p.is_dir():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[2] / "metal"  # an uninstalled checkout


_texts: dict[str, str] = {}


def source_text(name: str, _seen: set | None = None) -> str:
    """Text of ``metal/<name>`` with its local ``#include "file"`` lines replaced by those files' text
    (each file once, like ``#pragma once``): what ``mx.fast.*_kernel`` gets as ``header``.

    Raises:
        FileNotFoundError: no such source.
    """
    top = _seen is None
    if top and name in _texts:
        return _texts[name]
    seen = set() if top else _seen
    path = _source_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {name!r} not found in {path.parent}")
    seen.add(name)
    out = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith('#include "') and stripped.endswith('"'):
            inc = stripped[len('#include "'):-1]
            if inc not in seen:
                out.append(source_text(inc, seen))
            continue
        if stripped == "#pragma once":
            continue
        out.append(line)
    text = "\n".join(out) + "\n"
    if top:
        text = _texts[name] = compact_source(text)
    return text


_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)


def compact_source(text: str) -> str:
    """``text`` without comments, indentation and blank lines (the lines and their order kept).

    Why: MLX builds each custom kernel's source string anew at every call and hashes it at every launch
    (``mlx/backend/cuda/custom_kernel.cpp``: ``build_kernel`` then ``std::hash`` of the source in
    ``eval_gpu``), a host cost per launch that grows with the text (that build and hash, written in C++ on this
    project's loaded 2-core CPU: 2.5-4.4 us for 8-12 KB, 1.4-1.6 us for 4 KB; ``qmm.cu`` goes from 12.1 to
    8.4 KB), and a routed 8B target launches ~250 matmuls per forward. The
    sources in ``metal/`` keep their comments; what reaches ``mx.fast`` (and the compile and emulation
    checks, which read the same text) is this. A line holding a string literal keeps its ``//`` text.
    """
    text = _BLOCK_COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out = []
    for line in text.splitlines():
        if '"' not in line:
            line = line.split("//", 1)[0]
        line = line.strip()
        if line:
            out.append(line)
    return "\n".join(out) + "\n"


INCLUDE_ENV = "MLX_DFLASH2_CUDA_INCLUDE"
SRC_DIR_ENV = "MLX_DFLASH2_CUDA_SRC_DIR"
_include_failed = False  # set once (never reset) when an include did not build and the inline text did
_include_lock = threading.Lock()


def _use_include() -> bool:
    return not _include_failed and os.environ.get(INCLUDE_ENV, "1") != "0"


def source_cache_dir() -> Path:
    """Where :func:`cuda_header` writes kernel sources: ``$MLX_DFLASH2_CUDA_SRC_DIR``, else the cache
    (``$MLX_DFLASH2_CACHE``, ``$XDG_CACHE_HOME/mlx_dflash2`` or ``~/.cache/mlx_dflash2``) ``/cuda-src``.

    Raises:
        RuntimeError: no home directory to be found (``Path.home()``).
    """
    d = os.environ.get(SRC_DIR_ENV)
    if d:
        return Path(d).expanduser()
    from ..assets import cache_dir

    return cache_dir() / "cuda-src"


_headers: dict[str, str] = {}


def cuda_header(name: str, inline: bool = False) -> str:
    """The ``header`` an ``mx.fast.cuda_kernel`` of source ``name`` gets: one line
    ``#include "<absolute path>"`` of the compacted text (:func:`source_text`) written once to
    :func:`source_cache_dir` as ``<stem>-<sha1 of the text, 12 hex><suffix>``, or the text itself with
    ``inline``, where that file cannot be written or read back, its path needs quoting,
    ``MLX_DFLASH2_CUDA_INCLUDE=0``, or once an include failed to build where the text inline built
    (:meth:`KernelOp.gate`).

    Why: MLX's CUDA backend builds each custom kernel's full source string (header included) and hashes
    it at every launch; measured on the H200 (session 19, ``benchmarks/gpu/trace_chain.py``): a trivial
    kernel costs 5.2 us per launch, 8.3 us with ``qmm.cu``'s 8.4 KB as its header and 4.2 us with that
    header ``#include``d from a file by absolute path (NVRTC reads it); a routed 8B forward launches ~216
    custom kernels. The content hash in the file name is in the source MLX hashes (its kernel cache key),
    so a changed source never meets a kernel built from an older one.
    """
    text = source_text(name)
    if inline or not _use_include():
        return text
    line = _headers.get(name)
    if line is None:
        import hashlib

        digest = hashlib.sha1(text.encode()).hexdigest()[:12]
        stem, dot, suffix = name.rpartition(".")
        fname = f"{stem or suffix}-{digest}{dot + suffix if stem else ''}"
        tmp = None
        try:
            path = source_cache_dir() / fname
            if not (path.is_file() and path.read_text() == text):
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_text(text)
                os.replace(tmp, path)
                tmp = None
            full = str(path.resolve())
            if not full.isascii() or any(c in full for c in '"\\\n'):
                raise OSError(f"path {full!r} needs quoting")
            line = f'#include "{full}"\n'
        except (OSError, ValueError, RuntimeError) as e:  # ValueError: a file that is not text
            logger.debug("mlx_dflash2: kernel source %s inline: %s", name, e)
            line = text
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        _headers[name] = line
    return line


@dataclass
class KernelSpec:
    """One ``mx.fast.metal_kernel`` / ``cuda_kernel`` of an op, declared so that the op can build it
    and ``mlx_dflash2.kernels.check`` can compile-check it without a GPU.

    Attributes:
        name: kernel name (MLX prefixes ``custom_kernel_``).
        inputs, outputs: ``(name, type)`` pairs; a type is a template parameter name (``"T"``) or
            ``"uint32"``, ``"int32"``, ``"float32"``.
        header: the source file in ``metal/`` (its local includes expanded).
        body: the kernel body (the signature is generated from ``inputs``/``outputs``).
        examples: template-argument dicts to instantiate in compile checks.
        contiguous: MLX copies non-contiguous inputs first (``ensure_row_contiguous``); ``False`` passes
            views as they are (the body then reads ``<input>_shape`` / ``<input>_strides``).
    """

    name: str
    inputs: list
    outputs: list
    header: str
    body: str
    examples: list = field(default_factory=list)
    contiguous: bool = True


@dataclass
class GateResult:
    """Outcome of a numerics gate: ``ok``, the max error, and why not (``reason``)."""

    ok: bool
    max_error: float = 0.0
    reason: str = ""


class KernelOp:
    """Base class of a registered op (subclasses: :mod:`mlx_dflash2.kernels`).

    Subclasses define :meth:`reference` (pure MLX, the CPU path and the gate's yardstick),
    :meth:`supports` (which calls the kernel handles), :meth:`shape_key`, :meth:`sample` (random
    inputs of a key), :meth:`launch` (build and run the kernel on ``backend``) and ``tolerance``.
    Calling the op runs :meth:`dispatch`.

    Attributes:
        name: the op's registry name.
        sources: ``{backend: file name in metal/}``.
        row_invariant: the gate also checks that a row's output does not depend on how many rows
            are computed with it (inputs' axis ``-2``).
    """

    name: str = ""
    sources: dict[str, str] = {}
    row_invariant: bool = False
    tolerance: dict = {mx.float32: 1e-4, mx.float16: 2e-2, mx.bfloat16: 3e-2}

    def __init__(self):
        self._gates: dict[tuple, GateResult] = {}
        self._warned: set[str] = set()
        self._kernels: dict[tuple, Any] = {}
        self._fast: dict = {}
        self._lock = threading.Lock()
        self._inline = False  # CUDA: this op's kernels built with their source inline (the gate's retry)

    # -- to define --------------------------------------------------------
    def reference(self, *args, **kw):  # pragma: no cover - abstract
        raise NotImplementedError

    def supports(self, *args, **kw) -> bool:
        return True

    def shape_key(self, *args, **kw) -> tuple:
        raise NotImplementedError

    def sample(self, key: tuple) -> tuple[tuple, dict]:
        raise NotImplementedError

    def launch(self, backend: str, *args, **kw):
        raise NotImplementedError

    def rows_of(self, args: tuple, kw: dict, n: int) -> tuple[tuple, dict]:
        """The inputs restricted to their first ``n`` rows (row-invariance check)."""
        raise NotImplementedError

    def specs(self, backend: str) -> dict[str, KernelSpec]:
        """The op's kernels on ``backend`` by role (see :class:`KernelSpec`)."""
        raise NotImplementedError

    # -- machinery ----------------------------------------------------------
    def kernel(self, backend: str, role: str):
        """The ``mx.fast`` kernel object of ``role`` on ``backend`` (made once per header text: on CUDA the
        header is :func:`cuda_header`'s, an include or, for this op's inline retry or once includes are
        off, the text; MLX compiles it per template instantiation at first launch)."""
        inline = self._inline or _include_failed
        k = (backend, role, inline)
        kern = self._kernels.get(k)  # per launch: a dict lookup
        if kern is None:
            spec = self.specs(backend)[role]
            if backend == "cuda":
                make, header = mx.fast.cuda_kernel, cuda_header(spec.header, inline=inline)
            else:
                make, header = mx.fast.metal_kernel, source_text(spec.header)
            names = dict(input_names=[n for n, _ in spec.inputs], output_names=[n for n, _ in spec.outputs])
            kern = self._kernels[k] = make(name=spec.name, header=header, source=spec.body,
                                           ensure_row_contiguous=spec.contiguous, **names)
        return kern

    def tol(self, dtype) -> float:
        return self.tolerance.get(dtype, 1e-4)

    def active(self, *args, mode: str | None = None, **kw) -> bool:
        """Whether a call with these inputs would run the kernel (gating it first if needed)."""
        mode = check_mode(mode)
        be = backend()
        if mode == "reference" or be == "cpu" or be not in self.sources or not self.supports(*args, **kw):
            return False
        key = self.shape_key(*args, **kw)
        gate = self._gates.get(key)
        if gate is None:
            with self._lock:
                gate = self._gates.get(key)
                if gate is None:
                    t0 = time.perf_counter()
                    gate = self._gates[key] = self.gate(be, key)
                    # at INFO: when a gate runs in a request's rounds it costs them its build and check
                    logger.info("mlx_dflash2: kernel %s %s gated in %.2f s: %s", self.name, key,
                                time.perf_counter() - t0, "ok" if gate.ok else gate.reason)
        if not gate.ok:
            if mode == "kernel":
                raise KernelError(f"kernel {self.name} {key}: {gate.reason}")
            if gate.reason not in self._warned:
                self._warned.add(gate.reason)
                logger.warning("mlx_dflash2: kernel %s falls back to its MLX reference for %s: %s",
                               self.name, key, gate.reason)
            return False
        return True

    def fast_key(self, args: tuple, kw: dict):
        """A cheap hashable summary of a call that decides :meth:`active` (shapes, dtypes, static
        arguments), or ``None``. With one, the decision is cached: an op runs once per layer per
        forward, and the host builds the graph on the round's critical path."""
        return None

    def decide(self, be: str, args: tuple, kw: dict, mode: str | None = None) -> bool:
        """Whether this call runs the kernel (:meth:`active`), cached per :meth:`fast_key` where the op has one.

        Raises:
            KernelError: mode ``"kernel"`` and the kernel failed to build or disagreed.
        """
        fk = self.fast_key(args, kw)
        if fk is None:
            return self.active(*args, mode=mode, **kw)
        key = (be, mode, fk)  # mode None: the environment's, read when a signature is first met
        on = self._fast.get(key)
        if on is None:
            on = self._fast[key] = self.active(*args, mode=mode, **kw)  # raises in mode "kernel"
        return on

    def dispatch(self, *args, mode: str | None = None, **kw):
        """Run the kernel where :meth:`active`, else the reference."""
        be = backend()
        if self.decide(be, args, kw, mode):
            return self.launch(be, *args, **kw)
        return self.reference(*args, **kw)

    __call__ = dispatch

    def gate(self, be: str, key: tuple, _retrying: bool = False) -> GateResult:
        """Build and check the kernel on random inputs of ``key`` (see the module docstring)."""
        try:
            args, kw = self.sample(key)
            dev = yardstick_device(be, args, kw)
            if dev is None:
                ref = self.reference(*args, **kw)
            else:
                with mx.stream(dev):
                    ref = self.reference(*args, **kw)
            out = self.launch(be, *args, **kw)
            refs, outs = _as_list(ref), _as_list(out)
            mx.eval(refs, outs)
            err = 0.0
            for r, o in zip(refs, outs):
                if r.shape != o.shape:
                    return GateResult(False, float("inf"), f"shape {o.shape} != reference {r.shape}")
                if mx.issubdtype(r.dtype, mx.floating):
                    scale = max(float(mx.abs(r.astype(mx.float32)).max().item()), 1.0)
                    e = float(mx.abs(r.astype(mx.float32) - o.astype(mx.float32)).max().item()) / scale
                    tol = self.tol(r.dtype)
                else:
                    e = float(mx.sum(r != o).item())
                    tol = 0.0
                if not e <= tol:  # NaN too
                    return GateResult(False, e, f"max error {e:.3g} > tolerance {tol:g}")
                err = max(err, e)
            if self.row_invariant:
                why = self.check_invariance(be, args, kw, outs)
                if why:
                    return GateResult(False, err, f"not row-count invariant: {why}")
            return GateResult(True, err)
        except Exception as e:  # a build or launch failure: fall back, never crash the request
            if be == "cuda" and _use_include() and not self._inline and not _retrying:
                # was it the #include of the source (cuda_header)? this op gates again with its text inline; if
                # that passes, every CUDA kernel made from now on gets its text inline (one warning; kernels
                # already built and checked keep working)
                self._inline = True
                again = self.gate(be, key, _retrying=True)
                if again.ok:
                    global _include_failed
                    with _include_lock:
                        warn, _include_failed = not _include_failed, True
                    if warn:
                        first = str(e).strip().splitlines()
                        logger.warning("mlx_dflash2: CUDA kernels get their source inline (built from an #include "
                                       "of it, %s failed: %s)", self.name, first[0][:200] if first else "")
                    return again
                self._inline = False
            msg = str(e).strip().splitlines()
            return GateResult(False, float("inf"), f"{type(e).__name__}: {msg[0][:300] if msg else ''}")

    def check_invariance(self, be: str, args: tuple, kw: dict, outs: list) -> str | None:
        """Row-count invariance on the gate's inputs: the first ``n`` rows computed alone (for each
        ``n`` of :meth:`invariance_rows`) equal the same rows computed among all, bit for bit.
        Returns why not, or ``None``."""
        for n in self.invariance_rows():
            a2, k2 = self.rows_of(args, kw, n)
            part = _as_list(self.launch(be, *a2, **k2))
            mx.eval(part)
            for o, p in zip(outs, part):
                if not mx.array_equal(o[..., :n, :], p):
                    return f"{n} rows computed alone differ from the same rows computed among more"
        return None

    def invariance_rows(self) -> tuple[int, ...]:
        """Row counts :meth:`check_invariance` recomputes on their own."""
        return (1,)


def yardstick_device(be: str, args: tuple, kw: dict):
    """Where a gate computes its reference: ``mx.cpu`` for float32 inputs on CUDA, else ``None``
    (the default device).

    MLX's CUDA backend rounds float32 matmuls and attention through TF32: on the H200 its float32
    ``scaled_dot_product_attention`` (and the same attention written with ``@`` and ``softmax``) was
    2-3e-4 off a float64 computation at real head geometries, while the ``verify_attention`` kernel was
    within 7e-7 (session 15, ``benchmarks/README.md``); the gate then refused an exact kernel. MLX's
    CPU computes float32 in float32, so a float32 gate on CUDA measures against the CPU. Half-precision
    gates keep the GPU's reference (their tolerances are far above TF32's error).
    """
    if be != "cuda":
        return None
    vals = list(args) + list(kw.values())
    return mx.cpu if any(isinstance(a, mx.array) and a.dtype == mx.float32 for a in vals) else None


def device_input(x: mx.array, n: int = 8) -> mx.array:
    """``x`` (1-D) padded with zeros to at least ``n`` elements. ``mx.fast.metal_kernel`` passes an input
    of fewer than 8 elements in Metal's ``constant`` address space (``const constant T*``; MLX's
    ``max_constant_array_size``), a pointer type that a body taking ``const device T*`` cannot accept;
    padded, small inputs (parameters, a single anchor, a short draft) stay ``device`` pointers."""
    if x.shape[0] >= n:
        return x
    return mx.concatenate([x, mx.zeros((n - x.shape[0],), dtype=x.dtype)])


_int_params: dict[tuple, mx.array] = {}


def int_params(*values: int) -> mx.array:
    """A kernel's small int32 parameter array ``values`` (zero-padded to 8 elements: a ``device`` pointer
    on Metal, see :func:`device_input`), made once per distinct ``values`` and evaluated: no host array
    is created per call. (On MLX's CUDA backend a host array made while the GPU runs a queued step
    halved the pipelined plain decoding of the 8B shape: one per attention layer per step.)"""
    p = _int_params.get(values)
    if p is None:
        p = mx.array(list(values) + [0] * max(0, 8 - len(values)), dtype=mx.int32)
        mx.eval(p)
        if len(_int_params) < 65536:
            _int_params[values] = p
    return p


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]
