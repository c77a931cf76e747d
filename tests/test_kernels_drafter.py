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
from mlx_dflash2.drafter.config import DrafterConfig
from mlx_dflash2.drafter.model import DraftContext, DraftModel, GroupedDynamicCausalConv
from mlx_dflash2.kernels import emulate, registry
from mlx_dflash2.kernels.dynamic_conv import dynamic_conv, dynamic_conv_reference
from mlx_dflash2.kernels.greedy_accept import greedy_accept, greedy_accept_reference
from mlx_dflash2.kernels.selector_walk import lattice_scores, selector_walk, tree_sum, walk_lattice
from mlx_dflash2.proposers import Proposal
from mlx_dflash2.verify import GreedyVerifier

from test_drafter import randomize, tiny_cfg

needs_emu = pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")
DRAFTER_OPS = (dynamic_conv, selector_walk, greedy_accept)
# float32 gate keys (the emulation's dtype) first, then others
KEYS = {"dynamic_conv": [("float32", "float32", "float32"), ("bfloat16", "bfloat16", "float32")],
        "selector_walk": [("float32", 32), ("bfloat16", 8)], "greedy_accept": [("float32",), ("float16",)],
        "qmm": [("mlx.core.bfloat16", 4, 64, 1000, 512), ("mlx.core.float32", 8, 32, 64, 256)],
        "verify_attention": [("mlx.core.float16", 8, 2, 64), ("mlx.core.bfloat16", 8, 2, 128, "rows")],
        "qk_norm_rope": [("mlx.core.bfloat16", 8, 2, 128, True), ("mlx.core.float32", 4, 4, 64, False)],
        "gated_delta_steps": [("float32", 128), ("bfloat16", 32)], "gated_delta_final": [("float32", 128), ("bfloat16", 64)]}


def test_drafter_ops_are_registered():
    for op in DRAFTER_OPS:
        assert kernels.OPS[op.name] is op
        assert set(op.sources) == {"cuda", "metal"}
        for be in op.sources:
            assert all(spec.examples for spec in op.specs(be).values())


# ---------------------------------------------------------------------------- references on the CPU


