"""The drafter-side fused ops (issue 19, item 3): ``dynamic_conv``, ``selector_walk``, ``greedy_accept``.

On the CPU: each op is its MLX reference (today's code path), the shared kernel bodies run in the CPU
emulation equal that reference (bit for bit / token for token) on random inputs with ties, infinities
and NaN, the numerics gate passes them, and the drafter round routes through the ops. The compile
checks of every instantiation (NVRTC, Metal shim) are tests/test_kernels.py's, over ``OPS``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash2 import kernels
from mlx_dflash2.kernels import emulate, registry
from mlx_dflash2.kernels.dynamic_conv import dynamic_conv, dynamic_conv_reference

needs_emu = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")
DRAFTER_OPS = (dynamic_conv,)
# float32 gate keys (the emulation's dtype) first, then others
KEYS = {"dynamic_conv": [("float32", "float32", "float32"), ("bfloat16", "bfloat16", "float32")],
        "selector_walk": [("float32", 32), ("bfloat16", 8)], "greedy_accept": [("float32",), ("float16",)]}


def test_drafter_ops_are_registered():
    for op in DRAFTER_OPS:
        assert kernels.OPS[op.name] is op
        assert set(op.sources) == {"cuda", "metal"}
        for be in op.sources:
            assert all(spec.examples for spec in op.specs(be).values())


# ---------------------------------------------------------------------------- shared bodies, emulated


@needs_emu
@pytest.mark.parametrize("N,B,D,K,gs", [(1, 16, 64, 2, 16), (2, 5, 48, 3, 8), (3, 1, 32, 2, 16)])
def test_dynamic_conv_body_emulated(N, B, D, K, gs):
    """metal/dynamic_conv.h in the CPU emulation equals the MLX reference bit for bit (float32), with
    signed zeros, infinities and a tap before the block start."""
    rng = np.random.default_rng(N * 100 + B)
    x = rng.normal(size=(N, B, D)).astype(np.float32)
    x.flat[:: 7] = -0.0
    x.flat[5] = np.inf
    base = rng.normal(size=(2, K, D)).astype(np.float32)
    base[0, 0, :3] = 0.0
    delta = rng.normal(size=(N, B, 2, K, D // gs)).astype(np.float32)
    for side in (0, 1):
        out = emulate.dynamic_conv(x, base, delta, side, gs)
        ref = np.array(dynamic_conv_reference(mx.array(x), mx.array(base), mx.array(delta), side, gs))
        assert np.array_equal(out, ref, equal_nan=True)
        assert np.array_equal(np.signbit(out), np.signbit(ref))


# ---------------------------------------------------------------------------- the gate and the wiring


def _emulated_launch(op):
    """``op.launch`` through the CPU emulation (float32 inputs)."""
    if op.name == "dynamic_conv":
        return lambda be, x, base, delta, side, gs: mx.array(
            emulate.dynamic_conv(np.array(x), np.array(base), np.array(delta), side, gs))
    if op.name == "selector_walk":
        return lambda be, *args: mx.array(emulate.selector_walk(*(np.array(a) for a in args)))

    def accept(be, logits, draft):
        a, tokens = emulate.greedy_accept(np.array(logits), np.array(draft))
        return mx.array(a, dtype=mx.int32), mx.array(tokens)

    return accept


@needs_emu
@pytest.mark.parametrize("op", DRAFTER_OPS, ids=lambda op: op.name)
def test_gate_passes_the_emulated_kernels(monkeypatch, op):
    """The numerics gate, on each op's own gate inputs (``sample``: ties, -inf), passes the shared
    body as the emulation runs it; a call then runs the kernel."""
    monkeypatch.setattr(registry, "backend", lambda: "cuda")
    monkeypatch.setattr(op, "_gates", {})
    key = KEYS[op.name][0]
    args, kw = op.sample(key)
    assert op.supports(*args, **kw) and op.shape_key(*args, **kw) == key
    monkeypatch.setattr(op, "launch", _emulated_launch(op))
    assert op.active(*args, mode="kernel", **kw)  # raises KernelError (with the reason) if the gate fails
    assert op._gates[key].ok and op._gates[key].max_error == 0.0


class _FakeKernel:
    """Stands for an ``mx.fast`` kernel: records a launch, returns zeros of the asked shapes."""

    def __init__(self, spec, log):
        self.spec, self.log = spec, log

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, **kw):
        self.log.append((self.spec, inputs, template or [], grid, threadgroup))
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]


@pytest.mark.parametrize("be", ["cuda", "metal"])
@pytest.mark.parametrize("op", DRAFTER_OPS, ids=lambda op: op.name)
def test_launches_match_their_specs(monkeypatch, op, be):
    """launch() on the gate's inputs and on one-block inputs feeds each kernel what its KernelSpec
    declares (inputs, dtypes, template names of the compile-checked examples), in whole threadgroups
    of at most 1024 threads, every input of >= 8 elements (Metal: device pointers, not constant), and
    returns the reference's shapes and dtypes."""
    log = []
    monkeypatch.setattr(op, "kernel", lambda backend, role: _FakeKernel(op.specs(backend)[role], log))
    names = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16", mx.int32: "int32",
             mx.uint32: "uint32"}
    for key in KEYS[op.name]:
        args, kw = op.sample(key)
        cases = [args]
        if op.name == "selector_walk":  # one block, as the proposer calls it
            cases.append((args[0][:1], args[1][:1], args[2][:1], args[3], args[4], args[5][:1]))
        if op.name == "greedy_accept":  # the plain step: one row, no draft
            cases.append((args[0][:1], args[1][:0]))
        for case in cases:
            assert op.supports(*case)
            log.clear()
            out = op.launch(be, *case)
            ref = op.reference(*case)
            for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
                assert o.shape == r.shape and o.dtype == r.dtype
            for spec, inputs, template, grid, tg in log:
                tmpl = dict(template)
                assert set(tmpl) in [set(ex) for ex in spec.examples], (tmpl, spec.examples)
                assert len(inputs) == len(spec.inputs) and all(x.size >= 8 for x in inputs)
                for x, (name, ty) in zip(inputs, spec.inputs):
                    want = tmpl[ty] if ty in tmpl else getattr(mx, ty)
                    assert x.dtype == want, (spec.name, name, x.dtype)
                assert tg[0] <= 1024 and grid[0] % tg[0] == 0 and grid[1:] == (1, 1) and tg[1:] == (1, 1)