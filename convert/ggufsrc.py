"""GGUF reader for the converter (a thin layer over :mod:`mlx_dflash2.gguf`, the
project's one GGUF checkpoint loader: header, name map, q/k un-permute,
tokenizer and chat template from the metadata).

* Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 tensors have an exact MLX affine layout at
  group size 32 (4/4/5/5/8 bits): used as-is when the requested spec is exactly
  that (e.g. with ``--keep-source-layout``, or ``--q-group-size 32`` for the Q4 tensors).
* Every other case (another group size or bit width, K-quants, Q5_x, Q6_K,
  BF16...) dequantizes with ``gguf.quants.dequantize`` to float32 and quantizes
  that with MLX round-to-nearest. (``mx.load`` is never used for GGUF data: it
  mis-decodes Q4_K and refuses Q5_0, offline-assets.md pitfall 7.)
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .errors import CorruptCheckpointError, UnsupportedFormatError
from .mlxq import Packed, QSpec
from .source import Deferred, SourceModel

__all__ = ["read_gguf"]


def read_gguf(path: Path) -> SourceModel:
    """Open a GGUF file (or a directory holding one).

    Raises:
        CorruptCheckpointError: unreadable or truncated file, bad metadata.
        UnsupportedFormatError: architecture, rope scaling or tokenizer not supported.
    """
    from mlx_dflash2.gguf import GGUFError, build_tokenizer, gguf_model_config, gguf_tensors, read_gguf_header

    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) != 1:
            raise UnsupportedFormatError(f"{path}: expected exactly one .gguf file, found {len(files)}")
        path = files[0]
    try:
        h = read_gguf_header(path)
    except GGUFError as e:
        raise CorruptCheckpointError(str(e)) from e
    try:
        cfg = gguf_model_config(h)
        tensors = gguf_tensors(h, cfg)
        tok = build_tokenizer(h)
    except GGUFError as e:
        msg = str(e)
        cls = CorruptCheckpointError if "missing" in msg or "unexpected tensors" in msg else UnsupportedFormatError
        raise cls(msg) from e

    weights = {}
    packed = {}
    native = {}
    for name, t in tensors.items():
        rows = None
        if t.unpermute_heads is None and len(t.shape) == 2:
            rows = lambda r0, r1, t=t: mx.array(t.dense_rows(r0, r1))  # noqa: E731
        weights[name] = Deferred(t.shape, (lambda t=t: mx.array(t.dense())), load_rows=rows)
        if t.is_native and name.endswith(".weight") and len(t.shape) == 2:
            module = name[: -len(".weight")]
            bits = {"Q8_0": 8, "Q5_0": 5, "Q5_1": 5}.get(t.ggml_type, 4)
            native[module] = QSpec(bits, 32)

            def make(spec: QSpec, t=t, bits=bits):
                if spec != QSpec(bits, 32):
                    return None
                w, s, b, _ = t.native()
                return Packed(mx.array(w), mx.array(s), mx.array(b), spec)

            packed[module] = make
    eos = sorted(tok.eos_token_ids)
    if eos:
        cfg["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    bos = h.metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    types: dict[str, int] = {}
    for t in tensors.values():
        types[t.ggml_type] = types.get(t.ggml_type, 0) + 1
    src_q = {"gguf_file": path.name, "file_type": h.metadata.get("general.file_type"), "tensor_types": types}
    return SourceModel(
        "gguf",
        path,
        cfg,
        weights,
        dequantized=set(weights),
        packed=packed,
        native=native,
        tokenizer=tok._tokenizer,
        default_dtype="float16",
        source_quantization=src_q,
        notes=[f"GGUF tensor types: {types}"],
    )
