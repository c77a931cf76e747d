"""Tiny random Hugging Face checkpoints built in the tests (no downloads, no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VOCAB = 320  # 256 bytes + a few specials + merges; a multiple of 64


def tiny_config(arch: str = "llama", tied: bool = True, **over) -> dict:
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "bos_token_id": 256,
        "eos_token_id": 257,
    }
    cfg.update(over)
    return cfg


def random_weights(cfg: dict, seed: int = 0, dtype=mx.bfloat16, with_head: bool | None = None) -> dict:
    """Random weights with the mlx-lm (= HF) names of ``cfg``'s architecture."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("norm.weight") or "layernorm" in k:
            a = 1.0 + 0.1 * rng.standard_normal(v.shape)
        else:
            a = rng.standard_normal(v.shape) * (0.5 / np.sqrt(v.shape[-1]))
            if "embed_tokens" in k:
                a = rng.standard_normal(v.shape) * 0.5
        out[k] = mx.array(a.astype(np.float32)).astype(dtype)
    if with_head is None:
        with_head = not cfg.get("tie_word_embeddings", True)
    if with_head and "lm_head.weight" not in out:
        out["lm_head.weight"] = mx.array(
            (rng.standard_normal((cfg["vocab_size"], cfg["hidden_size"])) * 0.05).astype(np.float32)
        ).astype(dtype)
    return out


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (256 bytes + specials) with a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True) for t in ("<|bos|>", "<|im_end|>", "<|im_start|>", "<|mask|>")])
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|im_end|>",
                "chat_template": CHAT_TEMPLATE,
                "add_bos_token": False,
            }
        )
    )


def write_hf(path: Path, cfg: dict, weights: dict, shards: int = 1, tokenizer: bool = True) -> Path:
    """Write a Hugging Face-style checkpoint directory (config, sharded safetensors + index, tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    keys = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), {k: weights[k] for k in keys})
    else:
        per = -(-len(keys) // shards)
        wm = {}
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: weights[k] for k in keys[i * per : (i + 1) * per]}
            mx.save_safetensors(str(path / name), part)
            wm.update({k: name for k in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    if tokenizer:
        write_tokenizer(path)
    return path


def load_dir_tensors(path: Path) -> dict:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out
