"""Converter: GPTQ (v1/v2, sym/asym, 2/3/4/8 bits, act-order) and AWQ (GEMM) -> MLX.

Fixtures are packed by our own packers (tests/convert_helpers.py), written from the
reference layouts; the checks compare against the reference dequantization
formula ``s[g_idx] * (q - z[g_idx])`` with the q/z/s the packer used, and AWQ
additionally against mlx-lm's independent AWQ loader."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from convert_helpers import load_dir_tensors, random_weights, tiny_config, write_hf, write_quantized_hf
from mlx_dflash2.convert import (
    CorruptCheckpointError,
    MissingTensorError,
    UnsupportedFormatError,
    convert,
    unpack_codes,
)


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config("qwen2", tied=False)
    return cfg, random_weights(cfg, dtype=mx.float32)


def _gptq(tmp_path, tiny, bits=4, gs=128, sym=True, v1=True, act_order=False, **qc_extra):
    cfg, w = tiny
    qc = {"bits": bits, "group_size": gs, "sym": sym, "desc_act": act_order, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    qc.update(qc_extra)
    return write_quantized_hf(
        tmp_path / "src", cfg, w, "gptq", qc, {"bits": bits, "group_size": gs, "sym": sym, "v1": v1, "act_order": act_order}
    )


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_exact_repack(tmp_path, tiny, bits, v1, sym):
    src, ref, raw = _gptq(tmp_path, tiny, bits=bits, sym=sym, v1=v1)
    res = convert(src, tmp_path / "out", progress=False, q_bits=bits)  # MLX group 64 from GPTQ group 128
    assert sorted(res.exact) == sorted(raw)
    out = load_dir_tensors(tmp_path / "out")
    for p, (q, z, s, g_idx) in raw.items():
        codes = unpack_codes(out[f"{p}.weight"], bits, q.shape[0])
        assert np.array_equal(np.array(codes), q.T), p  # codes kept bit for bit
        s_exp = np.repeat(s.T, 2, axis=1)
        assert np.array_equal(np.array(out[f"{p}.scales"]), s_exp), p
        b_exp = np.repeat((-(z.T.astype(np.float32)) * s.T.astype(np.float32)).astype(np.float16), 2, axis=1)
        assert np.array_equal(np.array(out[f"{p}.biases"]), b_exp), p
        deq = mx.dequantize(out[f"{p}.weight"], out[f"{p}.scales"].astype(mx.float32), out[f"{p}.biases"].astype(mx.float32), 64, bits)
        tol = 0 if sym else 1e-4  # asymmetric: the fp16 bias rounds (<= half an ulp)
        np.testing.assert_allclose(np.array(deq), ref[f"{p}.weight"], atol=tol, rtol=0)


def test_gptq_keep_source_layout_g128_and_loads(tmp_path, tiny):
    import mlx_lm

    from mlx_dflash2.loading import load_target

    src, ref, raw = _gptq(tmp_path, tiny, bits=4, sym=False, v1=True)
    from mlx_dflash2.convert import parse_override

    ov = [parse_override("embed_tokens=none"), parse_override("lm_head=none")]  # keep the float layers float
    res = convert(src, tmp_path / "out", progress=False, keep_source_layout=True, overrides=ov)
    assert sorted(res.exact) == sorted(raw) and not res.requantized
    q = json.loads((tmp_path / "out/config.json").read_text())["quantization"]
    assert q["model.layers.0.mlp.down_proj"] == {"group_size": 128, "bits": 4, "mode": "affine"}
    assert "model.embed_tokens" not in q
    out = load_dir_tensors(tmp_path / "out")
    assert out["model.layers.0.mlp.down_proj.scales"].dtype == mx.float16  # scales keep the source dtype
    model, _ = mlx_lm.load(str(tmp_path / "out"))
    load_target(str(tmp_path / "out"))
    # top-1 agreement with the float reference (the dequantized source) >= 95 %
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    cfg["torch_dtype"] = "float32"
    hf = write_hf(tmp_path / "ref", cfg, {k: mx.array(v) for k, v in ref.items()})
    ref_model, _ = mlx_lm.load(str(hf))
    ids = mx.array(np.random.default_rng(0).integers(0, 250, size=(1, 64)))
    a = mx.argmax(ref_model(ids), -1)
    b = mx.argmax(model(ids).astype(mx.float32), -1)
    assert mx.mean(a == b).item() >= 0.98


def test_gptq_act_order_requantizes_from_the_reference(tmp_path, tiny):
    src, ref, raw = _gptq(tmp_path, tiny, bits=4, gs=32, act_order=True)
    res = convert(src, tmp_path / "out", progress=False, measure_error=True)
    assert not res.exact
    out = load_dir_tensors(tmp_path / "out")
    for p in list(raw)[:4]:
        wq, s, b = mx.quantize(mx.array(ref[f"{p}.weight"]), 64, 4)
        assert mx.array_equal(out[f"{p}.weight"], wq).item(), p
        assert mx.array_equal(out[f"{p}.scales"], s.astype(mx.float16)).item(), p
    assert res.total_error < 0.2


def test_gptq_group_sizes(tmp_path, tiny):
    # per-row groups (-1): exact at MLX g64 (in % 64 == 0)
    src, _, raw = _gptq(tmp_path, tiny, gs=-1)
    res = convert(src, tmp_path / "o1", progress=False)
    assert sorted(res.exact) == sorted(raw)
    # source groups of 32 -> MLX 64 cannot be exact; keep_source_layout keeps 32
    import shutil

    shutil.rmtree(src)
    src, _, raw = _gptq(tmp_path, tiny, gs=32)
    res = convert(src, tmp_path / "o2", progress=False, q_group_size=64)
    assert not res.exact
    res = convert(src, tmp_path / "o3", progress=False, measure_error=True)  # the default keeps it
    assert sorted(res.exact) == sorted(raw) and all(res.layer_errors[p] < 1e-6 for p in raw)


def test_gptq_quantize_config_json_side_file(tmp_path, tiny):
    src, _, raw = _gptq(tmp_path, tiny)
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "quantize_config.json").write_text(json.dumps(qc))
    res = convert(src, tmp_path / "out", progress=False)
    assert res.format == "gptq" and sorted(res.exact) == sorted(raw)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"checkpoint_format": "marlin"}, "marlin"),
        ({"format": "gptq_p", "checkpoint_format": None}, "gptq_p"),
        ({"bits": 5}, "bits"),
        ({"dynamic": {"-:.*down": {}}}, "dynamic"),
        ({"pack_dtype": "int16"}, "pack_dtype"),
    ],
)
def test_gptq_refused_layouts(tmp_path, tiny, extra, match):
    src, _, _ = _gptq(tmp_path, tiny)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"].update(extra)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedFormatError, match=match):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_gptq_corrupt_tensors(tmp_path, tiny):
    src, _, _ = _gptq(tmp_path, tiny)
    w = load_dir_tensors(src)
    w["model.layers.1.mlp.up_proj.qzeros"] = w["model.layers.1.mlp.up_proj.qzeros"][:, :-1]
    import mlx.core as mx_

    mx_.save_safetensors(str(src / "model.safetensors"), w)
    with pytest.raises(CorruptCheckpointError, match=r"model.layers.1.mlp.up_proj.qzeros has shape"):
        convert(src, tmp_path / "out", progress=False)
    del w["model.layers.1.mlp.up_proj.qzeros"]
    mx_.save_safetensors(str(src / "model.safetensors"), w)
    with pytest.raises(MissingTensorError, match="model.layers.1.mlp.up_proj.qzeros"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_gptq_tied_with_quantized_redundant_head(tmp_path):
    """known-bugs row 14: tied embeddings but a (quantized) lm_head shipped anyway."""
    import mlx_lm

    cfg = tiny_config("llama", tied=True)
    w = random_weights(cfg, dtype=mx.float32, with_head=True)
    w["lm_head.weight"] = w["model.embed_tokens.weight"]
    from convert_helpers import LINEARS

    src, _, raw = write_quantized_hf(
        tmp_path / "src", cfg, w, "gptq", {"bits": 4, "group_size": 128, "lm_head": True}, {"bits": 4, "group_size": 128}
    )
    # pack the head too, as GPTQ with lm_head=true does
    from convert_helpers import gptq_pack

    t, _, _ = gptq_pack(np.array(w["lm_head.weight"]), 4, 128)
    ws = load_dir_tensors(src)
    del ws["lm_head.weight"]
    ws.update({f"lm_head.{k}": mx.array(v) for k, v in t.items()})
    mx.save_safetensors(str(src / "model.safetensors"), ws)
    res = convert(src, tmp_path / "out", progress=False)
    assert any("redundant" in n for n in res.notes)
    assert not [k for k in load_dir_tensors(tmp_path / "out") if k.startswith("lm_head")]
    mlx_lm.load(str(tmp_path / "out"))
    assert LINEARS


# ---------------------------------------------------------------------------
# AWQ
# ---------------------------------------------------------------------------


def _awq(tmp_path, tiny, **qc):
    cfg, w = tiny
    base = {"bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    base.update(qc)
    return write_quantized_hf(tmp_path / "src", cfg, w, "awq", base, {"group_size": 128})


def test_awq_exact_and_equal_to_mlx_lm_loader(tmp_path, tiny):
    from mlx_lm.utils import _transform_awq_weights

    src, ref, raw = _awq(tmp_path, tiny)
    res = convert(src, tmp_path / "keep", progress=False, keep_source_layout=True, measure_error=True)
    assert sorted(res.exact) == sorted(raw)
    ours = load_dir_tensors(tmp_path / "keep")
    theirs, q = _transform_awq_weights(load_dir_tensors(src), {"bits": 4, "group_size": 128})
    assert q == {"group_size": 128, "bits": 4}
    for p in raw:
        for k in ("weight", "scales", "biases"):
            assert mx.array_equal(ours[f"{p}.{k}"], theirs[f"{p}.{k}"]).item(), (p, k)
        np.testing.assert_allclose(
            np.array(mx.dequantize(ours[f"{p}.weight"], ours[f"{p}.scales"].astype(mx.float32),
                                   ours[f"{p}.biases"].astype(mx.float32), 128, 4)),
            ref[f"{p}.weight"], atol=1e-4, rtol=0,
        )
    res = convert(src, tmp_path / "g64", progress=False, q_group_size=64)  # group 64: still exact (scales repeated)
    assert sorted(res.exact) == sorted(raw)
    out = load_dir_tensors(tmp_path / "g64")
    p = next(iter(raw))
    assert mx.array_equal(out[f"{p}.weight"], ours[f"{p}.weight"]).item()
    assert mx.array_equal(out[f"{p}.scales"][:, ::2], ours[f"{p}.scales"]).item()


@pytest.mark.parametrize("qc,match", [({"version": "gemv"}, "gemv"), ({"version": "marlin"}, "marlin"),
                                      ({"bits": 8}, "bits"), ({"zero_point": False}, "zero points")])
def test_awq_refused(tmp_path, tiny, qc, match):
    src, _, _ = _awq(tmp_path, tiny)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"].update(qc)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedFormatError, match=match):
        convert(src, tmp_path / "out", progress=False)


def test_gptq_partial_last_group(tmp_path):
    """in_features not a multiple of the GPTQ group (576 = 4.5 x 128, as SmolLM2's hidden size): the
    source layout has no MLX form (MLX groups must divide the row), so the default takes 4-bit g64,
    exact by repeating the scales of the 4 whole groups and trimming the half group's."""
    cfg = tiny_config("llama", tied=False, hidden_size=192, intermediate_size=384, head_dim=48)
    w = random_weights(cfg, dtype=mx.float32)
    src, ref, raw = write_quantized_hf(tmp_path / "src", cfg, w, "gptq", {"bits": 4, "group_size": 128, "sym": True},
                                       {"bits": 4, "group_size": 128})
    res = convert(src, tmp_path / "out", progress=False)
    assert sorted(res.exact) == sorted(raw)
    q = json.loads((tmp_path / "out/config.json").read_text())["quantization"]
    out = load_dir_tensors(tmp_path / "out")
    for p in raw:
        gs = q.get(p, q)["group_size"]
        assert gs == (128 if p.endswith("down_proj") else 64), p  # down_proj: 384 inputs, whole g128 groups
        deq = mx.dequantize(out[f"{p}.weight"], out[f"{p}.scales"].astype(mx.float32),
                            out[f"{p}.biases"].astype(mx.float32), gs, 4)
        np.testing.assert_array_equal(np.array(deq), ref[f"{p}.weight"])
    res = convert(src, tmp_path / "g64", progress=False, q_group_size=64)  # every layer at g64, still exact
    assert sorted(res.exact) == sorted(raw)
    out = load_dir_tensors(tmp_path / "g64")
    for p in raw:
        deq = mx.dequantize(out[f"{p}.weight"], out[f"{p}.scales"].astype(mx.float32),
                            out[f"{p}.biases"].astype(mx.float32), 64, 4)
        np.testing.assert_array_equal(np.array(deq), ref[f"{p}.weight"])
