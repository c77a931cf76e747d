"""``gated_delta_steps``: the gated delta rule over a block of steps, with every step's state (issue 20).

Hybrid targets (Qwen3.5 / Qwen3-Next: GatedDeltaNet layers between attention layers) carry a
recurrent state per linear-attention layer instead of a KV cache. A speculative round verifies ``T``
tokens at once and keeps only an accepted prefix, so the recurrence must be able to stop after any
step: this op runs the ``T`` steps and returns the state after each of them (``states[:, t]``), and
:func:`select_states` picks, per sequence, the recurrent state and the causal-convolution window after
its last accepted step (the rollback is a gather, no recomputation).

The recurrence is the gated delta rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks:
Improving Mamba2 with Delta Rule") exactly as mlx-lm computes it (``mlx_lm/models/gated_delta.py``:
``_gated_delta_step_ops`` / ``gated_delta_ops``; ``qwen3_5.GatedDeltaNet`` calls
``gated_delta_update`` with ``g = compute_g(A_log, a, dt_bias)`` (``exp(-exp(A_log) * softplus(a +
dt_bias))``, float32) and ``beta = sigmoid(b)``, after ``normalize_qk``). Per step, per value head::

    S = g_t * S;  delta = (v_t - S k_t) * beta_t;  S = S + delta k_t^T;  y_t = S q_t

with ``S`` of shape ``[Dv, Dk]`` in float32 and key head ``hv // (Hv // Hk)`` (mlx-lm's ``mx.repeat``).

The reference (:func:`gated_delta_steps_reference`) is mlx-lm's step math in a loop over ``T``; the
kernel (``metal/gated_delta_steps.h``, one body for Metal and CUDA) runs all ``T`` steps in one launch
with the state in registers, one SIMD-group / warp per value row (mlx-lm's generic kernel's layout),
writing each step's state. Float tolerance, not bit-exact (the sums' order differs). No mask (the
verify block has no padding) and no vector gating (``g [B, T, Hv, Dk]``; Qwen3.5 uses scalar gates).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from .registry import KernelOp, KernelSpec, device_input, int_params

__all__ = ["GatedDeltaSteps", "GatedDeltaFinal", "gated_delta_steps", "gated_delta_final", "gated_delta_steps_reference",
           "gated_delta_final_reference", "select_states", "TGY", "DKS"]

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_NAMES = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}
TGY = 4  # value rows (warps) per threadgroup: threadgroup (32, TGY, 1)
DKS = (32, 64, 128, 256)  # key head sizes the kernel is built for (DK / 32 state floats per lane)


def check_shapes(q, k, v, g, beta, state) -> tuple[int, int, int, int, int, int]:
    """``(B, T, Hk, Dk, Hv, Dv)`` of consistent inputs (see :func:`gated_delta_steps_reference`).

    Raises:
        ValueError: a rank or size that does not fit (named), or a missing input.
    """
    if any(not isinstance(x, mx.array) for x in (q, k, v, g, beta, state)):
        raise ValueError("q, k, v, g, beta and state must be arrays (state: zeros for a fresh sequence)")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D], got {q.shape}, {k.shape}, {v.shape}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if k.shape != q.shape or v.shape[:2] != (B, T):
        raise ValueError(f"k must have q's shape {q.shape} and v start with {(B, T)}; got k {k.shape}, v {v.shape}")
    if T < 1 or Hk < 1 or Hv % Hk != 0:
        raise ValueError(f"need T >= 1 and Hv a multiple of Hk; got T={T}, Hk={Hk}, Hv={Hv}")
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(f"g and beta must be {(B, T, Hv)} (scalar gates), got {g.shape}, {beta.shape}")
    if state.shape != (B, Hv, Dv, Dk):
        raise ValueError(f"state must be {(B, Hv, Dv, Dk)}, got {state.shape}")
    return B, T, Hk, Dk, Hv, Dv


@partial(mx.compile, shapeless=True)
def _step(q, k, v, g, beta, state):
    # mlx-lm's _gated_delta_step_ops (scalar gate, no mask), op for op; compiled once for all shapes (mlx-lm
    # compiles per shape: on the CPU each compile runs the host C++ compiler, and T varies per round)
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # [B, H, Dv]
    delta = (v - kv_mem) * beta[..., None]  # [B, H, Dv]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)  # [B, H, Dv]
    return y.astype(q.dtype), state


def gated_delta_steps_reference(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                                state: mx.array) -> tuple[mx.array, mx.array]:
    """The gated delta rule over ``T`` steps in MLX ops, every step's state kept (the CPU path and the
    kernel's yardstick): mlx-lm's ``gated_delta_ops`` step by step.

    Args:
        q, k: ``[B, T, Hk, Dk]`` (float; as mlx-lm: after ``normalize_qk``, the readout scale in ``q``).
        v: ``[B, T, Hv, Dv]``, ``Hv`` a multiple of ``Hk`` (value head ``h`` reads key head ``h // (Hv // Hk)``).
        g: ``[B, T, Hv]`` the decay, already exponentiated (mlx-lm's ``compute_g``; float32 there).
        beta: ``[B, T, Hv]`` the write strength (``sigmoid(b)``).
        state: ``[B, Hv, Dv, Dk]`` the recurrent state before the block (float32).

    Returns:
        ``(y, states)``: ``y [B, T, Hv, Dv]`` in ``q``'s dtype and ``states [B, T, Hv, Dv, Dk]``
        (float32 for a float32 state), ``states[:, t]`` the state after step ``t``: ``states[:, -1]`` is
        ``gated_delta_ops``' final state.

    Raises:
        ValueError: inconsistent shapes (:func:`check_shapes`).
    """
    B, T, Hk, Dk, Hv, Dv = check_shapes(q, k, v, g, beta, state)
    if Hv > Hk:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    ys, states = [], []
    for t in range(T):
        y, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), mx.stack(states, axis=1)


def gated_delta_final_reference(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                                state: mx.array) -> tuple[mx.array, mx.array]:
    """The gated delta rule over ``T`` steps, only the final state kept (a prompt chunk's forward), exactly
    as mlx-lm computes it in ``gated_delta_update``: its fused Metal kernel (``gated_delta_kernel``) on an
    Apple GPU, else its loop of MLX ops (``gated_delta_ops``).

    Args: as :func:`gated_delta_steps_reference`.

    Returns:
        ``(y, state)``: ``y [B, T, Hv, Dv]`` in ``q``'s dtype and the state after the last step
        ``[B, Hv, Dv, Dk]`` (float32 for a float32 state).

    Raises:
        ValueError: inconsistent shapes (:func:`check_shapes`).
    """
    from mlx_lm.models.gated_delta import gated_delta_kernel, gated_delta_ops

    Dk = check_shapes(q, k, v, g, beta, state)[3]
    if mx.default_device() == mx.gpu and mx.metal.is_available() and Dk >= 32 and Dk % 32 == 0:
        return gated_delta_kernel(q, k, v, g, beta, state)
    return gated_delta_ops(q, k, v, g, beta, state)


def select_states(states: mx.array, conv_inputs: mx.array, accepted: mx.array) -> tuple[mx.array, mx.array]:
    """The recurrent state and the causal-convolution window of each sequence after its last accepted
    step (the GatedDeltaNet layer's cache after a speculative round; sequences may accept different
    lengths). Pure MLX gathers (``take_along_axis``), no host read.

    Args:
        states: ``[B, T, Hv, Dv, Dk]`` every step's state (:func:`gated_delta_steps`).
        conv_inputs: ``[B, K - 1 + T, C]`` the convolution's input of the block: the previous window
            (``K - 1`` rows, the layer's ``conv_state``) followed by the ``T`` new rows (mlx-lm's
            ``conv_input = concatenate([conv_state, qkv], axis=1)``); ``K`` is inferred.
        accepted: int ``[B]``, the 0-based index of each sequence's last kept step, in ``0 .. T - 1``
            (values outside are clipped to that range: they are not read on the host).

    Returns:
        ``(state, conv_state)``: ``state [B, Hv, Dv, Dk] = states[b, accepted[b]]`` and
        ``conv_state [B, K - 1, C]``, the ``K - 1`` rows of ``conv_inputs`` ending at step
        ``accepted[b]`` (rows ``accepted[b] + 1 .. accepted[b] + K - 1``: mlx-lm's window for a cache of
        ``accepted[b] + 1`` new tokens; all accepted: the last ``K - 1`` rows).

    Raises:
        ValueError: shapes that do not fit (named), or a non-integer ``accepted``.
    """
    if states.ndim != 5:
        raise ValueError(f"states must be [B, T, Hv, Dv, Dk], got {states.shape}")
    B, T = states.shape[:2]
    if conv_inputs.ndim != 3 or conv_inputs.shape[0] != B or conv_inputs.shape[1] < T:
        raise ValueError(f"conv_inputs must be [B={B}, K - 1 + T (T={T}), C], got {conv_inputs.shape}")
    if accepted.shape != (B,) or not mx.issubdtype(accepted.dtype, mx.integer):
        raise ValueError(f"accepted must be an integer array of shape {(B,)}, got {accepted.dtype} {accepted.shape}")
    n_keep = conv_inputs.shape[1] - T
    a = mx.clip(accepted.astype(mx.int32), 0, T - 1)
    state = mx.take_along_axis(states, a.reshape(B, 1, 1, 1, 1), axis=1).squeeze(1)
    pos = (a[:, None] + 1 + mx.arange(n_keep, dtype=mx.int32)[None])[..., None]  # [B, K - 1, 1]
    return state, mx.take_along_axis(conv_inputs, pos, axis=1)


class GatedDeltaSteps(KernelOp):
    """The ``gated_delta_steps`` op. Call: ``gated_delta_steps(q, k, v, g, beta, state, mode=None)`` with
    the arguments of :func:`gated_delta_steps_reference` (same outputs within the gate's tolerance).

    The kernel handles ``q``, ``k``, ``v`` of one float dtype, a float32 ``state``, ``Dk`` in
    :data:`DKS` and any float ``g`` / ``beta`` (converted to float32, exactly); other calls run the
    reference.
    """

    name = "gated_delta_steps"
    sources = {"cuda": "gated_delta_steps.cu", "metal": "gated_delta_steps.metal"}

    def reference(self, q, k, v, g, beta, state):
        return gated_delta_steps_reference(q, k, v, g, beta, state)

    def supports(self, q, k, v, g, beta, state):
        try:
            B, T, Hk, Dk, Hv, Dv = check_shapes(q, k, v, g, beta, state)
        except ValueError:
            return False
        return (q.dtype in DTYPES and k.dtype == q.dtype and v.dtype == q.dtype and g.dtype in DTYPES
                and beta.dtype in DTYPES and state.dtype == mx.float32 and Dk in DKS
                and B * (T if self.ALL else 1) * Hv * Dv * Dk < 2**31 and B * T * Hv * Dv < 2**31)

    def fast_key(self, args, kw):
        if len(args) != 6 or kw or any(not isinstance(a, mx.array) for a in args):
            return None
        return tuple((a.shape, a.dtype) for a in args)

    def shape_key(self, q, k, v, g, beta, state):
        return (_NAMES[q.dtype], q.shape[-1])

    def sample(self, key):
        """Random inputs as mlx-lm's GatedDeltaNet makes them: unit-norm keys, queries scaled by
        ``Dk ** -0.5``, ``g = exp(-exp(A_log) * softplus(a + dt_bias))``, ``beta = sigmoid(b)``; two
        sequences, a key head repeated for two value heads, ``Dv`` not a multiple of :data:`TGY` (padded
        grid rows). Small: the CPU emulation runs it in the tests."""
        dtype, Dk = getattr(mx, key[0]), key[1]
        B, T, Hk, Hv, Dv = 2, 4, 1, 2, 10
        r = mx.random.split(mx.random.key(20), 7)
        q = mx.random.normal((B, T, Hk, Dk), key=r[0])
        k = mx.random.normal((B, T, Hk, Dk), key=r[1])
        q = q * mx.rsqrt((q * q).sum(-1, keepdims=True)) * Dk**-0.5
        k = k * mx.rsqrt((k * k).sum(-1, keepdims=True))
        v = mx.random.normal((B, T, Hv, Dv), key=r[2])
        a = mx.random.normal((B, T, Hv), key=r[3])
        A_log = mx.log(mx.random.uniform(0.5, 8.0, (Hv,), key=r[4]))
        g = mx.exp(-mx.exp(A_log) * mx.logaddexp(a + 1.0, 0.0))
        beta = mx.sigmoid(mx.random.normal((B, T, Hv), key=r[5])).astype(dtype)
        state = mx.random.normal((B, Hv, Dv, Dk), key=r[6]) * 0.3
        return (q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta, state), {}

    ALL = 1  # the body's ALL template argument: every step's state (1) or the last one only (0)

    def specs(self, backend):
        ex = [dict(T=t, DK=128, ALL=self.ALL) for t in ("float32", "bfloat16", "float16")]
        ex += [dict(T="float32", DK=d, ALL=self.ALL) for d in DKS if d != 128]
        if backend == "cuda":
            ids = "int(blockIdx.z), int(blockIdx.y * blockDim.y + threadIdx.y), int(threadIdx.x)"
        else:
            ids = ("int(thread_position_in_grid.z), int(thread_position_in_grid.y), "
                   "int(thread_position_in_threadgroup.x)")
        header = "gated_delta_steps." + ("cu" if backend == "cuda" else "metal")
        return {"steps": KernelSpec(
            "dflash_gated_delta_steps" if self.ALL else "dflash_gated_delta_final", header=header, examples=ex,
            inputs=[("q", "T"), ("k", "T"), ("v", "T"), ("g", "float32"), ("beta", "float32"), ("state", "float32"),
                    ("params", "int32")],
            outputs=[("y", "T"), ("states", "float32")],
            body=f"  dflash_gdn::gated_delta_steps<T, DK, ALL>(q, k, v, g, beta, state, params, y, states, {ids});\n")}

    def launch(self, backend, q, k, v, g, beta, state):
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2:]
        g32 = device_input(g.astype(mx.float32).reshape(-1))  # Metal: device pointers (B * T * Hv may be < 8)
        b32 = device_input(beta.astype(mx.float32).reshape(-1))
        rows = -(-Dv // TGY) * TGY
        y, states = self.kernel(backend, "steps")(
            inputs=[q, k, v, g32, b32, state, int_params(B, T, Hk, Hv, Dv)],
            template=[("T", q.dtype), ("DK", Dk), ("ALL", self.ALL)],
            grid=(32, rows, B * Hv), threadgroup=(32, TGY, 1),
            output_shapes=[(B, T, Hv, Dv), (B, T if self.ALL else 1, Hv, Dv, Dk)],
            output_dtypes=[q.dtype, mx.float32])
        return (y, states) if self.ALL else (y, states[:, 0])


class GatedDeltaFinal(GatedDeltaSteps):
    """The ``gated_delta_final`` op: the recurrence of :class:`GatedDeltaSteps` over a prompt chunk, only the
    state after the last step kept. Call: ``gated_delta_final(q, k, v, g, beta, state, mode=None)`` ->
    ``(y [B, T, Hv, Dv], state [B, Hv, Dv, Dk])`` (:func:`gated_delta_final_reference`).

    Same body as ``gated_delta_steps`` (``metal/gated_delta_steps.h`` with ``ALL = 0``): the routed
    GatedDeltaNet mixers run prefill chunks through it (:mod:`mlx_dflash2.kernels.gdn`), so a hybrid
    target's prompt costs one launch per layer and chunk instead of MLX ops per step where mlx-lm has no
    fused kernel (its CUDA backend).
    """

    name = "gated_delta_final"
    ALL = 0

    def reference(self, q, k, v, g, beta, state):
        return gated_delta_final_reference(q, k, v, g, beta, state)


gated_delta_steps = GatedDeltaSteps()
gated_delta_final = GatedDeltaFinal()
