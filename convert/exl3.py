"""ExLlamaV3 EXL3 reader: trellis decoding, Hadamard un-rotation, padding removal.

Format facts (formats.md §5, read from turboderp-org/exllamav3 and verified there
bit-exactly against the CUDA kernel): each quantized linear ``P`` stores

* ``P.trellis`` int16 ``(in_p/16, out_p/16, 16*K)``: one packed 16x16 tile per
  (row-tile, column-tile); ``K = shape[-1] / 16`` bits per weight, an integer 1..8
  or 1.5/2.5/3.5 (MUL1 codebook only);
* ``P.suh`` fp16 ``(in_p,)`` / ``P.svh`` fp16 ``(out_p,)`` sign x scale vectors (legacy
  files: ``P.su``/``P.sv`` int16 packed sign bits, bit set = -1);
* an optional codebook marker: ``P.mcg`` (0xCBAC1FED) or ``P.mul1`` (0x83DCD12D), else 3INST;
* optional ``P.bias``.

Decoding one tile (§5.3): the ``16*K`` int16 words are read as little-endian uint32
words holding an MSB-first bit ring of ``R = 256*K`` bits; position ``i`` (0..255)
ends at bit ``S(i) = sum_{j<=i} D(j)`` (``D = K``, or ``KA + (i odd)`` for
``K = KA + 0.5``) and its 16-bit state is ring bits ``[S(i)-16, S(i))`` (tail-biting);
the codebook maps the state to an fp16 value; position ``i`` lands at row-major index
``perm[i]`` of the tile (tensor-core order, ``tensor_core_perm`` in exllamav3).
Then ``W = diag(suh) . H . W_hat . H . diag(svh)`` with ``H`` the 128x128 Sylvester
Hadamard / sqrt(128) applied block-diagonally (§5.4; exllamav3
``LinearEXL3.get_weight_tensor``), and the Hugging Face weight is
``W.T[:out, :in]`` (padding sliced off; the true shape comes from the model config).

Everything here is MLX (lazy) or numpy; the arithmetic after the fp16 codebook
lookup is float32 (exllamav3's own reconstruction rounds to fp16 between steps).
EXL3 is always lossy to MLX affine: convert from the original weights when you can.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import CorruptCheckpointError, MissingTensorError, ShapeMismatchError, UnsupportedFormatError
from .hf import open_safetensors, read_config, tokenizer_files
from .source import Deferred, SourceModel

__all__ = [
    "CODEBOOKS",
    "MCG_MULT",
    "MUL1_MULT",
    "codebook_lut",
    "tile_perm",
    "decode_trellis",
    "hadamard_128",
    "unrotate",
    "decode_exl3_weight",
    "decode_exl3_rows",
    "read_exl3",
]

CODEBOOKS = ("3inst", "mcg", "mul1")
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
_HALF_K = (1.5, 2.5, 3.5)


@lru_cache(maxsize=None)
def codebook_lut(codebook: str) -> np.ndarray:
    """The 65536-entry fp16 lookup table ``state -> value`` of an EXL3 codebook.

    3INST: ``x = (s*89226354 + 64248484) mod 2^32``; MCG: ``x = s*0xCBAC1FED mod 2^32``;
    both then ``x = (x & 0x8FFF8FFF) ^ 0x3B603B60`` and ``value = fp16(half(x & 0xFFFF) +
    half(x >> 16))`` (sum exact, one rounding). MUL1: ``x = s*0x83DCD12D mod 2^32``,
    ``B`` = sum of x's four bytes, ``value = fp16((1024 + B) * k_inv + k_bias)`` with
    ``k_inv`` = fp16 bits 0x1EEE and ``k_bias`` = fp16 bits 0xC931 (exllamav3 ``codebook.cuh``).

    Raises:
        UnsupportedFormatError: unknown codebook.
    """
    s = np.arange(65536, dtype=np.uint64)
    if codebook in ("3inst", "mcg"):
        if codebook == "3inst":
            x = (s * 89226354 + 64248484) & 0xFFFFFFFF
        else:
            x = (s * MCG_MULT) & 0xFFFFFFFF
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        lo = (x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
        hi = (x >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
        return (lo + hi).astype(np.float16)
    if codebook == "mul1":
        x = (s * MUL1_MULT) & 0xFFFFFFFF
        b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        k_inv = float(np.array([0x1EEE], np.uint16).view(np.float16)[0])
        k_bias = float(np.array([0xC931], np.uint16).view(np.float16)[0])
        return ((1024.0 + b.astype(np.float64)) * k_inv + k_bias).astype(np.float16)
    raise UnsupportedFormatError(f"unknown EXL3 codebook {codebook!r} (known: {CODEBOOKS})")


@lru_cache(maxsize=None)
def tile_perm() -> np.ndarray:
    """``perm[i]``: row-major index in the 16x16 tile of trellis position ``i`` (tensor-core order)."""
    perm = np.zeros(256, np.int64)
    for t in range(32):
        r0, c0 = 2 * (t % 4), t // 4
        rows = (r0, r0 + 1, r0 + 8, r0 + 9)
        for j in range(8):
            perm[t * 8 + j] = rows[j % 4] * 16 + c0 + (8 if j >= 4 else 0)
    return perm


@lru_cache(maxsize=None)
def _state_windows(K: float) -> tuple[np.ndarray, np.ndarray, int]:
    """For each position: (index of the first uint32 word holding its state window, bit offset), words."""
    if float(K).is_integer():
        d = np.full(256, int(K), np.int64)
    else:
        ka = int(K)
        d = ka + (np.arange(256) % 2)
    R = int(round(256 * K))
    end = np.cumsum(d)
    start = (end - 16) % R
    return start // 32, start % 32, R // 32


def _states(w32: mx.array, K: float) -> mx.array:
    """uint32 states ``(..., 256)`` of tiles given as uint32 words ``(..., nw)``."""
    word, off, nw = _state_windows(K)
    a = mx.take(w32, mx.array(word.astype(np.int32)), axis=-1)
    b = mx.take(w32, mx.array(((word + 1) % nw).astype(np.int32)), axis=-1)
    o = mx.array(off.astype(np.uint32))
    # the 32 ring bits starting at the window: (a << o) | (b >> (32 - o)), the second term 0 when o == 0
    window = (a << o) | ((b >> 1) >> (31 - o))
    return window >> 16


def decode_trellis(trellis: mx.array, K: float, codebook: str) -> mx.array:
    """Decode packed tiles to the rotated weight ``W_hat``.

    Args:
        trellis: int16 ``(in_p/16, out_p/16, 16*K)``.
        K: bits per weight (``shape[-1] / 16``).
        codebook: ``"3inst"``, ``"mcg"`` or ``"mul1"``.

    Returns:
        float16 ``(in_p, out_p)`` (rows = inputs, rotated basis), lazily.
    """
    ti, to, n16 = trellis.shape
    w16 = trellis.view(mx.uint16).astype(mx.uint32).reshape(ti, to, n16 // 2, 2)
    w32 = w16[..., 0] | (w16[..., 1] << 16)
    vals = mx.take(mx.array(codebook_lut(codebook)), _states(w32, K))
    inv = np.argsort(tile_perm())  # tile_flat[j] = vals[inv[j]]
    tiles = mx.take(vals, mx.array(inv.astype(np.int32)), axis=-1).reshape(ti, to, 16, 16)
    return tiles.transpose(0, 2, 1, 3).reshape(ti * 16, to * 16)


def hadamard_128(x: mx.array, axis: int) -> mx.array:
    """Block-diagonal normalised Sylvester Hadamard (blocks of 128) along ``axis`` of a 2-D array.

    ``H[i, j] = (-1)^popcount(i & j) / sqrt(128)``; a fast Walsh-Hadamard transform
    (7 butterfly levels), float32. ``H`` is symmetric and its own inverse.
    """
    if axis == 0:
        return hadamard_128(x.T, 1).T
    rows, n = x.shape
    if n % 128:
        raise ShapeMismatchError(f"Hadamard blocks of 128 need a multiple of 128 columns, got {n}")
    y = x.astype(mx.float32).reshape(rows, n // 128, 128)
    h = 64
    while h >= 1:
        y = y.reshape(rows, n // 128, 128 // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = mx.stack([a + b, a - b], axis=-2)
        h //= 2
    return y.reshape(rows, n) * (1.0 / np.sqrt(128.0))


def unrotate(w_hat: mx.array, suh: mx.array, svh: mx.array) -> mx.array:
    """``diag(suh) . H . W_hat . H . diag(svh)`` in float32; ``(in_p, out_p)``."""
    w = hadamard_128(w_hat.astype(mx.float32), 0) * suh.astype(mx.float32)[:, None]
    return hadamard_128(w, 1) * svh.astype(mx.float32)[None, :]


def unpack_signs(packed: mx.array) -> mx.array:
    """Legacy ``su``/``sv`` int16 words -> float ±1 vector (bit i of word w set -> element 16w+i is -1)."""
    bits = (packed.view(mx.uint16).astype(mx.uint32)[:, None] >> mx.arange(16, dtype=mx.uint32)) & 1
    return (1.0 - 2.0 * bits.astype(mx.float32)).reshape(-1)


def decode_exl3_weight(
    trellis: mx.array, suh: mx.array, svh: mx.array, codebook: str, out_features: int, in_features: int
) -> mx.array:
    """The Hugging Face ``(out, in)`` float32 weight of one EXL3 linear (lazy).

    Raises:
        ShapeMismatchError: the requested shape exceeds the padded trellis.
    """
    ti, to, n16 = trellis.shape
    K = n16 / 16
    if in_features > ti * 16 or out_features > to * 16:
        raise ShapeMismatchError(
            f"EXL3 trellis {tuple(trellis.shape)} covers {ti * 16}x{to * 16} but the model needs {in_features}x{out_features}"
        )
    w = unrotate(decode_trellis(trellis, K, codebook), suh, svh)
    return w.T[:out_features, :in_features]


def decode_exl3_rows(
    trellis: mx.array, suh: mx.array, svh: mx.array, codebook: str, in_features: int, r0: int, r1: int
) -> mx.array:
    """Output rows ``r0:r1`` of :func:`decode_exl3_weight` (``r0`` a multiple of 128): decodes only
    the column tiles ``r0/16 .. ceil(r1/128)*8`` (the right Hadamard acts within 128-column blocks)."""
    if r0 % 128:
        raise ShapeMismatchError(f"EXL3 row slices start at multiples of 128, got {r0}")
    c1 = min(-(-r1 // 128) * 128, trellis.shape[1] * 16)
    part = trellis[:, r0 // 16 : c1 // 16]
    K = trellis.shape[-1] / 16
    w = unrotate(decode_trellis(part, K, codebook), suh, svh[r0:c1])
    return w.T[: r1 - r0, :in_features]


def _marker(w: dict, key: str, expected: int, path: Path) -> bool:
    if key not in w:
        return False
    v = np.array(w[key]).astype(np.int64).reshape(-1)
    if v.size != 1 or (int(v[0]) & 0xFFFFFFFF) != expected:
        raise CorruptCheckpointError(
            f"{path}: codebook marker {key} holds {int(v[0]) & 0xFFFFFFFF:#x} (size {v.size}), expected {expected:#x}"
        )
    return True


def read_exl3(path: Path) -> SourceModel:
    """Open an EXL3 checkpoint directory.

    Raises:
        UnsupportedFormatError: trellis-coded embedding tables (n-gram / PLE), impossible bit rates.
        CorruptCheckpointError, MissingTensorError: bad markers, missing sign vectors, shape errors.
    """
    path = Path(path)
    cfg = read_config(path)
    qc = cfg.get("quantization_config") or {}
    if str(qc.get("quant_method", "exl3")).lower() != "exl3":
        raise UnsupportedFormatError(f"{path}: quant_method {qc.get('quant_method')!r} is not exl3")
    w = open_safetensors(path)
    odd = sorted(k for k in w if "ngram" in k or k.endswith(".row_scales"))
    if odd:
        raise UnsupportedFormatError(f"{path}: trellis-coded embedding tables are not supported ({odd[:3]})")
    prefixes = sorted(k[: -len(".trellis")] for k in w if k.endswith(".trellis"))
    if not prefixes:
        raise MissingTensorError(f"{path}: quantization_config says exl3 but no *.trellis tensors were found")
    used = set()
    layers = {}
    for p in prefixes:
        tr = w[f"{p}.trellis"]
        if tr.ndim != 3 or tr.dtype not in (mx.int16, mx.uint16):
            raise CorruptCheckpointError(f"{path}: {p}.trellis must be int16 (rows/16, cols/16, 16*K), got {tr.dtype} {tuple(tr.shape)}")
        K = tr.shape[-1] / 16
        mcg = _marker(w, f"{p}.mcg", MCG_MULT, path)
        mul1 = _marker(w, f"{p}.mul1", MUL1_MULT, path)
        if mcg and mul1:
            raise CorruptCheckpointError(f"{path}: {p} has both mcg and mul1 markers")
        cb = "mcg" if mcg else "mul1" if mul1 else "3inst"
        if not (float(K).is_integer() and 1 <= K <= 8) and not (K in _HALF_K and cb == "mul1"):
            raise UnsupportedFormatError(
                f"{path}: {p}.trellis has {K} bits per weight ({cb}); supported: 1..8, and 1.5/2.5/3.5 with mul1"
            )
        in_p, out_p = tr.shape[0] * 16, tr.shape[1] * 16
        if f"{p}.suh" in w:
            suh = w[f"{p}.suh"]
        elif f"{p}.su" in w:
            suh = unpack_signs(w[f"{p}.su"])
        else:
            raise MissingTensorError(f"{path}: missing {p}.suh (or legacy {p}.su)")
        if f"{p}.svh" in w:
            svh = w[f"{p}.svh"]
        elif f"{p}.sv" in w:
            svh = unpack_signs(w[f"{p}.sv"])
        else:
            raise MissingTensorError(f"{path}: missing {p}.svh (or legacy {p}.sv)")
        if tuple(suh.shape) != (in_p,) or tuple(svh.shape) != (out_p,):
            raise CorruptCheckpointError(
                f"{path}: {p} sign vectors {tuple(suh.shape)}/{tuple(svh.shape)} do not match the trellis ({in_p}, {out_p})"
            )
        used |= {f"{p}.{s}" for s in ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")}
        layers[p] = (tr, suh, svh, cb, K)

    weights = {k: v for k, v in w.items() if k not in used}
    dequantized = set()
    for p in layers:
        weights[f"{p}.weight"] = Deferred((-1, -1), None)  # shape bound to the model's below
        dequantized.add(f"{p}.weight")

    def bind(expected: dict) -> None:
        for p, (tr, suh, svh, cb, _k) in layers.items():
            shape = expected.get(f"{p}.weight")
            if shape is None:
                shape = (tr.shape[1] * 16, tr.shape[0] * 16)  # unknown to the model: reported as unexpected
            out_f, in_f = shape
            if in_f > tr.shape[0] * 16 or out_f > tr.shape[1] * 16:
                raise ShapeMismatchError(
                    f"{path}: {p}.trellis covers {tr.shape[0] * 16} inputs x {tr.shape[1] * 16} outputs, "
                    f"the model needs ({out_f}, {in_f})"
                )
            weights[f"{p}.weight"] = Deferred(
                (out_f, in_f),
                lambda tr=tr, suh=suh, svh=svh, cb=cb, o=out_f, i=in_f: decode_exl3_weight(tr, suh, svh, cb, o, i),
                load_rows=lambda r0, r1, tr=tr, suh=suh, svh=svh, cb=cb, i=in_f: decode_exl3_rows(tr, suh, svh, cb, i, r0, r1),
                row_align=128,
            )
            source.weights[f"{p}.weight"] = weights[f"{p}.weight"]

    out_cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    notes = []
    if "lm_head" in layers or "lm_head.weight" in weights:
        if out_cfg.get("tie_word_embeddings", True):
            notes.append("EXL3 stores a separate lm_head: treated as untied (tie_word_embeddings=false)")
        out_cfg["tie_word_embeddings"] = False
    emb = weights.get("model.embed_tokens.weight")
    default_dtype = "bfloat16" if emb is not None and emb.dtype == mx.bfloat16 else "float16"
    ks = sorted({float(v[4]) for v in layers.values()})
    cbs = sorted({v[3] for v in layers.values()})
    notes.append(f"EXL3 layers: {len(layers)}, bits per weight {ks}, codebooks {cbs} (always lossy to MLX affine)")
    source = SourceModel(
        "exl3",
        path,
        out_cfg,
        weights,
        dequantized=dequantized,
        copy_files=tokenizer_files(path),
        default_dtype=default_dtype,
        source_quantization=dict(qc),
        bind=bind,
        notes=notes,
    )
    return source