def test_dynamic_conv_reference_is_the_layer_on_cpu():
    """GroupedDynamicCausalConv.apply is dynamic_conv in every mode (on the CPU: its reference),
    including blocks shorter than the kernel."""
    D, K, gs = 32, 3, 8
    conv = GroupedDynamicCausalConv(D, K, gs)
    conv.base_kernel = mx.random.normal((2, K, D), key=mx.random.key(0))
    for B in (1, 2, 7):
        x = mx.random.normal((2, B, D), key=mx.random.key(B))
        delta = mx.random.normal((2, B, 2, K, D // gs), key=mx.random.key(10 + B))
        ref = dynamic_conv_reference(x, conv.base_kernel, delta, 1, gs)
        for mode in registry.MODES:
            assert mx.array_equal(conv.apply(x, 1, delta, mode), ref)
        xn, dn, bn = np.array(x), np.array(delta), np.array(conv.base_kernel)
        want = np.zeros_like(xn)
        for t in range(B):
            for k in range(min(K, B)):
                if t >= k:
                    want[:, t] += (bn[1, k] + np.repeat(dn[:, t, 1, k], gs, axis=-1)) * xn[:, t - k]
        np.testing.assert_allclose(np.array(ref), want, rtol=1e-5, atol=1e-5)


def test_greedy_accept_reference_is_the_verifier():
    """GreedyVerifier.verify gives greedy_accept's outputs: the rows' first-index argmaxes (ties,
    -inf rows) and the matching prefix, for every acceptance length and for an empty draft."""
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(size=(6, 50)) * 2).astype(np.float32)  # ties at the maximum
    x[2] = -np.inf
    target = np.argmax(x, axis=-1)  # numpy: first index of the maximum too
    for a in range(6):
        draft = target[:-1].copy()
        if a < 5:
            draft[a] = (draft[a] + 1) % 50
        for mode in registry.MODES:
            vr = GreedyVerifier(kernel_mode=mode).verify(mx.array(x), Proposal(mx.array(draft.astype(np.int32))))
            assert vr.num_accepted.item() == a and vr.num_accepted.dtype == mx.int32
            assert vr.tokens.tolist() == target.tolist() and vr.tokens.dtype == mx.int32
    n0, t0 = greedy_accept(mx.array(x[:1]), mx.zeros((0,), dtype=mx.int32))
    assert n0.item() == 0 and n0.shape == () and t0.tolist() == target[:1].tolist()


def test_selector_lattice_is_the_pair_score():
    """lattice_scores: S_t(a, b) = U_t(b) + sum_r A[a, r] H_t[r] Bc[b, r] (as the matmul form the
    selector used before), summed in tree_sum's fixed order; the greedy op is the lattice's walk."""
    cfg = DrafterConfig.from_dict(tiny_cfg(selector_rank=12))
    sel = randomize(DraftModel(cfg), seed=3).candidate_selector
    M, T, V = 2, 5, 100
    unary = mx.random.normal((M, T, V), key=mx.random.key(1)) * 3
    hidden = mx.random.normal((M, T, 64), key=mx.random.key(2))
    anchor = mx.array([3, 50], dtype=mx.int32)
    cand, u, H = sel.candidates(unary, hidden)
    first, edges = lattice_scores(cand, u, H, sel.predecessor_codebook, sel.successor_codebook, anchor)
    succ = sel.successor_codebook[cand] * H[..., None, :]
    want_first = u[:, 0] + (succ[:, 0] @ sel.predecessor_codebook[anchor][..., None])[..., 0]
    want_edges = u[:, 1:, None, :] + sel.predecessor_codebook[cand[:, :-1]] @ succ[:, 1:].swapaxes(-1, -2)
    np.testing.assert_allclose(np.array(first), np.array(want_first), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(edges), np.array(want_edges), rtol=1e-5, atol=1e-5)
    x = mx.random.normal((3, 12))
    np.testing.assert_allclose(np.array(tree_sum(x)), np.array(x.sum(-1)), rtol=1e-5, atol=1e-6)
    tokens = walk_lattice(cand, first, edges)[0]
    for mode in registry.MODES:
        out = sel.walk(unary, hidden, anchor, mode=mode)
        assert mx.array_equal(out.tokens, tokens) and out.q is None
        assert mx.array_equal(selector_walk(cand, u, H, sel.predecessor_codebook, sel.successor_codebook, anchor,
                                            mode=mode), tokens)


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
@pytest.mark.parametrize("op", list(kernels.OPS.values()), ids=lambda op: op.name)
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
        if op.name == "greedy_accept":  # the plain step (one row, no draft) is MLX's argmax alone
            assert not op.supports(args[0][:1], args[1][:0])
        if op.name in ("qmm", "verify_attention", "qk_norm_rope"):  # the plain step: one row
            cases.append((args[0][:1],) + args[1:] if op.name != "verify_attention" else (args[0][:, :, :1],) + args[1:])
        for case in cases:
            assert op.supports(*case, **kw)
            log.clear()
            out = op.launch(be, *case, **kw)
            ref = op.reference(*case, **kw)
            for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
                assert o.shape == r.shape and o.dtype == r.dtype
            for spec, inputs, template, grid, tg in log:
                tmpl = dict(template)
                assert set(tmpl) in [set(ex) for ex in spec.examples], (tmpl, spec.examples)
                assert len(inputs) == len(spec.inputs) and all(x.size >= 8 for x in inputs)
                for x, (name, ty) in zip(inputs, spec.inputs):
                    want = tmpl[ty] if ty in tmpl else getattr(mx, ty)
                    assert x.dtype == want, (spec.name, name, x.dtype)
                assert tg[0] * tg[1] * tg[2] <= 1024 and all(g % t == 0 for g, t in zip(grid, tg))


def test_drafter_round_routes_the_fused_ops(monkeypatch):
    """A drafter round (forward, greedy walk) and a greedy verify go through the three ops where
    kernels run (a faked GPU whose kernels are the references); training's forward_blocks, sampled
    walks and mode "reference" do not."""
    monkeypatch.setattr(registry, "backend", lambda: "cuda")
    calls = {op.name: 0 for op in DRAFTER_OPS}
    for op in DRAFTER_OPS:
        monkeypatch.setattr(op, "_gates", {})

        def launch(be, *args, _op=op, **kw):
            calls[_op.name] += 1
            return _op.reference(*args, **kw)

        monkeypatch.setattr(op, "launch", launch)
    cfg = DrafterConfig.from_dict(tiny_cfg())
    m = randomize(DraftModel(cfg), seed=1)
    ctx = DraftContext(m)
    ctx.append(m, mx.random.normal((5, 128)))
    emb = mx.random.normal((1, 8, 64))
    h = m(emb, ctx)
    n_conv = calls["dynamic_conv"]
    assert n_conv >= 4 * cfg.num_hidden_layers  # gate runs included
    m.forward_blocks(emb, mx.random.normal((1, 5, 128)), mx.array([[3]]))
    assert calls["dynamic_conv"] == n_conv
    u = h[0, 1:] @ mx.random.normal((64, 100))
    m.candidate_selector.walk(u, h[0, 1:], mx.array(3))
    assert calls["selector_walk"] >= 1
    n_walk = calls["selector_walk"]
    m.candidate_selector.walk(u, h[0, 1:], mx.array(3), temperature=0.7, key=mx.random.key(0))
    m.candidate_selector.walk(u, h[0, 1:], mx.array(3), mode="reference")
    assert calls["selector_walk"] == n_walk
    GreedyVerifier().verify(mx.random.normal((3, 100)), Proposal(mx.array([1, 2], dtype=mx.int32)))
    assert calls["greedy_accept"] >= 1
    m.kernel_mode = "reference"
    m(emb, ctx)
    assert calls["dynamic_conv"] == n_conv


def test_plain_step_accept_is_one_argmax_and_no_host_array():
    """No drafts (the plain loop's step): the accept is MLX's argmax alone and its ``num_accepted`` one
    evaluated scalar reused every step (a host array made per step stalls MLX's CUDA pipeline)."""
    from mlx_dflash2.kernels.greedy_accept import greedy_accept as ga

    logits = mx.random.normal((1, 50))
    empty = mx.zeros((0,), dtype=mx.int32)
    assert not ga.supports(logits, empty)
    a1, t1 = ga(logits, empty, mode="kernel")
    a2, _ = ga(mx.random.normal((1, 50)), empty, mode="kernel")
    assert a1 is a2 and int(a1) == 0 and int(t1[0]) == int(mx.argmax(logits[0]))
