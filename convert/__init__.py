"""``mlx_dflash2.convert``: checkpoints made for other engines -> MLX (4-bit by default).

Sources: Hugging Face bf16/fp16/fp32 safetensors, GPTQ (v1/v2, sym/asym, 2/3/4/8
bits, act-order), AWQ (GEMM), GGUF (Q4_0/Q4_1/Q8_0 natively, every other type
through the ``gguf`` package's dequantizer), ExLlamaV3 EXL3, and DFlash /
DFlash2 drafter checkpoints. Output: a directory ``mlx_lm.load`` and
``mlx_dflash2.load`` read (or, for drafters, one ``load_drafter`` reads).

Command line: ``mlx_dflash2.convert SRC DEST`` or ``python -m mlx_dflash2.convert``;
Python: :func:`convert`. Format facts: ``shared/research/formats.md``.
"""

import mlx_dflash2  # noqa: F401,I001  (before MLX: `python -m convert` gets the optimized CPU BLAS too, mlx_dflash2/_blas.py)

from .errors import (
    ConvertError,
    CorruptCheckpointError,
    MissingTensorError,
    OutputExistsError,
    OutputWriteError,
    ShapeMismatchError,
    UnsupportedFormatError,
)
from .mlxq import QSpec, QuantPlan, pack_codes, parse_override, unpack_codes
from .pipeline import FORMATS, ConvertResult, convert, detect_format

__all__ = [
    "convert",
    "detect_format",
    "ConvertResult",
    "FORMATS",
    "QSpec",
    "QuantPlan",
    "parse_override",
    "pack_codes",
    "unpack_codes",
    "ConvertError",
    "UnsupportedFormatError",
    "CorruptCheckpointError",
    "MissingTensorError",
    "ShapeMismatchError",
    "OutputExistsError",
    "OutputWriteError",
]
