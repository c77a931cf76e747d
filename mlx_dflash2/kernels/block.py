"""Routed decoder layers whose per-layer graph is built by ``mx.compile``'d functions (the host's share of a forward).

Why: on MLX's CUDA backend the routed forward is bound by the host, not the GPU (session 18 on the H200, the
Qwen3-8B shape: a one-token forward's kernels take 5.9 ms of GPU time against 7.4 ms for MLX's own ops, but
building its graph in Python takes 5.3 ms against MLX's 2.5, and the forward runs at 12.1 ms pipelined against
MLX's 10.2). A decoder layer makes ~25 Python-level op calls per token step; a compiled function replays its
recorded graph in C++, so the layer becomes two compiled calls around the part that depends on the cache:

* ``head(x)``: ``input_layernorm``, the fused q/k/v ``qmm``, the split, the q/k norms, the transposes;
* RoPE at the cache's offset, the cache update and :data:`~.attention.verify_attention` (eager: they depend on the
  cache's length);
* ``tail(x, attn, gate)``: ``o_proj`` (times the output gate where gated), the residual, ``post_attention_layernorm``,
  the MLP (gate and up fused), the residual.

The ops and their order are exactly those of the eager layer (compiling fuses elementwise ops, e.g. SwiGLU, without
changing their arithmetic), so the plain step and the verify still compute every row the same way. A signature
(activation shape and dtype) first runs eagerly: the kernels' numerics gates and bindings happen there, outside any
trace (a gate evaluates arrays, which a trace may not); the compiled functions take over from its second call.

Used by :meth:`~mlx_dflash2.target.TargetAdapter.route_kernels` on GPU backends (``MLX_DFLASH2_COMPILE``: ``1``
everywhere, ``0`` never; default on a GPU only: on MLX's CPU backend a compiled graph's fused kernels are built by a
C++ compiler at first use, for nothing: the CPU runs no kernels).
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from .attention import KernelAttention

__all__ = ["KernelBlock", "route_blocks", "BLOCK_CLASSES", "compile_enabled", "COMPILE_ENV"]

COMPILE_ENV = "MLX_DFLASH2_COMPILE"
# mlx-lm decoder layers whose __call__ is h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))
BLOCK_CLASSES = ("mlx_lm.models.llama.TransformerBlock", "mlx_lm.models.qwen2.TransformerBlock",
                 "mlx_lm.models.qwen3.TransformerBlock")
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


class KernelBlock(nn.Module):
    """A decoder layer of :data:`BLOCK_CLASSES` whose attention is a :class:`~.attention.KernelAttention`, run as
    two ``mx.compile``'d functions around its cache-dependent middle (see the module's docstring) wherever the
    attention's fast path applies (one sequence, at most 16 new rows, a plain ``KVCache``); other calls (prompt
    chunks, other caches) run the wrapped layer as it is.

    Args:
        block: the mlx-lm decoder layer (its ``self_attn`` already routed; its ``mlp`` routed or not).
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        self.inner = block
        attn = block.self_attn
        # plain attributes (outside the module tree: the inner layer lists them)
        object.__setattr__(self, "parts", (block.input_layernorm, attn, block.post_attention_layernorm, block.mlp))
        object.__setattr__(self, "_seen", set())
        object.__setattr__(self, "_head", mx.compile(self.head))
        object.__setattr__(self, "_tail", mx.compile(self.tail))

    def __getattr__(self, key):  # the wrapped layer's members (self_attn, mlp, norms) read through
        try:
            return super().__getattr__(key)
        except AttributeError:
            inner = dict.get(self, "inner")
            if inner is None:
                raise
            return getattr(inner, key)

    def head(self, x):
        """``(q, k, v, gate)`` of the layer's attention from its input ``x`` ``[1, L, D]`` (before RoPE)."""
        norm, attn, _, _ = self.parts
        q, k, v, gate = attn.project(norm(x))
        return (q, k, v) if gate is None else (q, k, v, gate)

    def tail(self, x, out, *gate):
        """The layer's output from its input ``x`` and the attention core's output ``out`` ``[1, H, L, Dh]``."""
        _, attn, norm, mlp = self.parts
        h = x + attn.output(out, gate[0] if gate else None)
        return h + mlp(norm(h))

    def __call__(self, x, mask=None, cache=None):
        _, attn, _, _ = self.parts
        B, L, _ = x.shape
        if cache is None or not attn.fast(cache, mask, B, L):
            return self.inner(x, mask, cache)
        sig = (x.shape, x.dtype)
        compiled = sig in self._seen
        if not compiled and len(self._seen) < MAX_SIGNATURES:
            self._seen.add(sig)  # this call runs eagerly (gates, bindings); the next ones compiled
        head, tail = (self._head, self._tail) if compiled else (self.head, self.tail)
        q, k, v, *gate = head(x)
        out = attn.attend(q, k, v, mask, cache)
        return tail(x, out, *gate)


def route_blocks(layers, mode: str | None = None) -> list[tuple]:
    """Wrap every decoder layer of ``layers`` (a model's list, edited in place) whose class is in
    :data:`BLOCK_CLASSES` and whose ``self_attn`` is a :class:`~.attention.KernelAttention` with a
    :class:`KernelBlock` (this model instance only). ``mode`` is unused (the layer's routed modules carry theirs).

    Returns:
        The swaps ``[(layers, i, original)]`` (``kernels.qmm.undo_routes`` restores them).
    """
    swaps = []
    for i, layer in enumerate(layers):
        name = f"{type(layer).__module__}.{type(layer).__name__}"
        if name in BLOCK_CLASSES and isinstance(getattr(layer, "self_attn", None), KernelAttention):
            swaps.append((layers, i, layer))
            layers[i] = KernelBlock(layer)
    return swaps
