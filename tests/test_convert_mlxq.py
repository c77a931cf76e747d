"""MLX affine packing helpers against mx.quantize / mx.dequantize, and override parsing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash2.convert import ConvertError, QSpec, QuantPlan, pack_codes, parse_override, unpack_codes


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_pack_unpack_match_mlx(bits, gs):
    w = mx.array(np.random.default_rng(bits * gs).standard_normal((8, 256)).astype(np.float32))
    wq, s, b = mx.quantize(w, gs, bits)
    codes = unpack_codes(wq, bits, 256)
    assert int(mx.max(codes).item()) < (1 << bits)
    assert mx.array_equal(pack_codes(codes, bits), wq).item()
    ref = mx.dequantize(wq, s, b, gs, bits)
    mine = codes.astype(mx.float32) * mx.repeat(s, gs, axis=1) + mx.repeat(b, gs, axis=1)
    assert mx.allclose(ref, mine, atol=1e-6).item()


def test_gguf_q5_repack_matches_gguf_dequantizer():
    """Q5_0/Q5_1 blocks (gguf-py quantizer) -> MLX 5-bit g32, exactly equal to gguf-py's dequantization."""
    import gguf

    from mlx_dflash2.gguf import _repack_native

    a = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    for name in ("Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q8_0"):
        qt = gguf.GGMLQuantizationType[name]
        blocks = gguf.quants.quantize(a, qt)
        ref = gguf.quants.dequantize(blocks, qt).reshape(a.shape)
        w, s, b, bits = _repack_native(blocks, name)
        got = mx.dequantize(mx.array(w), mx.array(s).astype(mx.float32), mx.array(b).astype(mx.float32), 32, bits)
        np.testing.assert_array_equal(np.array(got), ref.astype(np.float32), err_msg=name)


def test_plan_and_overrides():
    plan = QuantPlan(QSpec(4, 64), [parse_override("embed=8"), parse_override("lm_head=6:32"), parse_override("gate$=none")])
    assert plan.spec_for("model.embed_tokens", 128) == (QSpec(8, 64), True)
    assert plan.spec_for("lm_head", 128) == (QSpec(6, 32), True)
    assert plan.spec_for("model.layers.0.mlp.gate", 128) == (None, True)
    assert plan.spec_for("model.layers.0.mlp.up_proj", 100) == (None, False)  # 100 % 64 != 0: stays float
    assert plan.spec_for("x", 128, {"bits": 8}) == (QSpec(8, 64), False)  # the model's own quant_predicate
    for bad in ("nothing", "x=abc", "(=4"):
        with pytest.raises(ConvertError):
            parse_override(bad)
    with pytest.raises(ConvertError):
        QSpec(7, 64)
    with pytest.raises(ConvertError):
        QSpec(4, 16)
