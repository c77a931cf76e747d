"""``verify_attention``: causal attention of up to 16 new query rows over a KV cache.

Used for the verify forward (B rows) and the plain step (1 row) alike, so both compute a row the same
way: the kernel is **row-count invariant** (``metal/verify_attention.h`` says how: keys split at fixed
absolute chunk and tile positions, causal and out-of-cache keys skipped exactly, fixed-order sums).
It also keeps the verify off MLX's CUDA cuDNN SDPA path, which builds a graph for every new key
length (60-75 ms per verify on the H200, and an error after a few hundred misses).

Reference: ``mx.fast.scaled_dot_product_attention`` with ``mask="causal"`` (bottom-right aligned)
for more than one row. :class:`KernelAttention` routes an mlx-lm attention module (llama, mistral,
qwen2, qwen3 families) through it.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from mlx_lm.models.base import scaled_dot_product_attention as _sdpa
from mlx_lm.models.cache import KVCache as _KVCache

from .qmm import KernelQuantizedLinear
from .registry import KernelOp, KernelSpec, int_params
from .rope import HEAD_DIMS as ROPE_HEAD_DIMS
from .rope import qk_norm_rope

__all__ = ["VerifyAttention", "verify_attention", "KernelAttention", "route_attention", "ATTENTION_CLASSES"]

MAX_ROWS = 16
CHUNK = 128  # keys per chunk, at fixed absolute positions (each block: one chunk, in TILES tiles of 32 keys)
TILE = 32  # keys per tile (metal/verify_attention.h: one per lane)
TILES = CHUNK // TILE
WARPS = 8  # warps per block: TILES tiles x 2 row subgroups
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)  # D: a multiple of 32, at most 256
# Threadgroup memory a block may use: Apple GPUs give a threadgroup 32 KB (M1-M4), CUDA 48 KB of static shared memory.
SHARED_BYTES = {"cuda": 48 * 1024, "metal": 32 * 1024}


def scratch_floats(D: int, rows: int, warps: int, kd: int) -> int:
    """Floats of the kernel's scratch: the warps' key sub-tiles (32 keys x ``kd`` dims, padded) or, reusing it, the
    merge's per-tile results (``TILES x rows x (D + 2)``), whichever is larger."""
    return max(warps * 32 * (kd + 1), TILES * rows * (D + 2))


def geometry(backend: str, D: int, R: int = 8, rows: int | None = None, warps: int = WARPS,
             kd: int | None = None, vb: int | None = None, pf: int | None = None) -> tuple[int, ...]:
    """``(TILES, ROWS, WARPS, KD, SCR, VB, PF)`` of the kernel for head dimension ``D`` and ``R`` query rows per kv head
    (``G * Lq``) on ``backend``: row groups of ``ROWS`` rows (the smallest of 2, 4, 8 covering ``R``, at most 8;
    ``rows`` forces it), each warp's key row staged ``KD`` dims at a time (32, else 16 or 8: the widest that fits),
    ``SCR`` scratch floats; everything within the backend's threadgroup memory (``ROWS * D + SCR`` floats).
    ``VB``: keys whose value rows a lane loads at once (8 for ``D <= 128``, else 4: registers); ``PF``: the next key
    sub-tile's loads issued before the current one's dot products (1) or after them (0). Neither changes an
    addition (they order loads only).
    The chunk (128 keys) and its tiles (32) never change, so a row's sums are split the same way whatever the
    number of rows beside it and whatever ``ROWS`` (the row-count invariance holds per backend and D).
    D = 128, 8 rows: 32-dim sub-tiles on CUDA (37.9 KB), 16 on Metal (21.4 KB).

    Raises:
        ValueError: no geometry fits (named), or ``vb`` does not divide 32.
    """
    budget = SHARED_BYTES.get(backend, SHARED_BYTES["metal"])
    vb = vb or (8 if D <= 128 else 4)
    pf = 1 if pf is None else int(bool(pf))
    if TILE % vb:
        raise ValueError(f"verify_attention: VB = {vb} does not divide the tile ({TILE} keys)")
    rw = warps // TILES
    want = rows or next((r for r in (2, 4, 8) if r >= R), 8)
    cands = [want] if rows else [r for r in (8, 4, 2) if r <= want and r % rw == 0]
    for r in cands:
        for k in ((kd,) if kd else (32, 16, 8)):
            if D % k:
                continue
            scr = scratch_floats(D, r, warps, k)
            if 4 * (r * D + scr) <= budget and warps % TILES == 0 and r % rw == 0:
                return TILES, r, warps, k, scr, vb, pf
    raise ValueError(f"verify_attention: no launch geometry fits D = {D} on {backend}")


