"""``qmm``: small-M affine quantized matmul for verify widths 1..16 (and the plain step's M = 1).

``y = x @ dequantize(w, scales, biases)^T`` with MLX's affine layout (``mx.quantize``: codes packed
LSB-first in uint32 words, one scale and bias per ``group_size`` weights of a row), for 4- and
8-bit codes, group sizes 32/64/128, float32/float16/bfloat16 activations and at most 16 rows.

Why: MLX 0.32's CUDA backend runs M = 1 through ``qmv`` and M >= 2 through a ``qmm`` kernel that
launches too few thread blocks for per-layer weights, so a verify forward of 16 tokens cost 2.1x a
1-token forward on the H200 (chained layer after layer; ``shared research h200-profile.md``). The
kernel (``metal/qmm.cu``, ``metal/qmm.metal``) reads every weight group once for all rows, splits K
over the warps of a block for parallelism, accumulates in fp32, and is **row-count invariant**: a
row's result is bit-identical whatever the number of rows beside it, so with the plain step and
the verify both on it, greedy speculative output equals plain output token for token.

Reference: ``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)`` (MLX's own kernels).
"""

from __future__ import annotations

import math
import os

import mlx.core as mx
import mlx.nn as nn

from .registry import KernelOp, KernelSpec, int_params
from .registry import backend as backend_of_default

__all__ = ["QuantizedMatmul", "qmm", "KernelQuantizedLinear", "KernelMLP", "route_quantized_linears", "route_mlps", "undo_routes",
           "qmm_config", "MLP_CLASSES", "fuse_linears", "fusable"]

MAX_ROWS = 16
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
CUDA_TYPES = {mx.bfloat16: "bf16", mx.float16: "f16", mx.float32: "f32"}


def qmm_config(backend: str, n: int, k: int, group_size: int, dtype) -> tuple[int, int, int]:
    """Launch geometry ``(NT, WARPS, U)`` for an ``n x k`` weight: ``NT`` tiles of 8 output columns
    per block (CUDA) or simdgroup (Metal), ``WARPS`` warps/simdgroups splitting K, ``U`` groups
    loaded ahead per warp (CUDA). ``MLX_DFLASH2_QMM_CONFIG="NT,WARPS,U"`` overrides it (benchmarks)."""
    env = os.environ.get("MLX_DFLASH2_QMM_CONFIG")
    if env:
        nt, w, u = (int(v) for v in env.split(","))
        return nt, w, u
    groups = k // group_size
    if backend == "cuda":
        # H200 sweep of dependent chains over the 36 layers of the Qwen3-8B shape (bench_kernels.py --sweep,
        # benchmarks/README.md session 11): wide weights want 4 tiles and 4 warps, 4096-row ones 2 tiles and
        # 8 warps (K split finer), 1024-row ones the same with two groups loaded ahead
        if n >= 8192:
            nt, warps, u = 4, (4 if k <= 8192 else 8), 1
        else:
            nt, warps, u = 2, 8, (2 if n < 2048 else 1)
        while warps > 1 and groups < 2 * warps:  # every warp gets at least two groups
            warps //= 2
        return nt, warps, (1 if dtype == mx.float32 else u)
    nt = 2 if n >= 2048 else 1
    sg = 4 if groups >= 32 else 2
    return nt, sg, 1


