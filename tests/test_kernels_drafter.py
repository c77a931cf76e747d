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
from mlx_dflash2.kernels.greedy_accept import greedy_accept, greedy_accept_reference
from mlx_dflash2.kernels.selector_walk import selector_walk, tree_sum

needs_emu = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")
DRAFTER_OPS = (dynamic_conv, selector_walk, greedy_accept)
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


def _lattice_inputs(rng, M, T, K, R, V):
    cand = np.stack([np.stack([rng.permutation(V)[:K] for _ in range(T)]) for _ in range(M)]).astype(np.int32)
    u = np.round(rng.normal(size=(M, T, K)) * 2).astype(np.float32)  # exact ties
    u[rng.random(size=u.shape) < 0.15] = -np.inf
    u[0, min(1, T - 1)] = -np.inf  # a row of -inf only: index 0
    H = rng.normal(size=(M, T, R)).astype(np.float32)
    A = rng.normal(size=(V, R)).astype(np.float32)
    Bc = (rng.normal(size=(V, R)) * (np.arange(V) % 3 != 0)[:, None]).astype(np.float32)  # zero rows: pair ties
    anchor = rng.integers(0, V, size=M).astype(np.int32)
    return cand, u, H, A, Bc, anchor


@needs_emu
@pytest.mark.parametrize("M,T,K,R", [(2, 15, 16, 32), (12, 6, 4, 8), (6, 4, 5, 48), (4, 3, 3, 128), (4, 4, 2, 1)])
def test_selector_walk_body_emulated(M, T, K, R):
    """metal/selector_walk.h in the CPU emulation walks the same tokens as the MLX reference: the M
    blocks are M independent random lattices (ties in the scores, -inf candidates and rows)."""
    rng = np.random.default_rng(M * 1000 + R)
    args = _lattice_inputs(rng, M, T, K, R, V=200)
    out = emulate.selector_walk(*args)
    ref = np.array(selector_walk.reference(*map(mx.array, args)))
    assert np.array_equal(out, ref), (out, ref)


@needs_emu
def test_selector_walk_body_follows_the_tree_order():
    """Candidates whose pair terms are permutations of each other tie in exact arithmetic and differ
    only by rounding, which depends on the summation order: the kernel still picks the reference's
    token in every step (a sequential sum over r would not)."""
    rng = np.random.default_rng(7)
    M, T, K, R, V = 3, 15, 16, 32, 64
    cand = np.stack([np.stack([rng.permutation(V)[:K] for _ in range(T)]) for _ in range(M)]).astype(np.int32)
    u = np.zeros((M, T, K), np.float32)
    H = np.ones((M, T, R), np.float32)
    A = np.ones((V, R), np.float32)
    base = (rng.normal(size=R) * 10.0 ** rng.uniform(-4, 4, size=R)).astype(np.float32)
    Bc = np.stack([rng.permutation(base) for _ in range(V)]).astype(np.float32)
    anchor = rng.integers(0, V, size=M).astype(np.int32)
    out = emulate.selector_walk(cand, u, H, A, Bc, anchor)
    ref = np.array(selector_walk.reference(*map(mx.array, (cand, u, H, A, Bc, anchor))))
    assert np.array_equal(out, ref)
    tree = np.array(tree_sum(mx.array(Bc)))  # each row's pair term (u = 0, A = H = 1)
    seq = np.zeros(V, np.float32)  # the same sums in sequential order ((x0 + x1) + x2) + ...
    for r in range(R):
        seq = (seq + Bc[:, r]).astype(np.float32)
    assert len(set(tree.tolist())) > 1  # equal in exact arithmetic, not in float32: rounding decides
    assert np.array_equal(ref[:, 0], cand[np.arange(M), 0, np.argmax(tree[cand[:, 0]], axis=-1)])
    assert not np.array_equal(ref[:, 0], cand[np.arange(M), 0, np.argmax(seq[cand[:, 0]], axis=-1)])


@needs_emu
@pytest.mark.parametrize("rows,V,tpb", [(9, 5003, 128), (1, 7, None), (5, 3000, 64), (17, 200, 32)])
def test_greedy_accept_body_emulated(rows, V, tpb):
    """metal/greedy_accept.h in the CPU emulation gives the reference's tokens and acceptance length
    (none, one, half, all accepted): ties, a row of -inf, NaN (counts as the maximum) and +inf."""
    rng = np.random.default_rng(rows * V)
    x = np.round(rng.normal(size=(rows, V)) * 2).astype(np.float32)
    x[0] = -np.inf
    if rows > 2:
        x[1, rng.integers(0, V, 3)] = np.nan
    if rows > 3:
        x[2, 5] = np.inf
        x[2, V - 1] = np.inf
    target = np.array(mx.argmax(mx.array(x), axis=-1))
    for a_true in sorted({0, 1, rows // 2, rows - 1}):
        draft = target[:-1].astype(np.int32)
        if a_true < rows - 1:
            draft[a_true] += 1
        a, tokens = emulate.greedy_accept(x, draft, tpb)
        ra, rt = greedy_accept_reference(mx.array(x), mx.array(draft))
        assert (a, tokens.tolist()) == (ra.item(), rt.tolist()) and a == min(a_true, rows - 1)


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