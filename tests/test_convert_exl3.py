"""Converter: EXL3 (ExLlamaV3) -> MLX. Trellis decoding (3INST/MCG/MUL1, integer and
half-integer K), Hadamard un-rotation with the sign vectors, padding removal; a tiny EXL3
model end to end; malformed inputs."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from convert_helpers import load_dir_tensors, random_weights, tiny_config, write_hf
from exl3_tools import LUT_RMS, _perm, encode, lut, reference_decode, sylvester
from mlx_dflash2.convert import (
    CorruptCheckpointError,
    MissingTensorError,
    ShapeMismatchError,
    UnsupportedFormatError,
    convert,
)
from mlx_dflash2.convert.exl3 import codebook_lut, decode_exl3_weight, decode_trellis, hadamard_128, tile_perm, unpack_signs

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("exl3_*.safetensors"))


@pytest.mark.parametrize("cb", ["3inst", "mcg", "mul1"])
def test_codebook_luts(cb):
    """Vectorised LUT == entry-by-entry Python-integer LUT, and the RMS measured on exllamav3's tables."""
    ours = codebook_lut(cb)
    assert np.array_equal(ours.view(np.uint16), lut(cb).view(np.uint16))
    assert abs(float(np.sqrt(np.mean(ours.astype(np.float64) ** 2))) - LUT_RMS[cb]) < 5e-4


def test_tile_perm_and_hadamard():
    assert np.array_equal(tile_perm(), _perm())
    x = mx.array(np.random.default_rng(0).standard_normal((256, 384)).astype(np.float32))
    H = np.kron(np.eye(3), sylvester())
    np.testing.assert_allclose(np.array(hadamard_128(x, 1)), np.array(x) @ H, atol=1e-5)
    np.testing.assert_allclose(np.array(hadamard_128(x, 0)), np.kron(np.eye(2), sylvester()) @ np.array(x), atol=1e-5)
    np.testing.assert_allclose(np.array(hadamard_128(hadamard_128(x, 1), 1)), np.array(x), atol=1e-5)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture_decodes_exactly(path):
    with safe_open(str(path), "numpy") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    cb, K = meta["codebook"], float(meta["K"])
    assert ("mcg" in t) == (cb == "mcg") and ("mul1" in t) == (cb == "mul1")
    assert t["trellis"].shape == (8, 8, int(16 * K))
    # 1. the rotated-basis values equal the encoder's own reconstruction, bit for bit
    w_hat = np.array(decode_trellis(mx.array(t["trellis"]), K, cb))
    assert np.array_equal(w_hat.view(np.uint16), t["w_hat"].view(np.uint16)), meta["producer"]
    # 2. the full weight equals the literal reference decoder (explicit Hadamard matrices)
    out_f, in_f = int(meta["out_features"]), int(meta["in_features"])
    ours = np.array(decode_exl3_weight(mx.array(t["trellis"]), mx.array(t["suh"]), mx.array(t["svh"]), cb, out_f, in_f))
    ref = reference_decode(t["trellis"], t["suh"], t["svh"], cb, table=codebook_lut(cb)).T[:out_f, :in_f]
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    # 3. it approximates the source weight
    src = np.random.default_rng(int(meta["seed"])).standard_normal((out_f, in_f)) * 0.02
    rel = np.linalg.norm(ours - src) / np.linalg.norm(src)
    assert rel < {2.0: 0.3, 2.5: 0.22, 3.0: 0.17, 4.0: 0.09}[K], rel


def test_committed_fixtures_come_from_exllamav3():
    """The committed fixtures are exllamav3's own encodings (tests/fixtures/README.md), not our encoder's."""
    assert len(FIXTURES) == 5
    for path in FIXTURES:
        with safe_open(str(path), "numpy") as f:
            assert f.metadata()["producer"].startswith("exllamav3 "), path.name


def test_legacy_packed_signs():
    rng = np.random.default_rng(5)
    signs = rng.choice([-1.0, 1.0], 128)
    bits = (signs < 0).reshape(8, 16)
    packed = (bits * (1 << np.arange(16))).sum(1).astype(np.uint16).view(np.int16)
    assert np.array_equal(np.array(unpack_signs(mx.array(packed))), signs)