class QuantizedMatmul(KernelOp):
    """The ``qmm`` op. Call: ``qmm(x, w, scales, biases, group_size, bits, mode=None, residual=None)``.

    Args:
        x: ``[..., M, K]`` activations (M = product of the leading axes, 1..16 for the kernel).
        w: uint32 ``[N, K * bits / 32]`` packed codes.
        scales, biases: ``[N, K / group_size]`` (the activations' dtype).
        group_size, bits: MLX's affine quantization parameters.
        residual: ``[..., M, N]`` added to the product (the decoder layer's residual), or None.

    The kernel adds ``residual`` after the matmul (one launch where there were two: the host builds and launches
    every op of a forward, and on MLX's CUDA backend its per-launch cost, not the GPU, bounds a step), to the fp32
    sum before its one rounding, so the kernel's result is the reference's within rounding, not bit for bit (the
    plain step and the verify run the same kernel: greedy output stays exact). A SwiGLU computed in the down
    projection's loads (session 22) cost 199 us per call at one row on the H200 against 17 us for the matmul alone
    (every block recomputed it for the whole input): the MLP keeps its own SwiGLU launch.

    Returns:
        ``[..., M, N]`` in the activations' dtype.
    """

    name = "qmm"
    sources = {"cuda": "qmm.cu", "metal": "qmm.metal"}

    def __init__(self):
        super().__init__()
        self._geo: dict = {}
    row_invariant = True
    tolerance = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 2e-2}

    def reference(self, x, w, scales, biases, group_size, bits, config=None, residual=None):
        y = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
        return y if residual is None else residual + y  # the layer's own order: h = x + f(x)

    def supports(self, x, w, scales, biases, group_size, bits, config=None, residual=None):
        if biases is None or bits not in BITS or group_size not in GROUP_SIZES or x.dtype not in DTYPES:
            return False
        K = x.shape[-1]
        M = math.prod(x.shape[:-1])
        if residual is not None and (residual.dtype != x.dtype or residual.shape != (*x.shape[:-1], w.shape[0])):
            return False
        return (1 <= M <= MAX_ROWS and K % group_size == 0 and K % 16 == 0 and scales.dtype == x.dtype
                and biases.dtype == x.dtype and w.dtype == mx.uint32 and w.shape[-1] * 32 // bits == K
                and w.ndim == 2)

    def shape_key(self, x, w, scales, biases, group_size, bits, config=None, residual=None):
        # the code path depends on dtype, bits, group size, the geometry and the residual (not on M: row-invariant)
        key = (str(x.dtype), bits, group_size, int(w.shape[0]), int(x.shape[-1]))
        return key + ("residual",) * (residual is not None)

    def sample(self, key):
        from .registry import backend

        dtype, bits, gs, n, k = key[:5]
        res = "residual" in key[5:]
        dtype = getattr(mx, dtype.split(".")[-1])
        # the kernel's path depends on K and on the launch geometry chosen for the real N, not on N's
        # size: a slice of rows (keeping N's remainder mod 8, the ragged last tile) is checked
        n_s = min(n, 256 + n % 8)
        r = mx.random.split(mx.random.key(n * 131 + k), 3)
        w = mx.random.normal((n_s, k), key=r[0]).astype(dtype) * 0.05
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        x = mx.random.normal((MAX_ROWS, k), key=r[1]).astype(dtype)
        config = qmm_config(backend(), n, k, gs, dtype)
        kw = {"config": config}
        if res:
            kw["residual"] = mx.random.normal((MAX_ROWS, n_s), key=r[2]).astype(dtype)
        return (x, wq, s.astype(dtype), b.astype(dtype), gs, bits), kw

    def rows_of(self, args, kw, n):
        x, *rest = args
        if kw.get("residual") is not None:
            kw = dict(kw, residual=kw["residual"][:n])
        return (x[:n], *rest), kw

    def invariance_rows(self):
        return (1, 3, 8)

    def specs(self, backend):
        io = dict(inputs=[("x", "T"), ("w", "uint32"), ("scales", "T"), ("biases", "T"), ("res", "T"),
                          ("params", "int32")],
                  outputs=[("y", "T")])
        ex = [dict(T=t, BITS=b, GS=g, NT=nt, WARPS=w, U=u, RES=rs) for t in ("bfloat16", "float16", "float32")
              for b in BITS for g in GROUP_SIZES for nt, w, u in ((1, 2, 1), (4, 8, 2)) for rs in (0, 1)]
        if backend == "cuda":
            return {"qmm": KernelSpec(
                "dflash_qmm", header="qmm.cu", examples=ex,
                body="  __shared__ float part[WARPS][NT * 4][32];\n"
                     "  dflash_qmm::qmm_block<T, BITS, GS, NT, WARPS, U, RES>(x, w, scales, biases, res, params, y, part);\n",
                **io)}
        ex = [{("S" if k == "WARPS" else k): v for k, v in e.items() if k != "U"} for e in ex]
        return {"qmm": KernelSpec(
            "dflash_qmm", header="qmm.metal", examples=ex,
            body="  threadgroup float part[S * NT * 2 * 64];\n"
                 "  dflash_qmm::qmm_block<T, BITS, GS, NT, S, RES>(x, w, scales, biases, res, params, y, part,\n"
                 "      threadgroup_position_in_grid.x, simdgroup_index_in_threadgroup, thread_index_in_simdgroup);\n",
            **io)}

    def fast_key(self, args, kw):
        x, w, scales, biases, group_size, bits = args[:6]
        r = kw.get("residual")
        return (x.shape, x.dtype, w.shape, w.dtype, scales.dtype, None if biases is None else biases.dtype,
                group_size, bits, None if r is None else (r.shape, r.dtype))

    def _geometry(self, backend, shape, N, group_size, bits, dtype, config=None, residual=False):
        """``(template, grid, threadgroup, output shapes, params)`` of a call signature (worked out once)."""
        key = (backend, shape, N, group_size, bits, dtype, config, residual)
        geo = self._geo.get(key)
        if geo is None:
            K = shape[-1]
            M = math.prod(shape[:-1])
            nt, warps, u = config or qmm_config(backend, N, K, group_size, dtype)
            tmpl = [("T", dtype), ("BITS", bits), ("GS", group_size), ("NT", nt)]
            tmpl += [("WARPS", warps), ("U", u)] if backend == "cuda" else [("S", warps)]
            tmpl += [("RES", int(bool(residual)))]
            blocks = -(-N // (8 * nt))
            # the kernel indexes rows flat (row r at r * K of x, r * N of y): x and y keep their leading axes,
            # no reshape nodes around the call (MLX copies a non-contiguous x first: ensure_row_contiguous)
            geo = self._geo[key] = (tmpl, (blocks * warps * 32, 1, 1), (warps * 32, 1, 1), [(*shape[:-1], N)],
                                    int_params(M, N, K))
        return geo

    def launch(self, backend, x, w, scales, biases, group_size, bits, config=None, residual=None):
        tmpl, grid, tg, out_shapes, params = self._geometry(backend, x.shape, w.shape[0], group_size, bits, x.dtype,
                                                            config, residual is not None)
        return self.kernel(backend, "qmm")(
            inputs=[x, w, scales, biases, x if residual is None else residual, params], template=tmpl, grid=grid,
            threadgroup=tg, output_shapes=out_shapes, output_dtypes=[x.dtype])[0]

    def bind(self, x, w, scales, biases, group_size, bits, mode=None, residual=None):
        """A function ``f(x)`` (``f(x, residual)`` where ``residual`` is given: an array of the call's residual
        shape) for calls shaped like ``x`` (shape, dtype) on these weights.

        The decision (kernel or reference: the op's gate, mode and backend, as :meth:`dispatch` makes it)
        and the launch geometry are taken once, here; the function then goes straight to the kernel.
        Why: a forward builds its graph on the host, one call per quantized layer per step, and on
        MLX's CUDA backend that host work, not the GPU, bounded the routed forward (session 16,
        ``benchmarks/gpu/trace_chain.py``: the kernel's GPU time per call at or below MLX's ``qmv``, the
        graph build 6.8-11.9 us per call against 1.8 us). Used by :class:`KernelQuantizedLinear`, which
        keeps one per call signature.

        Raises:
            KernelError: mode ``"kernel"`` and the kernel failed to build or disagreed.
        """
        be = backend_of_default()
        kw = {} if residual is None else {"residual": residual}
        if not self.decide(be, (x, w, scales, biases, group_size, bits), kw, mode):
            ref = self.reference
            if residual is None:
                return lambda x: ref(x, w, scales, biases, group_size, bits)
            return lambda x, r: ref(x, w, scales, biases, group_size, bits, residual=r)
        tmpl, grid, tg, out_shapes, params = self._geometry(be, x.shape, w.shape[0], group_size, bits, x.dtype,
                                                            None, residual is not None)
        kern, dtypes = self.kernel(be, "qmm"), [x.dtype]

        if residual is None:
            def run(x):
                return kern(inputs=[x, w, scales, biases, x, params], template=tmpl, grid=grid, threadgroup=tg,
                            output_shapes=out_shapes, output_dtypes=dtypes)[0]
        else:
            def run(x, r):
                return kern(inputs=[x, w, scales, biases, r, params], template=tmpl, grid=grid, threadgroup=tg,
                            output_shapes=out_shapes, output_dtypes=dtypes)[0]

        return run


qmm = QuantizedMatmul()


FUSE_ENV = "MLX_DFLASH2_QMM_FUSE"


def fuse_enabled() -> bool:
    """Whether routed layers fuse the residual adds into their ``qmm`` launches
    (:meth:`KernelQuantizedLinear.fused`): ``MLX_DFLASH2_QMM_FUSE`` = ``0`` turns it off (an A/B switch for
    benchmarks), read per eager call: a compiled layer (:class:`~.block.KernelBlock`) keeps what it read when its
    trace was made, so set it before loading.

    Raises:
        ValueError: set to anything but ``0`` or ``1``.
    """
    v = os.environ.get(FUSE_ENV, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"{FUSE_ENV} must be 0 or 1, got {v!r}")
    return v != "0"


class KernelQuantizedLinear(nn.Module):
    """An ``nn.QuantizedLinear`` (affine mode) whose matmul goes through the registry's ``qmm``.

    Holds the original layer's arrays (shared, not copied). Used by :func:`route_quantized_linears`
    on a target the package owns; the reference path is exactly ``nn.QuantizedLinear.__call__``.
    Each call signature (activation shape, dtype, default device type) is bound once
    (:meth:`QuantizedMatmul.bind`): later calls go straight to the kernel, so the host's graph build
    stays close to ``nn.QuantizedLinear``'s.

    Args:
        layer: the quantized linear layer.
        mode: kernel mode (``None``: the process default, ``MLX_DFLASH2_KERNELS``).
    """

    MAX_BOUND = 64  # call signatures kept (1..16 rows, a few dtypes); more are served unbound

    def __init__(self, layer: nn.QuantizedLinear, mode: str | None = None):
        super().__init__()
        self.weight, self.scales = layer.weight, layer.scales
        if getattr(layer, "biases", None) is not None:
            self.biases = layer.biases
        if "bias" in layer:
            self.bias = layer.bias
        self.group_size, self.bits = layer.group_size, layer.bits
        self.kernel_mode = mode
        object.__setattr__(self, "_bound", {})  # not a module member: outside parameters() and children()
        object.__setattr__(self, "original", layer)
        self.freeze()

    def set_arrays(self, weight, scales, biases, bias=None) -> None:
        """Rebind the weights (e.g. to views of a fused array) in this module and in the original layer."""
        for m in (self, self.original):
            m.weight, m.scales = weight, scales
            if biases is not None:
                m.biases = biases
            if bias is not None:
                m.bias = bias
        self._bound.clear()

    def __call__(self, x):
        key = (x.shape, x.dtype, mx.default_device().type)
        f = self._bound.get(key)
        if f is None:
            f = qmm.bind(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                         mode=self.kernel_mode)
            if len(self._bound) < self.MAX_BOUND:
                self._bound[key] = f
        y = f(x)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def fused(self, x, residual):
        """``residual + self(x)`` in one ``qmm`` launch (:class:`QuantizedMatmul`; ``residual`` ``[..., M, N]``). A
        layer with an additive bias (or ``MLX_DFLASH2_QMM_FUSE=0``) runs the two as separate ops."""
        if "bias" in self or not fuse_enabled():
            return residual + self(x)
        key = (x.shape, x.dtype, mx.default_device().type, residual.shape, residual.dtype)
        f = self._bound.get(key)
        if f is None:
            f = qmm.bind(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                         mode=self.kernel_mode, residual=residual)
            if len(self._bound) < self.MAX_BOUND:
                self._bound[key] = f
        return f(x, residual)


# mlx-lm MLP classes whose __call__ is down_proj(swiglu(gate_proj(x), up_proj(x))) (checked by the target's probe)
MLP_CLASSES = ("mlx_lm.models.llama.MLP", "mlx_lm.models.mistral.MLP", "mlx_lm.models.qwen2.MLP",
               "mlx_lm.models.qwen3.MLP", "mlx_lm.models.qwen3_next.Qwen3NextMLP",
               "mlx_dflash2.drafter.model.DraftMLP")  # the drafter's own (DraftModel.route_kernels)


class Wrapper(nn.Module):
    """A module wrapping another one (``self.inner``) whose members it does not have itself read through to the
    wrapped one (e.g. a routed MLP's ``gate_proj``, a routed layer's ``self_attn``), so code that reads the
    original module's attributes keeps working."""

    def __getattr__(self, key):
        try:
            return super().__getattr__(key)
        except AttributeError:
            inner = dict.get(self, "inner")
            if inner is None:
                raise
            return getattr(inner, key)


class KernelMLP(Wrapper):
    """A SwiGLU MLP of a supported mlx-lm family with its gate and up projections fused into one ``qmm``
    call over their concatenated rows: ``down(silu(g) * u)`` with ``[g | u] = x @ [W_gate; W_up]^T``.

    One launch instead of two per layer (a routed forward is bound by the host's per-call work on
    MLX's CUDA backend, and the GPU runs one wide matmul better than two). Memory is unchanged: the
    gate and up layers are rebound to row views of the fused arrays. A row's result is the same
    computation as before for each output column (the kernel is row-count invariant; its launch
    geometry now follows the fused width, for the plain step and the verify alike).

    Args:
        mlp: the mlx-lm MLP module (its ``gate_proj`` and ``up_proj`` already
            :class:`KernelQuantizedLinear`, affine, same bits and group size, both or neither with a bias:
            :func:`fusable`).
        mode: kernel mode.
    """

    def __init__(self, mlp: nn.Module, mode: str | None = None):
        super().__init__()
        self.inner = mlp
        self.hidden = int(mlp.gate_proj["weight"].shape[0])
        object.__setattr__(self, "gate_up", fuse_linears([mlp.gate_proj, mlp.up_proj], mode))  # not listed twice

    def __call__(self, x, residual=None):
        """``down(silu(g) * u)`` (plus ``residual`` where given: the layer's ``h + mlp(norm(h))`` with ``h`` as the
        residual, added inside the down projection's ``qmm`` launch where it is routed:
        :meth:`KernelQuantizedLinear.fused`)."""
        from mlx_lm.models.activations import swiglu

        y = self.gate_up(x)
        n = self.hidden
        a = swiglu(y[..., :n], y[..., n:])
        down = self.inner.down_proj
        if residual is None:
            return down(a)
        return down.fused(a, residual) if isinstance(down, KernelQuantizedLinear) else residual + down(a)


class _Arrays(nn.Module):
    """The arrays of a quantized linear layer (what :class:`KernelQuantizedLinear` reads)."""

    def __init__(self, weight, scales, biases, group_size, bits, bias=None):
        super().__init__()
        self.weight, self.scales, self.biases = weight, scales, biases
        if bias is not None:
            self.bias = bias
        self.group_size, self.bits = group_size, bits


def fusable(linears) -> bool:
    """Whether these routed linears can share one ``qmm`` call: affine with biases (MLX's ``quantize``),
    the same bits, group size, input width and dtypes, and all or none with an additive bias."""
    if not linears or not all(isinstance(m, KernelQuantizedLinear) and "biases" in m for m in linears):
        return False
    a = linears[0]
    sig = lambda m: (m.bits, m.group_size, m["weight"].shape[1], m["scales"].dtype, "bias" in m,  # noqa: E731
                     m["bias"].dtype if "bias" in m else None)
    return all(sig(m) == sig(a) for m in linears)


def fuse_linears(linears, mode: str | None = None) -> "KernelQuantizedLinear":
    """One :class:`KernelQuantizedLinear` over the concatenated rows of ``linears`` (same input), each of
    them rebound to its row view of the fused arrays (no second copy of the weights stays alive).

    Returns:
        The fused layer: its output's last axis is the parts' outputs side by side, in order.
    """
    keys = ("weight", "scales", "biases") + (("bias",) if "bias" in linears[0] else ())
    fused = {k: mx.concatenate([m[k] for m in linears], axis=0) for k in keys}
    mx.eval(list(fused.values()))
    start = 0
    for m in linears:
        n = int(m["weight"].shape[0])
        views = {k: v[start:start + n] for k, v in fused.items()}
        m.set_arrays(views["weight"], views["scales"], views["biases"], views.get("bias"))
        start += n
    a = linears[0]
    return KernelQuantizedLinear(_Arrays(fused["weight"], fused["scales"], fused["biases"], a.group_size, a.bits,
                                         fused.get("bias")), mode)


def _fusable_mlp(mlp) -> bool:
    if f"{type(mlp).__module__}.{type(mlp).__name__}" not in MLP_CLASSES:
        return False
    return fusable([getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)])


