"""The kernel registry on the CPU: reference paths, the gate's fallback, and the kernel sources
(CUDA twins through NVRTC, Metal through a C++ shim, shared bodies run in the CPU emulation)."""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash2 import kernels
from mlx_dflash2.kernels import check, emulate, registry
from mlx_dflash2.kernels.attention import verify_attention
from mlx_dflash2.kernels.qmm import KernelQuantizedLinear, qmm, route_quantized_linears


def test_reference_paths_on_cpu():
    """On the CPU backend every op is its MLX reference, whatever the mode."""
    x = mx.random.normal((5, 128))
    w = mx.random.normal((64, 128)) * 0.1
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
    for mode in registry.MODES:
        assert mx.array_equal(qmm(x, wq, s, b, 64, 4, mode=mode), ref)
    q, k, v = (mx.random.normal((1, h, n, 64)) for h, n in ((4, 3), (2, 40), (2, 40)))
    ref = mx.fast.scaled_dot_product_attention(q, k[:, :, :20], v[:, :, :20], scale=0.125, mask="causal")
    assert mx.allclose(verify_attention(q, k, v, 20, 0.125), ref)


def test_qmm_residual_is_the_unfused_add():
    """qmm's residual (o_proj's and the MLP's down projection's launches add the layer's residual) computes the add it
    replaces, in the layer's order: exactly on the reference path, and so through a routed layer's
    :meth:`KernelQuantizedLinear.fused` (an additive bias comes before the residual); ``MLX_DFLASH2_QMM_FUSE=0``
    keeps the add apart; a residual of the wrong shape is not the kernel's."""
    import mlx.nn as nn

    x = mx.random.normal((3, 128))
    res = mx.random.normal((3, 64))
    wq, s, b = mx.quantize(mx.random.normal((64, 128)) * 0.1, group_size=64, bits=4)
    want = res + mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
    assert mx.array_equal(qmm(x, wq, s, b, 64, 4, residual=res), want)
    assert qmm.supports(x, wq, s, b, 64, 4, residual=res)
    assert not qmm.supports(x, wq, s, b, 64, 4, residual=res[:, :8])
    assert qmm.shape_key(x, wq, s, b, 64, 4, residual=res)[-1] == "residual"
    for bias in (False, True):
        lin = nn.Linear(128, 64, bias=bias)
        lin.update({"bias": mx.random.normal((64,))} if bias else {})
        q = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
        assert mx.array_equal(KernelQuantizedLinear(q, "kernel").fused(x, res), res + q(x))


def test_quantized_linear_routing_is_the_same_layer():
    """route_quantized_linears swaps this model's QuantizedLinear modules only (shared arrays, same output)."""
    import mlx.nn as nn

    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32, bias=False))
    nn.quantize(model, group_size=32, bits=4)
    x = mx.random.normal((3, 128))
    before = model(x)
    assert len(route_quantized_linears(model)) == 2
    assert all(isinstance(m, KernelQuantizedLinear) for m in (model.layers[0], model.layers[2]))
    assert mx.array_equal(model(x), before)
    assert nn.QuantizedLinear.__call__ is not KernelQuantizedLinear.__call__  # no class was touched


def test_mlp_routing_fuses_gate_and_up_without_changing_the_model():
    """route_mlps: one qmm over [W_gate; W_up] per SwiGLU MLP, the gate and up layers rebound to row views of
    the fused arrays (no second copy in the parameter tree), the same output, undone by undo_routes."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    from mlx_dflash2.kernels.qmm import KernelMLP, route_mlps, undo_routes

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                           vocab_size=300, rope_theta=1e4, max_position_embeddings=512, tie_word_embeddings=True)
    model = qwen3.Model(args)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    ids = mx.array([[1, 5, 9, 13, 200, 7]])
    before = model(ids)
    params_before = tree_flatten(model.parameters())
    swaps = route_quantized_linears(model)
    swaps += route_mlps(model.model.layers)
    assert all(isinstance(layer.mlp, KernelMLP) for layer in model.model.layers)
    after = model(ids)
    assert mx.allclose(after, before, atol=1e-5, rtol=1e-5), float(mx.abs(after - before).max())
    params_after = tree_flatten(model.parameters())
    assert len(params_after) == len(params_before)  # the fused arrays are not listed beside the views
    mlp = model.model.layers[0].mlp
    n = mlp.hidden
    for k in ("weight", "scales", "biases"):
        assert mx.array_equal(mlp.gate_up[k][:n], mlp.inner.gate_proj[k])
        assert mx.array_equal(mlp.gate_up[k][n:], mlp.inner.up_proj[k])
    undo_routes(swaps)
    assert isinstance(model.model.layers[0].mlp, qwen3.MLP)
    assert isinstance(model.model.layers[0].mlp.gate_proj, nn.QuantizedLinear)
    assert mx.array_equal(model(ids), before)


def test_routed_linear_binds_each_call_signature_once():
    """KernelQuantizedLinear decides kernel or reference once per (shape, dtype, device) and reuses it."""
    import mlx.nn as nn

    lin = nn.QuantizedLinear(128, 64, bias=True, group_size=64, bits=4)
    mx.eval(lin.parameters())
    k = KernelQuantizedLinear(lin, mode="reference")
    for rows in (1, 3, 1, 3, 1):
        x = mx.random.normal((rows, 128))
        assert mx.array_equal(k(x), lin(x))
    assert len(k._bound) == 2


def test_verify_attention_decides_once_per_signature(monkeypatch):
    """verify_attention is called once per layer per forward with a new cache length each step: its kernel-or-
    reference decision (supports, shape key, gate) ran on every call, ~19 us of the 35 us a call cost the
    H200's host (session 17, benchmarks/gpu/profile_build.py). Now decided once per shapes and dtypes; a length
    out of the cache's range is still refused per call."""
    from mlx_dflash2.kernels import verify_attention

    calls = []
    real = verify_attention.active
    monkeypatch.setattr(verify_attention, "active", lambda *a, **k: calls.append(1) or real(*a, **k))
    verify_attention._fast.clear()
    k = mx.random.normal((1, 2, 64, 32))
    v = mx.random.normal((1, 2, 64, 32))
    for L, n in ((40, 1), (41, 1), (60, 4), (61, 4), (62, 1)):
        q = mx.random.normal((1, 4, n, 32))
        out = verify_attention(q, k, v, L, 0.2)
        ref = verify_attention.reference(q, k, v, L, 0.2)
        assert mx.array_equal(out, ref)
    assert len(calls) == 2  # one per query shape (1 and 4 rows), not one per call
    verify_attention(mx.random.normal((1, 4, 1, 32)), k, v, 64, 0.2)  # the whole buffer: still in range
    assert len(calls) == 2
    verify_attention(mx.random.normal((1, 4, 1, 32)), k, v, 65, 0.2)  # past the buffer: not the cached path
    assert len(calls) == 3


