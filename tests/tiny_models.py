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
    from mlx_lm.utils import save_config

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
    path = Path(path)
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    save_config(cfg, path / "config.json")
    tok._tokenizer.save_pretrained(str(path))
    return path
