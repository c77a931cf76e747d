"""``greedy_accept``: greedy verification of a draft (DFlash2 spec §2.3) fused into two small launches.

For the ``n + 1`` verify rows (after the request's logits processors) the target's argmaxes are the
emitted tokens, and the number of accepted drafts is the longest prefix with ``d_i == argmax(row_{i-1})``.
The reference (:func:`greedy_accept_reference`, what :class:`~mlx_dflash2.verify.GreedyVerifier` ran)
takes an argmax, a cast, a comparison, a cumulative product and a sum; the kernel
(``metal/greedy_accept.h``, one body for Metal and CUDA) takes one row-argmax launch (one threadgroup
per row, for vocabularies up to ~152K) and one tiny accept launch, so the round still reads the host
once. The log-probabilities stay in MLX. Comparisons only: the outputs equal the reference's exactly.
"""

from __future__ import annotations

import mlx.core as mx

from .registry import KernelOp, KernelSpec, device_input, int_params

__all__ = ["GreedyAccept", "greedy_accept", "greedy_accept_reference", "TPB"]

TPB = 1024  # threads per row
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_NAMES = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}


_zero: list = []


def _no_accept() -> mx.array:
    """The int32 scalar 0, made and evaluated once: a plain step (no drafts) must not create a host array per
    step (on MLX's CUDA backend one made while the GPU runs a queued step stalls the pipeline)."""
    if not _zero:
        z = mx.array(0, dtype=mx.int32)
        mx.eval(z)
        _zero.append(z)
    return _zero[0]


def greedy_accept_reference(logits: mx.array, draft: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy acceptance in MLX ops.

    Args:
        logits: float ``[n + 1, V]`` processed verify rows (row ``i``: the token after position ``i``).
        draft: int ``[n]`` draft tokens ``d_1..d_n`` (``n`` may be 0).

    Returns:
        ``(num_accepted, tokens)``: int32 scalar ``a`` in ``0..n`` and int32 ``[n + 1]`` the rows'
        argmaxes (first index of the maximum, as ``mx.argmax``).
    """
    target = mx.argmax(logits, axis=-1).astype(mx.int32)
    if draft.shape[0] == 0:
        return _no_accept(), target
    match = (draft.astype(mx.int32) == target[:-1]).astype(mx.int32)
    return mx.cumprod(match).sum(), target


class GreedyAccept(KernelOp):
    """The ``greedy_accept`` op. Call: ``greedy_accept(logits, draft, mode=None)`` with the arguments
    of :func:`greedy_accept_reference` (same outputs)."""

    name = "greedy_accept"
    sources = {"cuda": "greedy_accept.cu", "metal": "greedy_accept.metal"}

    def reference(self, logits, draft):
        return greedy_accept_reference(logits, draft)

    def supports(self, logits, draft):
        # no drafts (the plain step): MLX's argmax alone, one op (the kernel path is two launches and a pad)
        return (draft.ndim == 1 and draft.shape[0] > 0 and logits.ndim == 2 and logits.dtype in DTYPES and draft.ndim == 1
                and mx.issubdtype(draft.dtype, mx.integer) and draft.shape[0] == logits.shape[0] - 1
                and 1 <= logits.shape[1] < 2**31 and logits.size >= 8)  # Metal: device pointers (device_input)

    def shape_key(self, logits, draft):
        return (_NAMES[logits.dtype],)

    def fast_key(self, args, kw):
        logits, draft = args
        return (logits.shape, logits.dtype, draft.shape, draft.dtype)

    def sample(self, key):
        """Nine rows over a vocabulary not a multiple of :data:`TPB`: planted maxima (the first of two
        equal ones in row 2, index 0 and ``V - 1``), a row of ``-inf``; the first six drafts match."""
        dtype = getattr(mx, key[0])
        rows, V = 9, 5003
        x = mx.random.normal((rows, V), key=mx.random.key(3))
        best = [17, 4000, 100, 0, V - 1, 0, 2500, 3, 4999]
        for i, p in enumerate(best):
            x[i, p] = 10.0
        x[2, 107] = 10.0  # a tie: index 100 wins
        x[3] = -mx.inf  # all -inf: index 0
        draft = mx.array(best[:6] + [best[6] + 1, best[7], best[8]], dtype=mx.int32)[: rows - 1]
        return (x.astype(dtype), draft), {}

    def specs(self, backend):
        ex = [dict(T=t, TPB=TPB) for t in ("float32", "bfloat16", "float16")]
        if backend == "cuda":
            tg = "__shared__"
            ids = "int(blockIdx.x), int(threadIdx.x) / 32, int(threadIdx.x) % 32"
            tid = "int(blockIdx.x * blockDim.x + threadIdx.x)"
        else:
            tg = "threadgroup"
            ids = ("int(threadgroup_position_in_grid.x), int(simdgroup_index_in_threadgroup), "
                   "int(thread_index_in_simdgroup)")
            tid = "int(thread_position_in_grid.x)"
        header = "greedy_accept." + ("cu" if backend == "cuda" else "metal")
        return {
            "argmax": KernelSpec(
                "dflash_row_argmax", header=header, examples=ex,
                inputs=[("logits", "T"), ("params", "int32")], outputs=[("tokens", "int32")],
                body=f"  {tg} float wv[32];\n  {tg} int wi[32];\n"
                     f"  dflash_acc::row_argmax<T, TPB>(logits, params, tokens, wv, wi, {ids});\n"),
            "accept": KernelSpec(
                "dflash_greedy_accept", header=header, examples=[{}],
                inputs=[("tokens", "int32"), ("draft", "int32"), ("params", "int32")], outputs=[("num", "int32")],
                body=f"  dflash_acc::accept(tokens, draft, params, num, {tid});\n"),
        }

    def launch(self, backend, logits, draft):
        rows, V = logits.shape
        n = rows - 1
        params = int_params(V, n)
        tokens = self.kernel(backend, "argmax")(  # >= 8 entries: the accept kernel's device input
            inputs=[logits, params], template=[("T", logits.dtype), ("TPB", TPB)],
            grid=(rows * TPB, 1, 1), threadgroup=(TPB, 1, 1),
            output_shapes=[(max(rows, 8),)], output_dtypes=[mx.int32])[0]
        d = device_input(draft.astype(mx.int32))  # n = 0 too: the accept kernel reads none of it
        num = self.kernel(backend, "accept")(
            inputs=[tokens, d, params], grid=(32, 1, 1), threadgroup=(32, 1, 1),
            output_shapes=[(1,)], output_dtypes=[mx.int32])[0]
        return num.reshape(()), tokens[:rows]


greedy_accept = GreedyAccept()
