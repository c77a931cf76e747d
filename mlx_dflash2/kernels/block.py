"""Routed decoder layers whose per-layer graph is built by ``mx.compile``'d functions (the host's share of a forward).

Why: on MLX's CUDA backend the routed forward is bound by the host, not the GPU (session 18 on the H200, the
Qwen3-8B shape: a one-token forward's kernels take 5.9 ms of GPU time against 7.4 ms for MLX's own ops, but
building its graph in Python takes 5.3 ms against MLX's 2.5, and the forward runs at 12.1 ms pipelined against
MLX's 10.2). A decoder layer makes ~25 Python-level op calls per token step; a compiled function replays its
recorded graph in C++, so the layer becomes two compiled calls around the part that depends on the cache:

* ``head(x)``: ``input_layernorm`` and the fused q/k/v ``qmm`` (where the heads' norms and RoPE are one
  :data:`~.rope.qk_norm_rope` launch, the usual case: llama, qwen2, qwen3), else also the split, the q/k norms and
  the transposes;
* :data:`~.rope.qk_norm_rope` (or RoPE alone) at the cache's offset, the cache update and
  :data:`~.attention.verify_attention` (eager: they depend on the cache's length);
* ``tail(x, attn, gate)``: ``o_proj`` (times the output gate where gated), the residual, ``post_attention_layernorm``,
  the MLP (gate and up fused), the residual.

The hybrids' GatedDeltaNet layers (Qwen3-Next, Qwen3.5: ``linear_attn`` in place of ``self_attn``) keep their input
norm and mixer eager and compile the same tail; layers with a mixture of experts are left as they are.

The ops and their order are those of the eager layer (compiling fuses elementwise ops, e.g. SwiGLU, without
changing their arithmetic) except the two residual adds, which ``o_proj``'s and the down projection's ``qmm`` launches
make themselves (one rounding of matmul + residual where the unrouted layer rounds twice: the result moves within
rounding, ``MLX_DFLASH2_QMM_FUSE=0`` keeps them apart); the plain step and the verify run the same compiled tail, so
they still compute every row the same way. A signature
(activation shape and dtype) first runs eagerly: the kernels' numerics gates and bindings happen there, outside any
trace (a gate evaluates arrays, which a trace may not); the compiled functions take over from its second call.

Used by :meth:`~mlx_dflash2.target.TargetAdapter.route_kernels` on GPU backends (``MLX_DFLASH2_COMPILE``: ``1``
everywhere, ``0`` never; default on a GPU only: on MLX's CPU backend a compiled graph's fused kernels are built by a
C++ compiler at first use, for nothing: the CPU runs no kernels).
"""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import mlx.nn as nn

from .attention import MAX_ROWS, KernelAttention
from .qmm import MLP_CLASSES, KernelMLP, Wrapper

__all__ = ["KernelBlock", "route_blocks", "BLOCK_CLASSES", "compile_enabled", "COMPILE_ENV", "SUBMIT_ENV",
           "submit_every", "set_submit_every"]

COMPILE_ENV = "MLX_DFLASH2_COMPILE"
SUBMIT_ENV = "MLX_DFLASH2_SUBMIT_EVERY"
SUBMIT_DEFAULT = 9  # layers per early submission of a multi-row forward (36 layers: four parts)
# mlx-lm decoder layers whose __call__ is h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))
# (the hybrids' layers: the same with linear_attn, a GatedDeltaNet mixer, in place of self_attn where is_linear)
HYBRID_BLOCK_CLASSES = ("mlx_lm.models.qwen3_next.Qwen3NextDecoderLayer", "mlx_lm.models.qwen3_5.DecoderLayer")
BLOCK_CLASSES = ("mlx_lm.models.llama.TransformerBlock", "mlx_lm.models.qwen2.TransformerBlock",
                 "mlx_lm.models.qwen3.TransformerBlock") + HYBRID_BLOCK_CLASSES
MAX_SIGNATURES = 64  # (shape, dtype) pairs compiled per layer; later ones run eagerly


def compile_enabled(backend: str) -> bool:
    """Whether routed decoder layers compile their graphs on ``backend`` (``"cpu"``, ``"cuda"``, ``"metal"``):
    ``MLX_DFLASH2_COMPILE`` = ``1`` / ``0`` forces it; unset, a GPU backend only.

    Raises:
        ValueError: the variable is set to something else.
    """
    v = os.environ.get(COMPILE_ENV, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"{COMPILE_ENV} must be 0 or 1, got {v!r}")
    return v == "1" if v else backend != "cpu"


