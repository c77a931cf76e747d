"""``gated_delta_steps`` and ``select_states`` (issue 20: hybrid GatedDeltaNet targets).

On the CPU: the op is its MLX reference, which is mlx-lm's gated delta recurrence (``gated_delta_ops``,
``gated_delta_update`` with Qwen3.5's ``A_log`` / ``dt_bias`` / ``a`` / ``b``) with every step's state kept;
``select_states`` rolls a batch back to per-sequence accepted prefixes; the shared kernel body
(``metal/gated_delta_steps.h``) run in the CPU emulation equals the reference within float tolerance
and passes the numerics gate. The compile checks of every instantiation (NVRTC, Metal shim) and the
launch/spec agreement are tests/test_kernels.py's and tests/test_kernels_drafter.py's, over ``OPS``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, gated_delta_update

from mlx_dflash2 import kernels
from mlx_dflash2.kernels import emulate, registry
from mlx_dflash2.kernels.gated_delta_steps import gated_delta_steps, gated_delta_steps_reference, select_states

needs_emu = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")


def _inputs(B, T, Hk, Hv, Dk, Dv, dtype=mx.float32, seed=0):
    """Inputs as Qwen3.5's GatedDeltaNet makes them (normalized q / k, ``g = compute_g``, ``beta = sigmoid(b)``)
    plus the raw ``a``, ``b``, ``A_log``, ``dt_bias``."""
    r = mx.random.split(mx.random.key(seed), 8)
    q = mx.random.normal((B, T, Hk, Dk), key=r[0])
    k = mx.random.normal((B, T, Hk, Dk), key=r[1])
    q = (q * mx.rsqrt((q * q).sum(-1, keepdims=True)) * Dk**-0.5).astype(dtype)
    k = (k * mx.rsqrt((k * k).sum(-1, keepdims=True))).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv), key=r[2]).astype(dtype)
    a = mx.random.normal((B, T, Hv), key=r[3]).astype(dtype)
    b = mx.random.normal((B, T, Hv), key=r[4]).astype(dtype)
    A_log = mx.log(mx.random.uniform(0.5, 16.0, (Hv,), key=r[5]))
    dt_bias = mx.random.normal((Hv,), key=r[6]) * 0.5 + 1.0
    state = mx.random.normal((B, Hv, Dv, Dk), key=r[7]) * 0.3
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    return (q, k, v, g, beta, state), (a, b, A_log, dt_bias)


def _close(x, ref, tol):
    x, ref = np.array(x.astype(mx.float32)), np.array(ref.astype(mx.float32))
    assert x.shape == ref.shape
    err = np.abs(x - ref).max() / max(np.abs(ref).max(), 1.0)
    assert err <= tol, err


# ---------------------------------------------------------------------------- the reference on the CPU


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv,dtype", [(2, 7, 2, 4, 32, 16, mx.float32), (1, 1, 2, 2, 64, 8, mx.float32),
                                                   (3, 4, 1, 3, 32, 12, mx.bfloat16)])
def test_reference_is_mlx_lm(B, T, Hk, Hv, Dk, Dv, dtype):
    """y and the last state equal mlx-lm's gated_delta_ops (and gated_delta_update from the layer's raw
    a, b, A_log, dt_bias) to 1e-5; the op is the reference in every mode; dtypes as promised."""
    args, (a, b, A_log, dt_bias) = _inputs(B, T, Hk, Hv, Dk, Dv, dtype)
    y, states = gated_delta_steps_reference(*args)
    assert y.shape == (B, T, Hv, Dv) and y.dtype == dtype
    assert states.shape == (B, T, Hv, Dv, Dk) and states.dtype == mx.float32
    y_lm, s_lm = gated_delta_ops(*args)
    _close(y, y_lm, 1e-5)
    _close(states[:, -1], s_lm, 1e-5)
    y_up, s_up = gated_delta_update(args[0], args[1], args[2], a, b, A_log, dt_bias, args[5], use_kernel=False)
    _close(y, y_up, 1e-5)
    _close(states[:, -1], s_up, 1e-5)
    for mode in registry.MODES:
        y2, st2 = gated_delta_steps(*args, mode=mode)
        assert mx.array_equal(y2, y) and mx.array_equal(st2, states)


def test_states_are_the_prefix_states():
    """states[:, t] is the state after the first t + 1 steps: the reference run on that prefix alone."""
    args, _ = _inputs(2, 6, 2, 4, 32, 8, seed=1)
    y, states = gated_delta_steps_reference(*args)
    for t in range(6):
        pre = [x[:, : t + 1] for x in args[:5]] + [args[5]]
        y_t, s_t = gated_delta_steps_reference(*pre)
        _close(s_t[:, -1], states[:, t], 1e-6)
        _close(y_t, y[:, : t + 1], 1e-6)
    # and continuing from states[:, t] gives the rest of the block
    y_rest, s_rest = gated_delta_steps_reference(*[x[:, 3:] for x in args[:5]], states[:, 2])
    _close(y_rest, y[:, 3:], 1e-6)
    _close(s_rest, states[:, 3:], 1e-6)


def test_shape_errors_are_named():
    args, _ = _inputs(1, 3, 2, 4, 32, 8)
    q, k, v, g, beta, state = args
    with pytest.raises(ValueError, match="multiple of Hk"):
        gated_delta_steps(q, k, v[:, :, :3], g[..., :3], beta[..., :3], state[:, :3])
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_steps(q, k, v, g, beta, state[..., :16])
    with pytest.raises(ValueError, match="scalar gates"):
        gated_delta_steps(q, k, v, g[..., None] * mx.ones((32,)), beta, state)
    with pytest.raises(ValueError, match="state: zeros"):
        gated_delta_steps(q, k, v, g, beta, None)
    assert not gated_delta_steps.supports(q, k, v, g, beta, state[..., :16])


# ---------------------------------------------------------------------------- select_states


def test_select_states_per_row():
    """Each sequence keeps the state after its own last accepted step and the K - 1 conv-input rows
    ending there: what processing only the accepted tokens would have left (mlx-lm's conv window)."""
    B, T, Hk, Hv, Dk, Dv, K, C = 3, 5, 1, 2, 32, 8, 4, 6
    args, _ = _inputs(B, T, Hk, Hv, Dk, Dv, seed=2)
    _, states = gated_delta_steps_reference(*args)
    conv_state = mx.random.normal((B, K - 1, C), key=mx.random.key(5))
    qkv = mx.random.normal((B, T, C), key=mx.random.key(6))
    conv_inputs = mx.concatenate([conv_state, qkv], axis=1)
    accepted = mx.array([0, T - 1, 2], dtype=mx.int32)
    state, window = select_states(states, conv_inputs, accepted)
    assert state.shape == (B, Hv, Dv, Dk) and window.shape == (B, K - 1, C)
    for i, a in enumerate(accepted.tolist()):
        pre = [x[i : i + 1, : a + 1] for x in args[:5]] + [args[5][i : i + 1]]
        _close(state[i], gated_delta_steps_reference(*pre)[1][0, -1], 1e-6)
        want = mx.concatenate([conv_state[i], qkv[i, : a + 1]], axis=0)[-(K - 1):]
        assert mx.array_equal(window[i], want)
    # out-of-range indices are clipped, never read out of bounds
    s2, w2 = select_states(states, conv_inputs, mx.array([-3, 99, 2], dtype=mx.int32))
    assert mx.array_equal(s2, select_states(states, conv_inputs, mx.array([0, T - 1, 2]))[0])
    assert w2.shape == (B, K - 1, C)
    s1, w1 = select_states(states, qkv, accepted)  # K = 1: no convolution window
    assert mx.array_equal(s1, state) and w1.shape == (B, 0, C)
    with pytest.raises(ValueError, match="accepted"):
        select_states(states, conv_inputs, mx.array([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="conv_inputs"):
        select_states(states, conv_inputs[:, :2], accepted)


# ---------------------------------------------------------------------------- the shared body, emulated


@needs_emu
@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv", [(1, 3, 2, 4, 128, 6), (1, 1, 1, 1, 128, 3), (2, 2, 1, 3, 128, 8)])
def test_body_emulated(B, T, Hk, Hv, Dk, Dv):
    """metal/gated_delta_steps.h in the CPU emulation (its grid threadgroup by threadgroup, padded rows
    past Dv) writes every y and every step's state, equal to the reference within float32 rounding."""
    args, _ = _inputs(B, T, Hk, Hv, Dk, Dv, seed=B * 10 + Dk)
    y, states = emulate.gated_delta_steps(*(np.array(x) for x in args))
    ry, rs = gated_delta_steps_reference(*args)
    assert not np.isnan(y).any() and not np.isnan(states).any()
    _close(mx.array(y), ry, 2e-6)
    _close(mx.array(states), rs, 2e-6)


@needs_emu
def test_gate_passes_the_emulated_kernel(monkeypatch):
    """The numerics gate on the op's own inputs (sample) passes the shared body as the emulation runs
    it; a call then runs the kernel."""
    op = gated_delta_steps
    assert kernels.OPS[op.name] is op and set(op.sources) == {"cuda", "metal"}
    monkeypatch.setattr(registry, "backend", lambda: "cuda")
    monkeypatch.setattr(op, "_gates", {})
    monkeypatch.setattr(op, "_fast", {})
    key = ("float32", 128)
    args, kw = op.sample(key)
    assert op.supports(*args) and op.shape_key(*args) == key

    def launch(be, *a):
        y, st = emulate.gated_delta_steps(*(np.array(x) for x in a))
        return mx.array(y), mx.array(st)

    monkeypatch.setattr(op, "launch", launch)
    assert op.active(*args, mode="kernel")  # raises KernelError (with the reason) if the gate fails
    assert op._gates[key].ok and op._gates[key].max_error < 1e-5


# ---------------------------------------------------------------------------- gated_delta_final (prompt chunks)


def test_final_reference_is_the_last_step_of_the_steps():
    """gated_delta_final's reference (mlx-lm's gated_delta_update path) gives the same outputs as every step's
    reference and its last state."""
    from mlx_dflash2.kernels.gated_delta_steps import gated_delta_final_reference

    args, _ = _inputs(2, 9, 1, 3, 32, 8, seed=3)
    y, st = gated_delta_final_reference(*args)
    ry, rs = gated_delta_steps_reference(*args)
    _close(y, ry, 1e-6)
    _close(st, rs[:, -1], 1e-6)
    assert st.shape == (2, 3, 8, 32)


@needs_emu
@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv", [(1, 5, 2, 4, 128, 6), (2, 3, 1, 3, 64, 8)])
def test_final_body_emulated(B, T, Hk, Hv, Dk, Dv):
    """The body's ALL = 0 instantiation writes every y and only the state after the last step."""
    args, _ = _inputs(B, T, Hk, Hv, Dk, Dv, seed=B * 7 + T)
    y, st = emulate.gated_delta_steps(*(np.array(x) for x in args), all_steps=False)
    ry, rs = gated_delta_steps_reference(*args)
    assert st.shape == (B, 1, Hv, Dv, Dk) and not np.isnan(y).any() and not np.isnan(st).any()
    _close(mx.array(y), ry, 2e-6)
    _close(mx.array(st[:, 0]), rs[:, -1], 2e-6)


@needs_emu
def test_final_gate_passes_the_emulated_kernel(monkeypatch):
    from mlx_dflash2.kernels.gated_delta_steps import gated_delta_final

    op = gated_delta_final
    assert kernels.OPS[op.name] is op and op.ALL == 0
    monkeypatch.setattr(registry, "backend", lambda: "cuda")
    monkeypatch.setattr(op, "_gates", {})
    monkeypatch.setattr(op, "_fast", {})
    key = ("float32", 128)
    args, kw = op.sample(key)

    def launch(be, *a):
        y, st = emulate.gated_delta_steps(*(np.array(x) for x in a), all_steps=False)
        return mx.array(y), mx.array(st[:, 0])

    monkeypatch.setattr(op, "launch", launch)
    assert op.active(*args, mode="kernel")
    assert op._gates[key].ok and op._gates[key].max_error < 1e-5