# ---------------------------------------------------------------------------
# a tiny EXL3 model, end to end
# ---------------------------------------------------------------------------

LAYERS = {"q_proj": ("mcg", 4), "k_proj": ("mul1", 4), "v_proj": ("mul1", 2.5), "o_proj": ("3inst", 3),
          "gate_proj": ("mcg", 4), "up_proj": ("mul1", 4), "down_proj": ("mcg", 3), "lm_head": ("3inst", 6)}


def write_exl3(path: Path, cfg: dict, w: dict, legacy_signs: bool = False):
    """An EXL3 checkpoint of HF weights ``w`` (our encoder); embeddings / norms fp16.
    Returns (path, decoded reference weights (float32) by HF name)."""
    tensors, ref = {}, {}
    for name, v in w.items():
        mod = name[: -len(".weight")]
        kind = mod.split(".")[-1]
        if name.endswith(".weight") and kind in LAYERS:
            cb, K = LAYERS[kind]
            W = np.array(v.astype(mx.float32)).astype(np.float64)
            e = encode(W, K, cb, seed=len(tensors))
            for k, a in e.items():
                tensors[f"{mod}.{k}"] = mx.array(a)
            ref[name] = reference_decode(e["trellis"], e["suh"], e["svh"], cb, table=codebook_lut(cb)).T[: W.shape[0], : W.shape[1]].astype(np.float32)
        else:
            tensors[name] = v.astype(mx.float16)
            ref[name] = np.array(v.astype(mx.float16).astype(mx.float32))
    cfg = dict(cfg, quantization_config={"quant_method": "exl3", "version": "1.6.5", "bits": 4.0, "head_bits": 6,
                                         "codebook": "mcg"})
    write_hf(path, cfg, tensors)
    return path, ref


@pytest.fixture(scope="module")
def tiny_exl3(tmp_path_factory):
    # hidden 192 pads to 256 inputs; vocab 320 pads the head's outputs to 384
    cfg = tiny_config("llama", tied=True, hidden_size=192, intermediate_size=256, head_dim=48, torch_dtype="float16")
    w = random_weights(cfg, dtype=mx.float32, with_head=True)
    path, ref = write_exl3(tmp_path_factory.mktemp("exl3") / "src", cfg, w)
    return cfg, w, path, ref


def test_tiny_exl3_model_converts_and_loads(tmp_path, tiny_exl3):
    import mlx_lm

    from mlx_dflash2.loading import load_target

    cfg, w, src, ref = tiny_exl3
    res = convert(src, tmp_path / "out", progress=False, measure_error=True)
    assert res.format == "exl3"
    out_cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert out_cfg["tie_word_embeddings"] is False  # a separate lm_head ships: untied
    assert any("untied" in n for n in res.notes)
    out = load_dir_tensors(tmp_path / "out")
    assert out["lm_head.scales"].shape == (320, 3) and out["model.layers.0.mlp.down_proj.weight"].shape == (192, 32)
    # each layer is MLX RTN of the decoded EXL3 weight (float32), within the float32 decode tolerance
    for name in ("model.layers.0.self_attn.v_proj.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"):
        p = name[: -len(".weight")]
        deq = mx.dequantize(out[f"{p}.weight"], out[f"{p}.scales"].astype(mx.float32), out[f"{p}.biases"].astype(mx.float32), 64, 4)
        rel = float(np.linalg.norm(np.array(deq) - ref[name]) / np.linalg.norm(ref[name]))
        assert rel < 0.15, (name, rel)
    assert 0.05 < res.total_error < 0.15
    model, _ = mlx_lm.load(str(tmp_path / "out"))
    load_target(str(tmp_path / "out"))
    # top-1 agreement with the decoded EXL3 source as a float model
    rcfg = dict(cfg, tie_word_embeddings=False, torch_dtype="float32")
    hf = write_hf(tmp_path / "ref", rcfg, {k: mx.array(v) for k, v in ref.items()})
    ref_model, _ = mlx_lm.load(str(hf))
    ids = mx.array(np.random.default_rng(0).integers(0, 250, size=(1, 64)))
    agree = mx.mean(mx.argmax(ref_model(ids), -1) == mx.argmax(model(ids).astype(mx.float32), -1)).item()
    assert agree >= 0.8, agree


