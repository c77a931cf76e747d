"""``qk_norm_rope``: the attention's per-head work between the fused q/k/v projection and the KV cache, one launch.

From ``y = [q | k | v]`` (the fused projection's output, ``[..., L, (H + 2 Hk) * D]``), every query and key head's
RMS norm (``q_norm`` / ``k_norm`` where the layer has them: Qwen3) and RoPE at its token's position, and the
heads laid out as the cache and :data:`~.attention.verify_attention` take them: ``q [1, H, L, D]``,
``k, v [1, Hk, L, D]``.

Why: on MLX's CUDA backend a routed forward is bound by launches (MLX encodes each on the calling thread, and each
small kernel is a latency-bound few microseconds on the GPU). Session 20's H200 trace of the 8B shape counted ~21
launches per routed layer at 16 rows: two RMS norms, two RoPE launches and the copies that made the strided head
slices contiguous are ~6 of them, all replaced by this one (and by none of them at one row: the plain step too).

Row-count invariant: each (row, head) is one warp's own computation at its own position, so the plain step and
the verify compute a row the same way. Positions come from a persistent int32 table (:func:`positions`: a view,
no host array per call). RoPE is MLX's non-traditional form with ``base`` (``mx.fast.rope``; ``nn.RoPE`` of
``dims == D``, ``scale == 1``, D a multiple of 64); other RoPE variants keep mlx-lm's own modules
(:meth:`~.attention.KernelAttention` checks at routing).

Reference: ``mx.fast.rms_norm`` on each head, then ``mx.fast.rope(..., offset=offset)``: exactly what mlx-lm's
``nn.RMSNorm`` and ``nn.RoPE`` compute on the sliced heads.
"""

from __future__ import annotations

import math
import threading

import mlx.core as mx

from .registry import KernelOp, KernelSpec, int_params

__all__ = ["QKNormRope", "qk_norm_rope", "positions"]

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
HEAD_DIMS = (64, 128, 192, 256)
MIN_POSITIONS = 8  # a view of at least 8 elements: a Metal `device` pointer (registry.device_input)

_table: list = [None]
_table_lock = threading.Lock()


def positions(offset: int, n: int) -> mx.array:
    """int32 positions ``offset .. offset + max(n, 8) - 1`` as a view of a persistent, evaluated table (grown by
    doubling, at least 4,096 rows): what the kernel reads per row, with no array made on the host per call.

    Raises:
        ValueError: a negative offset.
    """
    if offset < 0:
        raise ValueError(f"positions: offset must be >= 0, got {offset}")
    need = offset + max(n, MIN_POSITIONS)
    t = _table[0]
    if t is None or t.shape[0] < need:
        with _table_lock:
            t = _table[0]
            if t is None or t.shape[0] < need:
                t = mx.arange(max(4096, 1 << (need - 1).bit_length()), dtype=mx.int32)
                mx.eval(t)
                _table[0] = t
    return t[offset:need]


