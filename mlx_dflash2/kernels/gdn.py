"""GatedDeltaNet mixers that keep every step's state of a verify block (the fast rollback of hybrid targets).

The reference rollback of a hybrid target (:class:`~mlx_dflash2.caches.RecurrentCache`) replays the
accepted prefix of a block from the pre-verify snapshot: the mixer's projections and convolution run
again on up to B rows per GatedDeltaNet layer. :func:`route_gated_delta` switches each mixer *object*
of one model to a subclass whose ``__call__`` is mlx-lm's GatedDeltaNet forward
(``mlx_lm/models/qwen3_5.py`` / ``qwen3_next.py``) with the recurrence computed by the registry's
:data:`~mlx_dflash2.kernels.gated_delta_steps` (every step's float32 state, one fused kernel on a GPU),
and hands the states and the convolution input to the cache: a trim inside the block then *selects*
the state after the last accepted token and its convolution window (what
:func:`~mlx_dflash2.kernels.select_states` does per sequence) instead of replaying.

Only blocks of at most ``cache.max_record`` rows keep every step's state. A longer forward (a prompt
chunk would keep thousands of states) runs the same recurrence through
:data:`~mlx_dflash2.kernels.gated_delta_final` (the state after its last step only: one launch per layer
and chunk where mlx-lm's ``gated_delta_update`` has no fused kernel, as on MLX's CUDA backend, whose
per-step ops ran a 27B hybrid's prefill at ~36 tok/s on the H200), recorded like mlx-lm's forward (a
trim drops it whole or not at all). Only forwards without a mask take either path: a single sequence's
(:class:`~mlx_dflash2.caches.RecurrentCache`) or a batch's verify block
(:class:`~mlx_dflash2.caches.RaggedRecurrentCache`: every row's steps, each row rolled back to its own
accepted step by ``select_states``). The routed target's parity probe compares it with the model's own
forward.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

__all__ = ["route_gated_delta", "SteppingMixer"]


class SteppingMixer:
    """Marker base of the per-object stepping subclasses made by :func:`route_gated_delta`."""


def _projections(self, x: mx.array):
    """mlx-lm's input projections of both GatedDeltaNet variants: ``(mixed qkv [B, S, C], z [B, S, Hv, Dv],
    b [B, S, Hv], a [B, S, Hv])``."""
    B, S, _ = x.shape
    if hasattr(self, "in_proj_qkvz"):  # qwen3_next: fused projections in per-key-head order
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(x), self.in_proj_ba(x))
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return mixed, z, b, a
    z = self.in_proj_z(x).reshape(B, S, self.num_v_heads, self.head_v_dim)  # qwen3_5 and later
    return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


@functools.lru_cache(maxsize=None)
def _stepping_class(base: type, mode: str) -> type:
    """A subclass of ``base`` (a recording mixer class of :mod:`mlx_dflash2.caches`) whose forward keeps
    every step's state of short blocks."""
    from mlx_lm.models.gated_delta import compute_g, normalize_qk

    from ..caches import RaggedRecurrentCache, RecurrentCache
    from .gated_delta_steps import gated_delta_final, gated_delta_steps

    def __call__(self, x, mask=None, cache=None):
        B, S, _ = x.shape
        if (not isinstance(cache, (RecurrentCache, RaggedRecurrentCache)) or mask is not None
                or cache.lengths is not None):
            return base.__call__(self, x, mask, cache)  # recorded for replay (padded batch joins)
        steps = S <= cache.max_record
        mixed, z, b, a = _projections(self, x)
        k1 = self.conv_kernel_size - 1
        conv_state = cache[0] if cache[0] is not None else mx.zeros((B, k1, self.conv_dim), dtype=x.dtype)
        cache.record(x, mask, functools.partial(base.__call__, self))  # the pre-forward snapshot
        conv_input = mx.concatenate([conv_state, mixed], axis=1)
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                               [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                               [self.head_k_dim, self.head_k_dim, self.head_v_dim])
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        beta, g = mx.sigmoid(b), compute_g(self.A_log, a, self.dt_bias)
        state = cache[1] if cache[1] is not None else mx.zeros(
            (B, self.num_v_heads, self.head_v_dim, self.head_k_dim), dtype=mx.float32)
        if steps:
            y, states = gated_delta_steps(q, k, v, g, beta, state, mode=mode)
            cache.record_steps(states, conv_input)
            state = states[:, -1]
        else:  # a prompt chunk: the last state only (the record keeps no inputs: dropped whole by a trim)
            y, state = gated_delta_final(q, k, v, g, beta, state, mode=mode)
        cache[0] = mx.contiguous(conv_input[:, -k1:, :])
        cache[1] = state
        cache.advance(S)
        out = self.norm(y, z)
        return self.out_proj(out.reshape(B, S, -1))

    return type(f"Stepping{base.__name__}", (base, SteppingMixer), {"__call__": __call__, "__module__": __name__})


def route_gated_delta(model: nn.Module, mode: str | None = None) -> list[tuple]:
    """Switch every recording GatedDeltaNet mixer of ``model`` (this object only) to its stepping subclass.

    Args:
        model: an mlx-lm hybrid model whose mixers record (:func:`mlx_dflash2.caches.install_recording`).
        mode: kernel mode of :data:`~mlx_dflash2.kernels.gated_delta_steps` (``None``: the process default).

    Returns:
        ``[(mixer, "__class__", previous class), ...]``: :func:`~mlx_dflash2.kernels.undo_routes` puts the
        previous classes back.
    """
    from ..caches import _RecordingMixer

    swapped = []
    for module in model.modules():
        mixer = module.get("linear_attn") if isinstance(module, dict) else None
        if isinstance(mixer, _RecordingMixer) and not isinstance(mixer, SteppingMixer):
            prev = type(mixer)
            mixer.__class__ = _stepping_class(prev, mode or "auto")
            swapped.append((mixer, "__class__", prev))
    return swapped
