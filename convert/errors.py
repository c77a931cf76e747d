"""Exceptions raised by the converter.

Every error names the offending file, tensor or config field. Any error raised
during a conversion leaves no output directory behind (the output is written
into a temporary directory next to the destination and renamed at the end).
"""

from __future__ import annotations

__all__ = [
    "ConvertError",
    "UnsupportedFormatError",
    "CorruptCheckpointError",
    "MissingTensorError",
    "ShapeMismatchError",
    "OutputExistsError",
    "OutputWriteError",
]


class ConvertError(Exception):
    """Base class of every converter error."""


class UnsupportedFormatError(ConvertError):
    """The input uses a format, quantization method or layout the converter cannot read
    (e.g. FP8, GPTQ "marlin", AWQ GEMV, an unknown ``quant_method``)."""


class CorruptCheckpointError(ConvertError):
    """A file is unreadable, truncated or internally inconsistent (bad header, bad JSON,
    data shorter than the header says, packed tensors whose shapes disagree)."""


class MissingTensorError(ConvertError):
    """A tensor the architecture needs is absent, or the checkpoint has tensors the
    architecture does not know (nothing is dropped silently)."""


class ShapeMismatchError(ConvertError):
    """A tensor's shape does not match what the architecture expects."""


class OutputExistsError(ConvertError, FileExistsError):
    """The destination exists and ``overwrite`` was not requested."""


class OutputWriteError(ConvertError):
    """The output cannot be written: the destination's parent is not a writable directory,
    the disk is full, or a file write failed (nothing is left behind)."""