class QKNormRope(KernelOp):
    """The ``qk_norm_rope`` op. Call: ``qk_norm_rope(y, q_weight, k_weight, H, Hk, eps, base, offset, mode=None)``.

    Args:
        y: ``[..., L, (H + 2 Hk) * D]`` (leading axes of size 1): q, k and v of L tokens side by side.
        q_weight, k_weight: ``[D]`` RMS norm weights (the activations' dtype), or both ``None`` (no norms).
        H, Hk: query and key/value heads.
        eps: the norms' epsilon.
        base: RoPE's base (``nn.RoPE.base``).
        offset: position of the first row.

    Returns:
        ``(q [1, H, L, D], k [1, Hk, L, D], v [1, Hk, L, D])`` in the activations' dtype.
    """

    name = "qk_norm_rope"
    sources = {"cuda": "qk_norm_rope.cu", "metal": "qk_norm_rope.metal"}
    row_invariant = True
    tolerance = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 2e-2}

    def __init__(self):
        super().__init__()
        self._geo: dict = {}

    def reference(self, y, q_weight, k_weight, H, Hk, eps, base, offset):
        L, W = y.shape[-2], y.shape[-1]
        D = W // (H + 2 * Hk)
        y = y.reshape(1, L, W)
        q = y[..., : H * D].reshape(1, L, H, D)
        k = y[..., H * D : (H + Hk) * D].reshape(1, L, Hk, D)
        v = y[..., (H + Hk) * D :].reshape(1, L, Hk, D)
        if q_weight is not None:
            q, k = mx.fast.rms_norm(q, q_weight, eps), mx.fast.rms_norm(k, k_weight, eps)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        rope = lambda a: mx.fast.rope(a, D, traditional=False, base=base, scale=1.0, offset=offset)  # noqa: E731
        return rope(q), rope(k), v

    def supports(self, y, q_weight, k_weight, H, Hk, eps, base, offset):
        if y.dtype not in DTYPES or y.ndim < 2 or math.prod(y.shape[:-2]) != 1 or H % max(Hk, 1) or Hk < 1:
            return False
        W = y.shape[-1]
        D, rem = divmod(W, H + 2 * Hk)
        if rem or D not in HEAD_DIMS or offset < 0 or (q_weight is None) != (k_weight is None):
            return False
        if q_weight is not None and not all(w.shape == (D,) and w.dtype == y.dtype for w in (q_weight, k_weight)):
            return False
        return True

    def shape_key(self, y, q_weight, k_weight, H, Hk, eps, base, offset):
        return (str(y.dtype), H, Hk, y.shape[-1] // (H + 2 * Hk), q_weight is not None)

    def sample(self, key):
        dtype, H, Hk, D, norm = key
        dtype = getattr(mx, dtype.split(".")[-1])
        r = mx.random.split(mx.random.key(H * 131 + D), 3)
        y = mx.random.normal((16, (H + 2 * Hk) * D), key=r[0]).astype(dtype)
        qw = kw = None
        if norm:
            qw = (1.0 + 0.1 * mx.random.normal((D,), key=r[1])).astype(dtype)
            kw = (1.0 + 0.1 * mx.random.normal((D,), key=r[2])).astype(dtype)
        return (y, qw, kw, H, Hk, 1e-6, 1_000_000.0, 300), {}

    def rows_of(self, args, kw, n):
        y, *rest = args
        return (y[..., :n, :], *rest), kw

    def invariance_rows(self):
        return (1, 5)

    def specs(self, backend):
        ex = [dict(T=t, D=d) for t in ("bfloat16", "float16", "float32") for d in (64, 128, 256)]
        io = dict(inputs=[("y", "T"), ("qw", "T"), ("kw", "T"), ("pos", "int32"), ("params", "int32"),
                          ("fparams", "float32")],
                  outputs=[("qo", "T"), ("ko", "T"), ("vo", "T")])
        tid = "blockIdx.x * blockDim.x + threadIdx.x" if backend == "cuda" else "int(thread_position_in_grid.x)"
        return {"qkr": KernelSpec(
            "dflash_qk_norm_rope", header="qk_norm_rope." + ("cu" if backend == "cuda" else "metal"), examples=ex,
            body=f"  const int t = {tid};\n"
                 "  dflash_qkr::qk_norm_rope<T, D>(y, qw, kw, pos, params, fparams, qo, ko, vo, t / 32, t % 32);\n",
            **io)}

    def fast_key(self, args, kw):
        if len(args) != 8:
            return None
        y, qw, kw_, H, Hk, eps, base, offset = args
        if offset < 0:
            return None
        sig = lambda w: None if w is None else (w.shape, w.dtype)  # noqa: E731
        return (y.shape, y.dtype, sig(qw), sig(kw_), H, Hk, eps, base)

    def _geometry(self, y, has_norm, H, Hk, eps, base):
        key = (y.shape, y.dtype, has_norm, H, Hk, eps, base)
        geo = self._geo.get(key)
        if geo is None:
            L, W = y.shape[-2], y.shape[-1]
            D = W // (H + 2 * Hk)
            warps = L * (H + 2 * Hk)
            fparams = mx.array([eps, math.log2(base)] + [0.0] * 6, dtype=mx.float32)
            dummy = mx.zeros((D,), dtype=y.dtype)
            mx.eval(fparams, dummy)
            geo = self._geo[key] = (
                [("T", y.dtype), ("D", D)], (-(-warps // 4) * 128, 1, 1), int_params(H, Hk, L, int(has_norm)),
                fparams, dummy, [(1, H, L, D), (1, Hk, L, D), (1, Hk, L, D)], [y.dtype] * 3, L)
        return geo

    def launch(self, backend, y, q_weight, k_weight, H, Hk, eps, base, offset):
        tmpl, grid, params, fparams, dummy, shapes, dtypes, L = self._geometry(y, q_weight is not None, H, Hk, eps,
                                                                             base)
        qw = dummy if q_weight is None else q_weight
        kw = dummy if k_weight is None else k_weight
        return tuple(self.kernel(backend, "qkr")(
            inputs=[y, qw, kw, positions(offset, L), params, fparams], template=tmpl, grid=grid,
            threadgroup=(128, 1, 1), output_shapes=shapes, output_dtypes=dtypes))


qk_norm_rope = QKNormRope()
