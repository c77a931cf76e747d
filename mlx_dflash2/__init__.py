"""mlx_dflash2: lossless DFlash2 speculative decoding on MLX.

Public API (mirrors mlx-lm): :func:`load`, :func:`generate`,
:func:`stream_generate`, :class:`GenerationResponse`.
"""

import os as _os

# transformers (imported by mlx-lm) prints advisory warnings about PyTorch at import.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# MLX's CUDA backend (read at first use): keep JIT-compiled kernels on disk (a fresh process otherwise spends
# ~120 s compiling on an H200; warm: 2.4 s), and keep attention off the cuDNN SDPA path, which builds a graph per
# exact key length (60-75 ms for every verify at a new length, and an error after a few hundred misses; see
# shared research h200-profile.md). Both only set when the user has not; no effect on Metal or the CPU.
_os.environ.setdefault("MLX_PTX_CACHE_DIR", _os.path.join(_os.path.expanduser("~"), ".cache", "mlx_dflash2", "ptx"))
_os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")

# Before anything loads MLX: its Linux CPU wheel's reference BLAS is ~20x slower than OpenBLAS.
from ._blas import preload as _preload_blas  # noqa: E402

_preload_blas()

# The CLI module shares its name with the function bound below, as in mlx-lm. Loading it here keeps
# ``import mlx_dflash2.generate`` from rebinding ``mlx_dflash2.generate`` to the module; ``python -m
# mlx_dflash2.generate`` then finds it already imported, which runpy reports as a RuntimeWarning about this
# package's own modules only (the module runs as __main__ all the same): silence exactly that message.
import warnings as _warnings  # noqa: E402

_warnings.filterwarnings(
    "ignore", message=r"'mlx_dflash2\.[a-z_]+' found in sys\.modules after import of package 'mlx_dflash2'",
    category=RuntimeWarning,
)

from ._version import __version__  # noqa: E402
from . import generate as _generate_cli  # noqa: E402,F401  (loaded first: the function below keeps the name)
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