def route_mlps(layers, mode: str | None = None) -> list[tuple]:
    """Wrap the ``mlp`` of every decoder layer in ``layers`` whose class is in :data:`MLP_CLASSES` and whose
    gate and up projections are routed quantized linears (:func:`route_quantized_linears` first) with
    :class:`KernelMLP` (this model instance only).

    Returns:
        The swaps ``[(layer, "mlp", original)]`` (:func:`undo_routes` restores them; the gate and up
        layers keep their row views of the fused arrays: the same values).
    """
    swaps = []
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and _fusable_mlp(mlp):
            swaps.append((layer, "mlp", mlp))
            layer.mlp = KernelMLP(mlp, mode)
    return swaps


def route_quantized_linears(model: nn.Module, mode: str | None = None) -> list[tuple]:
    """Replace every affine ``nn.QuantizedLinear`` under ``model`` (this instance only) with a
    :class:`KernelQuantizedLinear` sharing its arrays.

    No class is patched: only the submodules of this model object change, so another copy of the
    same checkpoint (e.g. mlx-lm's reference in a benchmark) is untouched.

    Returns:
        The swaps ``[(container, key, original module)]`` (:func:`undo_routes` restores them).
    """
    def swap(m):
        if isinstance(m, nn.QuantizedLinear) and getattr(m, "mode", "affine") == "affine":
            return KernelQuantizedLinear(m, mode)
        return None

    swaps = []
    for _, parent in list(model.named_modules()):
        for name, child in list(parent.children().items()):
            if isinstance(child, list):  # e.g. nn.Sequential's layers: edit the module's own list
                own = parent[name]
                for i, c in enumerate(own):
                    new = swap(c)
                    if new is not None:
                        swaps.append((own, i, c))
                        own[i] = new
            else:
                new = swap(child)
                if new is not None:
                    swaps.append((parent, name, child))
                    setattr(parent, name, new)
    return swaps


def undo_routes(swaps: list[tuple]) -> None:
    """Put the original modules of ``route_*`` swaps back."""
    for container, key, original in reversed(swaps):
        if isinstance(container, list):
            container[key] = original
        else:
            setattr(container, key, original)
