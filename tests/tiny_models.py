"""Tiny random mlx-lm model directories for tests (shared helper).

A directory holds ``config.json``, ``model.safetensors`` and the tokenizer files
of the embedded SmolLM2-135M-Instruct (49,152 tokens, its chat template), so
:func:`mlx_dflash2.loading.load_target` and ``mlx_lm.load`` read it like any
mlx-lm checkpoint. ``vocab_rows`` above the tokenizer's size pads the
embedding and LM head past the real vocabulary, as every Qwen2/2.5/3
checkpoint does (151,936 rows for 151,665 tokens).
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import mlx.core as mx

SMOL_VOCAB = 49152


@functools.lru_cache(maxsize=1)
def smol_tokenizer():
    """The embedded SmolLM2 tokenizer, built from the GGUF's metadata (no weights are read)."""
    from mlx_dflash2.assets import embedded_model_path
    from mlx_dflash2.gguf import build_tokenizer, read_gguf_header

    return build_tokenizer(read_gguf_header(embedded_model_path()))


def _save_dir(path, cfg: dict, weights: dict, tok) -> Path:
    """Write ``weights`` (safetensors), ``cfg`` (config.json) and ``tok``'s files to a new directory ``path``."""
    from mlx_lm.utils import save_config

    path = Path(path)
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    save_config(cfg, path / "config.json")
    tok._tokenizer.save_pretrained(str(path))
    return path


def tiny_mlx_lm_dir(
    path: Path,
    model_type: str = "qwen2",
    tokenizer=None,
    *,
    num_layers: int = 4,
    vocab_rows: int | None = None,
    pad_scale: float = 4.0,
    tied: bool | None = None,
    seed: int = 0,
) -> Path:
    """Write a random mlx-lm model of ``model_type`` (llama, qwen2, qwen3) to ``path``.

    Args:
        path: the directory to create (must not exist).
        tokenizer: a ``TokenizerWrapper`` whose files are saved with the model
            (default: :func:`smol_tokenizer`).
        num_layers: decoder layers.
        vocab_rows: embedding / LM-head rows (default: the tokenizer's size).
            Rows past the tokenizer are padding that no real token uses.
        pad_scale: the padding rows are this many times larger than the others,
            so an unmasked head picks them often (an untrained padded model
            emits padding ids; a real Qwen checkpoint's padding rows are not
            guaranteed to lose either).
        tied: tie the LM head to the embedding (default: untied for qwen2,
            tied otherwise).
        seed: MLX seed of the initialisation.

    Returns:
        ``path``.
    """
    from mlx.utils import tree_flatten

    tok = tokenizer if tokenizer is not None else smol_tokenizer()
    rows = int(vocab_rows or len(tok))
    if tied is None:
        tied = model_type != "qwen2"
    cfg = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": num_layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": rows,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": tied,
    }
    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    m = mod.Model(mod.ModelArgs.from_dict(cfg))
    weights = dict(tree_flatten(m.parameters()))
    n_real = len(tok)
    if rows > n_real:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights:
                w = weights[name]
                weights[name] = mx.concatenate([w[:n_real], w[n_real:] * pad_scale])
    return _save_dir(path, cfg, weights, tok)


# ---------------------------------------------------------------------------------------------------------
# Hybrid and sliding-window targets, saved the way their checkpoints ship
# ---------------------------------------------------------------------------------------------------------

HYBRID_KINDS = ("qwen3_next", "qwen3_5", "gemma3_text", "gemma3", "gemma4_text")