def test_backend_lookup_is_cached_not_grown_per_call():
    """registry.backend() is asked on every op call: its cache was keyed by MLX Device objects, which hash by
    identity, so it never hit and grew by one entry per call (a leak over a long server run)."""
    registry.backend()
    n = len(registry._backend_of)
    for _ in range(100):
        registry.backend()
    assert len(registry._backend_of) == n


class _FakeOp(registry.KernelOp):
    """A kernel that fails to build, disagrees, or is not row-invariant, as configured."""

    name = "fake"
    sources = {"cuda": "none.cu"}
    row_invariant = True

    def __init__(self, how):
        super().__init__()
        self.how, self.launches = how, 0

    def reference(self, x):
        return x * 2

    def shape_key(self, x):
        return (x.shape[-1],)

    def sample(self, key):
        return (mx.ones((4, key[0])),), {}

    def rows_of(self, args, kw, n):
        return (args[0][:n],), kw

    def launch(self, backend, x):
        self.launches += 1
        if self.how == "build":
            raise RuntimeError("nvrtc: error: expected a ';'\nmore lines")
        if self.how == "wrong":
            return x * 3
        if self.how == "rows":
            return x * 2 + x.shape[0] * 1e-6
        return x * 2


@pytest.mark.parametrize("how,reason", [("build", "RuntimeError: nvrtc: error: expected a ';'"),
                                        ("wrong", "max error"), ("rows", "not row-count invariant")])
def test_gate_falls_back_with_one_warning(monkeypatch, caplog, how, reason):
    monkeypatch.setattr(registry, "backend", lambda: "cuda")
    op = _FakeOp(how)
    with caplog.at_level(logging.WARNING, logger="mlx_dflash2"):
        for _ in range(3):
            out = op(mx.ones((2, 8)))
            assert mx.array_equal(out, mx.full((2, 8), 2.0))  # the reference's answer, never the kernel's
        op(mx.ones((2, 16)))  # a new shape key is gated again; same reason, no second line
    lines = [r.getMessage() for r in caplog.records if "kernel fake" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0] and "\n" not in lines[0], lines
    with pytest.raises(registry.KernelError, match=reason.split(":")[0]):
        op(mx.ones((2, 8)), mode="kernel")


def test_gate_passes_a_good_kernel(monkeypatch):
    monkeypatch.setattr(registry, "backend", lambda: "cuda")
    op = _FakeOp("good")
    assert mx.array_equal(op(mx.ones((2, 8))), mx.full((2, 8), 2.0))
    assert op._gates[(8,)].ok and op.launches == 3  # gate: full sample + the 1-row invariance run; then the call
    assert mx.array_equal(op(mx.ones((2, 8)), mode="reference"), mx.full((2, 8), 2.0)) and op.launches == 3


@pytest.mark.parametrize("dtype,where", [(mx.float32, "cpu"), (mx.bfloat16, None)])
def test_float32_gate_on_cuda_measures_against_the_cpu(monkeypatch, dtype, where):
    """On CUDA, MLX's float32 attention and matmuls round through TF32 (2-3e-4 off float64 on the
    H200, where the verify_attention kernel was within 7e-7 and its gate failed): a float32 gate's
    reference runs on the CPU stream; half-precision gates keep the GPU's."""
    import contextlib

    monkeypatch.setattr(registry, "backend", lambda: "cuda")
    entered, built = [], []

    @contextlib.contextmanager
    def spy(dev):
        entered.append(dev)
        yield

    monkeypatch.setattr(registry.mx, "stream", spy)

    class Op(_FakeOp):
        def sample(self, key):
            return (mx.ones((4, key[0]), dtype=dtype),), {}

        def reference(self, x):
            built.append(list(entered))
            return x * 2

    op = Op("good")
    op(mx.ones((2, 8), dtype=dtype))
    assert op._gates[(8,)].ok
    assert built[0] == ([mx.cpu] if where == "cpu" else [])  # the gate's reference
    assert registry.yardstick_device("cpu", (mx.ones(2),), {}) is None
    assert registry.yardstick_device("metal", (mx.ones(2),), {}) is None


def test_kernel_sources_reach_mlx_without_comments():
    """MLX rebuilds and hashes a custom kernel's source at every call and launch, so the text handed to
    ``mx.fast`` is compacted: no comments, indentation or blank lines; code, preprocessor lines and string
    literals (a ``//`` inside one stays) unchanged. The compile and emulation checks read the same text."""
    raw = 'a = 1;  // one\n\n  /* two\n three */ b = 2;\n#define X(v) \\\n   (v + 1) // four\nasm("//x");\n'
    assert registry.compact_source(raw) == 'a = 1;\nb = 2;\n#define X(v) \\\n(v + 1)\nasm("//x");\n'
    full = (registry._source_dir() / "qmm.cu").read_text()
    text = registry.source_text("qmm.cu")
    assert len(text) < 0.75 * len(full) and "fragment mapping" not in text.lower()
    assert all("//" not in line or '"' in line for line in text.splitlines())


def test_mode_env_is_checked(monkeypatch):
    monkeypatch.setenv(registry.ENV, "fast")
    with pytest.raises(ValueError, match="MLX_DFLASH2_KERNELS must be one of auto, reference, kernel"):
        registry.default_mode()


def _instances(be, every: bool = False):
    """(op, role, spec, template args) to compile: every registered instantiation, or (the default
    suite) the first of each activation dtype per kernel; `make test-all` compiles them all."""
    out, seen = [], set()
    for op in kernels.OPS.values():
        if be not in op.sources:
            continue
        for role, spec in op.specs(be).items():
            for ex in spec.examples:
                k = (op.name, role, ex.get("T"))
                if every or k not in seen:
                    seen.add(k)
                    out.append((op, role, spec, ex))
    return out


