"""mlx_dflash2: lossless DFlash2 speculative decoding on MLX.

Public API (mirrors mlx-lm): :func:`load`, :func:`generate`,
:func:`stream_generate`, :class:`GenerationResponse`.
"""

import os as _os

# transformers (imported by mlx-lm) prints advisory warnings about PyTorch at import.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")



def _map_source_tree_converter() -> None:
    """Make ``mlx_dflash2.convert`` importable from an uninstalled source checkout.

    The converter's code lives in the repository's top-level ``convert/``
    directory; ``pyproject.toml`` installs it as ``mlx_dflash2.convert``
    (``package-dir``), for regular and editable installs. When this package is
    imported straight from a checkout (``python -m ...`` at the repository
    root), nothing maps it, so register the same mapping here. Only applies
    when ``../convert/__init__.py`` sits next to this package inside a checkout
    of this project (``pyproject.toml`` names ``mlx-dflash2``) and no installed
    ``convert`` subpackage exists.
    """
    import importlib.abc
    import importlib.util
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    conv = here.parent / "convert"
    if (here / "convert").exists() or not (conv / "__init__.py").is_file():
        return
    try:
        if 'name = "mlx-dflash2"' not in (here.parent / "pyproject.toml").read_text():
            return
    except OSError:
        return

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != __name__ + ".convert":
                return None
            return importlib.util.spec_from_file_location(
                fullname, conv / "__init__.py", submodule_search_locations=[str(conv)]
            )

    sys.meta_path.insert(0, _Finder())


_map_source_tree_converter()

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
