"""GPTQ (AutoGPTQ / GPTQModel / transformers "gptq") and AWQ (GEMM) readers.

Layouts and formulas: formats.md §3 (GPTQ) and §4 (AWQ).

GPTQ, per quantized linear ``P`` (b bits, f = 32/b codes per word, G groups):
``P.qweight`` int32 ``(in*b/32, out)`` packed along ``in`` (LSB-first stream);
``P.qzeros`` int32 ``(G, out*b/32)`` packed along ``out``; ``P.scales`` ``(G, out)``;
``P.g_idx`` int32 ``(in,)`` (optional). Dequantization (the reference formula):
``W[o, i] = scales[g_idx[i], o] * (q[i, o] - z[g_idx[i], o])``. v1 checkpoints
(``checkpoint_format``/``format`` "gptq" or absent) store ``z - 1``; the reader
adds 1 back as GPTQModel's loader does (a word-level add for 2/4/8 bits, which
is the exact inverse of GPTQModel's word-level subtract; per field for 3 bits).
v2 ("gptq_v2") stores the real zero points.

AWQ GEMM: ``P.qweight`` int32 ``(in, out/8)`` packed along ``out`` with nibble k
of word c holding output ``8c + [0,2,4,6,1,3,5,7][k]``; ``P.qzeros`` the same at
``(in/gs, out/8)``; ``W[o, i] = (q[i, o] - z[i//gs, o]) * s[i//gs, o]``.

To MLX: when the group map is trivial (``g_idx[i] == i // group_size``, checked
on the tensor itself) and the MLX group size divides the source's, the codes
are kept bit for bit (``weight = qweight.T`` for 2/4/8-bit GPTQ), ``scales =
s.T`` (columns repeated ``gs_src / gs_mlx`` times) and ``biases = -z.T * s.T``
(float32, then cast to the scale dtype: exact for symmetric zero points, within
half an ulp otherwise). Act-order (non-trivial ``g_idx``) layers, other bit
widths and group sizes are dequantized with the formula above (float32) and
requantized with MLX round-to-nearest.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import CorruptCheckpointError, MissingTensorError, UnsupportedFormatError
from .hf import open_safetensors, read_config, tokenizer_files
from .mlxq import BITS, GROUP_SIZES, Packed, QSpec, pack_codes, unpack_codes
from .source import SourceModel

__all__ = ["read_gptq", "read_awq", "AWQ_ORDER"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds output column 8c + AWQ_ORDER[k]
_AWQ_REVERSE = tuple(int(i) for i in np.argsort(AWQ_ORDER))  # column j sits in nibble _AWQ_REVERSE[j]
_V1_WORD_ADD = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def _qconfig(path: Path, cfg: dict, side_file: str) -> dict:
    qc = cfg.get("quantization_config")
    if qc is None and (path / side_file).is_file():
        try:
            qc = json.loads((path / side_file).read_text())
        except json.JSONDecodeError as e:
            raise CorruptCheckpointError(f"{path / side_file}: invalid JSON ({e})") from e
    if not isinstance(qc, dict):
        raise CorruptCheckpointError(f"{path}: no quantization_config in config.json (nor {side_file})")
    return qc


def _group_layer(
    prefix: str,
    codes_oi: mx.array,
    zeros_go: mx.array,
    scales_go: mx.array,
    g_idx: np.ndarray,
    bits: int,
    gs_src: int,
    qweight_t: mx.array | None,
):
    """Build the dense (lazy) weight, the exact-packing function and the native spec of one layer.

    Args:
        codes_oi: uint32 codes ``(out, in)``; zeros_go: ``(G, out)``; scales_go: ``(G, out)``;
        g_idx: ``(in,)`` group of each input column; gs_src: the source group size (``in`` for -1);
        qweight_t: the MLX-layout packed words when they are bit-identical (GPTQ 2/4/8), else None.
    """
    out_f, in_f = codes_oi.shape
    gi = mx.array(g_idx.astype(np.int32))
    s_oi = mx.take(scales_go.T.astype(mx.float32), gi, axis=1)
    z_oi = mx.take(zeros_go.T.astype(mx.float32), gi, axis=1)
    dense = (codes_oi.astype(mx.float32) - z_oi) * s_oi
    trivial = bool(np.array_equal(g_idx, np.arange(in_f) // gs_src))
    native = None
    if trivial and bits in BITS and gs_src in GROUP_SIZES and in_f % gs_src == 0:  # no partial last group
        native = QSpec(bits, gs_src)

    def packed(spec: QSpec):
        if not trivial or spec.bits != bits or gs_src % spec.group_size or in_f % spec.group_size:
            return None
        rep = gs_src // spec.group_size
        weight = qweight_t if qweight_t is not None else pack_codes(codes_oi, bits)
        s = scales_go.T
        b = (-(zeros_go.T.astype(mx.float32)) * s.astype(mx.float32)).astype(s.dtype)
        if rep > 1:  # a partial last source group yields fewer MLX groups: trim
            s = mx.repeat(s, rep, axis=1)[:, : in_f // spec.group_size]
            b = mx.repeat(b, rep, axis=1)[:, : in_f // spec.group_size]
        return Packed(mx.contiguous(weight), mx.contiguous(s), mx.contiguous(b), spec)

    return dense, packed, native


def _int_tensor(w: dict, key: str, path: Path) -> mx.array:
    if key not in w:
        raise MissingTensorError(f"{path}: missing tensor {key}")
    a = w[key]
    if a.dtype not in (mx.int32, mx.uint32):
        raise UnsupportedFormatError(f"{path}: {key} is {a.dtype}; only int32-packed checkpoints are supported")
    return a.view(mx.uint32)


def read_gptq(path: Path) -> SourceModel:
    """Open a GPTQ checkpoint directory (v1/v2 zero points, sym/asym, 2/3/4/8 bits, act-order).

    Raises:
        UnsupportedFormatError: marlin / gptq_p / other checkpoint formats, non-int32 packing,
            other bit widths, per-module ``dynamic`` overrides.
        MissingTensorError, CorruptCheckpointError: missing packed tensors, inconsistent shapes.
    """
    path = Path(path)
    cfg = read_config(path)
    qc = _qconfig(path, cfg, "quantize_config.json")
    method = str(qc.get("quant_method", "gptq")).lower()
    if method != "gptq":
        raise UnsupportedFormatError(f"{path}: quant_method {method!r} is not GPTQ")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedFormatError(
            f"{path}: GPTQ checkpoint_format {fmt!r} is not supported (gptq v1 and gptq_v2 are; "
            "marlin and gptq_p are repacked layouts)"
        )
    bits = qc.get("bits")
    if bits not in (2, 3, 4, 8):
        raise UnsupportedFormatError(f"{path}: GPTQ bits {bits!r} not supported (2, 3, 4, 8)")
    if str(qc.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
        raise UnsupportedFormatError(f"{path}: GPTQ pack_dtype {qc.get('pack_dtype')!r} not supported (int32 only)")
    if qc.get("dynamic"):
        raise UnsupportedFormatError(f"{path}: GPTQ 'dynamic' per-module overrides are not supported")
    group_size = int(qc.get("group_size", 128))
    v1 = fmt == "gptq"
    notes = []
    if v1 and qc.get("sym") is False:
        notes.append(
            "GPTQ v1 asymmetric checkpoint: zero points read as stored+1 (GPTQModel convention); "
            "files written by AutoGPTQ with zero points of 0 are corrupt at the source"
        )

    w = open_safetensors(path)
    weights = {}
    packed = {}
    native = {}
    dequantized = set()
    scale_dtype = None
    prefixes = sorted(k[: -len(".qweight")] for k in w if k.endswith(".qweight"))
    if not prefixes:
        raise MissingTensorError(f"{path}: quantization_config says GPTQ but no *.qweight tensors were found")
    used = set()
    f = 32 // bits if 32 % bits == 0 else None
    for p in prefixes:
        qweight = _int_tensor(w, f"{p}.qweight", path)
        qzeros = _int_tensor(w, f"{p}.qzeros", path)
        if f"{p}.scales" not in w:
            raise MissingTensorError(f"{path}: missing tensor {p}.scales")
        scales = w[f"{p}.scales"]
        used |= {f"{p}.qweight", f"{p}.qzeros", f"{p}.scales", f"{p}.g_idx"}
        rows, out_f = qweight.shape
        in_f = rows * 32 // bits
        G = scales.shape[0]
        gs_src = in_f if group_size == -1 else group_size
        if scales.ndim != 2 or scales.shape[1] != out_f:
            raise CorruptCheckpointError(f"{path}: {p}.scales has shape {tuple(scales.shape)}, expected (G, {out_f})")
        if G != -(-in_f // gs_src):
            raise CorruptCheckpointError(
                f"{path}: {p}.scales has {G} groups; {in_f} inputs at group_size {group_size} need {-(-in_f // gs_src)}"
            )
        if tuple(qzeros.shape) != (G, out_f * bits // 32):
            raise CorruptCheckpointError(
                f"{path}: {p}.qzeros has shape {tuple(qzeros.shape)}, expected {(G, out_f * bits // 32)}"
            )
        if f"{p}.g_idx" in w:
            g_idx = np.array(w[f"{p}.g_idx"]).astype(np.int64)
            if g_idx.shape != (in_f,) or g_idx.min() < 0 or g_idx.max() >= G:
                raise CorruptCheckpointError(f"{path}: {p}.g_idx has shape {g_idx.shape} or values outside 0..{G - 1}")
        else:
            g_idx = np.arange(in_f) // gs_src
        if v1:
            if bits in _V1_WORD_ADD:
                qzeros = qzeros + mx.array(_V1_WORD_ADD[bits], dtype=mx.uint32)
                zeros = unpack_codes(qzeros, bits, out_f)
            else:
                zeros = (unpack_codes(qzeros, bits, out_f) + 1) & ((1 << bits) - 1)
        else:
            zeros = unpack_codes(qzeros, bits, out_f)
        qweight_t = mx.contiguous(qweight.T)
        codes = unpack_codes(qweight_t, bits, in_f)
        dense, fn, nat = _group_layer(p, codes, zeros, scales, g_idx, bits, gs_src, qweight_t if f else None)
        weights[f"{p}.weight"] = dense
        dequantized.add(f"{p}.weight")
        packed[p] = fn
        if nat is not None:
            native[p] = nat
        scale_dtype = scale_dtype or scales.dtype
    for k, v in w.items():
        if k not in used:
            weights[k] = v
    src_q = dict(qc)
    return SourceModel(
        "gptq",
        path,
        {k: v for k, v in cfg.items() if k != "quantization_config"},
        weights,
        dequantized=dequantized,
        packed=packed,
        native=native,
        copy_files=tokenizer_files(path),
        default_dtype=str(scale_dtype).split(".")[-1] if scale_dtype is not None else None,
        source_quantization=src_q,
        notes=notes,
    )


def _awq_unpack(words: mx.array, n_out: int) -> mx.array:
    """AWQ GEMM words ``(R, out/8)`` -> codes ``(R, out)`` undoing the [0,2,4,6,1,3,5,7] interleave."""
    shifts = mx.array([4 * k for k in _AWQ_REVERSE], dtype=mx.uint32)
    codes = (words[..., None] >> shifts) & 0xF
    return codes.reshape(words.shape[0], -1)[:, :n_out]


def read_awq(path: Path) -> SourceModel:
    """Open an AWQ checkpoint directory (GEMM layout, 4-bit, zero points).

    Raises:
        UnsupportedFormatError: GEMV / GEMV-fast / marlin / exllama versions, other bit widths,
            ``zero_point: false``.
        MissingTensorError, CorruptCheckpointError: missing packed tensors, inconsistent shapes.
    """
    path = Path(path)
    cfg = read_config(path)
    qc = _qconfig(path, cfg, "quant_config.json")
    method = str(qc.get("quant_method", "awq")).lower()
    if method != "awq":
        raise UnsupportedFormatError(f"{path}: quant_method {method!r} is not AWQ")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedFormatError(f"{path}: AWQ version {version!r} is not supported (GEMM only)")
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise UnsupportedFormatError(f"{path}: AWQ bits {bits!r} not supported (4 only)")
    if qc.get("zero_point", True) is False:
        raise UnsupportedFormatError(f"{path}: AWQ without zero points is not supported")
    gs = int(qc.get("group_size", qc.get("q_group_size", 128)))

    w = open_safetensors(path)
    weights, packed, native, dequantized, used = {}, {}, {}, set(), set()
    scale_dtype = None
    prefixes = sorted(k[: -len(".qweight")] for k in w if k.endswith(".qweight"))
    if not prefixes:
        raise MissingTensorError(f"{path}: quantization_config says AWQ but no *.qweight tensors were found")
    for p in prefixes:
        qweight = _int_tensor(w, f"{p}.qweight", path)
        qzeros = _int_tensor(w, f"{p}.qzeros", path)
        if f"{p}.scales" not in w:
            raise MissingTensorError(f"{path}: missing tensor {p}.scales")
        scales = w[f"{p}.scales"]
        used |= {f"{p}.qweight", f"{p}.qzeros", f"{p}.scales"}
        in_f, packed_out = qweight.shape
        out_f = packed_out * 8
        gs_src = in_f if gs == -1 else gs
        G = -(-in_f // gs_src)
        if tuple(scales.shape) != (G, out_f):
            raise CorruptCheckpointError(f"{path}: {p}.scales has shape {tuple(scales.shape)}, expected {(G, out_f)}")
        if tuple(qzeros.shape) != (G, packed_out):
            raise CorruptCheckpointError(f"{path}: {p}.qzeros has shape {tuple(qzeros.shape)}, expected {(G, packed_out)}")
        codes = mx.contiguous(_awq_unpack(qweight, out_f).T)  # (out, in)
        zeros = _awq_unpack(qzeros, out_f)  # (G, out)
        g_idx = np.arange(in_f) // gs_src
        dense, fn, nat = _group_layer(p, codes, zeros, scales, g_idx, 4, gs_src, None)
        weights[f"{p}.weight"] = dense
        dequantized.add(f"{p}.weight")
        packed[p] = fn
        if nat is not None:
            native[p] = nat
        scale_dtype = scale_dtype or scales.dtype
    for k, v in w.items():
        if k not in used:
            weights[k] = v
    return SourceModel(
        "awq",
        path,
        {k: v for k, v in cfg.items() if k != "quantization_config"},
        weights,
        dequantized=dequantized,
        packed=packed,
        native=native,
        copy_files=tokenizer_files(path),
        default_dtype=str(scale_dtype).split(".")[-1] if scale_dtype is not None else None,
        source_quantization=dict(qc),
    )