@pytest.mark.skipif(not check.nvrtc_available(), reason="NVRTC not installed (nvidia-cuda-nvrtc wheel)")
@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_cuda_twins_compile_with_nvrtc(every):
    """Every CUDA twin compiles for sm_90 as mx.fast.cuda_kernel builds it (every registered instantiation
    in the slow set)."""
    bad = []
    for op, role, spec, ex in _instances("cuda", every):
        ok, log = check.compile_cuda(check.cuda_source(spec, ex))
        if not ok:
            bad.append((op.name, role, ex, log[:2000]))
    assert not bad, bad[0]


@pytest.mark.skipif(not check.cxx_available(), reason="no C++ compiler")
@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_metal_sources_compile_against_the_shim(every):
    bad = []
    for op, role, spec, ex in _instances("metal", every):
        ok, log = check.compile_metal(check.metal_source(spec, ex))
        if not ok:
            bad.append((op.name, role, ex, log[:2000]))
    assert not bad, bad[0]


@pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")
@pytest.mark.parametrize("H,Hk,D,L,backend", [(4, 2, 64, 150, "cuda"), (2, 2, 32, 33, "cuda"), (2, 1, 128, 140, "metal"),
                                              pytest.param(2, 1, 128, 140, "cuda", marks=pytest.mark.slow),
                                              pytest.param(4, 2, 64, 150, "metal", marks=pytest.mark.slow),
                                              pytest.param(2, 1, 256, 140, "cuda", marks=pytest.mark.slow),
                                              pytest.param(2, 1, 256, 140, "metal", marks=pytest.mark.slow)])
def test_attention_body_emulated(H, Hk, D, L, backend):
    """(Each geometry once in the default suite, the rest in `make test-all`.) The shared attention body
    (metal/verify_attention.h, run in the CPU emulation with each backend's launch geometry for the rows at hand: key
    sub-tiles of 32 dims on CUDA, 16 on Metal; row groups sized by the rows) equals MLX's causal SDPA, and each row
    equals the same row computed alone at its position (a smaller row group), bit for bit."""
    rng = np.random.default_rng(0)
    Lq, S = 16, L + 20
    q = rng.normal(size=(H, Lq, D)).astype(np.float32)
    k, v = (rng.normal(size=(Hk, S, D)).astype(np.float32) for _ in range(2))
    out = emulate.attention(q, k, v, L, D**-0.5, backend)
    ref = mx.fast.scaled_dot_product_attention(mx.array(q)[None], mx.array(k[:, :L])[None], mx.array(v[:, :L])[None],
                                               scale=D**-0.5, mask="causal")
    assert np.abs(np.array(ref[0]) - out).max() < 1e-5
    for i in (0, 7, Lq - 1):
        alone = emulate.attention(q[:, i : i + 1], k, v, L - Lq + i + 1, D**-0.5, backend)
        assert np.array_equal(alone[:, 0], out[:, i]), i


@pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")
def test_attention_load_batching_changes_no_bit():
    """The attention body's load batching (VB value rows at once, the next key sub-tile's loads before or after the
    current dot products: what the geometry sweep tunes per machine) orders loads only: every setting gives the
    default's output bit for bit (a cache ending inside a tile: the batch's keys past it load nothing and add
    nothing)."""
    rng = np.random.default_rng(2)
    H, Hk, D, L, Lq = 4, 2, 64, 150, 3
    q = rng.normal(size=(H, Lq, D)).astype(np.float32)
    k, v = (rng.normal(size=(Hk, L + 20, D)).astype(np.float32) for _ in range(2))
    base = emulate.attention(q, k, v, L, D**-0.5, "cuda")
    for vb, pf in ((1, 0), (4, 1), (32, 0)):
        assert np.array_equal(emulate.attention(q, k, v, L, D**-0.5, "cuda", vb=vb, pf=pf), base), (vb, pf)


_SIZES = {"float": 4, "int": 4, "uint": 4, "half": 2, "bfloat16_t": 2}


@pytest.mark.parametrize("backend,limit", [("metal", 32768), ("cuda", 49152)])
def test_kernels_fit_threadgroup_memory(backend, limit):
    """Every kernel's threadgroup / shared arrays, at every compile-checked instantiation, fit what the GPU gives a
    threadgroup: 32 KB on Apple GPUs (M1-M4), 48 KB of static shared memory on CUDA. verify_attention's first 32-key
    tiles took 41 KB at D = 128: on a Mac its pipeline could not be built (the gate would fall back every time)."""
    import re

    decl = re.compile(r"(?:threadgroup|__shared__)\s+(\w+)\s+\w+((?:\[[^\]]+\])+)")
    over, seen = [], 0
    for op, role, spec, ex in _instances(backend, True):
        total = 0
        for typ, dims in decl.findall(spec.body):
            n = 1
            for expr in re.findall(r"\[([^\]]+)\]", dims):
                n *= eval(expr, {}, {k: v for k, v in ex.items() if isinstance(v, int)})
            total += _SIZES[typ] * n
            seen += 1
        if total > limit:
            over.append((op.name, role, ex, total))
    assert seen >= 4 and not over, over


def test_selftest_runs_on_the_cpu(capsys):
    """mlx_dflash2.selftest (what a Mac user runs) prints its table; on the CPU it checks the references."""
    from mlx_dflash2.selftest import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "kernel backend: cpu" in out and "reference only" in out and "qmm" in out and "verify_attention" in out
    assert "gated_delta_steps" in out
    from mlx_dflash2 import kernels

    assert all(name in out for name in kernels.OPS)  # every registered op has a line


