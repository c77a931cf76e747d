"""The reader interface: what every format reader hands to the pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx

from .mlxq import Packed, QSpec

__all__ = ["Deferred", "SourceModel", "TOKENIZER_FILES"]

# Files carried over verbatim from a Hugging Face-style source directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass
class Deferred:
    """A dense tensor computed on demand (for readers whose decoders are not MLX-lazy).

    Attributes:
        shape: the dense (Hugging Face / mlx-lm) shape, e.g. ``(out, in)`` for a linear.
        load: returns the values as an ``mx.array`` (float32 for decoded quantized data).
        load_rows: optional ``(r0, r1) -> rows r0:r1`` of the same values, so that large
            tensors can be quantized in row chunks (``r0``/``r1`` multiples of ``row_align``,
            or ``r1`` the last row); bounds peak memory to a chunk of float32 values.
    """

    shape: tuple[int, ...]
    load: Callable[[], mx.array]
    dtype: mx.Dtype = mx.float32
    load_rows: Callable[[int, int], mx.array] | None = None
    row_align: int = 1


@dataclass
class SourceModel:
    """A checkpoint opened by a reader (nothing decoded yet).

    Attributes:
        format: ``"hf"``, ``"gptq"``, ``"awq"``, ``"gguf"``, ``"exl3"``.
        path: the input file or directory.
        config: Hugging Face-style model config (what mlx-lm's model classes read),
            without the source's ``quantization_config``.
        weights: tensor name (HF naming) -> lazy ``mx.array`` or :class:`Deferred`.
        dequantized: names in ``weights`` whose values are decoded from a quantized
            source (float32): they are quantized from float32, never cast first.
        packed: module path -> function ``QSpec -> Packed | None`` giving an exact MLX
            layout of that quantized layer for the spec, or ``None`` where no exact one exists.
        native: module path -> the source's own spec where an exact mapping exists
            (used by ``keep_source_layout``).
        copy_files: files carried over verbatim (tokenizer, chat template, generation config).
        tokenizer: an object with ``save_pretrained(dir)`` for sources without tokenizer
            files (GGUF builds one from its metadata).
        default_dtype: the output float dtype when none is given (``None``: mlx-lm's rule).
        source_quantization: the source's quantization config, recorded in the output.
        bind: optional hook called with the expected mlx-lm parameter shapes before
            tensors are matched (EXL3 needs them to slice its padding).
        notes: human-readable remarks (what was dropped or adjusted, and why).
    """

    format: str
    path: Path
    config: dict
    weights: dict
    dequantized: set = field(default_factory=set)
    packed: dict[str, Callable[[QSpec], Packed | None]] = field(default_factory=dict)
    native: dict[str, QSpec] = field(default_factory=dict)
    copy_files: list[Path] = field(default_factory=list)
    tokenizer: object | None = None
    default_dtype: str | None = None
    source_quantization: dict | None = None
    bind: Callable[[dict], None] | None = None
    notes: list[str] = field(default_factory=list)
