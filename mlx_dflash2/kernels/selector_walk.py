"""``selector_walk``: DFlash2's candidate-selector greedy walk (spec §5.5) in one launch.

The selector scores slot ``t``'s top-K candidates ``b`` given the token ``a`` chosen at slot ``t-1``
(the anchor for ``t = 0``): ``S_t(a, b) = U_t(b) + sum_r A[a, r] * H_t[r] * Bc[b, r]``
(:class:`~mlx_dflash2.drafter.model.CandidateSelector`). The reference builds the whole lattice
(:func:`lattice_scores`) and walks it with ``T`` rounds of small ops (:func:`walk_lattice`); the
kernel (``metal/selector_walk.h``, one body for Metal and CUDA) walks all ``T`` steps in one launch,
scoring only the realised row of each step.

What stays in MLX (:meth:`CandidateSelector.candidates`): the top-K candidates (``top_k_ids``),
their unary scores (float32) and the hidden projection ``H`` (a matmul of the drafter's states).
The kernel reads the codebook rows it needs itself.

Exactness: the kernel's tokens equal the reference's. Both compute every score as the same float32
number: products rounded in one order (``Bc * H``, then ``A *``), the sum over the rank in one
fixed tree (:func:`tree_sum`, which the kernel's lane-local sums and xor butterfly reproduce add for
add), then ``U +``; and the argmax is MLX's (first index of the maximum; NaN counts as the maximum).
Sampled walks (temperature > 0) stay on the reference (:func:`walk_lattice`): their proposal rows
``q`` come from the same lattice.
"""

from __future__ import annotations

import mlx.core as mx

from .registry import KernelOp, KernelSpec, device_input, int_params

__all__ = ["SelectorWalk", "selector_walk", "tree_sum", "lattice_scores", "walk_lattice", "MAX_K", "MAX_RANK"]

MAX_K = 32  # candidates per slot: one warp / SIMD group each, at most 1024 threads
MAX_RANK = 1024  # selector rank: at most 32 tree leaves per lane
CODEBOOK_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_NAMES = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}


def _pow2(r: int) -> int:
    return 1 << max(r - 1, 0).bit_length()


def tree_sum(x: mx.array) -> mx.array:
    """Sum over the last axis in a fixed order: zero-padded to a power of two ``P``, then halving
    levels ``x[..., :n/2] + x[..., n/2:]`` down to one (the selector kernel's order, add for add).

    Args:
        x: float ``[..., R]``.

    Returns:
        ``[...]`` in ``x``'s dtype.
    """
    R = x.shape[-1]
    P = _pow2(R)
    if P != R:
        x = mx.concatenate([x, mx.zeros(x.shape[:-1] + (P - R,), dtype=x.dtype)], axis=-1)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def lattice_scores(cand: mx.array, u: mx.array, H: mx.array, pred_codebook: mx.array, succ_codebook: mx.array,
                   anchor: mx.array) -> tuple[mx.array, mx.array | None]:
    """Edge scores of ``M`` blocks' lattices, in float32.

    Args:
        cand: int32 ``[M, T, K]`` candidate ids of slots 1..T.
        u: float32 ``[M, T, K]`` their unary scores (``-inf`` for invalid ids).
        H: float32 ``[M, T, r]`` the hidden projection of each slot.
        pred_codebook, succ_codebook: ``[V, r]`` (``A`` and ``Bc``).
        anchor: int ``[M]`` anchor ids.

    Returns:
        ``(first [M, K], edges [M, T-1, K, K] or None)``: slot-1 scores given the anchor and, for
        t >= 2, slot t's candidates (columns) given each candidate of slot t-1 (rows):
        ``u + tree_sum(A[a] * (Bc[b] * H))``.
    """
    succ = succ_codebook[cand].astype(mx.float32) * H[..., None, :]  # [M, T, K, r]
    pred0 = pred_codebook[anchor].astype(mx.float32)  # [M, r]
    first = u[:, 0] + tree_sum(pred0[:, None, :] * succ[:, 0])
    edges = None
    if cand.shape[1] > 1:
        pred = pred_codebook[cand[:, :-1]].astype(mx.float32)  # [M, T-1, K, r]
        edges = u[:, 1:, None, :] + tree_sum(pred[..., :, None, :] * succ[:, 1:, None, :, :])  # [M, T-1, K, K]
    return first, edges