def _tiny_quantized_target(model_type="qwen3", head_dim=16):
    import importlib

    import mlx.nn as nn

    from mlx_dflash2.target import TargetAdapter

    cfg = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim, "rms_norm_eps": 1e-6,
           "vocab_size": 512, "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True}
    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(3)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return TargetAdapter(model, cfg, vocab_size=500)


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen2"])  # qwen2: q, k, v with additive biases
def test_target_routing_keeps_the_model(model_type):
    """The target's layers routed through the registry (forced on the CPU, where the ops are their
    references) compute exactly what mlx-lm's modules compute, and speculative decoding on the routed
    target still equals plain decoding."""
    from mlx_dflash2.kernels import KernelAttention, KernelMLP, KernelQuantizedLinear
    from mlx_dflash2.proposers import LookupProposer
    from mlx_dflash2.speculative import speculative_generate_step

    t = _tiny_quantized_target(model_type)
    prompt = [5, 9, 5, 9, 5, 9, 5, 9, 17, 23]
    ids = mx.array(prompt + [3, 4, 5], dtype=mx.int32)
    before = t.forward(ids, t.make_cache()).logits
    plain = [tok for tok, _, _ in speculative_generate_step(prompt, t, None, max_tokens=20)]
    assert t.route_kernels("auto") == 0  # the CPU backend: nothing to route
    n = t.route_kernels("kernel", force=True)
    assert n == 3 * 7 + 3 + 3 and t.kernels == "kernel"  # linears, MLPs (gate and up fused), attention
    assert isinstance(t.layers[0].self_attn, KernelAttention) and isinstance(t.layers[0].mlp, KernelMLP)
    assert t.layers[0].self_attn.qkv is not None  # q, k, v in one call
    assert isinstance(t.layers[0].mlp.down_proj, KernelQuantizedLinear)
    assert mx.array_equal(t.forward(ids, t.make_cache()).logits, before)
    spec = [tok for tok, _, _ in speculative_generate_step(prompt, t, LookupProposer(block_size=6), max_tokens=20)]
    assert spec == plain


