"""GGUF reader for the converter (a thin layer over :mod:`mlx_dflash2.gguf`, the
project's one GGUF checkpoint loader: header, name map, q/k un-permute,
tokenizer and chat template from the metadata).

* Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 tensors have an exact MLX affine layout at
  group size 32 (4/4/5/5/8 bits): used as-is by default (the source layout is kept),
  or when the requested spec is exactly that (``--q-group-size 32`` for the Q4 tensors).
* Q4_K / Q5_K map onto MLX 4/5-bit group 32 with scale ``d*sc`` and bias
  ``-dmin*m`` (:meth:`mlx_dflash2.gguf.GGUFTensor.native`): exact with float32
  scales (``--dtype float32``); float16/bfloat16 scales round ``d*sc`` (17
  significant bits) and ``dmin*m`` to 11/8 bits.
* Q6_K (16-value sub-blocks with int8 scales, symmetric 6-bit) has no MLX layout
  (group sizes are 32/64/128): keeping the source layout (the default) quantizes its
  exact dequantized values to MLX 8-bit group 32 (near-lossless). Q2_K/Q3_K, IQ* and
  TQ* have none either and always take the ``--q-bits``/``--q-group-size`` spec.
* Every other case (another group size or bit width, Q2_K/Q3_K, BF16...)
  dequantizes with ``gguf.quants.dequantize`` to float32 and quantizes that with
  MLX round-to-nearest. (``mx.load`` is never used for GGUF data: it mis-decodes
  Q4_K and refuses Q5_0, offline-assets.md pitfall 7.)
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from mlx_dflash2.gguf import REQUANTIZED as _REQUANTIZED

from .errors import CorruptCheckpointError, UnsupportedFormatError
from .mlxq import Packed, QSpec
from .source import Deferred, SourceModel

__all__ = ["read_gguf"]

# source-layout spec (kept by default) of types without an MLX layout of their own: Q6_K's exact values
# requantized to 8 bits (MLX affine RTN; relative weight error 0.49 % on Qwen2.5-Coder-0.5B's
# Q6_K layers, tests/test_convert_slow.py); the same table the runtime's packed GGUF load uses.
_NEAR_EXACT = {t: QSpec(bits, gs) for t, (bits, gs) in _REQUANTIZED.items()}


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
        if not (name.endswith(".weight") and len(t.shape) == 2):
            continue
        module = name[: -len(".weight")]
        if t.ggml_type in _NEAR_EXACT:
            native[module] = _NEAR_EXACT[t.ggml_type]  # requantized by the pipeline from t.dense()
        elif t.is_native:
            bits = t.native_bits
            native[module] = QSpec(bits, 32)

            def make(spec: QSpec, t=t, bits=bits):
                if spec != QSpec(bits, 32):
                    return None
                w, s, b, _ = t.native()  # scales/biases float32 for Q4_K/Q5_K: cast to --dtype by the pipeline
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
    notes = [f"GGUF tensor types: {types}"]
    lossy = sorted({t.ggml_type for t in tensors.values() if t.ggml_type in ("Q2_K", "Q3_K")})
    if lossy:
        notes.append(
            f"{'/'.join(lossy)} have no MLX layout: requantized to the --q-bits/--q-group-size spec "
            "(default 4-bit g64) even when the source layout is kept"
        )
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
        notes=notes,
    )
