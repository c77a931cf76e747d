"""``dynamic_conv``: one side of DFlash2's grouped dynamic causal convolution (spec §5.4) in one launch.

The drafter applies it four times per layer and round (before and after the attention and the MLP
sublayer); the reference builds each from ``2 * K`` coefficient, shift, product and sum ops. The
kernel (``metal/dynamic_conv.h``, one body for Metal and CUDA) does one thread per output element,
with the reference's arithmetic step by step (bit-identical in float32).

Only the drafter's per-round forward (:meth:`~mlx_dflash2.drafter.model.DraftModel.__call__`) routes
through the kernel; training and replay evaluation (``forward_blocks``) keep the reference, which MLX
can differentiate (``mx.fast`` kernels have no VJP), compiled forward and backward
(:func:`dynamic_conv_compiled`).
"""

from __future__ import annotations

import mlx.core as mx

from .registry import KernelOp, KernelSpec, device_input, int_params

__all__ = ["DynamicConv", "dynamic_conv", "dynamic_conv_reference", "dynamic_conv_compiled"]

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_NAMES = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}
THREADS = 256  # threads per threadgroup (elementwise)


def dynamic_conv_reference(x: mx.array, base_kernel: mx.array, delta: mx.array, side: int, group_size: int) -> mx.array:
    """Side ``side`` of the convolution in MLX ops (the CPU path and the kernel's yardstick).

    Args:
        x: ``[N, B, D]`` the input of the side (float).
        base_kernel: ``[2, K, D]`` static taps (side 0 = before the sublayer, 1 = after).
        delta: ``[N, B, 2, K, G]`` dynamic taps per group of ``group_size`` channels (``G * group_size == D``).
        side: 0 or 1.
        group_size: channels per group.

    Returns:
        ``[N, B, D]`` in ``x``'s dtype: ``y_t = sum_k (base[side, k] + delta[t, side, k, g(c)]) * x_{t-k}``,
        taps past the block start reading zeros, each term and partial sum in ``x``'s dtype.
    """
    n, B, D = x.shape
    out = None
    for k in range(base_kernel.shape[1]):
        if k >= B:
            break
        coef = base_kernel[side, k] + mx.repeat(delta[:, :, side, k, :], group_size, axis=-1)
        xs = x if k == 0 else mx.concatenate([mx.zeros((n, k, D), dtype=x.dtype), x[:, : B - k]], axis=1)
        term = coef.astype(x.dtype) * xs
        out = term if out is None else out + term
    return out


_COMPILED: dict = {}


def dynamic_conv_compiled(x: mx.array, base_kernel: mx.array, delta: mx.array, side: int, group_size: int) -> mx.array:
    """:func:`dynamic_conv_reference` for training: differentiable, its forward and its backward each one
    ``mx.compile``d function (one per ``(side, group_size)``, traced again per shape and dtype).

    Arguments and result as :func:`dynamic_conv_reference`, whose graph both compile: the same values
    (bit for bit on the 2-core CPU, float32 and bfloat16, values and gradients: tested); on a GPU the
    compiled kernels may contract a multiply-add where the eager ops round twice.

    Why: eagerly, a side's forward and backward are ~30 ops over ``[N, B, D]`` arrays (the per-group
    taps repeated to every channel, the shifted copies, their sums and the backward's group sums), each a
    launch and a pass over memory; a drafter layer runs four sides. On the H100 the four cost ~5 ms of a
    layer's ~10 ms forward + backward in issue 21's training step (``benchmarks/profile_train_step.py``),
    as much as the layer's attention and MLP together. ``mx.compile`` fuses each chain's elementwise ops;
    an ``mx.custom_function`` makes the backward one compiled function too (a compiled forward's vjp
    would otherwise run its ops eagerly).
    """
    fn = _COMPILED.get((side, group_size))
    if fn is None:
        def ref(x, b, d):
            return dynamic_conv_reference(x, b, d, side, group_size)

        fwd = mx.compile(ref)
        bwd = mx.compile(lambda x, b, d, ct: tuple(mx.vjp(ref, [x, b, d], [ct])[1]))

        @mx.custom_function
        def fn(x, b, d):
            return fwd(x, b, d)

        @fn.vjp
        def fn_vjp(primals, cotangent, output):
            ct = cotangent if isinstance(cotangent, mx.array) else cotangent[0]
            return bwd(*primals, ct)

        _COMPILED[(side, group_size)] = fn
    return fn(x, base_kernel, delta)