def test_drafter_routing_keeps_its_proposals(tmp_path):
    """A quantized drafter's linear layers routed through the registry (forced on the CPU, where qmm is its
    reference) draft exactly what MLX's layers draft; mode ``reference`` and ``unroute_kernels`` put MLX's layers
    back; a routed drafter saves under its checkpoint's names (and stays routed), dequantizes unrouted; the loader
    routes a drafter only beside a target that kept its own kernels (the CPU: neither)."""
    import mlx.nn as nn

    from mlx.utils import tree_flatten

    from mlx_dflash2.drafter.io import dequantize_drafter, init_drafter, is_quantized, load_drafter, save_drafter
    from mlx_dflash2.kernels import KernelMLP, KernelQuantizedLinear
    from mlx_dflash2.proposers import DFlashProposer

    t = _tiny_quantized_target("qwen3", head_dim=64)

    class Tok:  # what init_drafter reads of a tokenizer
        eos_token_id = None

        def __len__(self):
            return 500

    d = init_drafter(t, Tok(), num_layers=2, block_size=6, mask_token_id=499, selector_rank=8, seed=2)
    nn.quantize(d, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    mx.eval(d.parameters())
    prompt = [5, 9, 5, 9, 17, 23, 41, 7, 3]

    out = t.forward(mx.array(prompt, dtype=mx.int32), t.make_cache(), tap_ids=tuple(d.config.target_layer_ids))

    def drafts():
        s = DFlashProposer(d, t, valid_vocab=500, min_confidence=0.0).start(prompt)
        s.extend(prompt[:4], out.features[:4])
        first = s.propose(prompt[4], 5).tokens.tolist()
        s.extend(prompt[4:], out.features[4:])  # the context K/V at another row count
        return first, s.propose(prompt[-1], 5).tokens.tolist()

    before = drafts()
    assert d.route_kernels("auto") == 0 and d.kernel_mode == "auto"  # the CPU backend: nothing to route
    n = d.route_kernels("kernel", force=True)
    linears = sum(isinstance(m, nn.QuantizedLinear) for _, m in d.named_modules())
    # per layer q k v o, gate up down, 2 conv projections; fc; selector; 2 MLPs; 2 attentions with q/k/v fused
    assert n == 2 * (4 + 3 + 2) + 1 + 1 + 2 + 2
    assert isinstance(d.layers[0].mlp, KernelMLP) and isinstance(d.fc, KernelQuantizedLinear) and linears == 0
    assert d.layers[0].self_attn._fused is not None  # the block's heads through qk_norm_rope
    assert drafts() == before
    assert d.route_kernels("kernel", force=True) == n and d.routed  # again in the same mode: nothing more
    path = save_drafter(d, tmp_path / "d")  # saved under the checkpoint's own names, still routed after
    assert d.routed and isinstance(d.fc, KernelQuantizedLinear)
    assert drafts() == before
    d.unroute_kernels()
    assert type(d.layers[0].mlp).__name__ == "DraftMLP" and isinstance(d.fc, nn.QuantizedLinear)
    assert d.layers[0].self_attn._fused is None and not d.routed
    assert drafts() == before
    saved = dict(tree_flatten(d.parameters()))
    loaded = dict(tree_flatten(load_drafter(path, t, Tok()).parameters()))
    assert saved.keys() == loaded.keys() and all(mx.array_equal(saved[k], loaded[k]).item() for k in saved)
    d.route_kernels("kernel", force=True)
    assert d.route_kernels("reference") == 0 and not d.routed and isinstance(d.fc, nn.QuantizedLinear)
    d.route_kernels("kernel", force=True)
    assert is_quantized(d) and not dequantize_drafter(d).routed


@pytest.mark.skipif(not emulate.available(), reason="no C++20 compiler")
@pytest.mark.parametrize("H,Hk,D,norm", [(4, 2, 64, True), (2, 1, 128, False), (4, 1, 256, True)])
def test_qk_norm_rope_body_emulated(H, Hk, D, norm):
    """The shared qk_norm_rope body (metal/qk_norm_rope.h in the CPU emulation) equals its reference (mlx's rms_norm
    and rope on the sliced heads) within float32 rounding, the value heads exactly, and a row computed alone at its
    position is bit-identical to the same row among five."""
    from mlx_dflash2.kernels import qk_norm_rope

    rng = np.random.default_rng(1)
    y = rng.normal(size=(5, (H + 2 * Hk) * D)).astype(np.float32)
    qw, kw = ((1 + 0.1 * rng.normal(size=D)).astype(np.float32) for _ in range(2)) if norm else (None, None)
    q, k, v = emulate.qk_norm_rope(y, qw, kw, H, Hk, 1e-6, 1e6, 300)
    ref = qk_norm_rope.reference(mx.array(y), *(None if w is None else mx.array(w) for w in (qw, kw)), H, Hk, 1e-6,
                                 1e6, 300)
    for got, r in zip((q, k), ref):
        assert np.abs(np.array(r[0]) - got).max() < 1e-4 * max(1.0, float(np.abs(np.array(r)).max()))
    assert np.array_equal(np.array(ref[2][0]), v)
    q1, k1, v1 = emulate.qk_norm_rope(y[3:4], qw, kw, H, Hk, 1e-6, 1e6, 303)
    assert np.array_equal(q1[:, 0], q[:, 3]) and np.array_equal(k1[:, 0], k[:, 3]) and np.array_equal(v1[:, 0], v[:, 3])


@pytest.mark.parametrize("model_type,compiled", [("qwen3", False), ("qwen3", True), ("llama", True)])
def test_routed_heads_go_through_qk_norm_rope(monkeypatch, model_type, compiled):
    """A routed target with head_dim 64 (fused q/k/v, nn.RoPE of the whole head) takes each attention layer's norms,
    RoPE and head layout through qk_norm_rope (one launch on a GPU), with the layers compiled or not: its logits are
    exactly the unrouted model's on the same chunks (float32, references on the CPU), and speculative decoding
    still equals plain decoding. A layer whose RoPE is not nn.RoPE (or is traditional) keeps mlx-lm's modules."""
    from mlx_dflash2.kernels import KernelAttention, attention
    from mlx_dflash2.proposers import LookupProposer
    from mlx_dflash2.speculative import speculative_generate_step
    from mlx_dflash2.target import trim_cache

    monkeypatch.setenv("MLX_DFLASH2_COMPILE", "1" if compiled else "0")
    t = _tiny_quantized_target(model_type, head_dim=64)
    prompt = [5, 9, 5, 9, 5, 9, 5, 9, 17, 23]
    ids = mx.array(prompt + [3, 4, 5], dtype=mx.int32)
    cache = t.make_cache()
    t.forward(ids[:10], cache)  # the same chunks as below (MLX's CPU matmuls at 13 rows round differently)
    before = t.forward(ids[10:], cache).logits
    plain = [tok for tok, _, _ in speculative_generate_step(prompt, t, None, max_tokens=20)]
    t.route_kernels("kernel", force=True)
    attn = t.inner.layers[0].self_attn
    assert isinstance(attn, KernelAttention) and attn.fused_rope
    calls = []
    real = attention.qk_norm_rope
    monkeypatch.setattr(attention, "qk_norm_rope", lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1])
    cache = t.make_cache()
    t.forward(ids[:10], cache)
    for _ in range(3):  # eager, then compiled twice (where compiled)
        assert mx.array_equal(t.forward(ids[10:], cache).logits, before)
        trim_cache(cache, 3)
    assert calls == [(1, 10, (4 + 2 * 2) * 64)] * 3 + [(1, 3, (4 + 2 * 2) * 64)] * 9  # three layers, four forwards
    spec = [tok for tok, _, _ in speculative_generate_step(prompt, t, LookupProposer(block_size=6), max_tokens=20)]
    assert spec == plain
    import mlx.nn as nn

    other = KernelAttention(_tiny_quantized_target(model_type, head_dim=64).inner.layers[0].self_attn)
    assert other.fused_rope is False  # unrouted linears: no fused q/k/v
    for rope in (nn.RoPE(64, traditional=True), nn.RoPE(32), nn.RoPE(64, scale=0.5)):
        assert not KernelAttention._fused_rope(attn.qkv, attn.splits, (4, 2), attn.fixed[3], rope, False)
    assert KernelAttention._fused_rope(attn.qkv, attn.splits, (4, 2), attn.fixed[3], nn.RoPE(64, base=5e5), False)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_compiled_blocks_compute_what_the_routed_layers_compute(monkeypatch, model_type):
    """MLX_DFLASH2_COMPILE=1 (the default on a GPU): route_kernels also wraps every decoder layer in a KernelBlock
    whose graph is built by two mx.compile'd functions around the cache update and attention. The first call of a
    signature runs eagerly (gates outside a trace), the next ones compiled; both give exactly the unrouted model's
    logits (float32, references on the CPU), prompt chunks past 16 rows take the layer as it was, speculative
    decoding still equals plain decoding, and undoing the routes puts the model's own layers back."""
    from mlx_dflash2.kernels import undo_routes
    from mlx_dflash2.kernels.block import KernelBlock, compile_enabled
    from mlx_dflash2.proposers import LookupProposer
    from mlx_dflash2.speculative import speculative_generate_step
    from mlx_dflash2.target import trim_cache

    monkeypatch.setenv("MLX_DFLASH2_COMPILE", "1")
    monkeypatch.setenv("MLX_DFLASH2_SUBMIT_EVERY", "1")  # every layer but the last queues a multi-row output early
    assert compile_enabled("cpu")
    t = _tiny_quantized_target(model_type)
    originals = list(t.inner.layers)
    prompt = [5, 9, 5, 9, 5, 9, 5, 9, 17, 23]
    ids = mx.array(prompt + [3, 4, 5], dtype=mx.int32)
    before = t.forward(ids, t.make_cache()).logits
    c0 = t.make_cache()
    t.forward(ids[:10], c0)
    # the unrouted model's own 3 rows after 10 cached ones: the reference of the same shapes (the 13-row forward's
    # last rows differ from them by ~1e-6 on some CPUs, e.g. this session's Intel Xeon host: other GEMM blocking)
    tail = t.forward(ids[10:], c0).logits
    plain = [tok for tok, _, _ in speculative_generate_step(prompt, t, None, max_tokens=20)]
    assert t.route_kernels("kernel", force=True) == 3 * 7 + 3 + 3 + 3
    blocks = t.inner.layers
    assert all(isinstance(b, KernelBlock) for b in blocks) and blocks[0].self_attn is originals[0].self_attn
    assert [b.submit for b in blocks] == [True, True, False]
    submitted = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (submitted.append(len(a)), real_async_eval(*a)))
    cache = t.make_cache()
    t.forward(ids[:10], cache)
    for _ in range(3):  # eager, then compiled twice
        assert mx.array_equal(t.forward(ids[10:], cache).logits, tail)
        trim_cache(cache, 3)
    assert len(submitted) == 2 * 4  # 10 rows (the wrapped layers) and 3 rows: layers 0 and 1, each call
    t.forward(ids[:1], cache)
    assert len(submitted) == 8  # one row: never early
    monkeypatch.setattr(mx, "async_eval", real_async_eval)
    assert ((1, 3, 64), mx.float32) in blocks[0]._compiled()[0]
    # another thread gets its own compiled functions (MLX keeps compiled traces per thread) and the same logits
    import threading

    got = {}

    def other():
        c2 = t.make_cache()
        t.forward(ids[:10], c2)
        ok = []
        for _ in range(2):  # eager, then compiled (MLX's streams are per thread: compared here)
            ok.append(mx.array_equal(t.forward(ids[10:], c2).logits, tail).item())
            trim_cache(c2, 3)
        got["ok"], got["fns"] = ok, blocks[0]._compiled()

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert got["ok"] == [True, True]
    assert got["fns"][1] is not blocks[0]._compiled()[1]
    assert mx.array_equal(t.forward(ids, t.make_cache()).logits, before)  # 13 rows without a cache offset
    long_ids = mx.array(list(range(40)), dtype=mx.int32)  # a 40-row chunk: the wrapped layers themselves
    undo = list(t._routes)
    routed_long = t.forward(long_ids, t.make_cache()).logits
    spec = [tok for tok, _, _ in speculative_generate_step(prompt, t, LookupProposer(block_size=6), max_tokens=20)]
    assert spec == plain
    undo_routes(undo)
    assert list(t.inner.layers) == originals
    assert mx.array_equal(t.forward(long_ids, t.make_cache()).logits, routed_long)