def test_exl3_keep_float_output_matches_decoder(tmp_path, tiny_exl3):
    cfg, w, src, ref = tiny_exl3
    convert(src, tmp_path / "out", progress=False, quantize=False, dtype="float32")
    out = load_dir_tensors(tmp_path / "out")
    for name in ("model.layers.1.self_attn.q_proj.weight", "lm_head.weight"):
        np.testing.assert_allclose(np.array(out[name]), ref[name], rtol=0, atol=2e-6 * np.abs(ref[name]).max())


def _mutate(tmp_path, tiny_exl3, fn):
    import shutil

    _, _, src, _ = tiny_exl3
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    t = load_dir_tensors(dst)
    fn(t)
    mx.save_safetensors(str(dst / "model.safetensors"), t)
    return dst


def test_exl3_bad_marker(tmp_path, tiny_exl3):
    def f(t):
        t["model.layers.0.self_attn.q_proj.mcg"] = mx.array(1234, dtype=mx.int32)

    with pytest.raises(CorruptCheckpointError, match="q_proj.mcg"):
        convert(_mutate(tmp_path, tiny_exl3, f), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_exl3_half_k_needs_mul1(tmp_path, tiny_exl3):
    def f(t):
        del t["model.layers.0.self_attn.v_proj.mul1"]

    with pytest.raises(UnsupportedFormatError, match="2.5"):
        convert(_mutate(tmp_path, tiny_exl3, f), tmp_path / "out", progress=False)


def test_exl3_missing_sign_vector(tmp_path, tiny_exl3):
    def f(t):
        del t["model.layers.1.mlp.up_proj.svh"]

    with pytest.raises(MissingTensorError, match="up_proj.svh"):
        convert(_mutate(tmp_path, tiny_exl3, f), tmp_path / "out", progress=False)


def test_exl3_trellis_too_small(tmp_path, tiny_exl3):
    def f(t):
        t["model.layers.0.mlp.up_proj.trellis"] = t["model.layers.0.mlp.up_proj.trellis"][:, :8]
        t["model.layers.0.mlp.up_proj.svh"] = t["model.layers.0.mlp.up_proj.svh"][:128]

    with pytest.raises(ShapeMismatchError, match="up_proj"):
        convert(_mutate(tmp_path, tiny_exl3, f), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_exl3_ngram_tables_refused(tmp_path, tiny_exl3):
    def f(t):
        t["model.ple_embedding.ngram_trellis"] = mx.zeros((4, 160), dtype=mx.int16)

    with pytest.raises(UnsupportedFormatError, match="embedding tables"):
        convert(_mutate(tmp_path, tiny_exl3, f), tmp_path / "out", progress=False)


def test_row_chunked_decoding_is_identical(tmp_path, tiny_exl3, monkeypatch):
    """Large tensors are decoded and quantized in 128-row chunks (bounded memory); the output is
    the same as decoding them whole."""
    from mlx_dflash2.convert import pipeline
    from mlx_dflash2.convert.exl3 import decode_exl3_rows

    cfg, w, src, ref = tiny_exl3
    t = load_dir_tensors(src)
    args = [t["lm_head.trellis"], t["lm_head.suh"], t["lm_head.svh"], "3inst"]
    whole = decode_exl3_weight(*args, 320, 192)
    assert mx.array_equal(decode_exl3_rows(*args, 192, 128, 320), whole[128:320]).item()
    a = convert(src, tmp_path / "whole", progress=False, measure_error=True)
    monkeypatch.setattr(pipeline, "CHUNK_ELEMENTS", 1000)
    b = convert(src, tmp_path / "chunked", progress=False, measure_error=True)
    ta, tb = load_dir_tensors(tmp_path / "whole"), load_dir_tensors(tmp_path / "chunked")
    for k in ta:
        assert mx.array_equal(ta[k], tb[k]).item(), k
    assert abs(a.total_error - b.total_error) < 1e-6
