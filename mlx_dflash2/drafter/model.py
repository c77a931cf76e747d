"""MLX DFlash / DFlash2 block drafters.

Implements the published architectures ``DFlashDraftModel`` and
``DFlash2DraftModel`` (DFlash2 spec §1 and §5; reference code z-lab/dflash
``dflash/model_mlx.py``, SpecForge ``specforge/modeling/draft/dflash2.py``):

* context features: ``hidden_norm(fc(concat(taps)))`` per committed token,
  injected as extra keys/values into every drafter layer (KV injection, §1.3);
  their K/V are computed once per committed token and cached
  (:class:`DraftContext`), the block's own K/V never are;
* block ``[anchor, mask x (B-1)]`` embedded with the *target's* embedding,
  positions ``P .. P+B-1`` (``P`` = committed tokens), RoPE with the drafter's
  own settings (§1.6);
* in-block attention causal or bidirectional per ``is_causal``; sliding-window
  layers see the last ``sliding_window - 1`` context rows (§1.5);
* Qwen3-style pre-norm layers (q/k RMSNorm, SiLU-gated MLP, no biases);
* DFlash2: a two-tap grouped dynamic causal convolution before and after every
  attention and MLP sublayer (§5.4) and the candidate selector (§5.5);
* output: final norm, the *target's* LM head for block positions 1..B-1, then
  ``output_multiplier`` and the logit softcap (§1.4).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from ..kernels.dynamic_conv import dynamic_conv, dynamic_conv_compiled
from ..kernels.selector_walk import lattice_scores, selector_walk, walk_lattice
from .config import DrafterConfig

__all__ = [
    "DraftModel",
    "DraftContext",
    "DEFAULT_CONTEXT_WINDOW",
    "DEFAULT_CONTEXT_SLACK",
    "GroupedDynamicCausalConv",
    "CandidateSelector",
    "SelectorOutput",
    "top_k_ids",
]


class DraftAttention(nn.Module):
    """Attention over ``[context K/V ; block K/V]`` (spec §1.3)."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, hd
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(hd, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings)
        self.causal = cfg.layer_is_causal(layer_idx)
        self.window = cfg.sliding_window if cfg.layer_is_sliding(layer_idx) else None
        object.__setattr__(self, "_fused", None)  # (fused q/k/v layer, kernel mode) once routed (DraftModel.route_kernels)

    def route(self, mode: str | None) -> bool:
        """Fuse the routed q, k and v projections into one ``qmm`` call whose output's heads get their norms, RoPE and
        layout from one :data:`~mlx_dflash2.kernels.qk_norm_rope` launch (the block's forward: one launch where there
        were seven or more); the three layers are rebound to row views of the fused weights (the same values: the
        context's keys and values still use ``k_proj`` and ``v_proj``). Only where the kernel computes what this
        module does: plain ``nn.RoPE`` of the whole head (non-traditional, scale 1), q/k RMS norms of one epsilon.

        Returns:
            Whether the block's projections are fused.
        """
        from ..kernels.qmm import fusable, fuse_linears
        from ..kernels.rope import HEAD_DIMS

        rope = self.rope
        ok = (fusable([self.q_proj, self.k_proj, self.v_proj]) and type(rope) is nn.RoPE and not rope.traditional
              and rope.scale == 1.0 and rope.dims == self.head_dim and self.head_dim in HEAD_DIMS
              and self.q_norm.eps == self.k_norm.eps)
        object.__setattr__(self, "_fused", (fuse_linears([self.q_proj, self.k_proj, self.v_proj], mode), mode)
                           if ok else None)
        return ok

    def unroute(self) -> None:
        """Back to the three projections (:meth:`route`'s views hold the same values)."""
        object.__setattr__(self, "_fused", None)

    def kv(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Keys/values of rows ``x`` ``[N, L, D]`` at positions ``offset..``: ``[N, KV, L, hd]`` each."""
        n, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(n, L, self.n_kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(n, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def __call__(self, x: mx.array, ctx_k: mx.array | None, ctx_v: mx.array | None, offset: int,
                 queries: int | None = None) -> mx.array:
        """Block rows ``x`` ``[1, B, D]`` at positions ``offset..offset+B-1``.

        ``ctx_k/ctx_v``: ``[1, KV, S, hd]`` cached context (positions
        ``offset-S .. offset-1``) or None. ``queries``: the output of the first
        ``queries`` rows only (``[1, queries, D]``): the attention runs for
        every row as before (its matmuls keep their shapes, so their values), the
        output projection for those rows only.
        """
        n, B, _ = x.shape
        if self._fused is not None and n == 1 and isinstance(offset, int):
            from ..kernels.rope import qk_norm_rope

            qkv, mode = self._fused
            q, k, v = qk_norm_rope(qkv(x), self.q_norm.weight, self.k_norm.weight, self.n_heads, self.n_kv_heads,
                                   self.q_norm.eps, self.rope.base, offset, mode=mode)
        else:
            q = self.q_norm(self.q_proj(x).reshape(n, B, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
            q = self.rope(q, offset=offset)
            k, v = self.kv(x, offset)
        S = 0
        if ctx_k is not None and ctx_k.shape[2] > 0:
            if self.window is not None and ctx_k.shape[2] > self.window - 1:
                ctx_k, ctx_v = ctx_k[:, :, -(self.window - 1) :], ctx_v[:, :, -(self.window - 1) :]
            S = ctx_k.shape[2]
            k = mx.concatenate([ctx_k, k], axis=2)
            v = mx.concatenate([ctx_v, v], axis=2)
        mask = None
        if self.causal or self.window is not None:
            qi = mx.arange(B)[:, None]
            kj = mx.arange(S + B)[None, :] - S  # key position relative to the anchor
            keep = mx.ones((B, S + B), dtype=mx.bool_)
            if self.causal:
                keep = keep & (kj <= qi)
            if self.window is not None:
                keep = keep & (qi - kj < self.window)
            mask = keep
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self._out(o, queries)

    def _out(self, o: mx.array, queries: int | None) -> mx.array:
        """The output projection of the attention ``o`` ``[N, H, B, hd]`` (of its first ``queries`` slots)."""
        n, _, B, _ = o.shape
        o = o.transpose(0, 2, 1, 3).reshape(n, B, -1)
        return self.o_proj(o if queries is None or queries >= B else o[:, :queries])

    def rows(self, x: mx.array, ctx_k: mx.array | None, ctx_v: mx.array | None, offsets: mx.array,
             mask: mx.array | None, queries: int | None = None) -> mx.array:
        """Blocks of ``N`` requests at once (a batched round): row ``i`` of ``x`` ``[N, B, D]`` sits at
        positions ``offsets[i] ..`` and attends to its own context, the rows ``ctx_k/ctx_v[i]``
        (``[N, KV, S, hd]``, right-aligned: row ``i``'s last context row at index ``S - 1``, the rows
        before its own context padding), as :meth:`__call__` does for one request; ``mask``
        (:meth:`rows_mask`) hides each row's padding (``None``: no padding and no in-block mask).
        ``queries``: as :meth:`__call__`'s, the first ``queries`` slots of each block only."""
        n, B, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(n, B, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=offsets)
        k, v = self.kv(x, offsets)
        if ctx_k is not None:
            k = mx.concatenate([ctx_k, k], axis=2)
            v = mx.concatenate([ctx_v, v], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self._out(o, queries)

    def rows_mask(self, B: int, S: int, held: list[int], always: bool = False) -> mx.array | None:
        """The mask of :meth:`rows`: bool ``[N, 1, B, S + B]``, row ``i`` seeing its last ``held[i]``
        context rows (right-aligned in ``S``) and its block as :meth:`__call__` lets one request see them
        (causal / sliding-window layers); ``None`` where nothing is hidden, unless ``always``."""
        if all(h == S for h in held) and not (self.causal or self.window is not None) and not always:
            return None
        qi = mx.arange(B)[:, None]
        kj = mx.arange(S + B)[None, :] - S  # key position relative to the anchor (as __call__'s, same S)
        keep = mx.ones((B, S + B), dtype=mx.bool_)
        if self.causal:
            keep = keep & (kj <= qi)
        if self.window is not None:
            keep = keep & (qi - kj < self.window)
        first = mx.array([S - h for h in held], dtype=mx.int32)  # first held context index per row
        pad = mx.arange(S + B)[None, :] >= first[:, None]  # [N, S + B]
        return (keep[None] & pad[:, None, :])[:, None]

    def blocks(self, x: mx.array, ctx_k: mx.array, ctx_v: mx.array, anchors: mx.array) -> mx.array:
        """Packed-blocks attention (training and replay evaluation).

        ``N`` sequences with ``A`` blocks each; block ``(n, a)`` sits at
        positions ``anchors[n, a] ..`` and sees the context rows of sequence
        ``n`` at positions strictly before its anchor plus its own block
        (DFlash training mask, spec §1.5/§3.1); no other block. For one block
        this equals :meth:`__call__` with a cache holding those context rows.

        Args:
            x: ``[N*A, B, D]`` normed block inputs.
            ctx_k, ctx_v: ``[N, KV, T, hd]`` context K/V (positions ``0..T-1``).
            anchors: int ``[N, A]`` anchor positions.

        Returns:
            ``[N*A, B, D]``.
        """
        NA, B, _ = x.shape
        N, A = anchors.shape
        T = ctx_k.shape[2]
        KV, H, hd = self.n_kv_heads, self.n_heads, self.head_dim
        rep = H // KV
        offs = anchors.reshape(-1).astype(mx.int32)
        q = self.q_norm(self.q_proj(x).reshape(NA, B, H, hd)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=offs)  # [NA, H, B, hd]
        kb, vb = self.kv(x, offs)  # [NA, KV, B, hd]
        # context scores, grouped by sequence: [N, KV, rep, A*B, T]
        qs = q.reshape(N, A, KV, rep, B, hd).transpose(0, 2, 3, 1, 4, 5).reshape(N, KV, rep, A * B, hd)
        s_ctx = (qs * self.scale) @ ctx_k[:, :, None].swapaxes(-1, -2)
        s_ctx = s_ctx.reshape(N, KV, rep, A, B, T).transpose(0, 3, 1, 2, 4, 5).reshape(NA, KV, rep, B, T)
        qb = q.reshape(NA, KV, rep, B, hd)
        s_blk = (qb * self.scale) @ kb[:, :, None].swapaxes(-1, -2)  # [NA, KV, rep, B, B]
        qpos = offs[:, None] + mx.arange(B)[None, :]  # [NA, B]
        keep_ctx = mx.arange(T)[None, None, :] < offs[:, None, None]  # strictly before the anchor
        if self.window is not None:
            keep_ctx = keep_ctx & (qpos[:, :, None] - mx.arange(T)[None, None, :] < self.window)
        keep_ctx = keep_ctx[:, None, None]  # [NA, 1, 1, B, T]
        keep_blk = None
        if self.causal or self.window is not None:
            qi, kj = mx.arange(B)[:, None], mx.arange(B)[None, :]
            keep_blk = mx.ones((B, B), dtype=mx.bool_)
            if self.causal:
                keep_blk = keep_blk & (kj <= qi)
            if self.window is not None:
                keep_blk = keep_blk & (qi - kj < self.window)
            keep_blk = keep_blk[None, None, None]
        neg = mx.array(-1e9 if s_ctx.dtype == mx.float32 else -6e4, s_ctx.dtype)
        s_ctx = mx.where(keep_ctx, s_ctx, neg)
        if keep_blk is not None:
            s_blk = mx.where(keep_blk, s_blk, neg)
        scores = mx.concatenate([s_ctx, s_blk], axis=-1).astype(mx.float32)
        p = mx.softmax(scores, axis=-1).astype(x.dtype)
        p_ctx, p_blk = p[..., :T], p[..., T:]
        p_ctx = p_ctx.reshape(N, A, KV, rep, B, T).transpose(0, 2, 3, 1, 4, 5).reshape(N, KV, rep, A * B, T)
        o_ctx = (p_ctx @ ctx_v[:, :, None]).reshape(N, KV, rep, A, B, hd).transpose(0, 3, 1, 2, 4, 5)
        o = o_ctx.reshape(NA, KV, rep, B, hd) + p_blk @ vb[:, :, None]
        o = o.reshape(NA, H, B, hd).transpose(0, 2, 1, 3).reshape(NA, B, H * hd)
        return self.o_proj(o)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class GroupedDynamicCausalConv(nn.Module):
    """DFlash2's two-sided grouped dynamic causal convolution (spec §5.4).

    Parameters: ``base_kernel`` ``[2, K, D]`` (side 0 = before the sublayer,
    side 1 = after) and ``kernel_projection`` ``Linear(D -> 2*K*G)`` with
    ``G = D / group_size``. For the normed sublayer input ``u`` ``[N, B, D]``:
    ``delta = kernel_projection(u)`` reshaped ``[N, B, 2, K, G]`` and, for side
    ``s`` applied to ``x``, ``y_t = sum_k (base[s,k] + delta[t,s,k,g(c)]) * x_{t-k}``
    with zero padding before the block start. Runs over the block only; the
    post side reuses the coefficients computed from the pre-sublayer input.
    Initialised as an exact identity (``base[:, 0] = 1``, the rest 0).
    """

    def __init__(self, dim: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = dim // group_size
        base = mx.zeros((2, kernel_size, dim))
        base[:, 0] = 1.0
        self.base_kernel = base
        self.kernel_projection = nn.Linear(dim, 2 * kernel_size * self.groups, bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def coefficients(self, u: mx.array) -> mx.array:
        """Dynamic part ``[N, B, 2, K, G]`` from the normed input ``u`` ``[N, B, D]``."""
        n, B, _ = u.shape
        return self.kernel_projection(u).reshape(n, B, 2, self.kernel_size, self.groups)

    def apply(self, x: mx.array, side: int, delta: mx.array, mode: str | None = "reference") -> mx.array:
        """Convolve ``x`` ``[N, B, D]`` with side ``side`` (0 pre, 1 post).

        ``mode``: kernel mode of :data:`mlx_dflash2.kernels.dynamic_conv` (the fused kernel on a GPU,
        same result). The default ``"reference"`` (MLX ops) is differentiable; ``"compiled"``: the same
        ops compiled, forward and backward (:func:`~mlx_dflash2.kernels.dynamic_conv.dynamic_conv_compiled`;
        :meth:`DraftModel.forward_blocks`, i.e. training); the drafter's per-round forward passes its
        ``kernel_mode``.
        """
        if mode == "compiled":
            return dynamic_conv_compiled(x, self.base_kernel, delta, side, self.group_size)
        return dynamic_conv(x, self.base_kernel, delta, side, self.group_size, mode=mode)


class DraftDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, idx: int):
        super().__init__()
        self.self_attn = DraftAttention(cfg, idx)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.has_conv = cfg.is_dflash2
        if self.has_conv:
            self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def __call__(self, x, attend, mode: str | None = "reference", queries: int | None = None):
        """``x`` ``[M, B, D]``; ``attend(self_attn, v)`` runs the attention on the
        (pre-conv'd) normed input ``v`` with the right context; ``mode``: the
        convolutions' kernel mode (:meth:`GroupedDynamicCausalConv.apply`).

        ``queries``: the output of the first ``queries`` slots only (``[M, queries, D]``): ``attend`` must then
        return the attention of those slots only (their queries over every slot's keys and values). What the full
        call gives those slots: the convolutions are causal (a slot reads itself and the slots before it) and the
        rest works slot by slot; a drafter whose last layer feeds only the slots drafted skips the others' work."""
        u = self.input_layernorm(x)
        if queries is not None and queries < x.shape[1]:
            x = x[:, :queries]
        if self.has_conv:
            d = self.attention_conv.coefficients(u)
            a = attend(self.self_attn, self.attention_conv.apply(u, 0, d, mode))
            if a.shape[1] < d.shape[1]:
                d = d[:, : a.shape[1]]
            a = self.attention_conv.apply(a, 1, d, mode)
        else:
            a = attend(self.self_attn, u)
        h = x + a
        u = self.post_attention_layernorm(h)
        if self.has_conv:
            d = self.mlp_conv.coefficients(u)
            m = self.mlp_conv.apply(self.mlp(self.mlp_conv.apply(u, 0, d, mode)), 1, d, mode)
        else:
            m = self.mlp(u)
        return h + m


#: columns per group of :func:`top_k_ids`' first stage
TOP_K_GROUP = 128


def top_k_ids(x: mx.array, k: int, group: int = TOP_K_GROUP) -> mx.array:
    """The ids of the ``k`` largest entries of each row of ``x``, in no particular order.

    Args:
        x: ``[..., V]`` scores (float; ``-inf`` allowed).
        k: ``1 <= k <= V``.
        group: columns per group of the first stage.

    Returns:
        uint32 ``[..., k]``: the same set as ``mx.argpartition(-x, k - 1, axis=-1)[..., :k]`` (rows with ties
        at the k-th value may take another of the tied ids: ``argpartition`` leaves that choice open too);
        a function of the row's values alone, so a row gives the same ids alone or in a batch.

    Algorithm (exact two-stage selection): the row's first ``G = V // group`` groups of ``group`` columns
    each give their maximum; the ``k`` groups with the largest maxima hold every one of the row's ``k``
    largest entries (an entry outside them is below ``k`` group maxima, each a distinct larger entry), so
    ``argpartition`` over those ``k * group`` columns (plus the ``V % group`` columns past the last whole
    group) finds them. One read of the row for the maxima, then selections over ``G`` and ``k * group``
    columns instead of ``V``: issue 21's training (3,840 rows of 32,768 ids, ``k = 16``) took its candidates
    in 1.30 s with one ``argpartition`` on the 2-core CPU, 0.19 s in two stages; on the H100 the selector's
    candidates and their gather cost ~12 ms of a 72 ms training step with one. Rows too short to gain
    (``V < 4 * k * group``) use one ``argpartition``.
    """
    V = x.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"top_k_ids: k={k} for rows of {V}")
    G = V // group
    if V < 4 * k * group:
        return mx.argpartition(-x, k - 1, axis=-1)[..., :k]
    lead = x.shape[:-1]
    gmax = x[..., : G * group].reshape(*lead, G, group).max(axis=-1)  # [..., G]
    gi = mx.argpartition(-gmax, k - 1, axis=-1)[..., :k].astype(mx.int32)  # [..., k] groups
    cols = (gi[..., None] * group + mx.arange(group, dtype=mx.int32)).reshape(*lead, k * group)
    if V > G * group:  # the columns past the last whole group are candidates too
        tail = mx.broadcast_to(mx.arange(G * group, V, dtype=mx.int32), (*lead, V - G * group))
        cols = mx.concatenate([cols, tail], axis=-1)
    j = mx.argpartition(-mx.take_along_axis(x, cols, axis=-1), k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(cols, j, axis=-1).astype(mx.uint32)


@dataclass
class SelectorOutput:
    """Result of the candidate selector's walk (spec §5.5, §5.7).

    Attributes:
        tokens: int32 ``[T]`` draft ids ``d_1..d_T``.
        cand_ids: int32 ``[T, K]`` candidate ids per slot.
        q: float32 ``[T, K]`` proposal distribution over ``cand_ids`` for the
            row of the predecessor actually chosen, or ``None`` for greedy
            (a point mass on ``tokens``).
    """

    tokens: mx.array
    cand_ids: mx.array
    q: mx.array | None


class CandidateSelector(nn.Module):
    """DFlash2 candidate selector: top-K unary candidates re-scored by a
    low-rank predecessor/successor term, walked left to right from the anchor.

    ``S_t(a, b) = U_t(b) + sum_r A[a, r] * H_t[r] * Bc[b, r]`` with
    ``A`` = ``predecessor_codebook`` ``[V, r]``, ``Bc`` = ``successor_codebook``
    ``[V, r]``, ``H_t = hidden_projection(h_t)`` ``[r]``. Greedy takes the argmax
    of each realised row; sampling draws from ``softmax(S_t(a_t, .) / T)`` over
    the K candidates and records that row as ``q``. A fresh selector
    (successor codebook zero) reproduces the unary choice exactly.
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, init_std: float = 0.02):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = mx.random.normal((vocab_size, rank)) * init_std
        self.successor_codebook = mx.zeros((vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def candidates(self, unary: mx.array, hidden: mx.array,
                   vocab_ids: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """The lattice's inputs, computed in MLX for every walk: ``(cand int32 [M, T, K], u float32
        [M, T, K], H float32 [M, T, r])``, the top-K candidates of each slot (:func:`top_k_ids`) in
        ascending id order, their unary scores and the hidden projection of ``hidden`` ``[M, T, D]``.
        ``vocab_ids``: ``unary``'s last axis covers a draft vocabulary, these ascending token ids
        (``[Vd]``), and ``cand`` holds token ids, not positions (ascending either way).

        The ascending order is part of the contract: a sampled walk's random draws are indexed by a
        candidate's position in its slot, and the order ``argpartition`` leaves its top K in is
        arbitrary, moved by the last bits of unrelated scores among the whole vocabulary (a batched
        drafter forward, a prompt-cache hit: issue 22). Sorted, a seeded walk's realisation depends on
        the candidate set and its scores only, as a solo and a batched forward of the same row agree
        up to near-ties."""
        K = min(self.top_k, unary.shape[-1])
        cand = mx.sort(top_k_ids(unary, K), axis=-1).astype(mx.int32)
        u = mx.take_along_axis(unary, cand, axis=-1).astype(mx.float32)
        H = self.hidden_projection(hidden).astype(mx.float32)  # [M, T, r]
        if vocab_ids is not None:
            cand = vocab_ids[cand]
        return cand, u, H

    def lattice(self, unary: mx.array, hidden: mx.array, anchor: mx.array):
        """Candidates and edge scores for ``M`` blocks.

        Args:
            unary: ``[M, T, V]`` unary logits (invalid ids already ``-inf``).
            hidden: ``[M, T, D]`` final-normed drafter states of slots 1..T.
            anchor: int32 ``[M]`` anchor ids.

        Returns:
            ``(cand [M, T, K], first [M, K], edges [M, T-1, K, K] or None)``:
            slot-1 scores from the anchor and, for t >= 2, scores of slot t's
            candidates (columns) given each candidate of slot t-1 (rows), in
            float32, the pair term summed in a fixed order
            (:func:`mlx_dflash2.kernels.selector_walk.lattice_scores`).
        """
        cand, u, H = self.candidates(unary, hidden)
        first, edges = lattice_scores(cand, u, H, self.predecessor_codebook, self.successor_codebook, anchor)
        return cand, first, edges

    def walk(
        self,
        unary: mx.array,
        hidden: mx.array,
        anchor: mx.array,
        temperature: float = 0.0,
        key: mx.array | None = None,
        mode: str | None = None,
        vocab_ids: mx.array | None = None,
    ) -> SelectorOutput:
        """Greedy (``temperature == 0``) or sampled walk; see the class doc. ``vocab_ids``: ``unary``
        covers a draft vocabulary (:meth:`candidates`); tokens and candidates are token ids either way.

        Accepts one block (``unary [T, V]``, ``hidden [T, D]``, scalar anchor)
        or ``M`` blocks (``[M, T, V]``, ``[M, T, D]``, ``[M]``); outputs keep
        the input's batching. A greedy walk runs the fused kernel
        :data:`mlx_dflash2.kernels.selector_walk` on a GPU (``mode``: its kernel
        mode; the same tokens as the MLX walk); a sampled walk runs in MLX.
        """
        single = unary.ndim == 2
        if single:
            unary, hidden, anchor = unary[None], hidden[None], mx.reshape(anchor, (1,))
        cand, u, H = self.candidates(unary, hidden, vocab_ids)
        A, Bc = self.predecessor_codebook, self.successor_codebook
        if temperature > 0:
            tokens, q = walk_lattice(cand, *lattice_scores(cand, u, H, A, Bc, anchor), temperature, key)
        else:
            tokens, q = selector_walk(cand, u, H, A, Bc, anchor, mode=mode), None
        if single:
            return SelectorOutput(tokens[0], cand[0], None if q is None else q[0])
        return SelectorOutput(tokens, cand, q)


#: rows of a matmul that a BLAS computes together: this machine's OpenBLAS (x86-64 sgemm) gives a row of ``x @ W``
#: the same bits whatever the other rows only within whole blocks of 8 rows (the last ``M % 8`` rows of an ``M``-row
#: product take another summation order), so :func:`last_layer_slots` keeps the drafter's row counts multiples of it
#: (not every host's BLAS has this: on an AVX2-only EPYC no row subset matched the whole product, session 37; there a
#: forward of fewer slots differs from the whole block's by rounding, which can change a draft at a near-tie but never
#: the output, which the target verifies)
MATMUL_ROW_BLOCK = 8


def last_layer_slots(slots: int, blocks: int, block_size: int) -> int:
    """Slots of each block the drafter's last layer computes when ``slots`` are wanted from ``blocks`` blocks of
    ``block_size``: ``slots`` rounded up so that ``blocks * slots`` is a multiple of :data:`MATMUL_ROW_BLOCK` (the
    matmuls then give the whole forward's bits), at most ``block_size``.

    >>> [last_layer_slots(2, n, 16) for n in (1, 2, 3, 4, 8)]
    [8, 4, 8, 2, 2]
    """
    step = MATMUL_ROW_BLOCK // math.gcd(int(blocks), MATMUL_ROW_BLOCK)
    return min(int(block_size), -(-int(slots) // step) * step)


class DraftModel(nn.Module):
    """A DFlash (v1) or DFlash2 block drafter (architecture from the config).

    Holds no embedding and no LM head: the caller passes the target's
    embeddings and applies the target's LM head (:meth:`unary_logits`).
    Tensor names match the published checkpoints (spec §5.6).

    ``kernel_mode``: the :mod:`mlx_dflash2.kernels` mode of the per-round forward
    (:meth:`__call__`: fused dynamic convolutions) and of the selector's greedy walk;
    ``None`` is the process default (``MLX_DFLASH2_KERNELS``). Training and replay
    evaluation (:meth:`forward_blocks`) run the MLX reference ops (the convolutions compiled), through the
    routed linear layers where :meth:`route_kernels` routed them (the same function within rounding).
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.kernel_mode: str | None = None
        object.__setattr__(self, "_routes", [])  # route_kernels' swaps (not a module member)
        object.__setattr__(self, "_routed", None)  # (mode, count) while routed
        D = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.layers = [DraftDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        if cfg.is_dflash2:
            self.candidate_selector = CandidateSelector(
                cfg.vocab_size, D, cfg.selector_rank, cfg.selector_top_k, cfg.initializer_range
            )

    # -- kernels ----------------------------------------------------------
    def route_kernels(self, mode: str | None = None, force: bool = False) -> int:
        """Route this drafter's affine quantized linear layers through the registry's ``qmm`` and fuse each MLP's
        gate and up projections into one call (:func:`~mlx_dflash2.kernels.route_quantized_linears`,
        :func:`~mlx_dflash2.kernels.route_mlps`: this instance's modules only, no class is patched).

        What it buys: the drafter's forward runs its linear layers at 16 rows (the block) and at the committed
        rows' count (the context K/V), where MLX's CUDA ``qmm`` is ~3x its one-row cost per call (session 21's
        H200 trace: 80 us per call at the 8B shape against 17-52 us for ``qmm``; a drafter of the shipped shape
        has 28 such calls per round at the 8B shape). The drafter's numbers do not touch losslessness (the target
        verifies every token); each kernel still passes its numerics gate at first use, else MLX's op runs.
        Nothing is routed on the CPU backend (the references are MLX's ops) unless ``force``, nor in mode
        ``"reference"`` (which puts MLX's layers back on a routed drafter); a drafter with float weights has nothing
        to route. Calling it again with another mode routes again in that mode. A routed drafter's MLPs are wrapped
        (their parameter names gain ``inner.``): :func:`~mlx_dflash2.drafter.io.save_drafter` and
        :func:`~mlx_dflash2.drafter.io.dequantize_drafter` put the original modules back first (:meth:`unrouted`).

        Args:
            mode: kernel mode (``None``: ``MLX_DFLASH2_KERNELS``); it also becomes :attr:`kernel_mode`.
            force: route on the CPU backend too (tests of the routing itself).

        Each attention's q, k and v projections become one call whose heads get their norms and RoPE from one
        ``qk_norm_rope`` launch (:meth:`DraftAttention.route`).

        Returns:
            How many modules are routed (0: none), the fused attentions counted once each.

        Raises:
            ValueError: an unknown mode.
        """
        from .. import kernels as K

        mode = K.check_mode(mode)
        if self._routed is not None:
            if self._routed[0] == mode:
                self.kernel_mode = mode
                return self._routed[1]
            self.unroute_kernels()
        self.kernel_mode = mode
        if mode == "reference" or (not force and K.backend() == "cpu"):
            return 0
        swaps = K.route_quantized_linears(self, mode)
        swaps += K.route_mlps(self.layers, mode)
        fused = sum(layer.self_attn.route(mode) for layer in self.layers)
        object.__setattr__(self, "_routes", swaps)
        object.__setattr__(self, "_routed", (mode, len(swaps) + fused) if swaps or fused else None)
        return len(swaps) + fused

    @property
    def routed(self) -> bool:
        """Whether :meth:`route_kernels` replaced modules of this drafter (and has not been undone)."""
        return self._routed is not None

    @contextmanager
    def unrouted(self):
        """A context in which this drafter holds its original modules (what its checkpoint names): the routes are
        undone on entry and made again, in the same mode, on exit. A drafter that is not routed is left as is."""
        state = self._routed
        if state is None:
            yield self
            return
        self.unroute_kernels()
        try:
            yield self
        finally:
            self.route_kernels(state[0], force=True)

    def unroute_kernels(self) -> None:
        """Put the modules :meth:`route_kernels` replaced back (the MLPs' gate and up layers keep their row views of
        the fused weights: the same values)."""
        from .. import kernels as K

        for layer in self.layers:
            layer.self_attn.unroute()
        K.undo_routes(self._routes)
        object.__setattr__(self, "_routes", [])
        object.__setattr__(self, "_routed", None)

    # -- context ----------------------------------------------------------
    def fuse(self, features: mx.array) -> mx.array:
        """Context features ``[N, S, k*D]`` (concatenated taps) -> ``[N, S, D]``."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: mx.array, offset: int) -> list[tuple[mx.array, mx.array]]:
        """Per-layer context K/V for new committed rows at positions ``offset..``."""
        c = self.fuse(features)
        return [layer.self_attn.kv(c, offset) for layer in self.layers]

    def __call__(self, block_embeddings: mx.array, context: "DraftContext", slots: int | None = None) -> mx.array:
        """Drafter forward over one block.

        Args:
            block_embeddings: ``[1, B, D]`` target embeddings of
                ``[anchor, mask, ..., mask]`` (times the input scale).
            context: the request's :class:`DraftContext`; the block sits at
                positions ``context.offset ..``.
            slots: the states of the first ``slots`` positions only (``None``: all ``B``): the last layer
                computes those (the earlier ones every slot: the block attends both ways), the same values.

        Returns:
            Final-normed hidden states ``[1, B, D]`` (``[1, slots, D]``).
        """
        x = block_embeddings
        P = context.offset
        last = len(self.layers) - 1
        Q = None if slots is None else last_layer_slots(slots, 1, x.shape[1])
        for i, layer in enumerate(self.layers):
            ck, cv = context.layer_kv(i)
            q = Q if i == last else None
            x = layer(x, lambda attn, v, q=q: attn(v, ck, cv, P, q), self.kernel_mode, q)
        return self.norm(x if slots is None else x[:, :slots])

    def forward_rows(self, block_embeddings: mx.array, contexts: list["DraftContext"],
                     slots: int | None = None) -> mx.array:
        """Drafter forward over the blocks of ``N`` requests at once (a batched round).

        Args:
            block_embeddings: ``[N, B, D]``: row ``i`` the embeddings of ``[anchor_i, mask, ..., mask]``
                (times the input scale), one block length ``B`` for all.
            contexts: the requests' :class:`DraftContext` (every queued row appended); block ``i`` sits at
                positions ``contexts[i].offset ..`` and attends to that context only (what
                :meth:`__call__` gives it alone: the same keys, the others' masked out).
            slots: as :meth:`__call__`'s: the first ``slots`` positions of each block only.

        Returns:
            Final-normed hidden states ``[N, B, D]`` (``[N, slots, D]``).
        """
        x = block_embeddings
        B = int(x.shape[1])
        last = len(self.layers) - 1
        Q = None if slots is None else last_layer_slots(slots, x.shape[0], B)
        offsets = mx.array([c.offset for c in contexts], dtype=mx.int32)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            kvs = [c.layer_kv(i) for c in contexts]
            if attn.window is not None:  # as __call__: a sliding layer sees its last window - 1 rows
                w = attn.window - 1
                kvs = [(k, v) if k is None or k.shape[2] <= w else (k[:, :, -w:], v[:, :, -w:]) for k, v in kvs]
            held = [0 if k is None else int(k.shape[2]) for k, _ in kvs]
            S = max(held)
            ck = cv = None
            if S > 0:
                # every row's context written right-aligned into one zero block by a slice update (in place: one
                # copy of the contexts): each row runs the same operation whatever its context's length, so
                # consecutive rounds of one batch evaluate one sequence of operations and a backend that caches
                # graphs by topology (MLX's CUDA graphs) reuses them (issue 22, session 54:
                # benchmarks/round_graphs.py counted a new sequence every drafting round while only the rows
                # shorter than the longest were padded)
                rk, rv = next((k, v) for k, v in kvs if k is not None)
                ck = mx.zeros((len(kvs), rk.shape[1], S, rk.shape[3]), rk.dtype)
                cv = mx.zeros((len(kvs), rv.shape[1], S, rv.shape[3]), rv.dtype)
                for r, ((k, v), h) in enumerate(zip(kvs, held)):
                    if k is not None:
                        ck[r : r + 1, :, S - h :] = k
                        cv[r : r + 1, :, S - h :] = v
            mask = attn.rows_mask(B, S, held, always=True)  # (a mask every round: one sequence of operations)
            q = Q if i == last else None
            x = layer(x, lambda a, v, ck=ck, cv=cv, mask=mask, q=q: a.rows(v, ck, cv, offsets, mask, q),
                      self.kernel_mode, q)
        return self.norm(x if slots is None else x[:, :slots])

    def context_kv_all(self, features: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Per-layer context K/V of whole sequences: features ``[N, T, k*D]`` ->
        ``[(k [N, KV, T, hd], v)]`` (positions ``0..T-1``)."""
        c = self.fuse(features)
        return [layer.self_attn.kv(c, 0) for layer in self.layers]

    def forward_blocks(self, block_embeddings: mx.array, features: mx.array | None, anchors: mx.array,
                       ctx_kv: list | None = None) -> mx.array:
        """Drafter forward over many blocks at once (training, replay evaluation).

        Args:
            block_embeddings: ``[N*A, B, D]`` embeddings of ``[anchor, mask...]``
                per block (times the input scale), sequence-major.
            features: ``[N, T, k*D]`` context features of each sequence
                (concatenated target taps at positions ``0..T-1``), or None
                when ``ctx_kv`` (from :meth:`context_kv_all`) is given.
            anchors: int ``[N, A]`` anchor positions; block ``(n, a)`` sees
                context positions ``< anchors[n, a]`` only.

        Returns:
            Final-normed hidden states ``[N*A, B, D]``.

        The convolutions run compiled (mode ``"compiled"`` of :meth:`GroupedDynamicCausalConv.apply`).
        """
        if ctx_kv is None:
            ctx_kv = self.context_kv_all(features)
        x = block_embeddings
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, lambda attn, v, ck=ck, cv=cv: attn.blocks(v, ck, cv, anchors), "compiled")
        return self.norm(x)

    def unary_logits(self, hidden: mx.array, lm_head) -> mx.array:
        """Target LM head on drafter states, then ``output_multiplier`` and softcap."""
        logits = lm_head(hidden)
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping and cfg.final_logit_softcapping > 0:
            cap = cfg.final_logit_softcapping
            logits = mx.tanh(logits / cap) * cap
        return logits

    # -- initialisation ---------------------------------------------------
    def init_weights(self, seed: int = 0) -> None:
        """Fresh initialisation: normal(0, initializer_range) linear weights,
        unit norms, and DFlash2's conv and selector as exact no-ops
        (identity conv, zero successor codebook; SpecForge trainer, spec §5.4-5.5)."""
        std = self.config.initializer_range
        key = mx.random.key(seed)
        from mlx.utils import tree_flatten, tree_unflatten

        params = tree_flatten(self.parameters())
        keys = mx.random.split(key, len(params))
        new = []
        for (name, p), k in zip(params, keys):
            if name.endswith("kernel_projection.weight") or name.endswith("successor_codebook"):
                new.append((name, mx.zeros_like(p)))
            elif name.endswith("base_kernel"):
                b = mx.zeros_like(p)
                b[:, 0] = 1.0
                new.append((name, b))
            elif name.endswith("norm.weight"):
                new.append((name, mx.ones_like(p)))
            else:
                new.append((name, mx.random.normal(p.shape, key=k) * std))
        self.update(tree_unflatten(new))


DEFAULT_CONTEXT_WINDOW = 4096
"""Context rows a drafter attends to by default (:class:`DraftContext` ``window``; published DFlash2
drafters use sliding layers of 2048, other engines keep 4096)."""
DEFAULT_CONTEXT_SLACK = 64
"""Rows kept beyond the window so that a rollback of up to this many rows (a few blocks) stays exact."""


class _ContextRows:
    """One drafter layer's context K/V: the rows of positions ``[start, offset)``.

    ``keep``: most rows held after an append (``None``: all, never evicted). Rows
    are stored in temporal order at buffer indices ``[_lo, _lo + offset - start)``
    of preallocated ``[1, KV, capacity, hd]`` buffers (no ring): an append writes
    in place, evicts from the front, and compacts into a new buffer of
    ``held + new + step`` rows when the end is reached, so a bounded layer never
    holds more than ``keep + step + (rows of one append)`` buffer rows.
    """

    step = 256

    def __init__(self, keep: int | None):
        self.keep = keep
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0  # committed positions (the next row's position)
        self.start = 0  # oldest held position
        self._lo = 0

    @property
    def rows(self) -> int:
        return self.offset - self.start

    def append(self, k: mx.array, v: mx.array, total: int) -> None:
        """Add ``total`` positions ``[offset, offset + total)``, of which ``k``/``v`` ``[1, KV, m, hd]`` are
        the last ``m`` (the caller leaves out rows that would be evicted at once: ``m < total`` only when
        ``m >= keep``)."""
        m = int(k.shape[2])
        end = self.offset + total
        first = end - m  # position of k's first row
        s = self.start if self.keep is None else max(self.start, end - self.keep)
        if s >= first:  # every held row is evicted (and maybe some of the new ones)
            k, v = k[:, :, s - first :], v[:, :, s - first :]
            held = 0
            self._lo = 0
        else:
            self._lo += s - self.start
            held = self.offset - s
        m = int(k.shape[2])
        self.start = s
        if self.keys is None or self._lo + held + m > self.keys.shape[2]:
            B, H, _, D = k.shape
            cap = (held + m + 2 * self.step - 1) // self.step * self.step
            new_k = mx.zeros((B, H, cap, D), k.dtype)
            new_v = mx.zeros((B, H, cap, v.shape[3]), v.dtype)
            if held > 0:
                new_k[:, :, :held] = self.keys[:, :, self._lo : self._lo + held]
                new_v[:, :, :held] = self.values[:, :, self._lo : self._lo + held]
            self.keys, self.values, self._lo = new_k, new_v, 0
        a = self._lo + held
        self.keys[:, :, a : a + m] = k
        self.values[:, :, a : a + m] = v
        self.offset = end

    def fetch(self, last: int | None) -> tuple[mx.array | None, mx.array | None]:
        """K/V of the last ``min(last, rows)`` held positions (``None``: all held), ending at ``offset - 1``."""
        n = self.rows if last is None else min(last, self.rows)
        if n <= 0:
            return None, None
        b = self._lo + self.rows
        return self.keys[:, :, b - n : b], self.values[:, :, b - n : b]

    def trim(self, n: int) -> None:
        """Drop the last ``n`` positions; rows before ``start`` were evicted, so a trim past them leaves
        none held (the context then restarts at the new offset)."""
        self.offset -= n
        if self.offset < self.start:
            self.start, self._lo = self.offset, 0

    def clone(self) -> "_ContextRows":
        c = _ContextRows(self.keep)
        if self.keys is not None:  # new array objects: an in-place update of one copy never reaches the other
            c.keys, c.values = mx.array(self.keys), mx.array(self.values)
        c.offset, c.start, c._lo = self.offset, self.start, self._lo
        return c


class DraftContext:
    """Per-request drafter cache: context K/V of the committed tokens.

    One K/V store per drafter layer (keys already RoPE'd at their absolute
    positions). ``offset`` is the number of committed positions, i.e. the
    anchor's position for the next block. Rows can be dropped from the end
    (:meth:`trim`) when a request is cut back.

    ``window`` ``W`` bounds the drafter's context: a block at position ``P``
    attends to the context rows of positions ``[P - W, P)`` only, and each
    layer holds at most ``W + slack`` rows (plus its buffer's spare rows), so
    the drafter's memory does not grow with the prompt. A layer with its own
    sliding window (``cfg.layer_is_sliding``) keeps its smaller one. ``0``:
    unbounded (every committed row is kept and attended to). A trim of up to
    ``slack`` rows (the rollback of a few blocks) after any append is exact; a
    longer trim (a prompt cache reused far back) may leave fewer than ``W``
    rows before the new offset: the drafter then sees less context until new
    rows arrive, which costs acceptance only (the target verifies every token).
    """

    def __init__(self, model: DraftModel, window: int = 0, slack: int = DEFAULT_CONTEXT_SLACK):
        window, slack = int(window), int(slack)
        if window < 0 or slack < 0:
            raise ValueError(f"DraftContext: need window >= 0 and slack >= 0 (got {window}, {slack})")
        cfg = model.config
        self.window, self.slack = window, slack
        # rows each layer attends to (None: all) and keeps
        self.attend: list[int | None] = []
        for i in range(len(model.layers)):
            w = window or None
            if window and cfg.layer_is_sliding(i):
                w = min(window, cfg.sliding_window - 1)
            self.attend.append(w)
        self.caches = [_ContextRows(None if w is None else w + slack) for w in self.attend]
        self.offset = 0

    def append(self, model: DraftModel, features: mx.array) -> None:
        """Add context rows: ``features`` ``[S, k*D]`` for positions ``offset..offset+S-1``.

        With a window, K/V are computed only for the rows that stay held (the last ``W + slack``).
        """
        S = int(features.shape[0])
        if S == 0:
            return
        m = self.computed_rows(S)
        self.append_kv(model.context_kv(features[None, S - m :], self.offset + S - m), S)

    def computed_rows(self, S: int) -> int:
        """How many of ``S`` new rows :meth:`append` computes K/V for (the last ones: the rest would be
        evicted at once by the window)."""
        keeps = [c.keep for c in self.caches]
        return S if None in keeps else min(S, max(keeps))

    def append_kv(self, kvs: list[tuple[mx.array, mx.array]], S: int) -> None:
        """Add ``S`` positions whose last :meth:`computed_rows` rows have per-layer K/V ``kvs``
        (``[1, KV, m, hd]`` each, keys RoPE'd at their positions): :meth:`append`'s second half, for a
        caller that projects several contexts' rows at once (:meth:`~..proposers.DFlashProposer.flush`)."""
        for cache, (k, v) in zip(self.caches, kvs):
            cache.append(k, v, S)
        self.offset += S

    def layer_kv(self, i: int) -> tuple[mx.array | None, mx.array | None]:
        """Context K/V layer ``i`` attends to: ``[1, KV, S, hd]`` of positions ``offset-S .. offset-1``
        (``S <= W``), or ``(None, None)``."""
        return self.caches[i].fetch(self.attend[i])

    def rows(self) -> int:
        """Most context rows held by a layer (``<= W + slack`` with a window)."""
        return max((c.rows for c in self.caches), default=0)

    def clone(self) -> "DraftContext":
        new = DraftContext.__new__(DraftContext)
        new.window, new.slack, new.attend = self.window, self.slack, list(self.attend)
        new.caches = [c.clone() for c in self.caches]
        new.offset = self.offset
        return new

    def trim(self, n: int) -> None:
        n = min(n, self.offset)
        if n <= 0:
            return
        for c in self.caches:
            c.trim(n)
        self.offset -= n

    def state_arrays(self) -> list[mx.array]:
        return [a for c in self.caches if c.keys is not None for a in (c.keys, c.values)]


def param_count(model: nn.Module) -> int:
    """Number of weights; a quantized layer counts its unpacked weights, not its packed
    words, scales or biases (so a 4-bit drafter counts as its float original)."""
    from mlx.utils import tree_flatten

    modules = dict(model.named_modules())
    total = 0
    for name, p in tree_flatten(model.parameters()):
        mod, _, leaf = name.rpartition(".")
        q = modules.get(mod) if leaf in ("weight", "scales", "biases") else None
        if isinstance(q, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            if leaf == "weight":
                total += p.shape[0] * p.shape[1] * 32 // q.bits
            continue
        total += math.prod(p.shape)
    return total
