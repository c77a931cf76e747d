"""MLX affine quantization: packing helpers and the per-layer quantization plan.

MLX affine layout (mlx 0.32, formats.md §1.1): for a matrix ``(out, in)`` at
``bits`` b and ``group_size`` g,

* ``weight``: uint32 ``(out, in*b/32)``, codes along ``in`` as one little-endian,
  LSB-first bit stream (for b in {2, 4, 8} code j of a word sits at bits
  ``[j*b, (j+1)*b)``; 3/5/6-bit codes straddle words);
* ``scales``/``biases``: ``(out, in/g)`` float, ``w = scale * q + bias``.

Supported: b in {2, 3, 4, 5, 6, 8}, g in {32, 64, 128} (``mlx/ops.cpp``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .errors import ConvertError

__all__ = ["QSpec", "Packed", "QuantPlan", "pack_codes", "unpack_codes", "parse_override", "BITS", "GROUP_SIZES"]

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QSpec:
    """One layer's MLX affine quantization: ``bits`` per weight, ``group_size`` weights per scale."""

    bits: int
    group_size: int

    def __post_init__(self):
        if self.bits not in BITS:
            raise ConvertError(f"unsupported MLX bits {self.bits} (supported: {BITS})")
        if self.group_size not in GROUP_SIZES:
            raise ConvertError(f"unsupported MLX group size {self.group_size} (supported: {GROUP_SIZES})")

    def as_dict(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}


