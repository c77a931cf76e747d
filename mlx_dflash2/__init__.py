"""mlx_dflash2: lossless DFlash2 speculative decoding on MLX.

Public API (mirrors mlx-lm): :func:`load`, :func:`generate`,
:func:`stream_generate`, :class:`GenerationResponse`.
"""

import os as _os

# transformers (imported by mlx-lm) prints advisory warnings about PyTorch at import.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Before anything loads MLX: its Linux CPU wheel's reference BLAS is ~20x slower than OpenBLAS.
from ._blas import preload as _preload_blas  # noqa: E402

_preload_blas()

from ._version import __version__  # noqa: E402
from .api import GenerationResponse, generate, stream_generate  # noqa: E402
from .loading import SpeculativeModel, load  # noqa: E402
from .speculative import SpecStats, speculative_generate_step  # noqa: E402

__all__ = [
    "__version__",
    "load",
    "generate",
    "stream_generate",
    "GenerationResponse",
    "SpeculativeModel",
    "SpecStats",
    "speculative_generate_step",
]
