"""Atomic, sharded MLX checkpoint writer.

Output layout (what ``mlx_lm.load`` reads, formats.md §1.2): ``config.json``,
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards with
metadata ``{"format": "mlx"}``, ``model.safetensors.index.json``, plus
tokenizer / chat-template files.

Everything is written into a temporary directory next to the destination
(``.NAME.tmp-XXXX``) and renamed onto the destination only when complete, so an
interrupted or failed conversion leaves no half-written output.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from .errors import ConvertError, OutputExistsError, OutputWriteError

__all__ = ["AtomicOutput", "ShardWriter", "write_config", "DEFAULT_SHARD_BYTES"]

DEFAULT_SHARD_BYTES = 2 << 30  # 2 GiB: peak memory is about one shard plus one tensor


def _encode_floats(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: _encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode_floats(v) for v in obj]
    return obj


def write_config(config: dict, path: Path) -> None:
    """Write ``config.json`` the way mlx-lm does (``quantization_config`` mirrors
    ``quantization``, keys sorted, 4-space indent)."""
    config = dict(config)
    config.pop("_name_or_path", None)
    if "quantization" in config:
        config["quantization_config"] = config["quantization"]
    config = dict(sorted(config.items()))
    path.write_text(json.dumps(_encode_floats(config), indent=4) + "\n")


class AtomicOutput:
    """Context manager that yields a temporary directory and renames it onto ``dest`` on success.

    Args:
        dest: the output directory.
        overwrite: replace an existing ``dest`` (only once the new output is complete).

    Raises:
        OutputExistsError: ``dest`` exists and ``overwrite`` is False (checked on entry
            and again before the final rename).
        OutputWriteError: the output cannot be created or written (permissions, a file in
            the way, disk full); the temporary directory and any parent directories this
            writer created are removed.
    """

    def __init__(self, dest: str | Path, overwrite: bool = False):
        # normalized lexically: with "x/../x" the final renames would go through x after it has moved (its old
        # content was left as a hidden .x.old-* and the new one as .x.tmp-*, a fresh user's find)
        self.dest = Path(os.path.abspath(Path(dest).expanduser()))
        self.overwrite = overwrite
        self.tmp: Path | None = None
        self.made: list[Path] = []  # parent directories created here (removed again on failure)

    def check(self) -> None:
        if self.dest.exists() and not self.overwrite:
            raise OutputExistsError(f"{self.dest} exists; pass --overwrite (overwrite=True) to replace it")

    def __enter__(self) -> Path:
        self.check()
        self.made = [p for p in [self.dest.parent, *self.dest.parent.parents] if not p.exists()]
        try:
            self.dest.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.dest.name}.tmp-", dir=self.dest.parent))
        except OSError as e:
            self._remove_made()
            raise OutputWriteError(f"cannot create the output {self.dest}: {e.strerror or e}") from e
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the output is an ordinary directory
        return self.tmp

    def _remove_made(self) -> None:
        for p in self.made:  # deepest first
            try:
                p.rmdir()
            except OSError:
                break

    def _failed(self, exc) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._remove_made()
        if isinstance(exc, OSError) and not isinstance(exc, ConvertError):
            raise OutputWriteError(f"cannot write the output {self.dest}: {exc.strerror or exc}") from exc

    def __exit__(self, exc_type, exc, tb):
        assert self.tmp is not None
        if exc_type is not None:
            self._failed(exc)
            return False
        try:
            self.check()
            if self.dest.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{self.dest.name}.old-", dir=self.dest.parent))
                os.replace(self.dest, old / "x")
                try:
                    os.replace(self.tmp, self.dest)
                except BaseException:
                    os.replace(old / "x", self.dest)  # the old output back where it was
                    shutil.rmtree(old, ignore_errors=True)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(self.tmp, self.dest)
        except BaseException as e:
            self._failed(e)
            raise
        return False


class ShardWriter:
    """Collects evaluated tensors and writes them as safetensors shards.

    Each added tensor is evaluated immediately (so its sources can be freed); a
    shard is written once it would exceed ``max_shard_bytes``. Peak memory is
    therefore about one shard plus the tensor being computed.

    Args:
        directory: where shards go (the temporary output directory).
        max_shard_bytes: shard size limit in bytes (a larger tensor gets a shard of its own).
    """

    def __init__(self, directory: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.dir = Path(directory)
        self.max = int(max_shard_bytes)
        self.current: dict[str, mx.array] = {}
        self.current_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0
        self.total_params = 0

    def add(self, name: str, arr: mx.array, logical_params: int | None = None) -> None:
        """Evaluate ``arr`` and queue it under ``name``; ``logical_params`` counts
        the weights it represents (for packed tensors, codes rather than words)."""
        mx.eval(arr)
        nb = arr.nbytes
        if nb > (1 << 20):
            mx.clear_cache()  # return the temporaries of this tensor (dequantized floats...) to the system
        if self.current and self.current_bytes + nb > self.max:
            self._flush()
        self.current[name] = arr
        self.current_bytes += nb
        self.total_bytes += nb
        self.total_params += int(logical_params if logical_params is not None else arr.size)

    def _flush(self) -> None:
        if not self.current:
            return
        tmp_name = f".part-{len(self.files):05d}.safetensors"
        try:
            mx.save_safetensors(str(self.dir / tmp_name), self.current, metadata={"format": "mlx"})
        except RuntimeError as e:  # MLX reports failed writes (disk full...) as RuntimeError
            raise OutputWriteError(f"cannot write shard {self.dir / tmp_name}: {e}") from e
        self.files.append((tmp_name, sorted(self.current)))
        self.current = {}
        self.current_bytes = 0
        mx.clear_cache()

    def close(self) -> list[str]:
        """Write the last shard, give the shards their final names and write the index.

        Returns:
            The shard file names.
        """
        self._flush()
        n = len(self.files)
        names = []
        weight_map = {}
        for i, (tmp_name, keys) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / tmp_name, self.dir / final)
            names.append(final)
            for k in keys:
                weight_map[k] = final
        index = {
            "metadata": {"total_size": self.total_bytes, "total_parameters": self.total_params},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
        return names