def _promoted(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    return (mx.zeros((0,), dtype=a) + mx.zeros((0,), dtype=b)).dtype  # lazy: nothing is computed


class DynamicConv(KernelOp):
    """The ``dynamic_conv`` op. Call: ``dynamic_conv(x, base_kernel, delta, side, group_size, mode=None)``
    with the arguments of :func:`dynamic_conv_reference` (same result; float32 bit for bit)."""

    name = "dynamic_conv"
    sources = {"cuda": "dynamic_conv.cu", "metal": "dynamic_conv.metal"}

    def reference(self, x, base_kernel, delta, side, group_size):
        return dynamic_conv_reference(x, base_kernel, delta, side, group_size)

    def supports(self, x, base_kernel, delta, side, group_size):
        if x.ndim != 3 or base_kernel.ndim != 3 or delta.ndim != 5 or side not in (0, 1):
            return False
        if x.dtype not in DTYPES or base_kernel.dtype not in DTYPES or delta.dtype not in DTYPES:
            return False
        N, B, D = x.shape
        K = base_kernel.shape[1]
        return (group_size >= 1 and D % group_size == 0 and base_kernel.shape == (2, K, D)
                and delta.shape == (N, B, 2, K, D // group_size) and N * B * D < 2**31
                and min(x.size, delta.size, base_kernel.size) >= 8)  # Metal: device pointers (device_input)

    def shape_key(self, x, base_kernel, delta, side, group_size):
        return (_NAMES[x.dtype], _NAMES[delta.dtype], _NAMES[base_kernel.dtype])

    def sample(self, key):
        tx, td, tb = (getattr(mx, t) for t in key)
        N, B, D, K, gs = 2, 16, 128, 2, 16
        r = mx.random.split(mx.random.key(11), 3)
        x = mx.random.normal((N, B, D), key=r[0]).astype(tx)
        base = mx.random.normal((2, K, D), key=r[1]).astype(tb)
        delta = (mx.random.normal((N, B, 2, K, D // gs), key=r[2]) * 0.3).astype(td)
        return (x, base, delta, 1, gs), {}

    def specs(self, backend):
        ex = [dict(T="float32", TD="float32", TB="float32", TC="float32"),
              dict(T="bfloat16", TD="bfloat16", TB="float32", TC="float32"),
              dict(T="float16", TD="float16", TB="float32", TC="float32"),
              dict(T="bfloat16", TD="bfloat16", TB="bfloat16", TC="bfloat16"),
              dict(T="float16", TD="float16", TB="float16", TC="float16")]
        tid = "int(blockIdx.x * blockDim.x + threadIdx.x)" if backend == "cuda" else "int(thread_position_in_grid.x)"
        header = "dynamic_conv." + ("cu" if backend == "cuda" else "metal")
        return {"conv": KernelSpec(
            "dflash_dynamic_conv", header=header, examples=ex,
            inputs=[("x", "T"), ("delta", "TD"), ("base", "TB"), ("params", "int32")], outputs=[("out", "T")],
            body=f"  dflash_dconv::dynamic_conv<T, TD, TB, TC>(x, delta, base, params, out, {tid});\n")}

    def launch(self, backend, x, base_kernel, delta, side, group_size):
        N, B, D = x.shape
        K = base_kernel.shape[1]
        params = int_params(N, B, D, K, D // group_size, group_size, side)
        total = N * B * D
        return self.kernel(backend, "conv")(
            inputs=[x, delta, base_kernel, params],
            template=[("T", x.dtype), ("TD", delta.dtype), ("TB", base_kernel.dtype),
                      ("TC", _promoted(base_kernel.dtype, delta.dtype))],
            grid=(-(-total // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(N, B, D)], output_dtypes=[x.dtype])[0]


dynamic_conv = DynamicConv()