DTYPES = (mx.bfloat16, mx.float16, mx.float32)
MAX_KEYS_ENV = "MLX_DFLASH2_ATTENTION_MAX_KEYS"


def max_keys() -> int | None:
    """The longest cache (keys) the kernel takes, from ``MLX_DFLASH2_ATTENTION_MAX_KEYS`` (unset, empty or ``0``:
    no limit). Past it the op runs its reference (MLX's attention): on the H200 the kernel's CUDA-core body was
    2.5-5.6x slower than MLX's attention at 8K keys (session 17), so a long-context user can trade the kernels'
    bit-exact greedy there (the near-tie contract then holds) for MLX's speed. Read per call (cheap).

    Raises:
        ValueError: not a non-negative integer (named).
    """
    v = os.environ.get(MAX_KEYS_ENV, "").strip()
    if v and not (v.isascii() and v.isdigit()):
        raise ValueError(f"{MAX_KEYS_ENV} must be a non-negative integer, got {v!r}")
    return int(v) or None if v else None


class VerifyAttention(KernelOp):
    """The ``verify_attention`` op. Call: ``verify_attention(q, keys, values, length, scale, mode=None)``.

    Args:
        q: ``[1, H, Lq, D]`` queries (RoPE applied) at positions ``length - Lq .. length - 1``.
        keys, values: ``[1, Hk, S, D]`` cache buffers whose first ``length`` rows are valid
            (``S >= length``; mlx-lm ``KVCache.keys`` / ``.values``), ``H % Hk == 0``.
        length: valid cache rows, the new ones included.
        scale: the softmax scale.

        layout: ``"heads"`` (default): the output ``[1, H, Lq, D]``; ``"rows"``: ``[1, Lq, H * D]``, what the layer's
            ``o_proj`` takes (the kernel writes it so: no transpose copy after it at Lq > 1).

    Returns:
        ``[1, H, Lq, D]`` (or ``[1, Lq, H * D]``) in the queries' dtype.
    """

    name = "verify_attention"
    sources = {"cuda": "verify_attention.cu", "metal": "verify_attention.metal"}

    def __init__(self):
        super().__init__()
        self._scales: dict = {}
        self._geo: dict = {}
    row_invariant = True
    tolerance = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 2e-2}

    def reference(self, q, keys, values, length, scale, config=None, layout="heads"):
        k, v = keys[..., :length, :], values[..., :length, :]
        mask = "causal" if q.shape[2] > 1 else None
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(1, q.shape[2], -1) if layout == "rows" else out

    def supports(self, q, keys, values, length, scale, config=None, layout="heads"):
        if (layout not in ("heads", "rows") or q.ndim != 4 or keys.ndim != 4 or q.shape[0] != 1 or keys.shape[0] != 1
                or q.dtype not in DTYPES):
            return False
        H, Lq, D = q.shape[1], q.shape[2], q.shape[3]
        Hk = keys.shape[1]
        mk = max_keys()
        return (1 <= Lq <= MAX_ROWS and D in HEAD_DIMS and H % Hk == 0 and keys.dtype == q.dtype
                and values.dtype == q.dtype and values.shape == keys.shape and keys.shape[3] == D
                and Lq <= length <= keys.shape[2] and (mk is None or length <= mk))

    def shape_key(self, q, keys, values, length, scale, config=None, layout="heads"):
        key = (str(q.dtype), int(q.shape[1]), int(keys.shape[1]), int(q.shape[3]))
        return key if layout == "heads" else key + (layout,)

    def sample(self, key):
        dtype, H, Hk, D = key[:4]
        dtype = getattr(mx, dtype.split(".")[-1])
        r = mx.random.split(mx.random.key(H * 7 + D), 3)
        L, S = 300, 320  # crosses a chunk boundary (256) and ends inside a tile
        q = mx.random.normal((1, H, MAX_ROWS, D), key=r[0]).astype(dtype)
        k = mx.random.normal((1, Hk, S, D), key=r[1]).astype(dtype)
        v = mx.random.normal((1, Hk, S, D), key=r[2]).astype(dtype)
        return (q, k, v, L, D**-0.5), ({"layout": key[4]} if len(key) > 4 else {})

    def check_invariance(self, be, args, kw, outs):
        """Row i of a 16-row call equals the 1-row call at that row's position (what plain decoding
        computes there), bit for bit."""
        q, k, v, L, scale = args
        Lq = q.shape[2]
        rows = kw.get("layout") == "rows"
        for i in (0, 5, Lq - 1):
            one = self.launch(be, q[:, :, i : i + 1], k, v, L - Lq + i + 1, scale, **kw)
            if not mx.array_equal(one, outs[0][:, i : i + 1] if rows else outs[0][:, :, i : i + 1]):
                return f"row {i} of a {Lq}-row call differs from the same row computed alone"
        return None

    def specs(self, backend):
        ex, ex2 = [], []
        for t in ("bfloat16", "float16", "float32"):
            for d in (64, 128, 256):
                for R in (2, 4, 64):  # every row-group size the geometry picks (2, 4, 8)
                    tiles, rows, warps, kd, scr, vb, pf = geometry(backend, d, R)
                    ex.append(dict(T=t, D=d, TILES=tiles, ROWS=rows, WARPS=warps, KD=kd, SCR=scr, VB=vb, PF=pf))
                ex2.append(dict(T=t, D=d))
        io1 = dict(inputs=[("q", "T"), ("k", "T"), ("v", "T"), ("params", "int32"), ("scale", "float32")],
                   outputs=[("part_o", "float32"), ("part_ml", "float32")])
        io2 = dict(inputs=[("part_o", "float32"), ("part_ml", "float32"), ("params", "int32")], outputs=[("out", "T")])
        call = ("dflash_attn::attn_partial<T, D, TILES, ROWS, WARPS, KD, SCR, VB, PF>(q, k, v, params, scale, part_o, part_ml, "
                "tq, scr, ")
        # the cache length and the K/V head strides are read from the views' shapes and strides
        lens = "k_shape[2], (long)k_strides[1], (long)v_strides[1]"
        if backend == "cuda":
            tg, ids = "__shared__", ("blockIdx.x / n_rg, blockIdx.y, blockIdx.x % n_rg, threadIdx.x / 32, threadIdx.x % 32",
                                      "blockIdx.x * blockDim.x + threadIdx.x")
        else:
            tg, ids = "threadgroup", ("int(threadgroup_position_in_grid.x) / n_rg, int(threadgroup_position_in_grid.y), "
                                      "int(threadgroup_position_in_grid.x) % n_rg, int(simdgroup_index_in_threadgroup), "
                                      "int(thread_index_in_simdgroup)", "int(thread_position_in_grid.x)")
        header = "verify_attention." + ("cu" if backend == "cuda" else "metal")
        return {
            "partial": KernelSpec(
                "dflash_attn_partial", header=header, examples=ex, contiguous=False,
                body=f"  {tg} float tq[ROWS * D];\n  {tg} float scr[SCR];\n"
                     f"  const int n_rg = params[3];\n  {call}{ids[0]}, {lens});\n", **io1),
            "combine": KernelSpec(
                "dflash_attn_combine", header=header, examples=ex2,
                body=f"  const int t = {ids[1]};\n"
                     "  const int n_chunks = int(part_ml_shape[0]) / (2 * params[0] * params[2]);\n"
                     "  dflash_attn::attn_combine<T, D>(part_o, part_ml, params, out, t / 32, t % 32, n_chunks);\n",
                **io2),
        }

    def fast_key(self, args, kw):
        # the decision depends on shapes and dtypes only, once the length is in range (checked per call)
        if kw.get("config") is not None or len(args) != 5:
            return None
        q, keys, values, length, _ = args
        if q.ndim != 4 or keys.ndim != 4 or not q.shape[2] <= length <= keys.shape[2] or values.shape != keys.shape:
            return None
        mk = max_keys()
        return (q.shape, q.dtype, keys.shape[1], keys.shape[3], keys.dtype, values.dtype, mk is not None and length > mk,
                kw.get("layout", "heads"))

    def _geometry(self, backend, shape, Hk, dtype, config, layout="heads"):
        """What a call signature's launches share, worked out once (the host builds one call per layer per
        forward: session 17's H200 profile measured 35 us per call here against 7 us for MLX's attention)."""
        key = (backend, shape, Hk, dtype, config, layout)
        geo = self._geo.get(key)
        if geo is None:
            _, H, Lq, D = shape
            R = (H // Hk) * Lq
            cfg = dict(zip(("rows", "warps", "kd", "vb", "pf"), config or ()))
            tiles, rows, warps, kd, scr, vb, pf = geometry(backend, D, R, **cfg)
            n_rg = -(-R // rows)
            rows_total = Hk * R
            geo = self._geo[key] = (
                CHUNK, n_rg, warps, rows_total,
                int_params(H, Hk, Lq, n_rg, int(layout == "rows")),  # the length travels as a view's shape
                [("T", dtype), ("D", D), ("TILES", tiles), ("ROWS", rows), ("WARPS", warps), ("KD", kd),
                 ("SCR", scr), ("VB", vb), ("PF", pf)],
                (warps * 32, 1, 1), [mx.float32, mx.float32],
                [("T", dtype), ("D", D)], (-(-rows_total // 4) * 128, 1, 1),  # whole groups; extra rows return
                [(1, Lq, H * D) if layout == "rows" else (1, H, Lq, D)], [dtype])
        return geo

    def launch(self, backend, q, keys, values, length, scale, config=None, layout="heads"):
        """``config``: ``(ROWS, WARPS, KD, VB, PF)`` (a prefix of it) in place of the geometry's choice (benchmarks'
        geometry sweep only; the chunk and tiles stay, so a row's bits do not change)."""
        chunk, n_rg, warps, rows_total, params, tmpl, tg, f32s, tmpl2, grid2, out_shape, out_dtype = \
            self._geometry(backend, q.shape, keys.shape[1], q.dtype, config, layout)
        sc = self._scales.get(scale)
        if sc is None:
            sc = self._scales[scale] = mx.array([scale] + [0.0] * 7, dtype=mx.float32)
            mx.eval(sc)
        n_chunks = -(-length // chunk)
        D = q.shape[3]
        part_o, part_ml = self.kernel(backend, "partial")(
            inputs=[mx.contiguous(q), keys[:, :, :length], values[:, :, :length], params, sc],
            template=tmpl, grid=(n_chunks * n_rg * warps * 32, keys.shape[1], 1), threadgroup=tg,
            output_shapes=[(rows_total * n_chunks * D,), (rows_total * n_chunks * 2,)], output_dtypes=f32s)
        return self.kernel(backend, "combine")(
            inputs=[part_o, part_ml, params], template=tmpl2, grid=grid2, threadgroup=(128, 1, 1),
            output_shapes=out_shape, output_dtypes=out_dtype)[0]


verify_attention = VerifyAttention()

# the gated attention of the hybrid targets (qwen3_next, and qwen3_5 which imports it): q_proj gives each head's
# query and output gate side by side, the output is o_proj(attention * sigmoid(gate)), RoPE on a part of the head
GATED_ATTENTION = "mlx_lm.models.qwen3_next.Qwen3NextAttention"
# mlx-lm attention classes whose __call__ is q/k/v projections -> (q/k norm) -> RoPE at the cache offset
# -> cache.update_and_fetch -> scaled_dot_product_attention -> o_proj (checked by the target's parity probe)
ATTENTION_CLASSES = ("mlx_lm.models.llama.Attention", "mlx_lm.models.mistral.Attention",
                     "mlx_lm.models.qwen2.Attention", "mlx_lm.models.qwen3.Attention",
                     GATED_ATTENTION)


def _solo_offset(cache) -> int:
    """The (int) offset of the one sequence of a fast-path cache (:meth:`KernelAttention.fast`): RoPE's position and
    the cache's length, as in the solo loop's ``KVCache``, whatever the cache's kind."""
    return cache.offset if type(cache) is _KVCache else cache.solo_length()


class KernelAttention(nn.Module):
    """An mlx-lm attention module of a supported family (:data:`ATTENTION_CLASSES`: llama, mistral, qwen2, qwen3,
    and the hybrids' gated attention) whose attention core goes through
    :data:`verify_attention` when the new rows are at most 16 and the cache is a plain ``KVCache``
    (prefill chunks and other caches keep mlx-lm's ``scaled_dot_product_attention``). The module's
    own projections, norms and RoPE are reused (not copied); routed q, k and v projections
    (:func:`~.qmm.route_quantized_linears` first) are fused into one ``qmm`` call over their
    concatenated rows (:func:`~.qmm.fuse_linears`; one launch instead of three per layer).
    """

    def __init__(self, attn: nn.Module, mode: str | None = None):
        from .qmm import fusable, fuse_linears

        super().__init__()
        self.inner = attn
        self.kernel_mode = mode
        parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        qkv, splits = None, None
        if fusable(parts):  # q, k and v in one qmm call (their layers rebound to row views of the fused arrays)
            nq, nk = (int(p["weight"].shape[0]) for p in parts[:2])
            qkv, splits = fuse_linears(parts, mode), (nq, nq + nk)
        # plain attributes, outside the module tree (the fused arrays are the views' buffers: not listed twice)
        object.__setattr__(self, "qkv", qkv)
        object.__setattr__(self, "splits", splits)
        # what __call__ reads every call and nothing re-routes: head counts, scale, the q/k norms, RoPE
        # (session 17's H200 profile: nn.Module attribute lookups were ~10 us of a layer's graph build)
        norms = (attn.q_norm, attn.k_norm) if "q_norm" in attn else None
        gated = f"{type(attn).__module__}.{type(attn).__name__}" == GATED_ATTENTION
        heads = (attn.num_attention_heads, attn.num_key_value_heads) if gated else (attn.n_heads, attn.n_kv_heads)
        object.__setattr__(self, "fixed", (*heads, attn.scale, norms, attn.rope, gated))
        object.__setattr__(self, "fused_rope", self._fused_rope(qkv, splits, heads, norms, attn.rope, gated))

    @staticmethod
    def _fused_rope(qkv, splits, heads, norms, rope, gated) -> bool:
        """Whether the heads' norms, RoPE and layout go through :data:`~.rope.qk_norm_rope` (one launch): q, k and v
        fused, not gated, ``nn.RoPE`` of the whole head (non-traditional, scale 1), RMS norms on q and k (one epsilon)
        or none."""
        if qkv is None or gated or type(rope) is not nn.RoPE or rope.traditional or rope.scale != 1.0:
            return False
        nh, nkv = heads
        D, rem = divmod(splits[0], nh)
        if rem or D not in ROPE_HEAD_DIMS or rope.dims != D or splits[1] - splits[0] != nkv * D:
            return False
        return norms is None or (all(type(n) is nn.RMSNorm for n in norms) and norms[0].eps == norms[1].eps)

    def project(self, x):
        """The queries, keys and values of ``x`` ``[B, L, D]`` before RoPE: ``(q [B, H, L, Dh], k, v
        [B, Hk, L, Dh], gate [B, L, H * Dh] or None)`` (``gate``: the gated attention's output gate)."""
        a = self.inner
        B, L, _ = x.shape
        nh, nkv, _, norms, _, gated = self.fixed  # plain attributes: no nn.Module lookups per call
        if self.qkv is not None:
            y, (i, j) = self.qkv(x), self.splits
            q, k, v = y[..., :i], y[..., i:j], y[..., j:]
        else:
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        q = q.reshape(B, L, nh, -1)
        gate = None
        if gated:  # each head's query, then its output gate (mlx-lm's Qwen3NextAttention)
            q, gate = mx.split(q, 2, axis=-1)
            gate = gate.reshape(B, L, -1)
        k = k.reshape(B, L, nkv, -1)
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = v.reshape(B, L, nkv, -1).transpose(0, 2, 1, 3)
        return q, k, v, gate

    def output(self, out, gate, residual=None):
        """``o_proj`` of the attention's output ``out`` ``[B, H, L, Dh]`` or, laid out already, ``[B, L, H * Dh]``
        (times ``sigmoid(gate)`` where gated): ``[B, L, D]``; plus ``residual`` ``[B, L, D]`` where given (the
        layer's ``x + attention(x)``: one ``qmm`` launch with ``o_proj`` where that is routed)."""
        if out.ndim == 4:
            B, _, L, _ = out.shape
            out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        out = out * mx.sigmoid(gate) if gate is not None else out
        o_proj = self.inner.o_proj
        if residual is not None and isinstance(o_proj, KernelQuantizedLinear):
            return o_proj.fused(out, residual)
        y = o_proj(out)
        return y if residual is None else residual + y

    def fast(self, cache, mask, B: int, L: int) -> bool:
        """Whether the attention core of a call goes through :data:`verify_attention`: at most 16 new rows of one
        sequence, a plain ``KVCache`` with the causal mask (or none), or a batch's cache holding one sequence
        (:meth:`~mlx_dflash2.batch.RaggedKVCache.solo_length`: a batch of one, whose mask is that causal mask as
        an array)."""
        if B != 1 or L > MAX_ROWS:
            return False
        if type(cache) is _KVCache:
            return mask is None or (isinstance(mask, str) and mask == "causal")
        solo = getattr(cache, "solo_length", None)
        return solo is not None and solo() is not None

    def attend(self, q, k, v, mask=None, cache=None):
        """RoPE at the cache's offset, the cache update and the attention core of projected ``q, k, v``."""
        _, _, scale, _, rope, _ = self.fixed
        if cache is None:
            return _sdpa(rope(q), rope(k), v, cache=None, scale=scale, mask=mask)
        if not self.fast(cache, mask, q.shape[0], q.shape[2]):
            q, k = rope(q, offset=cache.offset), rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
            return _sdpa(q, k, v, cache=cache, scale=scale, mask=mask)
        off = _solo_offset(cache)
        q, k = rope(q, offset=off), rope(k, offset=off)
        cache.update_and_fetch(k, v)
        return verify_attention(q, cache.keys, cache.values, off + q.shape[2], scale, mode=self.kernel_mode)

    def attend_rows(self, y, cache):
        """The attention core from the fused projection's output ``y`` ``[1, L, (H + 2 Hk) * D]`` on the fast path
        (:meth:`fast`, :attr:`fused_rope`): the heads' norms, RoPE at the cache's offset and layout in one
        :data:`~.rope.qk_norm_rope` launch, the cache update, :data:`verify_attention`: ``[1, L, H * D]`` (o_proj's
        layout, written so by the kernel)."""
        nh, nkv, scale, norms, rope, _ = self.fixed
        off = _solo_offset(cache)
        if norms is None:
            qw = kw = None
            eps = 0.0
        else:
            qw, kw, eps = norms[0]["weight"], norms[1]["weight"], norms[0].eps
        q, k, v = qk_norm_rope(y, qw, kw, nh, nkv, eps, rope.base, off, mode=self.kernel_mode)
        cache.update_and_fetch(k, v)
        return verify_attention(q, cache.keys, cache.values, off + q.shape[2], scale, mode=self.kernel_mode,
                                layout="rows")

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        if self.fused_rope and cache is not None and self.fast(cache, mask, B, L):
            return self.output(self.attend_rows(self.qkv(x), cache), None)
        q, k, v, gate = self.project(x)
        return self.output(self.attend(q, k, v, mask, cache), gate)


def route_attention(layers, mode: str | None = None) -> list[tuple]:
    """Wrap the ``self_attn`` of every decoder layer in ``layers`` whose class is in
    :data:`ATTENTION_CLASSES` with :class:`KernelAttention` (this model instance only).

    Returns:
        The swaps ``[(layer, "self_attn", original)]`` (``kernels.qmm.undo_routes`` restores them).
    """
    swaps = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and f"{type(attn).__module__}.{type(attn).__name__}" in ATTENTION_CLASSES:
            swaps.append((layer, "self_attn", attn))
            layer.self_attn = KernelAttention(attn, mode)
    return swaps
