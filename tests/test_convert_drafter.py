"""Converter: published-style DFlash / DFlash2 drafter checkpoints -> our drafter format
(known-bugs row 13: mask_token_id, target_layer_ids, block_size and the DFlash2 fields kept;
missing or invalid fields are errors).

The converter's ``--target`` and ``mlx_dflash2.drafter info`` load the embedded target by name: here the session's
(``shared_embedded_load``), except in test_drafter_mask_is_eos_refused_with_target, which loads it for real."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dflash2.convert import ConvertError, MissingTensorError, ShapeMismatchError, convert, parse_override
from mlx_dflash2.drafter import DraftContext, DrafterConfig, DraftModel, load_drafter, pick_mask_token_id


def published_cfg(arch: str, mask: int, vocab: int = 49152) -> dict:
    """A config laid out like the published checkpoints (spec §1.7 / §5.3), sized for SmolLM2."""
    cfg = {
        "architectures": [arch],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": 576,
        "num_hidden_layers": 1,
        "intermediate_size": 256,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "max_position_embeddings": 8192,
        "vocab_size": vocab,
        "num_target_layers": 30,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "block_size": 8,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": [1, 15, 27]},
    }
    if arch == "DFlash2DraftModel":
        cfg.update(is_causal=False, layer_types=["sliding_attention"], sliding_window=64, use_sliding_window=True)
        cfg["dflash_config"].update(
            conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=16,
            output_multiplier=0.5, final_logit_softcapping=20.0,
        )
    return cfg


def write_published(path, cfg: dict, seed=0, prefix="model.", codebook_weight=True, dtype=mx.bfloat16):
    """Random weights under the reference names (optionally ``model.``-prefixed, codebooks as
    ``.weight`` like an nn.Embedding export). Returns the reference DraftModel (float32)."""
    c = DrafterConfig.from_dict(cfg)
    model = DraftModel(c)
    params = tree_flatten(model.parameters())
    rng = np.random.default_rng(seed)
    new = [(n, mx.array((rng.standard_normal(p.shape) * 0.05 + (1.0 if "norm" in n else 0.0)).astype(np.float32)).astype(dtype).astype(mx.float32))
           for n, p in params]
    model.update(tree_unflatten(new))
    out = {}
    for n, v in new:
        name = n
        if codebook_weight and n.endswith("_codebook"):
            name = n + ".weight"
        out[prefix + name] = v.astype(dtype)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), out)
    return model


def _forward(model, target, n_ctx=5):
    """Drafter hidden states for one block after a context of target features."""
    rng = np.random.default_rng(3)
    D = model.config.hidden_size
    feats = mx.array(rng.standard_normal((n_ctx, D * len(model.config.target_layer_ids))).astype(np.float32))
    ctx = DraftContext(model)
    ctx.append(model, feats)
    emb = mx.array(rng.standard_normal((1, model.config.block_size, D)).astype(np.float32))
    return model(emb, ctx).astype(mx.float32)


@pytest.mark.parametrize("arch", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_drafter_bf16_conversion_keeps_fields_and_weights(tmp_path, smol_q, arch):
    target, tok = smol_q
    mask = pick_mask_token_id(tok)
    cfg = published_cfg(arch, mask)
    ref = write_published(tmp_path / "src", cfg, prefix="model." if arch == "DFlashDraftModel" else "")
    res = convert(tmp_path / "src", tmp_path / "out", progress=False, quantize=False, target=None)
    assert res.format == "drafter"
    out_cfg = json.loads((tmp_path / "out/config.json").read_text())
    d = out_cfg["dflash_config"]
    assert d["mask_token_id"] == mask and d["target_layer_ids"] == [1, 15, 27] and d["block_size"] == 8
    assert out_cfg["block_size"] == 8 and out_cfg["rope_theta"] == 100000.0 and d["num_target_layers"] == 30
    if arch == "DFlash2DraftModel":
        assert (d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"], d["selector_top_k"]) == (2, 16, 8, 16)
        assert d["output_multiplier"] == 0.5 and d["final_logit_softcapping"] == 20.0
        assert out_cfg["is_causal"] is False and out_cfg["sliding_window"] == 64
    got = load_drafter(tmp_path / "out", target, tok, dtype=mx.float32)
    assert DrafterConfig.from_dict(cfg) == got.config
    for (n, a), (_, b) in zip(tree_flatten(ref.parameters()), tree_flatten(got.parameters())):
        assert mx.array_equal(a, b).item(), n  # bf16 source -> bf16 output: bit for bit
    assert mx.allclose(_forward(ref, target), _forward(got, target), atol=1e-5).item()


def test_drafter_4bit_loads_and_stays_close(tmp_path, smol_q, capsys, shared_embedded_load):
    target, tok = smol_q
    cfg = published_cfg("DFlash2DraftModel", pick_mask_token_id(tok))
    ref = write_published(tmp_path / "src", cfg)
    res = convert(tmp_path / "src", tmp_path / "out", progress=False, dtype="float32", target="smollm2-135m-instruct")
    out_cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert out_cfg["quantization"]["bits"] == 4 and out_cfg["quantization"]["group_size"] == 64
    assert "model.layers.0.self_attn.q_proj" not in res.requantized and "layers.0.self_attn.q_proj" in res.requantized
    got = load_drafter(tmp_path / "out", target, tok)
    import mlx.nn as nn

    assert isinstance(got.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert got.layers[0].mlp.down_proj.scales.dtype == mx.float32  # activations stay float32
    assert got.candidate_selector.predecessor_codebook.dtype == mx.float32  # codebooks not quantized
    a, b = _forward(ref, target), _forward(got, target)
    assert mx.all(mx.isfinite(b)).item()
    # closeness, at 8 bits (random drafters amplify 4-bit noise: ~0.4 relative at 4 bits, ~0.02 at 8)
    convert(tmp_path / "src", tmp_path / "out8", progress=False, dtype="float32", q_bits=8)
    b8 = _forward(load_drafter(tmp_path / "out8", target, tok), target)
    rel = float(mx.linalg.norm(a - b8).item() / mx.linalg.norm(a).item())
    assert rel < 0.05, rel
    # overrides may keep layers float, but not change bits per layer
    convert(tmp_path / "src", tmp_path / "out2", progress=False, overrides=[parse_override("kernel_projection=none")])
    got2 = load_drafter(tmp_path / "out2", target, tok)
    assert isinstance(got2.layers[0].attention_conv.kernel_projection, nn.Linear)
    from mlx_dflash2.drafter.cli import main as drafter_cli

    capsys.readouterr()
    assert drafter_cli(["info", str(tmp_path / "out2")]) == 0  # says which layers stayed float
    assert "linear layers 4-bit g64 (" in capsys.readouterr().out
    with pytest.raises(ConvertError, match="one quantization spec"):
        convert(tmp_path / "src", tmp_path / "out3", progress=False, overrides=[parse_override("fc=8")])
    assert not (tmp_path / "out3").exists()


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c["dflash_config"].pop("target_layer_ids"), "target_layer_ids"),
        (lambda c: c.pop("block_size"), "block_size"),
        (lambda c: c["dflash_config"].update(mask_token_id=49152), "mask_token_id"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 15, 30]), "target_layer_ids"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 1, 2]), "target_layer_ids"),
        (lambda c: c["dflash_config"].pop("selector_rank"), "selector_rank"),
        (lambda c: c["dflash_config"].pop("conv_group_size"), "conv_group_size"),
    ],
)
def test_drafter_missing_or_invalid_fields(tmp_path, mutate, field):
    from mlx_dflash2.convert.drafter import DrafterFieldError

    cfg = published_cfg("DFlash2DraftModel", 5)
    mutate(cfg)
    (tmp_path / "src").mkdir()
    (tmp_path / "src/config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterFieldError) as e:
        convert(tmp_path / "src", tmp_path / "out", progress=False)
    assert e.value.field == field and field in str(e.value)
    assert not (tmp_path / "out").exists()


def test_drafter_mask_is_eos_refused_with_target(tmp_path, smol_q):
    from mlx_dflash2.convert.drafter import DrafterFieldError

    _, tok = smol_q
    cfg = published_cfg("DFlashDraftModel", int(tok.eos_token_id))
    write_published(tmp_path / "src", cfg)
    with pytest.raises(DrafterFieldError, match="mask_token_id"):
        convert(tmp_path / "src", tmp_path / "out", progress=False, target="smollm2-135m-instruct")
    assert not (tmp_path / "out").exists()


def test_drafter_tensor_errors(tmp_path):
    cfg = published_cfg("DFlash2DraftModel", 5)
    write_published(tmp_path / "src", cfg)
    w = mx.load(str(tmp_path / "src/model.safetensors"))
    w2 = dict(w)
    del w2["model.layers.0.mlp_conv.base_kernel"]
    mx.save_safetensors(str(tmp_path / "src/model.safetensors"), w2)
    with pytest.raises(MissingTensorError, match="mlp_conv.base_kernel"):
        convert(tmp_path / "src", tmp_path / "out", progress=False)
    w2 = dict(w, **{"model.fc.weight": mx.zeros((576, 576), dtype=mx.bfloat16)})
    mx.save_safetensors(str(tmp_path / "src/model.safetensors"), w2)
    with pytest.raises(ShapeMismatchError, match=r"fc.weight has shape \(576, 576\)"):
        convert(tmp_path / "src", tmp_path / "out", progress=False)
    w2 = dict(w, **{"model.embed_tokens.weight": mx.zeros((4, 576), dtype=mx.bfloat16)})
    mx.save_safetensors(str(tmp_path / "src/model.safetensors"), w2)
    with pytest.raises(MissingTensorError, match="embed_tokens"):
        convert(tmp_path / "src", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------
# GPTQ / AWQ-packed drafters (community int4 drafters)
# ---------------------------------------------------------------------------


def write_packed_drafter(path, cfg: dict, method: str = "gptq", act_order: bool = False, group_size: int = 128):
    """A GPTQ (or AWQ) checkpoint of a random float DFlash2 drafter: every decoder-layer linear
    packed by the test packers (tests/convert_helpers.py), the rest float16, ``model.`` names.

    Returns:
        (the float reference DraftModel, {module: dequantized reference (out, in) float32}).
    """
    from convert_helpers import awq_pack, gptq_pack

    import mlx.nn as nn

    ref = write_published(path, cfg, dtype=mx.float32)
    flat = dict(tree_flatten(ref.parameters()))
    linears = [n for n, m in ref.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")
               and n.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
    out, deq = {}, {}
    for n, v in flat.items():
        mod = n[: -len(".weight")]
        if mod in linears:
            W = np.array(v)
            if method == "gptq":
                t, dense, _ = gptq_pack(W, 4, group_size, sym=True, act_order=act_order)
            else:
                t, dense, _ = awq_pack(W, group_size)
            out.update({f"model.{mod}.{k}": mx.array(a) for k, a in t.items()})
            deq[mod] = dense
        else:
            out["model." + n + (".weight" if n.endswith("_codebook") else "")] = v.astype(mx.float16)
    qc = {"quant_method": method, "bits": 4, "group_size": group_size}
    qc.update({"sym": True, "desc_act": act_order, "checkpoint_format": "gptq"} if method == "gptq"
              else {"zero_point": True, "version": "gemm"})
    (path / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc, torch_dtype="float16")))
    (path / "model.safetensors").unlink()
    mx.save_safetensors(str(path / "model.safetensors"), out)
    return ref, deq


def _dense(model, mod):
    m = dict(model.named_modules())[mod]
    return np.array(mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(mx.float32))


@pytest.mark.parametrize("method,act_order", [("gptq", False), ("gptq", True), ("awq", False)])
def test_packed_drafter_converts_and_loads(tmp_path, smol_q, method, act_order, shared_embedded_load):
    """`mlx_dflash2.convert <gptq drafter> out --target ...`: trivial group maps are repacked exactly
    (SmolLM2's 576 inputs are 4.5 groups of 128: MLX 4-bit g64 by repeating scales), act-order
    layers dequantized through g_idx and requantized; the result loads and its weights are the
    float source's within 4-bit quantization error."""
    from mlx_dflash2.convert.cli import main

    target, tok = smol_q
    cfg = published_cfg("DFlash2DraftModel", pick_mask_token_id(tok))
    ref, deq = write_packed_drafter(tmp_path / "src", cfg, method, act_order)
    check = ["--target", "smollm2-135m-instruct"] if method == "gptq" and not act_order else []  # (loads the target)
    assert main([str(tmp_path / "src"), str(tmp_path / "out"), "--quiet", "--dtype", "float32", *check]) == 0
    out_cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert out_cfg["quantization"]["bits"] == 4 and out_cfg["quantization"]["group_size"] == 64
    info = out_cfg["mlx_dflash2_convert"]
    assert info["source_quantization_config"]["quant_method"] == method
    got = load_drafter(tmp_path / "out", target, tok)
    for mod, dense in deq.items():
        w = _dense(got, mod)
        if act_order:  # MLX RTN of the GPTQ values: within one 4-bit g64 step
            assert np.linalg.norm(w - dense) / np.linalg.norm(dense) < 0.12, mod
        elif method == "gptq":  # symmetric zero points: bit for bit
            np.testing.assert_array_equal(w, dense, err_msg=mod)
        else:  # AWQ zero points: the bias -z*s rounds in float16 at the source (as the model converter)
            np.testing.assert_allclose(w, dense, atol=1e-3, rtol=0, err_msg=mod)
        src = np.array(dict(tree_flatten(ref.parameters()))[mod + ".weight"])
        assert np.linalg.norm(w - src) / np.linalg.norm(src) < (0.25 if act_order else 0.15), mod  # 4-bit error
    assert info["exact_layers"] == (0 if act_order else len(deq))
    assert mx.all(mx.isfinite(_forward(got, target))).item()


def test_packed_drafter_keeps_its_group_size_when_it_divides_every_layer(tmp_path, smol_q):
    target, tok = smol_q
    cfg = published_cfg("DFlash2DraftModel", pick_mask_token_id(tok))
    cfg["dflash_config"]["target_layer_ids"] = [1, 15, 27, 28]  # fc: 4 x 576 inputs = 18 groups of 128
    cfg.update(num_attention_heads=8, num_key_value_heads=4, head_dim=64, hidden_size=512, intermediate_size=256)
    cfg["vocab_size"] = 49152
    ref, deq = write_packed_drafter(tmp_path / "src", cfg, "gptq")
    res = convert(tmp_path / "src", tmp_path / "out", progress=False, dtype="float32")
    q = json.loads((tmp_path / "out/config.json").read_text())["quantization"]
    assert q["group_size"] == 128 and sorted(res.exact) == sorted(deq)
    res = convert(tmp_path / "src", tmp_path / "g64", progress=False, dtype="float32", q_group_size=64)
    assert json.loads((tmp_path / "g64/config.json").read_text())["quantization"]["group_size"] == 64
    assert sorted(res.exact) == sorted(deq)  # g128 -> g64 by repeating scales: still exact


def test_packed_drafter_loaded_directly_says_how_to_convert(tmp_path, smol_q, shared_embedded_load):
    """Loading a GPTQ drafter as --drafter is refused with the exact command, and that command works."""
    import shlex

    from mlx_dflash2.convert.cli import main
    from mlx_dflash2.drafter import DrafterNeedsConversionError
    from mlx_dflash2.loading import make_proposer

    target, tok = smol_q
    cfg = published_cfg("DFlash2DraftModel", pick_mask_token_id(tok))
    write_packed_drafter(tmp_path / "src", cfg, "gptq")
    with pytest.raises(DrafterNeedsConversionError) as e:
        make_proposer(str(tmp_path / "src"), target, tok, "smollm2-135m-instruct")
    cmd = shlex.split(e.value.command)
    assert e.value.method == "gptq" and e.value.command in str(e.value) and "GPTQ" in str(e.value)
    assert cmd[0] == "mlx_dflash2.convert" and cmd[1] == str(tmp_path / "src")
    assert cmd[-2:] == ["--target", "smollm2-135m-instruct"]
    assert main(cmd[1:] + ["--quiet"]) == 0
    make_proposer(cmd[2], target, tok, "smollm2-135m-instruct")


def test_other_drafter_quantization_schemes_are_refused_by_name(tmp_path, smol_q):
    from mlx_dflash2.convert import UnsupportedFormatError
    from mlx_dflash2.drafter import DrafterLoadError

    target, tok = smol_q
    cfg = published_cfg("DFlash2DraftModel", pick_mask_token_id(tok))
    write_published(tmp_path / "src", dict(cfg, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}))
    with pytest.raises(UnsupportedFormatError, match="'bitsandbytes' is not supported"):
        convert(tmp_path / "src", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(DrafterLoadError, match="'bitsandbytes' is not supported"):
        load_drafter(tmp_path / "src", target, tok)


def test_drafter_conversion_carries_its_draft_vocabulary(tmp_path, smol_q):
    """A drafter's ``draft_vocab.json`` (FR-Spec) comes through the converter (quantizing a drafter dropped it,
    so the converted drafter proposed from every id); a malformed one, or one with ids past the drafter's
    vocabulary, is an error that writes nothing."""
    from mlx_dflash2.convert import CorruptCheckpointError
    from mlx_dflash2.drafter.io import read_draft_vocab, write_draft_vocab

    cfg = published_cfg("DFlash2DraftModel", pick_mask_token_id(smol_q[1]))
    write_published(tmp_path / "src", cfg)
    write_draft_vocab(tmp_path / "src", [5, 7, 100, 2], method="test")
    convert(tmp_path / "src", tmp_path / "out", progress=False)
    assert read_draft_vocab(tmp_path / "out") == [2, 5, 7, 100]
    assert json.loads((tmp_path / "out/draft_vocab.json").read_text())["method"] == "test"
    for bad, match in (('{"ids": [1]}', "at least 2 distinct"), ("{", "cannot read"),
                       (json.dumps({"ids": [1, 49152]}), "outside the drafter's vocabulary")):
        (tmp_path / "src/draft_vocab.json").write_text(bad)
        with pytest.raises(CorruptCheckpointError, match=match):
            convert(tmp_path / "src", tmp_path / "bad", progress=False)
        assert not (tmp_path / "bad").exists()
    (tmp_path / "src/draft_vocab.json").unlink()
    (tmp_path / "src/draft_vocab.json").mkdir()  # a directory of that name is not skipped silently
    with pytest.raises(CorruptCheckpointError, match="cannot read the draft vocabulary"):
        convert(tmp_path / "src", tmp_path / "bad", progress=False)


def test_drafter_codebooks_quantized(tmp_path, smol_q, capsys, shared_embedded_load):
    """``--codebook-bits``: the selector's two [vocab, rank] codebooks stored MLX-quantized (group 32) and expanded
    at load, close to the float ones (8 bits: < 1 % relative; 4 bits: < 10 %); smaller files; a drafter with
    quantized codebooks converts again (expanded as the source); bad settings or layouts are errors naming them."""
    from mlx_dflash2.convert import CorruptCheckpointError
    from mlx_dflash2.drafter.io import DrafterLoadError

    target, tok = smol_q
    cfg = published_cfg("DFlash2DraftModel", pick_mask_token_id(tok))
    cfg["dflash_config"]["selector_rank"] = 32
    ref = write_published(tmp_path / "src", cfg)
    convert(tmp_path / "src", tmp_path / "float", progress=False, quantize=False, dtype="float32")
    sizes = {}
    for bits, tol in ((8, 0.01), (4, 0.1)):
        out = tmp_path / f"cb{bits}"
        convert(tmp_path / "src", out, progress=False, quantize=False, dtype="float32", codebook_bits=bits)
        assert json.loads((out / "config.json").read_text())["codebook_quantization"] == {"bits": bits, "group_size": 32}
        raw = mx.load(str(out / "model.safetensors"))
        assert raw["candidate_selector.successor_codebook"].dtype == mx.uint32
        assert "candidate_selector.successor_codebook.scales" in raw
        sizes[bits] = (out / "model.safetensors").stat().st_size
        got = load_drafter(out, target, tok)
        for name in ("predecessor_codebook", "successor_codebook"):
            a = getattr(ref.candidate_selector, name)
            b = getattr(got.candidate_selector, name)
            assert b.shape == a.shape and b.dtype == mx.float32
            rel = float(mx.linalg.norm(a - b).item() / mx.linalg.norm(a).item())
            assert rel < tol, (bits, name, rel)
        assert mx.array_equal(got.fc.weight, ref.fc.weight).item()  # the rest as before
    assert sizes[4] < sizes[8] < (tmp_path / "float/model.safetensors").stat().st_size
    from mlx_dflash2.drafter.cli import main as drafter_cli

    capsys.readouterr()
    assert drafter_cli(["info", str(tmp_path / "cb4")]) == 0
    assert "weights: linear layers float, selector codebooks 4-bit g32 (expanded at load)" in capsys.readouterr().out
    # converted again: the quantized codebooks are kept as stored by default (bit for bit; with --no-quantize, which
    # asks for float weights, when --codebook-bits names their bits), expanded exactly with codebook_bits=0
    # (--codebook-bits none) or --no-quantize alone, quantized again at other bits with a note (a second rounding)
    res = convert(tmp_path / "cb8", tmp_path / "kept", progress=False, quantize=False, dtype="float32",
                  codebook_bits=8)
    assert any("codebooks are stored 8-bit g32 in the source: kept as stored" in n for n in res.notes), res.notes
    assert json.loads((tmp_path / "kept/config.json").read_text())["codebook_quantization"]["bits"] == 8
    src8, kept = mx.load(str(tmp_path / "cb8/model.safetensors")), mx.load(str(tmp_path / "kept/model.safetensors"))
    assert all(mx.array_equal(v, kept[k]).item() for k, v in src8.items())
    res = convert(tmp_path / "cb8", tmp_path / "nq", progress=False, quantize=False, dtype="float32")
    assert any("expanded to float32" in n for n in res.notes), res.notes
    assert "codebook_quantization" not in json.loads((tmp_path / "nq/config.json").read_text())
    res = convert(tmp_path / "cb8", tmp_path / "again", progress=False, quantize=False, dtype="float32",
                  codebook_bits=0, measure_error=True)
    assert any("expanded to float32" in n for n in res.notes), res.notes
    assert res.layer_errors == {}  # nothing quantized in the output
    a = load_drafter(tmp_path / "cb8", target, tok).candidate_selector.successor_codebook
    b = load_drafter(tmp_path / "again", target, tok).candidate_selector.successor_codebook
    assert "codebook_quantization" not in json.loads((tmp_path / "again/config.json").read_text())
    assert mx.array_equal(a, b).item()
    res = convert(tmp_path / "cb8", tmp_path / "re4", progress=False, quantize=False, dtype="float32",
                  codebook_bits=4)
    assert any("quantized again at 4-bit g32 (a second rounding)" in n for n in res.notes), res.notes
    assert json.loads((tmp_path / "re4/config.json").read_text())["codebook_quantization"]["bits"] == 4
    # a codebook override matches no quantizable layer: a note pointing at --codebook-bits
    res = convert(tmp_path / "src", tmp_path / "ovr", progress=False, dtype="float32",
                  overrides=[parse_override("successor_codebook=8")])
    assert any("matches no quantizable layer (the selector's codebooks: --codebook-bits)" in n
               for n in res.notes), res.notes
    res = convert(tmp_path / "src", tmp_path / "ovr2", progress=False, dtype="float32",
                  overrides=[parse_override("lm_head=8")])  # no target's hint about tied heads for a drafter
    assert any("matches no quantizable layer (a drafter has no embedding or LM head of its own)" in n
               for n in res.notes), res.notes
    for bad in ("codebook=3:16", "fc=7"):  # what MLX cannot do is refused when parsed, matching or not
        with pytest.raises(ConvertError, match="MLX has bits"):
            parse_override(bad)
    for bad in (8.0, True, "8"):  # the API's codebook_bits: an int (8.0 wrote a block the loader refused)
        with pytest.raises(ConvertError, match="choose 4 or 8"):
            convert(tmp_path / "src", tmp_path / "bad", progress=False, codebook_bits=bad)
    # settings the converter refuses, writing nothing
    for kwargs, match in (({"codebook_bits": 5}, "choose 4 or 8"),):
        with pytest.raises(ConvertError, match=match):
            convert(tmp_path / "src", tmp_path / "bad", progress=False, **kwargs)
        assert not (tmp_path / "bad").exists()
    cfg8 = published_cfg("DFlash2DraftModel", pick_mask_token_id(tok))  # rank 8
    write_published(tmp_path / "rank8", cfg8)
    with pytest.raises(ConvertError, match="multiple of 32"):
        convert(tmp_path / "rank8", tmp_path / "bad", progress=False, codebook_bits=8)
    write_published(tmp_path / "v1", published_cfg("DFlashDraftModel", pick_mask_token_id(tok)))
    with pytest.raises(ConvertError, match="no selector codebooks"):
        convert(tmp_path / "v1", tmp_path / "bad", progress=False, codebook_bits=8)
    assert not (tmp_path / "bad").exists()
    # a malformed block or layout: the loader and the converter name it
    c = json.loads((tmp_path / "cb8/config.json").read_text())
    c["codebook_quantization"] = {"bits": 7, "group_size": 32}
    (tmp_path / "cb8/config.json").write_text(json.dumps(c))
    with pytest.raises(DrafterLoadError, match="codebook_quantization"):
        load_drafter(tmp_path / "cb8", target, tok)
    with pytest.raises(CorruptCheckpointError, match="codebook_quantization"):
        convert(tmp_path / "cb8", tmp_path / "bad", progress=False)
    c["codebook_quantization"] = {"bits": 4, "group_size": 32}  # says 4, holds 8: the packed width disagrees
    (tmp_path / "cb8/config.json").write_text(json.dumps(c))
    with pytest.raises(DrafterLoadError, match="not a 4-bit group-32 MLX-quantized tensor"):
        load_drafter(tmp_path / "cb8", target, tok)
    assert not (tmp_path / "bad").exists()


def test_mlx_quantized_drafter_converts_again(tmp_path, smol_q):
    """An MLX-quantized drafter (this converter's output, or a shipped one) is a source: to the same spec its layers
    are kept as stored (requantizing the expanded values is a second rounding: 3.5 % on the shipped drafter), to
    another spec or float they are expanded; a malformed quantization block or layer is an error writing nothing;
    quantized codebooks with integer scales are refused at load (they were accepted and drafted worse)."""
    from mlx.utils import tree_flatten

    from mlx_dflash2.convert import CorruptCheckpointError
    from mlx_dflash2.drafter.io import DrafterLoadError

    target, tok = smol_q
    cfg = published_cfg("DFlash2DraftModel", pick_mask_token_id(tok))
    cfg["dflash_config"]["selector_rank"] = 32
    write_published(tmp_path / "src", cfg)
    convert(tmp_path / "src", tmp_path / "q4", progress=False, dtype="float32")
    q4 = mx.load(str(tmp_path / "q4/model.safetensors"))
    res = convert(tmp_path / "q4", tmp_path / "cb", progress=False, dtype="float32", codebook_bits=4,
                  measure_error=True)
    assert any("layers kept as stored" in n and "expanded" not in n for n in res.notes), res.notes
    # --report-error: kept layers 0 against the source's values, quantized codebooks their rounding (was: nothing)
    assert res.layer_errors["fc"] == 0.0 and 0 < res.layer_errors["candidate_selector.successor_codebook"] < 0.2
    assert 0 < res.total_error < 0.2
    cb = mx.load(str(tmp_path / "cb/model.safetensors"))
    for k, v in q4.items():
        if "_codebook" not in k:
            assert mx.array_equal(v, cb[k]).item(), k
    assert cb["candidate_selector.successor_codebook"].dtype == mx.uint32
    a, b = load_drafter(tmp_path / "q4", target, tok), load_drafter(tmp_path / "cb", target, tok)
    assert mx.array_equal(a.fc.weight, b.fc.weight).item()
    res = convert(tmp_path / "q4", tmp_path / "q8", progress=False, dtype="float32", q_bits=8)
    assert any("quantized again (a second rounding)" in n for n in res.notes), res.notes
    assert load_drafter(tmp_path / "q8", target, tok).fc.bits == 8
    convert(tmp_path / "q4", tmp_path / "f", progress=False, dtype="float32", quantize=False)
    f = dict(tree_flatten(load_drafter(tmp_path / "f", target, tok).parameters()))
    w = mx.dequantize(q4["fc.weight"], q4["fc.scales"], q4["fc.biases"], group_size=64, bits=4)
    assert mx.array_equal(f["fc.weight"], w).item()
    # malformed sources: one error each, nothing written
    c = json.loads((tmp_path / "q4/config.json").read_text())
    for bad in ({"bits": 7, "group_size": 64}, "4-bit", {"bits": 4}):
        (tmp_path / "q4/config.json").write_text(json.dumps({**c, "quantization": bad}))
        with pytest.raises(CorruptCheckpointError, match="quantization"):
            convert(tmp_path / "q4", tmp_path / "bad", progress=False)
        assert not (tmp_path / "bad").exists()
    (tmp_path / "q4/config.json").write_text(json.dumps(c))
    mx.save_safetensors(str(tmp_path / "q4/model.safetensors"), {k: v for k, v in q4.items() if k != "fc.biases"})
    (tmp_path / "q4/model.safetensors.index.json").unlink(missing_ok=True)  # (its own check would name fc.biases)
    with pytest.raises(CorruptCheckpointError, match="fc: not a 4-bit group-64 MLX-quantized tensor"):
        convert(tmp_path / "q4", tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()
    # a deleted quantization / codebook_quantization block: named, by the loader and the converter
    for block, src in (("quantization", "q4"), ("codebook_quantization", "cb")):
        c = json.loads((tmp_path / src / "config.json").read_text())
        c.pop(block)
        (tmp_path / "noblock").mkdir(exist_ok=True)
        for f in (tmp_path / src).iterdir():
            (tmp_path / "noblock" / f.name).write_bytes(f.read_bytes())
        (tmp_path / "noblock/config.json").write_text(json.dumps(c))
        want = f"are stored MLX-quantized .* but config.json has no '{block}' block"
        with pytest.raises(DrafterLoadError, match=want):
            load_drafter(tmp_path / "noblock", target, tok)
        with pytest.raises(CorruptCheckpointError, match=want):
            convert(tmp_path / "noblock", tmp_path / "bad", progress=False)
        assert not (tmp_path / "bad").exists()
    # integer codebook scales
    w8 = mx.load(str(tmp_path / "cb/model.safetensors"))
    w8["candidate_selector.successor_codebook.scales"] = w8["candidate_selector.successor_codebook.scales"].astype(mx.int32)
    mx.save_safetensors(str(tmp_path / "cb/model.safetensors"), w8)
    with pytest.raises(DrafterLoadError, match="int32"):
        load_drafter(tmp_path / "cb", target, tok)


def test_mlx_quantized_drafter_keeps_its_layout_and_overwrite_through_dotdot(tmp_path, smol_q):
    """An MLX-quantized source keeps its own spec by default (8-bit g32 stays 8-bit g32, exact); --q-bits asks for
    another. `--overwrite` onto a DEST spelled with '..' replaces it (it lost DEST: the renames went through a
    path that no longer resolved). Loading refuses a malformed quantization block, integer or NaN scales."""
    from mlx_dflash2.drafter.io import DrafterLoadError

    target, tok = smol_q
    cfg = published_cfg("DFlash2DraftModel", pick_mask_token_id(tok))
    write_published(tmp_path / "src", cfg)
    convert(tmp_path / "src", tmp_path / "q8", progress=False, dtype="float32", q_bits=8, q_group_size=32)
    res = convert(tmp_path / "q8", tmp_path / "again", progress=False)
    q = json.loads((tmp_path / "again/config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (8, 32) and res.exact and not res.requantized
    res = convert(tmp_path / "q8", tmp_path / "q4", progress=False, q_bits=4)
    assert json.loads((tmp_path / "q4/config.json").read_text())["quantization"]["bits"] == 4 and res.requantized
    convert(tmp_path / "q8", tmp_path / "q4" / ".." / "q4", progress=False, overwrite=True, q_bits=4)
    assert load_drafter(tmp_path / "q4", target, tok).fc.bits == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "q4", "q8", "src"]  # no hidden leftovers
    c = json.loads((tmp_path / "q4/config.json").read_text())
    for bad in ("4bit", {"bits": 4}, {"bits": 4, "group_size": 64, "mode": "mxfp4"}):
        (tmp_path / "q4/config.json").write_text(json.dumps({**c, "quantization": bad}))
        with pytest.raises(DrafterLoadError, match="quantization"):
            load_drafter(tmp_path / "q4", target, tok)
    (tmp_path / "q4/config.json").write_text(json.dumps(c))
    w = mx.load(str(tmp_path / "q4/model.safetensors"))
    for bad, match in ((w["fc.scales"].astype(mx.int32), "int32"), (w["fc.scales"] * float("nan"), "NaN")):
        mx.save_safetensors(str(tmp_path / "q4/model.safetensors"), {**w, "fc.scales": bad})
        with pytest.raises(DrafterLoadError, match=match):
            load_drafter(tmp_path / "q4", target, tok)


def _copy(src, dst, **cfg_changes):
    """A drafter directory copied with config.json keys changed (None: removed)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    c = json.loads((src / "config.json").read_text())
    for k, v in cfg_changes.items():
        c.pop(k) if v is None else c.__setitem__(k, v)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_drafter_conversion_edges(tmp_path, smol_q, capsys, shared_embedded_load):
    """A fresh user's finds on the converter's drafter path (session 31): --report-error measures a layer kept as
    stored as 0 whatever --dtype (bf16-expanded references read 0.47 %); codebooks kept with scales rounded to another
    dtype say so; codebooks stored at another group are kept (not re-rounded to g32); a DFlash v1 drafter's stray
    codebook_quantization block is dropped with a note; the loader names every missing block at once and a
    quantization block whose spec does not describe the layers (MLX's own error, no file named); a non-affine codebook
    mode is refused; --target that does not load is a one-line error; --overwrite of a DEST holding SRC is refused."""
    from mlx_dflash2.convert import CorruptCheckpointError
    from mlx_dflash2.drafter.io import DrafterLoadError

    target, tok = smol_q
    cfg = published_cfg("DFlash2DraftModel", pick_mask_token_id(tok))
    cfg["dflash_config"]["selector_rank"] = 64
    write_published(tmp_path / "src", cfg)
    convert(tmp_path / "src", tmp_path / "bf", progress=False, dtype="bfloat16", codebook_bits=8)
    res = convert(tmp_path / "bf", tmp_path / "f32", progress=False, dtype="float32", measure_error=True)
    assert res.layer_errors and all(e == 0.0 for e in res.layer_errors.values()), res.layer_errors
    assert any("codebooks are stored 8-bit g32 in the source: kept as stored" in n for n in res.notes), res.notes
    convert(tmp_path / "src", tmp_path / "cbf32", progress=False, dtype="float32", codebook_bits=8)
    res = convert(tmp_path / "cbf32", tmp_path / "cbbf", progress=False, dtype="bfloat16")
    assert any("codes kept as stored, their scales and biases rounded to bfloat16" in n for n in res.notes), res.notes
    # codebooks stored at group 64 (hand-made): kept as stored, the block keeps its group
    w = mx.load(str(tmp_path / "cbf32/model.safetensors"))
    for n in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        dense = mx.dequantize(w[n], w[f"{n}.scales"], w[f"{n}.biases"], group_size=32, bits=8)
        w[n], w[f"{n}.scales"], w[f"{n}.biases"] = mx.quantize(dense, 64, 8)
    g64 = _copy(tmp_path / "cbf32", tmp_path / "g64", codebook_quantization={"bits": 8, "group_size": 64})
    mx.save_safetensors(str(g64 / "model.safetensors"), w)
    (g64 / "model.safetensors.index.json").unlink(missing_ok=True)
    res = convert(g64, tmp_path / "g64b", progress=False, dtype="float32")
    assert any("stored 8-bit g64 in the source: kept as stored" in n for n in res.notes), res.notes
    assert json.loads((tmp_path / "g64b/config.json").read_text())["codebook_quantization"]["group_size"] == 64
    out = mx.load(str(tmp_path / "g64b/model.safetensors"))
    assert all(mx.array_equal(out[k], v).item() for k, v in w.items() if "codebook" in k)
    load_drafter(tmp_path / "g64b", target, tok)
    # a DFlash v1 drafter with a stray codebook_quantization block: dropped, with a note
    write_published(tmp_path / "v1", published_cfg("DFlashDraftModel", pick_mask_token_id(tok)))
    v1 = _copy(tmp_path / "v1", tmp_path / "v1cb", codebook_quantization={"bits": 8, "group_size": 32})
    res = convert(v1, tmp_path / "v1out", progress=False)
    assert any("codebook_quantization is ignored" in n for n in res.notes), res.notes
    from mlx_dflash2.drafter.cli import main as drafter_cli

    assert drafter_cli(["info", str(v1)]) == 0
    assert "selector codebooks" not in capsys.readouterr().out
    assert "codebook_quantization" not in json.loads((tmp_path / "v1out/config.json").read_text())
    # the loader: both missing blocks named at once; a spec that does not describe the layers; a non-affine codebook
    both = _copy(tmp_path / "bf", tmp_path / "both", quantization=None, codebook_quantization=None)
    with pytest.raises(DrafterLoadError, match="no 'quantization' block .*no 'codebook_quantization' block"):
        load_drafter(both, target, tok)
    with pytest.raises(CorruptCheckpointError, match="no 'quantization' block .*no 'codebook_quantization' block"):
        convert(both, tmp_path / "bad", progress=False)
    spec2 = _copy(tmp_path / "bf", tmp_path / "spec2", quantization={"bits": 2, "group_size": 128})
    with pytest.raises(DrafterLoadError, match=r"spec2: [a-z_.0-9]+: packed .* at 2-bit g128 \(config.json.s quant"):
        load_drafter(spec2, target, tok)
    fp4 = _copy(tmp_path / "bf", tmp_path / "fp4", codebook_quantization={"bits": 8, "group_size": 32, "mode": "mxfp4"})
    with pytest.raises(DrafterLoadError, match="codebook_quantization .* affine"):
        load_drafter(fp4, target, tok)
    # --target that does not load: one line; --overwrite of a DEST that holds SRC: refused, SRC kept
    with pytest.raises(ConvertError, match="--target .*nonexistent"):
        convert(tmp_path / "bf", tmp_path / "bad", progress=False, target=str(tmp_path / "nonexistent"))
    assert not (tmp_path / "bad").exists()
    (tmp_path / "outer").mkdir()
    inner = _copy(tmp_path / "bf", tmp_path / "outer" / "inner")
    with pytest.raises(ConvertError, match="contains the source"):
        convert(inner, tmp_path / "outer", progress=False, overwrite=True)
    assert (inner / "config.json").is_file()