def submit_every() -> int:
    """Layers per early submission of a multi-row forward (see :class:`KernelBlock`): ``MLX_DFLASH2_SUBMIT_EVERY``
    (``0``: never), default 9.

    Raises:
        ValueError: not a non-negative integer.
    """
    v = os.environ.get(SUBMIT_ENV, "").strip()
    if not v:
        return SUBMIT_DEFAULT
    if not (v.isascii() and v.isdigit()):
        raise ValueError(f"{SUBMIT_ENV} must be a non-negative integer, got {v!r}")
    return int(v)


def set_submit_every(layers, k: int) -> None:
    """Mark every ``k``-th :class:`KernelBlock` of ``layers`` (counted over the KernelBlocks only, other layers
    skipped: the 9th, 18th, ... for ``k`` = 9; none for 0; never the last, whose output the caller evaluates) as one
    that submits its multi-row output early."""
    blocks = [b for b in layers if isinstance(b, KernelBlock)]
    for i, b in enumerate(blocks):
        object.__setattr__(b, "submit", k > 0 and (i + 1) % k == 0 and i + 1 < len(blocks))


class KernelBlock(Wrapper):
    """A decoder layer of :data:`BLOCK_CLASSES` with a dense MLP whose attention is a
    :class:`~.attention.KernelAttention` (or a hybrid's GatedDeltaNet layer, below), run as
    two ``mx.compile``'d functions around its cache-dependent middle (see the module's docstring) wherever the
    attention's fast path applies (one sequence, at most 16 new rows, a plain ``KVCache`` or a batch's one-row cache:
    :meth:`~.attention.KernelAttention.fast`); other calls (prompt
    chunks, other caches) run the wrapped layer as it is. A hybrid's GatedDeltaNet layer (``is_linear``: Qwen3-Next,
    Qwen3.5) runs its input norm and mixer eagerly (the mixer owns the recurrent state and, routed, the per-step
    records a rollback selects from) and its tail (residual, post norm, MLP, residual) compiled, for one sequence of
    at most 16 new rows.

    **Early submission** (``submit``, set by :func:`set_submit_every`): a multi-row call (a verify block) of a marked
    layer queues its output (``mx.async_eval``) before the next layers are built, so the GPU starts on the first
    layers while the host still builds the rest. A speculative round's verify is built right after the host read of
    the previous round, with nothing queued (unlike a pipelined plain step), so its whole build was on the round's
    critical path (~2.9 ms at the 8B shape with compiled layers, H200 session 19, in a ~15 ms round). One-row calls
    never submit early (the plain loop queues whole steps ahead). The ops are the same: outputs do not change.

    Args:
        block: the mlx-lm decoder layer (its ``self_attn`` already routed; its ``mlp`` routed or not).
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        self.inner = block
        object.__setattr__(self, "submit", False)
        # a hybrid's GatedDeltaNet layer: its mixer (recurrent state, conv window, the stepping mixer's records)
        # runs eagerly between the input norm and the compiled tail (residual, post norm, MLP, residual)
        linear = bool(getattr(block, "is_linear", False))
        object.__setattr__(self, "linear", linear)
        mixer = block.linear_attn if linear else block.self_attn
        # plain attributes (outside the module tree: the inner layer lists them)
        object.__setattr__(self, "parts", (block.input_layernorm, mixer, block.post_attention_layernorm, block.mlp))
        # an attention layer whose heads' norms and RoPE are one qk_norm_rope launch: the head is the input norm and
        # the fused q/k/v projection only
        object.__setattr__(self, "rows", not linear and bool(getattr(mixer, "fused_rope", False)))
        # the compiled functions and the signatures seen, per thread: MLX 0.32 keeps compiled traces per thread and,
        # when a compiled function is freed, erases them from the last calling thread's cache only; traced on two
        # threads (route_kernels' timed steps on one, a server's worker on another) a trace would outlive its block
        # (its weights held as constants) and, keyed by the function's address, could be found again by a later
        # block whose function reuses that address. One thread per compiled function keeps the erase complete.
        object.__setattr__(self, "_local", threading.local())

    def _compiled(self):
        """``(signatures seen, compiled head, compiled tail)`` of the calling thread (made at its first call)."""
        loc = self._local
        fns = getattr(loc, "fns", None)
        if fns is None:
            head = None if self.linear else mx.compile(self.head_rows if self.rows else self.head)  # a GatedDeltaNet
            # layer's head is its norm, eager
            fns = loc.fns = (set(), head, mx.compile(self.tail_linear if self.linear else self.tail))
        return fns

    def head(self, x):
        """``(q, k, v, gate)`` of the layer's attention from its input ``x`` ``[1, L, D]`` (before RoPE)."""
        norm, attn, _, _ = self.parts
        q, k, v, gate = attn.project(norm(x))
        return (q, k, v) if gate is None else (q, k, v, gate)

    def head_rows(self, x):
        """The fused q/k/v projection's output ``[1, L, (H + 2 Hk) * D]`` of the layer's input ``x`` (the input norm
        first): what :meth:`~.attention.KernelAttention.attend_rows` takes."""
        norm, attn, _, _ = self.parts
        return attn.qkv(norm(x))

    def tail(self, x, out, *gate):
        """The layer's output from its input ``x`` and the attention core's output ``out`` ``[1, H, L, Dh]``: both
        residual adds inside the ``qmm`` launches of ``o_proj`` and the MLP's down projection where those are routed
        (:meth:`~.attention.KernelAttention.output`, :meth:`~.qmm.KernelMLP.__call__`)."""
        _, attn, norm, mlp = self.parts
        h = attn.output(out, gate[0] if gate else None, residual=x)
        return mlp(norm(h), residual=h) if isinstance(mlp, KernelMLP) else h + mlp(norm(h))

    def tail_linear(self, x, r):
        """A GatedDeltaNet layer's output from its input ``x`` and its mixer's output ``r`` ``[1, L, D]``."""
        _, _, norm, mlp = self.parts
        h = x + r
        return mlp(norm(h), residual=h) if isinstance(mlp, KernelMLP) else h + mlp(norm(h))

    def __call__(self, x, mask=None, cache=None):
        norm, mixer, _, _ = self.parts
        B, L, _ = x.shape
        if self.linear:
            if cache is None or B != 1 or L > MAX_ROWS:
                return self.inner(x, mask, cache)
        elif cache is None or not mixer.fast(cache, mask, B, L):
            return self.inner(x, mask, cache)
        seen, c_head, c_tail = self._compiled()
        sig = (x.shape, x.dtype)
        compiled = sig in seen
        if not compiled and len(seen) < MAX_SIGNATURES:
            seen.add(sig)  # this call runs eagerly (gates, bindings); the next ones compiled
        if self.linear:
            y = (c_tail if compiled else self.tail_linear)(x, mixer(norm(x), mask, cache))
        elif self.rows:
            y = (c_head if compiled else self.head_rows)(x)
            y = (c_tail if compiled else self.tail)(x, mixer.attend_rows(y, cache))
        else:
            head, tail = (c_head, c_tail) if compiled else (self.head, self.tail)
            q, k, v, *gate = head(x)
            out = mixer.attend(q, k, v, mask, cache)
            y = tail(x, out, *gate)
        if self.submit and L > 1:
            mx.async_eval(y)
        return y