def _hybrid_text_config(kind: str, rows: int, window: int) -> dict:
    if kind in ("qwen3_next", "qwen3_5"):
        cfg = dict(
            hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=3,
            rms_norm_eps=1e-6, vocab_size=rows, max_position_embeddings=4096, tie_word_embeddings=False,
        )  # fmt: skip: 2 GatedDeltaNet layers + 1 full-attention layer
        if kind == "qwen3_next":
            cfg.update(model_type="qwen3_next", rope_theta=10000.0, partial_rotary_factor=0.5, num_experts=0,
                       num_experts_per_tok=0, decoder_sparse_step=1, shared_expert_intermediate_size=0,
                       mlp_only_layers=[], moe_intermediate_size=0)
        else:
            cfg.update(model_type="qwen3_5_text",
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        return cfg
    if kind in ("gemma3_text", "gemma3"):
        return dict(
            model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
            num_attention_heads=2, head_dim=32, num_key_value_heads=1, vocab_size=rows, sliding_window=window,
            sliding_window_pattern=3, query_pre_attn_scalar=32, rms_norm_eps=1e-6, max_position_embeddings=4096,
            rope_theta=1000000.0, rope_local_base_freq=10000.0,
        )  # fmt: skip: layers 0, 1, 3 windowed, 2 global
    if kind == "gemma4_text":
        return dict(
            model_type="gemma4_text", hidden_size=64, num_hidden_layers=5, intermediate_size=128,
            num_attention_heads=2, head_dim=32, global_head_dim=32, num_key_value_heads=1, num_kv_shared_layers=2,
            vocab_size=rows, vocab_size_per_layer_input=rows, hidden_size_per_layer_input=8,
            sliding_window=window, sliding_window_pattern=3, max_position_embeddings=4096,
        )  # fmt: skip
    raise KeyError(kind)


def tiny_hybrid_dir(path: Path, kind: str, tokenizer=None, *, window: int = 8, seed: int = 0) -> Path:
    """Write a random mlx-lm checkpoint of a hybrid / sliding-window family to ``path``, in the layout
    the real ones ship in.

    ``qwen3_next``: a plain text checkpoint (2 GatedDeltaNet layers + 1 attention layer). ``qwen3_5``: a
    vision-language checkpoint (``model_type: qwen3_5`` with the text model's config under
    ``text_config``; Hugging Face tensor names ``model.language_model.*``, the conv1d weights as
    ``[C, 1, K]`` and the RMSNorm weights stored as offsets from 1, which mlx-lm's ``sanitize`` undoes).
    ``gemma3_text``: 3 sliding layers of ``window`` tokens + 1 global layer, tied head; ``gemma3``: the
    same text model nested under ``text_config`` of a Gemma 3 multimodal checkpoint
    (``language_model.*`` tensors). ``gemma4_text``: 5 layers, 2 of them sharing K/V, per-layer inputs,
    logit soft-capping. Tokenizer files: :func:`smol_tokenizer`'s (49,152 tokens).

    Returns:
        ``path``.
    """
    from mlx.utils import tree_flatten

    tok = tokenizer if tokenizer is not None else smol_tokenizer()
    rows = len(tok)
    tc = _hybrid_text_config(kind, rows, window)
    if kind == "qwen3_5":
        cfg = {"model_type": "qwen3_5", "text_config": tc, "tie_word_embeddings": False}
    elif kind == "gemma3":
        cfg = {"model_type": "gemma3", "text_config": {k: v for k, v in tc.items() if k != "vocab_size"},
               "vocab_size": rows}
    else:
        cfg = tc
    mod = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    m = mod.Model(mod.ModelArgs.from_dict(cfg))
    weights = dict(tree_flatten(m.parameters()))
    if kind == "qwen3_5":  # back to Hugging Face's names and layouts
        norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")
        hf = {}
        for k, v in weights.items():
            if "conv1d.weight" in k:
                v = v.moveaxis(2, 1)
            elif any(k.endswith(s) for s in norms) and v.ndim == 1:
                v = v - 1.0
            k = k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
            hf[k] = v
        weights = hf
    elif kind in ("gemma3_text", "gemma3"):  # tied: no lm_head tensor (mlx-lm's sanitize ties it)
        weights = {k: v for k, v in weights.items() if not k.endswith("lm_head.weight")}
    return _save_dir(path, cfg, weights, tok)