def test_compile_switch_is_checked(monkeypatch):
    """MLX_DFLASH2_COMPILE: unset = GPU backends only; 0/1 force; anything else is a named error."""
    from mlx_dflash2.kernels.block import compile_enabled

    import mlx.nn as nn

    monkeypatch.delenv("MLX_DFLASH2_COMPILE", raising=False)
    t = _tiny_quantized_target()
    assert not compile_enabled("cpu") and compile_enabled("cuda") and compile_enabled("metal")
    monkeypatch.setenv("MLX_DFLASH2_COMPILE", "0")
    assert not compile_enabled("cuda")
    monkeypatch.setenv("MLX_DFLASH2_COMPILE", "yes")
    with pytest.raises(ValueError, match="MLX_DFLASH2_COMPILE"):
        compile_enabled("cuda")
    with pytest.raises(ValueError, match="MLX_DFLASH2_COMPILE"):
        t.route_kernels("kernel", force=True)
    # the error comes before any module is swapped: the model stays as it was
    assert type(t.layers[0].mlp.down_proj) is nn.QuantizedLinear and not t._routes
    monkeypatch.setenv("MLX_DFLASH2_COMPILE", "1")
    monkeypatch.setenv("MLX_DFLASH2_SUBMIT_EVERY", "-1")
    with pytest.raises(ValueError, match="MLX_DFLASH2_SUBMIT_EVERY must be a non-negative integer"):
        t.route_kernels("kernel", force=True)
    assert type(t.layers[0].mlp.down_proj) is nn.QuantizedLinear and not t._routes
    monkeypatch.setenv("MLX_DFLASH2_SUBMIT_EVERY", "9")
    monkeypatch.setenv("MLX_DFLASH2_QMM_FUSE", "2")
    with pytest.raises(ValueError, match="MLX_DFLASH2_QMM_FUSE must be 0 or 1"):
        t.route_kernels("kernel", force=True)
    assert type(t.layers[0].mlp.down_proj) is nn.QuantizedLinear and not t._routes