@dataclass
class Packed:
    """A quantized layer already in MLX affine layout (see the module doc for shapes)."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    spec: QSpec

    def cast(self, dtype: mx.Dtype | None) -> tuple["Packed", bool]:
        """This layer with its scales and biases in ``dtype`` (``None``: as they are), and whether
        that cast is lossless (every value survives the round trip: an exact repack stays exact)."""
        if dtype is None or self.scales.dtype == dtype:
            return self, True
        s, b = self.scales.astype(dtype), self.biases.astype(dtype)
        lossless = bool(mx.array_equal(s.astype(self.scales.dtype), self.scales).item()
                        and mx.array_equal(b.astype(self.biases.dtype), self.biases).item())
        return Packed(self.weight, s, b, self.spec), lossless


def unpack_codes(words: mx.array, bits: int, n: int) -> mx.array:
    """Unpack ``n`` codes per row from LSB-first bit-stream words.

    Args:
        words: uint32 (or int32, reinterpreted) ``(..., n*bits/32)``; the last axis is the stream.
        bits: bits per code (1..8).
        n: codes per row.

    Returns:
        uint32 ``(..., n)``. Works for MLX affine weights and for any format that packs a
        continuous LSB-first stream into 32-bit words (GPTQ along ``in`` after a transpose).
    """
    if words.dtype != mx.uint32:
        words = words.view(mx.uint32)
    nw = words.shape[-1]
    if nw * 32 < n * bits:
        raise ConvertError(f"packed row of {nw} words holds fewer than {n} codes of {bits} bits")
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        per = 32 // bits
        shifts = mx.arange(per, dtype=mx.uint32) * bits
        codes = (words[..., :, None] >> shifts) & mask
        return codes.reshape(*words.shape[:-1], nw * per)[..., :n]
    pos = np.arange(n, dtype=np.int64) * bits
    lo = pos // 32
    sh = (pos % 32).astype(np.uint64)
    hi = np.minimum(lo + 1, nw - 1)
    w64 = words.astype(mx.uint64)
    both = mx.take(w64, mx.array(lo), axis=-1) | (mx.take(w64, mx.array(hi), axis=-1) << 32)
    return ((both >> mx.array(sh)) & mask).astype(mx.uint32)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """Pack codes ``(..., n)`` (values < 2**bits) into MLX's uint32 ``(..., n*bits/32)`` layout.

    The inverse of :func:`unpack_codes`; ``n * bits`` must be a multiple of 32.
    """
    n = codes.shape[-1]
    if (n * bits) % 32:
        raise ConvertError(f"{n} codes of {bits} bits do not fill whole 32-bit words")
    codes = codes.astype(mx.uint32)
    lead = codes.shape[:-1]
    if 32 % bits == 0:
        per = 32 // bits
        shifts = mx.arange(per, dtype=mx.uint32) * bits
        return (codes.reshape(*lead, n // per, per) << shifts).sum(axis=-1).astype(mx.uint32)
    # general widths: expand to a bit stream, regroup by 32
    bit = (codes[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1
    bit = bit.reshape(*lead, n * bits // 32, 32)
    return (bit << mx.arange(32, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def parse_override(text: str) -> tuple[re.Pattern, QSpec | None]:
    """Parse a ``--q-override`` value ``REGEX=BITS[:GROUP]`` or ``REGEX=none``.

    ``REGEX`` is searched in the module path (``model.embed_tokens``, ``lm_head``,
    ``model.layers.3.mlp.down_proj``...). ``none``/``float`` keeps the layer unquantized.

    Raises:
        ConvertError: malformed value.
    """
    if "=" not in text:
        raise ConvertError(f"--q-override {text!r}: expected REGEX=BITS[:GROUP] or REGEX=none")
    pat, _, val = text.rpartition("=")
    try:
        rx = re.compile(pat)
    except re.error as e:
        raise ConvertError(f"--q-override {text!r}: bad regex ({e})") from e
    if val.lower() in ("none", "float", "false", "16"):
        return rx, None
    bits, _, gs = val.partition(":")
    try:
        b, g = int(bits), int(gs) if gs else None
    except ValueError:
        raise ConvertError(f"--q-override {text!r}: BITS and GROUP must be integers") from None
    if b not in BITS or (g is not None and g not in GROUP_SIZES):
        raise ConvertError(f"--q-override {text!r}: MLX has bits {BITS} and group sizes {GROUP_SIZES}")
    return rx, (b, g)  # type: ignore[return-value]


@dataclass
class QuantPlan:
    """Which layers get which :class:`QSpec`.

    Attributes:
        default: the default spec, or ``None`` for a float (unquantized) output.
        overrides: ``(regex, spec-or-None)`` in order; the last matching one wins.
            A spec given as ``(bits, None)`` takes the default group size.
        keep_source_layout: where the source has an exact MLX layout (GPTQ/AWQ groups,
            GGUF Q4_x/Q5_x/Q8_0/Q4_K/Q5_K blocks; GGUF Q6_K -> 8-bit g32), use the source's own bits/group size for that
            layer instead of the default (lossless), unless an override names the layer.
        requantize_reason: why layers with an exact source layout are not kept when
            ``keep_source_layout`` is False (for the converter's note), e.g. explicit
            ``--q-bits``/``--q-group-size``.
    """

    default: QSpec | None
    overrides: list = None  # type: ignore[assignment]
    keep_source_layout: bool = False
    requantize_reason: str = ""

    def __post_init__(self):
        self.overrides = list(self.overrides or [])

    def spec_for(self, path: str, in_dim: int, model_choice=True) -> tuple[QSpec | None, bool]:
        """The spec of module ``path`` with input dimension ``in_dim``.

        ``model_choice`` is what the mlx-lm model's own ``quant_predicate`` said
        (``True``/``False`` or a dict with ``bits``/``group_size``).

        Returns:
            ``(spec or None, overridden)``: ``overridden`` is True when a user override decided.
        """
        spec = self.default
        if spec is not None:
            if model_choice is False:
                spec = None
            elif isinstance(model_choice, dict):
                spec = QSpec(int(model_choice.get("bits", spec.bits)), int(model_choice.get("group_size", spec.group_size)))
        overridden = False
        for rx, val in self.overrides:
            if rx.search(path):
                overridden = True
                if val is None:
                    spec = None
                else:
                    bits, gs = val
                    gs = gs or (self.default.group_size if self.default else 64)
                    spec = QSpec(bits, gs)
        if spec is not None and in_dim % spec.group_size:
            return None, overridden
        return spec, overridden