def walk_lattice(cand: mx.array, first: mx.array, edges: mx.array | None, temperature: float = 0.0,
                 key: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
    """Walk ``M`` lattices left to right: greedy (``temperature == 0``: the argmax of each realised
    row) or sampled (``softmax(row / temperature)``, one key per slot split from ``key``; the global
    random state if ``key`` is ``None``).

    Returns:
        ``(tokens int32 [M, T], q float32 [M, T, K] or None)``: ``q`` holds the realised rows'
        distributions of a sampled walk.
    """
    M, T, K = cand.shape
    idx, qs = [], []
    keys = mx.random.split(key, T) if (temperature > 0 and key is not None) else [None] * T
    rows = mx.arange(M)
    for t in range(T):
        row = first if t == 0 else edges[rows, t - 1, idx[-1]]  # [M, K]
        if temperature > 0:
            logits = row / temperature
            qs.append(mx.softmax(logits, axis=-1))
            i = mx.random.categorical(logits, key=keys[t])
        else:
            i = mx.argmax(row, axis=-1)
        idx.append(i)
    idx = mx.stack(idx, axis=1)  # [M, T]
    tokens = mx.take_along_axis(cand, idx[..., None], axis=-1)[..., 0]
    return tokens, (mx.stack(qs, axis=1) if qs else None)


class SelectorWalk(KernelOp):
    """The ``selector_walk`` op (greedy). Call:
    ``selector_walk(cand, u, H, pred_codebook, succ_codebook, anchor, mode=None)`` with the
    arguments of :func:`lattice_scores`.

    Returns:
        int32 ``[M, T]``: the greedy walk's tokens (:func:`walk_lattice` at temperature 0).
    """

    name = "selector_walk"
    sources = {"cuda": "selector_walk.cu", "metal": "selector_walk.metal"}

    def reference(self, cand, u, H, pred_codebook, succ_codebook, anchor):
        first, edges = lattice_scores(cand, u, H, pred_codebook, succ_codebook, anchor)
        return walk_lattice(cand, first, edges)[0]

    def supports(self, cand, u, H, pred_codebook, succ_codebook, anchor):
        if cand.ndim != 3 or u.shape != cand.shape or H.ndim != 3 or pred_codebook.ndim != 2:
            return False
        M, T, K = cand.shape
        R = H.shape[-1]
        return (cand.dtype == mx.int32 and u.dtype == mx.float32 and H.dtype == mx.float32
                and H.shape[:2] == (M, T) and 1 <= K <= MAX_K and 1 <= R <= MAX_RANK and T >= 1
                and pred_codebook.shape[1] == R and succ_codebook.shape == pred_codebook.shape
                and pred_codebook.dtype in CODEBOOK_DTYPES and succ_codebook.dtype == pred_codebook.dtype
                and anchor.shape == (M,) and mx.issubdtype(anchor.dtype, mx.integer)
                and min(cand.size, H.size, pred_codebook.size) >= 8)  # Metal: device pointers (device_input)

    def shape_key(self, cand, u, H, pred_codebook, succ_codebook, anchor):
        return (_NAMES[pred_codebook.dtype], int(H.shape[-1]))

    def sample(self, key):
        """Random lattices with exact ties (integer unary scores, zero successor rows), ``-inf``
        unary scores, and a row whose candidates all score ``-inf``."""
        dtype, R = key
        dtype = getattr(mx, dtype)
        M, T, K, V = 3, 15, 16, 1000
        r = mx.random.split(mx.random.key(R), 6)
        cand = mx.argsort(mx.random.uniform(shape=(M, T, V), key=r[0]), axis=-1)[..., :K].astype(mx.int32)
        u = mx.round(mx.random.normal((M, T, K), key=r[1]) * 2)
        u = mx.where(mx.random.uniform(shape=(M, T, K), key=r[2]) < 0.1, -mx.inf, u)
        u[1, 3] = -mx.inf
        H = mx.random.normal((M, T, R), key=r[3])
        A = mx.random.normal((V, R), key=r[4]).astype(dtype)
        Bc = mx.random.normal((V, R), key=r[5]).astype(dtype) * (mx.arange(V) % 3 != 0)[:, None].astype(dtype)
        anchor = mx.array([5, 17, 999], dtype=mx.int32)
        return (cand, u, H, A, Bc, anchor), {}

    def specs(self, backend):
        ex = [dict(TC=t, R=r, P=_pow2(r)) for t in ("float32", "bfloat16", "float16") for r in (8, 32, 64, 128)]
        ex += [dict(TC="float32", R=r, P=_pow2(r)) for r in (1, 48, 256, 1024)]
        if backend == "cuda":
            tg, ids = "__shared__", "int(blockIdx.x), int(threadIdx.x) / 32, int(threadIdx.x) % 32"
        else:
            tg, ids = "threadgroup", ("int(threadgroup_position_in_grid.x), int(simdgroup_index_in_threadgroup), "
                                      "int(thread_index_in_simdgroup)")
        header = "selector_walk." + ("cu" if backend == "cuda" else "metal")
        return {"walk": KernelSpec(
            "dflash_selector_walk", header=header, examples=ex,
            inputs=[("cand", "int32"), ("unary", "float32"), ("hproj", "float32"), ("pred", "TC"), ("succ", "TC"),
                    ("anchor", "int32"), ("params", "int32")],
            outputs=[("tokens", "int32")],
            body=f"  {tg} float sc[32];\n  {tg} int prev[1];\n"
                 f"  dflash_sel::selector_walk<TC, R, P>(cand, unary, hproj, pred, succ, anchor, params, tokens, sc, "
                 f"prev, {ids});\n")}

    def launch(self, backend, cand, u, H, pred_codebook, succ_codebook, anchor):
        M, T, K = cand.shape
        R = H.shape[-1]
        params = int_params(M, T, K)
        return self.kernel(backend, "walk")(
            inputs=[cand, u, H, pred_codebook, succ_codebook, device_input(anchor.astype(mx.int32)), params],
            template=[("TC", pred_codebook.dtype), ("R", R), ("P", _pow2(R))],
            grid=(M * K * 32, 1, 1), threadgroup=(K * 32, 1, 1),
            output_shapes=[(M, T)], output_dtypes=[mx.int32])[0]


selector_walk = SelectorWalk()