def _dense_mlp(mlp) -> bool:
    """A SwiGLU MLP of :data:`~.qmm.MLP_CLASSES`, routed (:class:`~.qmm.KernelMLP`) or not: what a compiled tail may
    hold (a mixture of experts, e.g. the hybrids' sparse blocks, stays with the layer's own call)."""
    if isinstance(mlp, KernelMLP):
        return True
    return mlp is not None and f"{type(mlp).__module__}.{type(mlp).__name__}" in MLP_CLASSES


def route_blocks(layers) -> list[tuple]:
    """Wrap every decoder layer of ``layers`` (a model's list, edited in place) whose class is in
    :data:`BLOCK_CLASSES`, whose MLP is a dense SwiGLU one and whose ``self_attn`` is a
    :class:`~.attention.KernelAttention` (or that is a hybrid's GatedDeltaNet layer) with a
    :class:`KernelBlock` (this model instance only; the layer's routed modules carry their kernel mode), every
    :func:`submit_every`-th of them submitting its multi-row output early.

    Raises:
        ValueError: a bad ``MLX_DFLASH2_SUBMIT_EVERY`` (before any swap).

    Returns:
        The swaps ``[(layers, i, original)]`` (``kernels.qmm.undo_routes`` restores them).
    """
    k = submit_every()
    swaps = []
    for i, layer in enumerate(layers):
        name = f"{type(layer).__module__}.{type(layer).__name__}"
        if name not in BLOCK_CLASSES or not _dense_mlp(getattr(layer, "mlp", None)):
            continue
        if name in HYBRID_BLOCK_CLASSES and getattr(layer, "is_linear", False):
            ok = "linear_attn" in layer  # a GatedDeltaNet layer (routed or not: its mixer runs as it is)
        else:
            ok = isinstance(getattr(layer, "self_attn", None), KernelAttention)
        if ok:
            swaps.append((layers, i, layer))
            layers[i] = KernelBlock(layer)
    set_submit_every(layers, k)
    return swaps
