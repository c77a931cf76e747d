"""Hugging Face safetensors checkpoints: shards, index, config and tokenizer files.

Shared by the float (bf16/fp16/fp32), GPTQ, AWQ and EXL3 readers: they all
store safetensors shards with a ``config.json``. Tensors are opened lazily with
``mx.load`` (nothing is read until evaluated) after the header of every file
has been validated with the ``safetensors`` library (truncated files, bad
headers and index entries pointing at missing tensors are refused here).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .errors import CorruptCheckpointError, MissingTensorError, UnsupportedFormatError
from .source import TOKENIZER_FILES, SourceModel

__all__ = ["read_config", "open_safetensors", "tokenizer_files", "read_hf"]


def read_config(path: Path) -> dict:
    """Read ``path/config.json``.

    Raises:
        CorruptCheckpointError: missing or invalid JSON.
    """
    f = Path(path) / "config.json"
    if not f.is_file():
        raise CorruptCheckpointError(f"{path}: no config.json")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{f}: invalid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise CorruptCheckpointError(f"{f}: must hold a JSON object")
    return cfg


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{index}: invalid index ({e})") from e
        files = sorted({path / f for f in wm.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise MissingTensorError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise UnsupportedFormatError(f"{path}: only safetensors checkpoints are supported (found .bin/.pt)")
        raise MissingTensorError(f"{path}: no *.safetensors weight files")
    return files


def open_safetensors(path: Path) -> dict[str, mx.array]:
    """Validate every shard's header and return all tensors as lazy ``mx.array`` s.

    Raises:
        CorruptCheckpointError: unreadable/truncated file or duplicate tensor names.
        MissingTensorError: the index lists a tensor its shard lacks.
    """
    from safetensors import safe_open

    path = Path(path)
    files = _weight_files(path)
    out: dict[str, mx.array] = {}
    for f in files:
        try:
            with safe_open(str(f), "numpy") as h:
                keys = list(h.keys())
        except Exception as e:
            raise CorruptCheckpointError(f"{f}: not a readable safetensors file ({e})") from e
        try:
            arrs = mx.load(str(f))
        except Exception as e:
            raise CorruptCheckpointError(f"{f}: cannot read ({e})") from e
        if set(arrs) != set(keys):
            raise CorruptCheckpointError(f"{f}: header and contents disagree")
        dup = set(arrs) & set(out)
        if dup:
            raise CorruptCheckpointError(f"{f}: tensors {sorted(dup)[:5]} also appear in another shard")
        out.update(arrs)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        missing = sorted(set(wm) - set(out))
        if missing:
            raise MissingTensorError(f"{index} lists tensors absent from the shards: {missing[:5]}")
    return out


def tokenizer_files(path: Path) -> list[Path]:
    """The tokenizer / chat template / generation config files present in ``path``."""
    return [Path(path) / n for n in TOKENIZER_FILES if (Path(path) / n).is_file()]


def read_hf(path: Path) -> SourceModel:
    """Open a float (bf16/fp16/fp32) Hugging Face checkpoint directory.

    Raises:
        CorruptCheckpointError, MissingTensorError, UnsupportedFormatError.
    """
    path = Path(path)
    cfg = read_config(path)
    weights = open_safetensors(path)
    for k, v in weights.items():
        if not mx.issubdtype(v.dtype, mx.floating):
            raise UnsupportedFormatError(
                f"{path}: tensor {k} is {v.dtype}, but config.json declares no quantization_config; "
                "pass --from to name the format"
            )
    return SourceModel("hf", path, cfg, weights, copy_files=tokenizer_files(path))