def test_target_routing_that_disagrees_is_undone(monkeypatch, caplog):
    """A kernel path whose logits differ from the reference path is put back, with one warning."""
    import mlx.nn as nn

    from mlx_dflash2.kernels.qmm import QuantizedMatmul

    t = _tiny_quantized_target()
    orig = QuantizedMatmul.reference
    monkeypatch.setattr(QuantizedMatmul, "reference", lambda self, *a, **kw: orig(self, *a, **kw) * 1.5)
    with caplog.at_level(logging.WARNING, logger="mlx_dflash2"):
        assert t.route_kernels("auto", force=True) == 0
    assert t.kernels == "reference" and type(t.layers[0].mlp.down_proj) is nn.QuantizedLinear
    assert any("using the MLX reference path" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("sensitivity, explained", [(0.5, True), (0.01, False)])
def test_a_refused_16_bit_route_says_how_much_the_model_itself_moves(monkeypatch, caplog, sensitivity, explained):
    """A 16-bit route whose probe disagrees is put back; the warning adds the unrouted model's own movement
    between 16-bit and float32 activations when that alone exceeds the tolerance (a random-weight hybrid:
    the H200's 64-layer one read 0.421 against 0.1), and ``probe=False`` keeps the routes (benchmarks)."""
    import mlx.nn as nn

    from mlx_dflash2.kernels.qmm import QuantizedMatmul
    from mlx_dflash2.target import TargetAdapter

    t = _tiny_quantized_target()
    t.model.set_dtype(mx.bfloat16)
    assert t.dtype == mx.bfloat16
    orig = QuantizedMatmul.reference
    monkeypatch.setattr(QuantizedMatmul, "reference", lambda self, *a, **kw: orig(self, *a, **kw) * 1.5)
    monkeypatch.setattr(TargetAdapter, "rounding_sensitivity", lambda self, ref=None: sensitivity)
    with caplog.at_level(logging.WARNING, logger="mlx_dflash2"):
        assert t.route_kernels("kernel", force=True) == 0
    msg = [r.getMessage() for r in caplog.records if "using the MLX reference path" in r.getMessage()]
    assert len(msg) == 1 and ("cannot tell rounding from a fault" in msg[0]) == explained
    assert t.kernel_choice["bf16_vs_float32_activations"] == sensitivity
    assert t.kernels == "reference" and type(t.layers[0].mlp.down_proj) is nn.QuantizedLinear
    assert t.route_kernels("kernel", force=True, probe=False) > 0 and t.kernels == "kernel"
    assert t.kernel_choice["probe_difference"] is None


def test_rounding_sensitivity_puts_the_parameters_back():
    """The float32 probe casts the model's floating parameters and restores the very same arrays."""
    from mlx.utils import tree_flatten

    t = _tiny_quantized_target()
    assert t.rounding_sensitivity() == 0.0  # a float32 model
    t.model.set_dtype(mx.bfloat16)
    before = dict(tree_flatten(t.model.parameters()))
    ids = mx.array([5, 9, 17, 23], dtype=mx.int32)
    logits = t.forward(ids, t.make_cache()).logits
    s = t.rounding_sensitivity()
    assert 0.0 < s < 1.0
    after = dict(tree_flatten(t.model.parameters()))
    assert before.keys() == after.keys() and all(after[k] is before[k] for k in before)
    assert mx.array_equal(t.forward(ids, t.make_cache()).logits, logits)


@pytest.mark.parametrize("step_ms, verify_ms, routed", [
    (18.5, 30.0, False),  # the 8B shape on the H200: a routed step of 1.8x MLX's loses the plain loop
    (10.6, 30.0, True),  # within the step limit, the verify as MLX's
    (11.8, 11.0, True),  # the 1.5B on an H100/H200: a step ~1.1x slower but a verify ~2.7x faster
    (10.0, 35.0, False),  # the step as MLX's, a slower verify
    (13.0, 10.0, False),  # the round pays, but the plain step alone past AUTO_PLAIN_LIMIT
])
def test_auto_keeps_kernels_only_where_a_step_and_a_verify_pay(monkeypatch, caplog, step_ms, verify_ms, routed):
    """kernels="auto" times a one-token step and a 16-row verify with MLX's ops (here 10 and 30 ms) and routed,
    and keeps the kernels only if the routed pair costs at most AUTO_STEP_LIMIT times MLX's and the routed step
    at most AUTO_PLAIN_LIMIT times; "kernel" keeps them whatever the times."""
    import mlx.nn as nn

    from mlx_dflash2.kernels import KernelQuantizedLinear
    from mlx_dflash2.target import AUTO_PLAIN_LIMIT, AUTO_STEP_LIMIT, TargetAdapter

    assert AUTO_STEP_LIMIT < AUTO_PLAIN_LIMIT < 18.5 / 10.0
    t = _tiny_quantized_target()
    times = {1: iter([0.010, step_ms / 1e3]), 16: iter([0.030, verify_ms / 1e3])}
    monkeypatch.setattr(TargetAdapter, "time_step", lambda self, rows=1: next(times[rows]))
    with caplog.at_level(logging.INFO, logger="mlx_dflash2"):
        n = t.route_kernels("auto", force=True)
    assert (n > 0) == routed and t.kernels == ("auto" if routed else "reference")
    got = {k: t.kernel_choice[k] for k in ("step_ms_reference", "step_ms_kernel", "verify_ms_reference",
                                            "verify_ms_kernel", "routed")}
    assert got == pytest.approx({"step_ms_reference": 10.0, "step_ms_kernel": step_ms, "verify_ms_reference": 30.0,
                                 "verify_ms_kernel": verify_ms, "routed": routed})
    assert isinstance(t.layers[0].mlp.down_proj, KernelQuantizedLinear if routed else nn.QuantizedLinear)
    assert any("using MLX's ops" in r.getMessage() for r in caplog.records) == (not routed)
    t2 = _tiny_quantized_target()
    monkeypatch.setattr(TargetAdapter, "time_step", lambda self, rows=1: pytest.fail("kernel mode does not time"))
    assert t2.route_kernels("kernel", force=True) > 0 and t2.kernels == "kernel"


def test_time_step_is_a_cached_one_token_step():
    """time_step (one row or a verify's 16) leaves the adapter as it was (same logits after) and returns a
    positive median."""
    t = _tiny_quantized_target()
    ids = mx.array([5, 9, 17, 23], dtype=mx.int32)
    before = t.forward(ids, t.make_cache()).logits
    assert t.time_step(context=5, warmup=1, repeats=3) > 0
    assert t.time_step(context=5, warmup=1, repeats=3, rows=16) > 0
    assert mx.array_equal(t.forward(ids, t.make_cache()).logits, before)
    for bad in ({"repeats": 0}, {"rows": 0}, {"rows": 2.5}, {"rows": True}, {"context": "3"}):
        with pytest.raises(ValueError):
            t.time_step(**bad)


def test_verify_attention_max_keys(monkeypatch):
    """MLX_DFLASH2_ATTENTION_MAX_KEYS: past that many cached keys the op runs its reference (MLX's attention), also
    after a shorter call of the same shapes was decided for the kernel; bad values are refused by name."""
    from mlx_dflash2.kernels import attention

    op = attention.verify_attention
    monkeypatch.setattr(registry, "backend", lambda: "cuda")
    monkeypatch.setattr(op, "_fast", {})
    monkeypatch.setattr(op, "gate", lambda be, key: registry.GateResult(True))
    k = mx.zeros((1, 2, 128, 32))
    q = mx.zeros((1, 4, 1, 32))
    monkeypatch.setenv(attention.MAX_KEYS_ENV, "50")
    assert op.decide("cuda", (q, k, k, 40, 0.2), {}) is True
    assert op.decide("cuda", (q, k, k, 60, 0.2), {}) is False
    assert op.decide("cuda", (q, k, k, 41, 0.2), {}) is True
    monkeypatch.setenv(attention.MAX_KEYS_ENV, "0")
    assert attention.max_keys() is None and op.supports(q, k, k, 100, 0.2)
    monkeypatch.setenv(attention.MAX_KEYS_ENV, "lots")
    with pytest.raises(ValueError, match="MLX_DFLASH2_ATTENTION_MAX_KEYS"):
        attention.max_keys()


def test_cuda_header_is_an_include_of_the_written_source(monkeypatch, tmp_path):
    """On CUDA a kernel's header is one ``#include`` of its compacted source, written once under the cache
    with its content hash in the name (MLX builds and hashes the whole source at every launch: 8.3 us per
    launch with qmm.cu inline, 4.2 us included, H200 session 19); inline where the file cannot be written
    or ``MLX_DFLASH2_CUDA_INCLUDE=0``."""
    monkeypatch.setattr(registry, "_headers", {})
    monkeypatch.setattr(registry, "_include_failed", False)
    monkeypatch.delenv(registry.SRC_DIR_ENV, raising=False)  # the default rule: under the cache
    monkeypatch.setenv("MLX_DFLASH2_CACHE", str(tmp_path))
    line = registry.cuda_header("qmm.cu")
    text = registry.source_text("qmm.cu")
    assert line.startswith('#include "') and line.endswith('"\n') and line.count("\n") == 1
    path = Path(line[len('#include "'):-2])
    assert path.is_absolute() and path.parent == (tmp_path / "cuda-src").resolve()
    assert path.read_text() == text and path.name.startswith("qmm-") and path.suffix == ".cu"
    assert registry.cuda_header("qmm.cu") == line  # made once
    assert registry.cuda_header("qmm.cu", inline=True) == text
    stamp = path.stat().st_mtime_ns
    monkeypatch.setattr(registry, "_headers", {})
    assert registry.cuda_header("qmm.cu") == line  # the same file again: same line, nothing rewritten
    assert path.stat().st_mtime_ns == stamp and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    monkeypatch.setenv(registry.SRC_DIR_ENV, str(tmp_path / "elsewhere"))
    monkeypatch.setattr(registry, "_headers", {})
    assert registry.cuda_header("qmm.cu").startswith(f'#include "{(tmp_path / "elsewhere").resolve()}/qmm-')
    monkeypatch.setattr(registry, "_headers", {})
    monkeypatch.setenv(registry.INCLUDE_ENV, "0")
    assert registry.cuda_header("qmm.cu") == text
    monkeypatch.delenv(registry.INCLUDE_ENV)
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(registry.SRC_DIR_ENV, str(blocker))  # the folder is a file: cannot write
    assert registry.cuda_header("qmm.cu") == text
    monkeypatch.setattr(registry, "_headers", {})
    monkeypatch.setenv(registry.SRC_DIR_ENV, str(tmp_path / "bad"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / path.name).write_bytes(b"\xff\xfe not text")  # a corrupt file in the way: inline
    assert registry.cuda_header("qmm.cu") == text
    assert not [p for p in (tmp_path / "bad").iterdir() if p.suffix == ".tmp"]


def test_a_cuda_include_that_fails_to_build_is_gated_again_inline(monkeypatch, caplog):
    """If NVRTC cannot read the included source, the op gates again with its source inline; when that builds,
    every CUDA kernel made from then on gets its text inline (one warning). A kernel that fails inline too
    leaves the includes on."""
    monkeypatch.setattr(registry, "_include_failed", False)
    monkeypatch.setattr(registry, "_headers", {})
    headers = []

    def fake_cuda_kernel(name, header, source, ensure_row_contiguous, input_names, output_names):
        headers.append(header)

        def run(**kw):
            if header.startswith("#include") or "BROKEN" in source:
                raise RuntimeError("catastrophic error: cannot open source file")
            return [kw["inputs"][0] * 2]
        return run

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_cuda_kernel)

    class Op(registry.KernelOp):
        name = "fake_include"
        sources = {"cuda": "qmm.cu"}
        body = "y[0] = x[0];"

        def reference(self, x):
            return x * 2

        def shape_key(self, x):
            return (x.shape,)

        def sample(self, key):
            return (mx.ones(key[0]),), {}

        def specs(self, backend):
            return {"k": registry.KernelSpec("fake", [("x", "T")], [("y", "T")], "qmm.cu", self.body)}

        def launch(self, be, x):
            return self.kernel(be, "k")(inputs=[x])[0]

    text = registry.source_text("qmm.cu")
    bad = Op()
    bad.body = "BROKEN"
    assert not bad.gate("cuda", ((4,),)).ok and not registry._include_failed and not bad._inline
    assert [h.startswith("#include") for h in headers] == [True, False]  # tried inline too, then gave up
    headers.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_dflash2"):
        good, other = Op(), Op()
        assert good.gate("cuda", ((4,),)).ok
        assert other.gate("cuda", ((4,),)).ok  # made after the switch: inline from the start, no second warning
    assert headers == [headers[0], text, text] and headers[0].startswith("#include")
    assert registry._include_failed and registry.cuda_header("qmm.cu") == text
    assert [r.getMessage() for r in caplog.records] == [
        "mlx_dflash2: CUDA kernels get their source inline (built from an #include of it, fake_include failed: "
        "catastrophic error: cannot open source file)"]


def test_a_batch_of_one_takes_the_kernels_fast_path(monkeypatch):
    """A batch holding one request (the server with one client) runs the routed attention's fast path on its
    one-row RaggedKVCache, as the solo loop does on its KVCache (verify_attention, RoPE at the int offset, the
    compiled layers): its tokens equal the solo loop's and it calls verify_attention; two requests still give
    their solo tokens (mlx-lm's attention while both are rows)."""
    from mlx_dflash2.batch import SpeculativeBatch
    from mlx_dflash2.kernels import attention
    from mlx_dflash2.kernels.block import KernelBlock
    from mlx_dflash2.proposers import LookupProposer
    from mlx_dflash2.speculative import speculative_generate_step

    monkeypatch.setenv("MLX_DFLASH2_COMPILE", "1")
    t = _tiny_quantized_target()
    assert t.route_kernels("kernel", force=True) > 0 and isinstance(t.inner.layers[0], KernelBlock)
    prompt = [5, 9, 5, 9, 5, 9, 5, 9, 17, 23, 5, 9]
    prop = LookupProposer(block_size=6)
    solo = [int(x) for x, _, _ in speculative_generate_step(prompt, t, prop, max_tokens=24)]
    calls = []
    real = attention.verify_attention
    monkeypatch.setattr(attention, "verify_attention", lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1])

    def batch(prompts):
        b = SpeculativeBatch(t, prop)
        uids = [b.add(p, max_tokens=24) for p in prompts]
        out = {u: [] for u in uids}
        while b.active or b.pending:
            for ev in b.step():
                out[ev.uid] += ev.tokens
        return [out[u] for u in uids]

    assert batch([prompt]) == [solo]
    assert len(calls) >= 3 * 20 // 6 and all(s[0] == 1 for s in calls)
    two = batch([prompt, prompt[:7]])  # two rows: mlx-lm's attention until one leaves
    assert two == [solo, [int(x) for x, _, _ in speculative_generate_step(prompt[:7], t, prop, max_tokens=24)]]


def test_shared_bodies_have_no_program_scope_variables():
    """Metal allows no program-scope variable outside the `constant` address space (constexpr ones included:
    "program scope variable must reside in constant address space"); the shim, NVRTC and the CPU emulation all accept
    one, so a namespace-scope `constexpr int TILE = 32;` in verify_attention.h passed every check here and would have
    failed every Metal build (found by review). The shared bodies keep their constants inside functions or templates."""
    import re

    src = Path(__file__).resolve().parents[1] / "metal"
    bad = [(p.name, line) for p in sorted(src.glob("*.h")) if p.name != "dialect.h"
           for line in p.read_text().splitlines() if re.match(r"(static\s+)?(constexpr|const)\s+\w+\s+\w+\s*=", line)]
    assert not bad, bad
