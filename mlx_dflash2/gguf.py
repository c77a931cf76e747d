"""GGUF reader and target loader: a llama.cpp GGUF file -> an mlx-lm model + tokenizer.

The project's one GGUF checkpoint reader: :func:`gguf_tensors` (per-tensor, decoded
on demand from the memory-mapped file) serves both :func:`load_gguf` (runtime) and
the converter (``mlx_dflash2.convert``).

What it does (see ``shared/research/offline-assets.md`` §3 for the derivation):

* Reads the header (metadata and tensor table) with :func:`parse_gguf_header` (``struct``, no
  ``gguf.GGUFReader``), also what :func:`~.assets.gguf_file_size` reads.
* Quantized tensors are loaded **natively packed** (``QuantizedLinear``/``QuantizedEmbedding``,
  MLX affine, group size 32, one bit width per layer):

  - Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the K-quants Q4_K/Q5_K are repacked exactly
    (:meth:`GGUFTensor.native`: no requantization; ``mx.dequantize`` reproduces
    ``gguf.quants.dequantize``). Files whose tensors are all F32/F16/Q4_0/Q4_1/Q8_0 are read
    with ``mx.load`` (MLX's own decoding, bit-identical, tested); any other file is decoded
    here with numpy, because ``mx.load`` rejects Q5_0 and silently mis-decodes Q4_K.
  - Q6_K (16-value sub-blocks with their own int8 scales) has no MLX layout: its exact values
    are requantized to MLX 8-bit, group 32 (:data:`REQUANTIZED`; ``mx.quantize``, round to
    nearest with a rounded zero point: error at most one step ``|scale|`` ~ 1/255 of the group's
    range per weight; 0.49 % relative weight error on Qwen2.5-Coder-0.5B's Q6_K layers).
  - Other types (Q2_K, Q3_K, IQ*, BF16...) are dequantized to dense weights.

  ``dequantize=True`` gives dense weights everywhere instead, with
  ``gguf.quants.dequantize``'s exact values (the converter shares these repacks).
* Undoes llama.cpp's q/k row permutation for the ``llama`` architecture (the
  inverse of ``LlamaModel.permute`` in llama.cpp's ``convert_hf_to_gguf.py``);
  being a row permutation, it applies unchanged to packed weights, scales and
  biases.
* Builds a byte-level BPE tokenizer from ``tokenizer.ggml.tokens``/``merges``
  with the pre-tokenizer named by ``tokenizer.ggml.pre``, or a SentencePiece-BPE
  tokenizer from ``tokens``/``scores``/``token_type`` (``tokenizer.ggml.model ==
  "llama"``, Gemma 3), and takes the chat template from ``tokenizer.chat_template``.
* Gemma 3 (``gemma3``) becomes mlx-lm's ``gemma3_text``: llama.cpp's hard-coded
  layer pattern / local rope base / attention scale go into the config, and the
  ``+1`` llama.cpp folds into every Gemma norm weight is subtracted again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

__all__ = [
    "GGUFError",
    "GGUFTruncatedError",
    "GGUFHeader",
    "GGUFLayout",
    "GGUFTensorEntry",
    "GGUFFile",
    "GGUFTensorInfo",
    "GGUFTensor",
    "parse_gguf_header",
    "read_gguf_header",
    "gguf_model_config",
    "gguf_tensors",
    "load_gguf",
    "build_tokenizer",
]


class GGUFError(ValueError):
    """The GGUF file is malformed or uses something this loader does not support."""


# GGUF tensor types that ``mx.load`` decodes exactly (checked against
# ``gguf.quants.dequantize``: max |diff| = 0 for Q4_1/Q8_0 with mlx 0.32.4).
_MX_NATIVE_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}

_SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")
# GGUF architecture -> mlx-lm model module (mlx_lm.models.<module>) and config model_type
_MLX_MODULE = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}

# GPT-2 style byte-level pre-tokenizer regexes used by llama.cpp (llama-vocab.cpp).
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass
class GGUFHeader:
    """Parsed GGUF header.

    Attributes:
        path: the file.
        metadata: key -> Python value (strings, numbers, lists).
        tensor_types: tensor name -> GGUF type name (e.g. ``"Q4_1"``).
        arch: ``general.architecture``.
        reader: the :class:`GGUFFile` (tensor data memory-mapped, not read).
    """

    path: Path
    metadata: dict[str, Any]
    tensor_types: dict[str, str]
    arch: str
    reader: Any = None

    def get(self, key: str, default: Any = None) -> Any:
        """Architecture-relative lookup: ``get("block_count")`` reads ``{arch}.block_count``."""
        if key in self.metadata:
            return self.metadata[key]
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise GGUFError(f"{self.path.name}: missing GGUF metadata field {self.arch}.{key!s}")
        return v


@dataclass
class GGUFTensorInfo:
    """One tensor of a :class:`GGUFFile`, as ``gguf.GGUFReader`` describes it.

    Attributes:
        name: the GGUF tensor name.
        tensor_type: its ``gguf.GGMLQuantizationType``.
        shape: int64 ``[n_dims]``, GGUF order (fastest-varying dimension first).
        data: a read-only array over the file's bytes (not read until used): float/int types as their numpy
            dtype, shape reversed; block-quantized types as uint8 ``[..., row bytes]`` (``gguf.GGUFReader``'s
            layout, what ``gguf.quants.dequantize`` takes).
    """

    name: str
    tensor_type: Any
    shape: np.ndarray
    data: np.ndarray


class GGUFTruncatedError(GGUFError):
    """A GGUF header runs past the end of the bytes given: a cut-short file, or a prefix shorter than its header."""


@dataclass
class GGUFTensorEntry:
    """One row of a GGUF tensor table, as :func:`parse_gguf_header` reads it (no data is touched).

    Attributes:
        name: the GGUF tensor name.
        dims: uint64 ``[n_dims]``, GGUF order (fastest-varying dimension first).
        tensor_type: its ``gguf.GGMLQuantizationType``.
        offset: where its data starts, in bytes from the start of the data section.
        n_bytes: how many bytes its data takes (whole blocks of its type).
    """

    name: str
    dims: np.ndarray
    tensor_type: Any
    offset: int
    n_bytes: int


@dataclass
class GGUFLayout:
    """What a GGUF header says (:func:`parse_gguf_header`): metadata, tensor table and where the data starts.

    Attributes:
        version: the GGUF version (2 or 3).
        fields: metadata key -> Python value (str, int, float, bool, or a list of them), in file order.
        tensors: the :class:`GGUFTensorEntry` of every tensor, in file order.
        alignment: ``general.alignment`` (default 32), a power of two.
        data_offset: the byte where the data section starts (the header's end rounded up to ``alignment``).
    """

    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensorEntry]
    alignment: int
    data_offset: int

    @property
    def file_size(self) -> int:
        """The file's size in bytes as the header implies it: the end of the tensor data furthest in, rounded
        up to ``alignment`` (llama.cpp's writer pads every tensor, the last one included)."""
        end = self.data_offset + max((t.offset + t.n_bytes for t in self.tensors), default=0)
        return end + (-end % self.alignment)


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_ARRAYS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                12: "<f8"}


def parse_gguf_header(source: Any, name: str | None = None) -> GGUFLayout:
    """Parse a GGUF header (magic, version, metadata, tensor table) with ``struct``; tensor data is not read.

    The one GGUF header walker of the project: :class:`GGUFFile` runs it over a memory map of the whole file,
    :func:`~.assets.gguf_file_size` over a file object that may hold only the start of the file (the first chunk
    of a split model).

    Args:
        source: the file's bytes from its start (``bytes``, ``mmap.mmap``, anything ``struct.unpack_from`` and
            ``np.frombuffer`` take; tensor data may be missing), or a binary file object positioned at the start
            of a GGUF file, read in growing pieces until the header is complete (it is left positioned somewhere
            after the header).
        name: what error messages call the source (default: the file object's ``name``, else ``"GGUF data"``).

    Returns:
        A :class:`GGUFLayout`.

    Raises:
        GGUFTruncatedError: the header runs past the end of the bytes given (a ``GGUFError``).
        GGUFError: not a GGUF file, an unsupported version or byte order, bad UTF-8, an unknown value or tensor
            type, a duplicate tensor name, a quantized tensor whose rows are not whole blocks, or a bad
            ``general.alignment``; the message reads ``NAME: not a readable GGUF file (...)``.
        OSError: reading the file object failed.
    """
    if name is None:
        name = str(getattr(source, "name", None) or "GGUF data")
    if not hasattr(source, "read"):
        return _parse_gguf_header(source, name)
    buf = source.read(1 << 20)
    while True:
        try:
            return _parse_gguf_header(buf, name)
        except GGUFTruncatedError:
            more = source.read(max(len(buf), 1 << 20))  # doubling: at most about twice the header is parsed
            if not more:
                raise
            buf += more


def _parse_gguf_header(buf: Any, name: str) -> GGUFLayout:
    """:func:`parse_gguf_header` over a buffer (the caller's ``bytes`` or memory map)."""
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = len(buf)
    unpack = struct.unpack_from

    def fail(msg, error=GGUFError):
        raise error(f"{name}: not a readable GGUF file ({msg})")

    def short(what, off):
        fail(f"header cut short: {what} at byte {off} runs past the end of the {size} bytes given",
             GGUFTruncatedError)

    def read_str(off):
        (n,) = unpack("<Q", buf, off)
        end = off + 8 + n
        if end > size:
            short("a string", off)
        return bytes(buf[off + 8 : end]).decode("utf-8"), end

    def read_value(vtype, off):
        if vtype == 8:
            return read_str(off)
        if vtype == 9:
            sub, count = unpack("<IQ", buf, off)
            off += 12
            if sub in _GGUF_ARRAYS:
                dt = np.dtype(_GGUF_ARRAYS[sub])
                if off + count * dt.itemsize > size:
                    short("an array", off)
                values = np.frombuffer(buf, dt, count, off).tolist()
                return values, off + count * dt.itemsize
            values = []
            for _ in range(count):
                v, off = read_value(sub, off)
                values.append(v)
            return values, off
        if vtype in _GGUF_SCALARS:
            fmt = _GGUF_SCALARS[vtype]
            return unpack(fmt, buf, off)[0], off + struct.calcsize(fmt)
        fail(f"unknown metadata value type {vtype}")

    if size >= 4 and bytes(buf[:4]) != b"GGUF":
        fail("no GGUF magic")
    if size < 24:
        fail(f"header cut short: {size} bytes are too short for a GGUF header", GGUFTruncatedError)
    (version,) = unpack("<I", buf, 4)
    if version not in (2, 3):
        why = "big-endian files are not supported" if version & 0xFFFF == 0 else "only 2 and 3 are"
        fail(f"GGUF version {version} ({why})")
    n_tensors, n_kv = unpack("<QQ", buf, 8)
    off = 24
    fields: dict[str, Any] = {}
    raw = []
    try:
        for _ in range(n_kv):
            key, off = read_str(off)
            (vtype,) = unpack("<I", buf, off)
            fields[key], off = read_value(vtype, off + 4)
        for _ in range(n_tensors):
            tname, off = read_str(off)
            (n_dims,) = unpack("<I", buf, off)
            dims = np.array(unpack(f"<{n_dims}Q", buf, off + 4), dtype=np.uint64)
            ttype, offset = unpack("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            raw.append((tname, dims, ttype, offset))
    except struct.error as e:  # unpack_from past the end of the buffer (its formats are fixed)
        fail(f"header cut short: {e}", GGUFTruncatedError)
    except (UnicodeDecodeError, OverflowError, MemoryError) as e:
        fail(f"{type(e).__name__}: {e}")
    align = fields.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        fail(f"bad general.alignment {align!r}")
    tensors: list[GGUFTensorEntry] = []
    seen = set()
    for tname, dims, ttype, offset in raw:
        if tname in seen:
            fail(f"tensor {tname} appears twice")
        seen.add(tname)
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            fail(f"tensor {tname} has unknown type {ttype}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        row = int(dims[0]) if len(dims) else 1
        if row % block:
            fail(f"tensor {tname}: rows of {row} are not whole blocks of {block}")
        n = int(np.prod(dims)) if len(dims) else 1
        tensors.append(GGUFTensorEntry(tname, dims, qtype, int(offset), n * type_size // block))
    return GGUFLayout(version, fields, tensors, align, off + (-off % align))


class GGUFFile:
    """A GGUF file's metadata and tensor table (:func:`parse_gguf_header` over a memory map) and its data views.

    Why not ``gguf.GGUFReader`` (which reads the same format): it builds a numpy view per metadata item, and
    a Qwen2.5 tokenizer's 151,936 tokens and 151,387 merges took 12.8 s of a 0.5B model's 38.7 s load (session
    24); this reads them in well under a second. The tensor table and data views are laid out as
    ``GGUFReader``'s (tested against it on every GGUF fixture of the suite).

    Attributes:
        fields: metadata key -> Python value (str, int, float, bool, or a list of them), in file order.
        tensors: the :class:`GGUFTensorInfo` of every tensor, in file order.
        version: the GGUF version (2 or 3); little-endian files only.
        layout: the :class:`GGUFLayout` its header gives.

    Raises:
        GGUFError: what :func:`parse_gguf_header` raises (a header running past the end of the file is a
            :class:`GGUFTruncatedError`), or tensor data past the end of the file (``truncated or corrupt``).
    """

    def __init__(self, path: str | Path):
        import mmap

        from gguf.constants import GGML_QUANT_SIZES

        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self._buf = buf
        self.layout = layout = parse_gguf_header(buf, str(self.path))
        self.version = layout.version
        self.fields: dict[str, Any] = layout.fields
        floats = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}
        self.tensors: list[GGUFTensorInfo] = []
        for t in layout.tensors:
            at = layout.data_offset + t.offset
            if at + t.n_bytes > size:
                raise GGUFError(f"{self.path}: truncated or corrupt GGUF file: its header describes more tensor data "
                                f"than the file's {size} bytes hold (tensor {t.name} ends at byte {at + t.n_bytes})")
            np_dims = tuple(reversed(t.dims.tolist()))
            qtype = t.tensor_type
            if qtype.name in floats:
                dt = np.dtype(floats[qtype.name])
                data = np.frombuffer(buf, dt, t.n_bytes // dt.itemsize, at).reshape(np_dims)
            else:
                block, type_size = GGML_QUANT_SIZES[qtype]
                data = np.frombuffer(buf, np.uint8, t.n_bytes, at).reshape(
                    (*np_dims[:-1], np_dims[-1] // block * type_size))
            self.tensors.append(GGUFTensorInfo(t.name, qtype, t.dims.astype(np.int64), data))


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Read a GGUF file's metadata and tensor types (no tensor data is decoded; :class:`GGUFFile`).

    Raises:
        FileNotFoundError: no such file.
        GGUFError: not a readable GGUF file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = GGUFFile(path)
    metadata = dict(reader.fields)
    tensor_types = {t.name: t.tensor_type.name for t in reader.tensors}
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: missing general.architecture")
    return GGUFHeader(path, metadata, tensor_types, arch, reader)


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


def gguf_model_config(h: GGUFHeader) -> dict:
    """The mlx-lm / Hugging Face style config dict of a GGUF model (llama, qwen2, gemma3 -> gemma3_text).

    ``{arch}.attention.sliding_window`` becomes ``sliding_window`` on every layer (which
    :class:`~.target.TargetAdapter` refuses unless the window covers the whole context).

    Raises:
        GGUFError: unsupported architecture or rope scaling, missing metadata.
    """
    if h.arch not in _SUPPORTED_ARCHS:
        raise GGUFError(
            f"{h.path.name}: GGUF architecture {h.arch!r} is not supported "
            f"(supported: {', '.join(_SUPPORTED_ARCHS)})"
        )
    hidden = int(h.require("embedding_length"))
    heads = int(h.require("attention.head_count"))
    head_dim = int(h.get("attention.key_length") or hidden // heads)
    tokens = h.metadata.get("tokenizer.ggml.tokens")
    vocab = int(h.get("vocab_size") or (len(tokens) if tokens else 0))
    if vocab <= 0:
        raise GGUFError(f"{h.path.name}: cannot determine the vocabulary size")
    rope_scaling = None
    scaling_type = h.get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type == "linear":
            rope_scaling = {"type": "linear", "factor": float(h.require("rope.scaling.factor"))}
        else:
            raise GGUFError(f"{h.path.name}: rope scaling {scaling_type!r} is not supported")
    cfg = {
        "model_type": _MLX_MODULE[h.arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(h.require("block_count")),
        "intermediate_size": int(h.require("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(h.get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(h.require("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "rope_theta": float(h.get("rope.freq_base") or 10000.0),
        "max_position_embeddings": int(h.get("context_length") or 4096),
        "tie_word_embeddings": "output.weight" not in h.tensor_types,
        "rope_scaling": rope_scaling,
    }
    if h.arch == "gemma3":
        cfg.update(_gemma3_config(h, cfg))
        return cfg
    window = h.get("attention.sliding_window")
    if window:  # a GGUF carries no per-layer pattern for these architectures: every layer
        cfg["sliding_window"] = int(window)
        if h.arch == "qwen2":  # transformers' qwen2 semantics of "every layer windowed"
            cfg.update(use_sliding_window=True, max_window_layers=0)
    return cfg


def _gemma3_config(h: GGUFHeader, cfg: dict) -> dict:
    """The Gemma 3 fields of :func:`gguf_model_config` (mlx-lm ``gemma3_text``).

    A Gemma 3 GGUF leaves most of them out; llama.cpp (``llama-model.cpp``, ``LLM_ARCH_GEMMA3``)
    hard-codes them, and so do we: every 6th layer global, the others sliding-window
    (``sliding_window_pattern`` 6), local rope base 10000, and the attention scale
    ``1/sqrt(head_dim)`` (the 27B model, 62 layers: ``1/sqrt(hidden/heads)``). Newer files may
    carry ``rope.freq_base_swa`` and ``attention.sliding_window_pattern`` (a period, or one
    boolean per layer, true = sliding), which win.

    Raises:
        GGUFError: a per-layer pattern that is not "every n-th layer global", or a final logit
            soft-capping (mlx-lm's gemma3_text has none).
    """
    layers = int(cfg["num_hidden_layers"])
    pattern = h.get("attention.sliding_window_pattern")
    if pattern is None:
        period = 6
    elif isinstance(pattern, (list, tuple)):
        flags = [bool(x) for x in pattern]
        globals_ = [i for i, f in enumerate(flags) if not f]
        period = globals_[0] + 1 if globals_ else layers + 1
        if len(flags) != layers or flags != [(i + 1) % period != 0 for i in range(layers)]:
            raise GGUFError(f"{h.path.name}: sliding-window layer pattern {flags} is not 'every n-th layer global'")
    else:
        period = int(pattern)
    if h.get("final_logit_softcapping") or h.get("attn_logit_softcapping"):
        raise GGUFError(f"{h.path.name}: Gemma logit soft-capping is not supported by mlx-lm's gemma3_text")
    heads = int(cfg["num_attention_heads"])
    scalar = cfg["hidden_size"] // heads if layers == 62 else cfg["head_dim"]
    window = int(h.get("attention.sliding_window") or 512)
    return {
        "query_pre_attn_scalar": float(h.get("attention.query_pre_attn_scalar") or scalar),
        "rope_local_base_freq": float(h.get("rope.freq_base_swa") or 10000.0),
        "sliding_window": window,
        "sliding_window_pattern": period,
        # the Hugging Face form of the same pattern (what a window-aware consumer reads)
        "layer_types": ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)],
        "tie_word_embeddings": "output.weight" not in h.tensor_types,
        "hidden_activation": "gelu_pytorch_tanh",
    }


# ----------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3's four norms per block (llama.cpp's names): ffn_norm is the *pre*-feed-forward norm there.
_GEMMA3_LAYER_MAP = {
    **_LAYER_MAP,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SUFFIXES = ("weight", "bias", "scales", "biases")
# llama.cpp's convert_hf_to_gguf.py adds Gemma's RMSNorm "+1" (``x * (1 + w)``) into every
# ``*norm.weight`` of these architectures; mlx-lm's Gemma RMSNorm adds it at run time, so the
# loader subtracts it again.
_NORM_SHIFT = {"gemma3": 1.0}


def _mlx_name(gguf_name: str, arch: str = "llama") -> str | None:
    """``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``; None if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    parts = base.split(".")
    layer_map = _GEMMA3_LAYER_MAP if arch == "gemma3" else _LAYER_MAP
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_map:
        return f"model.layers.{parts[1]}.{layer_map[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _TOP_MAP:
        return f"{_TOP_MAP[parts[0]]}.{suffix}"
    return None


# Block layouts (gguf-py quants.py / ggml-common.h): bytes per block of 32 values, bits per value.
_NATIVE_BLOCKS = {"Q4_0": (18, 4), "Q4_1": (20, 4), "Q8_0": (34, 8), "Q5_0": (22, 5), "Q5_1": (24, 5)}
# K-quant super-blocks of 256 values (8 sub-blocks of 32): bytes per super-block, bits per value.
_K_BLOCKS = {"Q4_K": (144, 4), "Q5_K": (176, 5)}


REQUANTIZED = {"Q6_K": (8, 32)}
"""GGUF types without an exact MLX layout that a packed load (and the converter, keeping the source
layout) requantizes, RTN, from their exact values: type -> ``(bits, group_size)``."""


def _pack_stream(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``(rows, n)`` -> MLX's uint32 words: one LSB-first little-endian bit stream per row."""
    rows, n = codes.shape
    b = np.unpackbits(codes.astype(np.uint8)[..., None], axis=-1, count=8, bitorder="little")[..., :bits]
    packed = np.packbits(b.reshape(rows, n * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``(rows, ...)`` (any trailing shape, row-major order) -> MLX uint32 words ``(rows, n*bits/32)``.

    Eight codes of ``bits`` <= 8 make ``bits`` whole bytes of the LSB-first stream: they are
    OR-ed into one little-endian uint64 whose low ``bits`` bytes are kept (fast for every width;
    about 1 s per 100 M codes).
    """
    rows = codes.shape[0]
    flat = codes.reshape(rows, -1)
    if flat.shape[1] % 8 or bits > 8:
        return _pack_stream(flat, bits)
    c = flat.reshape(rows, -1, 8)
    v = c[..., 0].astype("<u8")
    for k in range(1, 8):
        v |= c[..., k].astype("<u8") << np.uint64(k * bits)
    stream = v.view(np.uint8).reshape(rows, -1, 8)[..., :bits]
    return np.ascontiguousarray(stream).reshape(rows, -1).view("<u4").astype(np.uint32, copy=False)


def _repack_native(blocks: np.ndarray, ggml_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks ``(rows, row_bytes)`` -> MLX affine (group 32) numpy arrays.

    Exact: Q4_0 ``w = d*(q-8)`` -> scale ``d``, bias ``-8d``; Q4_1 ``w = d*q + m`` -> ``(d, m)``;
    Q8_0 ``w = d*q`` (int8) -> code ``q+128``, scale ``d``, bias ``-128d``; Q5_0 ``w = d*(q-16)``
    -> ``(d, -16d)``; Q5_1 ``w = d*q + m`` (formats.md §6.2). Within a Q4/Q5 block, value ``j < 16``
    is the low nibble of ``qs[j]``, ``j + 16`` the high one; Q5's fifth bit of value ``j`` is bit
    ``j`` of the little-endian ``qh`` word.

    Returns:
        ``(weight uint32 (rows, cols*bits/32), scales fp16 (rows, cols/32), biases fp16, bits)``.
    """
    nbytes, bits = _NATIVE_BLOCKS[ggml_type]
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, nbytes)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    if ggml_type == "Q8_0":
        codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint32)
        biases = (d.astype(np.float32) * -128.0).astype(np.float16)
    else:
        off = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[ggml_type]
        qs = b[..., off : off + 16]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint32)
        if bits == 5:
            qh = b[..., off - 4 : off].copy().view("<u4")[..., 0]
            codes |= ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4
        if ggml_type in ("Q4_0", "Q5_0"):
            biases = (d.astype(np.float32) * -(1 << (bits - 1))).astype(np.float16)
        else:
            biases = b[..., 2:4].copy().view(np.float16)[..., 0]
    return _pack(codes, bits), d, biases, bits


def _repack_k(blocks: np.ndarray, ggml_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q4_K/Q5_K super-blocks ``(rows, row_bytes)`` -> MLX affine (group 32) numpy arrays.

    Layout (ggml-common.h ``block_q4_K``/``block_q5_K``, mirrored from gguf-py ``quants.py``
    ``Q4_K``/``Q5_K.dequantize_blocks``; formats.md §6.2): per 256 values, fp16 ``d`` and
    ``dmin``, 12 bytes of eight 6-bit ``(sc, m)`` pairs, [Q5_K: ``qh[32]``,] ``qs[128]``.
    Sub-block ``2k`` holds the low nibbles of ``qs[32k:32k+32]``, ``2k+1`` the high ones; Q5_K's
    fifth bit of value ``i`` of sub-block ``j`` is bit ``j`` of ``qh[i]``. ``w = d*sc*q - dmin*m``
    is MLX affine with group 32, scale ``d*sc``, bias ``-dmin*m``.

    Returns:
        ``(weight uint32 (rows, cols*bits/32), scales float32 (rows, cols/32), biases float32, bits)``.
        The scales and biases are computed in float32 exactly as gguf-py does, and
        ``d*sc*q`` (at most 22 significant bits) is exact in float32, so ``mx.dequantize``
        in float32 reproduces ``gguf.quants.dequantize`` bit for bit (FMA or not);
        ``d*sc`` has up to 17 significant bits, so casting them to float16 (or bfloat16)
        rounds them (relative error up to 2**-11, resp. 2**-8).
    """
    nbytes, bits = _K_BLOCKS[ggml_type]
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, nbytes)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # (rows, nb, 1)
    dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc6 = b[..., 4:16]
    lo, hi, mix = sc6[..., 0:4], sc6[..., 4:8], sc6[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scales = d * sc.astype(np.float32)  # (rows, nb, 8)
    biases = -(dmin * m.astype(np.float32))
    qs = b[..., nbytes - 128 :].reshape(rows, -1, 4, 1, 32)
    codes = (qs >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F  # (rows, nb, 4, 2, 32)
    codes = codes.reshape(rows, -1, 8, 32)
    if bits == 5:
        qh = b[..., 16:48].reshape(rows, -1, 1, 32)
        codes = codes | (((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
    return _pack(codes, bits), scales.reshape(rows, -1), biases.reshape(rows, -1), bits


@dataclass
class GGUFTensor:
    """One GGUF tensor under its mlx-lm name, decoded on demand (data stays memory-mapped).

    Attributes:
        gguf_name: the ggml name (``blk.3.attn_q.weight``).
        name: the mlx-lm name (``model.layers.3.self_attn.q_proj.weight``).
        ggml_type: the GGUF type name (``Q4_1``, ``Q6_K``, ``F32``...).
        shape: the dense shape (GGUF ``ne`` reversed: ``(out, in)`` for a linear).
        data: the raw tensor data as exposed by ``gguf.GGUFReader``.
        unpermute_heads: for llama-arch q/k, the head count whose llama.cpp row
            permutation is undone on every decoded form; otherwise ``None``.
        offset: added to the dense values (``-1`` for Gemma's norm weights, whose ``+1``
            llama.cpp folded in); only :meth:`dense`/:meth:`dense_rows` apply it.
    """

    gguf_name: str
    name: str
    ggml_type: str
    shape: tuple
    data: Any
    type_enum: Any
    unpermute_heads: int | None = None
    offset: float = 0.0

    @property
    def native_bits(self) -> int | None:
        """MLX bits of :meth:`native`'s layout (group size 32): 4 for Q4_0/Q4_1/Q4_K, 5 for
        Q5_0/Q5_1/Q5_K, 8 for Q8_0; ``None`` for types without one (Q6_K, Q2_K, Q3_K, IQ*...)."""
        spec = _NATIVE_BLOCKS.get(self.ggml_type) or _K_BLOCKS.get(self.ggml_type)
        return spec[1] if spec else None

    @property
    def is_native(self) -> bool:
        """True for types with an MLX affine layout at group size 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
        Q4_K, Q5_K): see :meth:`native`."""
        return self.native_bits is not None

    def _rows(self, a: np.ndarray) -> np.ndarray:
        if self.unpermute_heads is None:
            return a
        n = self.unpermute_heads
        rows = a.shape[0]
        return np.ascontiguousarray(a.reshape(n, rows // n // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape))

    def dense(self) -> np.ndarray:
        """float32 values of shape :attr:`shape` (``gguf.quants.dequantize``: correct for every
        type, including the K-quants that ``mx.load`` mis-decodes)."""
        import gguf

        arr = np.asarray(gguf.quants.dequantize(self.data, self.type_enum), dtype=np.float32).reshape(self.shape)
        if self.offset:
            arr = arr + np.float32(self.offset)
        return self._rows(arr)

    def dense_rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows ``r0:r1`` of :meth:`dense` (2-D tensors without a q/k permutation only)."""
        import gguf

        if self.unpermute_heads is not None or len(self.shape) != 2:
            raise GGUFError(f"{self.gguf_name}: row slices need a 2-D tensor without the q/k permutation")
        data = np.asarray(self.data).reshape(self.shape[0], -1)[r0:r1]
        arr = np.asarray(gguf.quants.dequantize(data, self.type_enum), dtype=np.float32).reshape(r1 - r0, self.shape[1])
        return arr + np.float32(self.offset) if self.offset else arr

    def native(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The MLX affine form (group size 32, no requantization) of a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
        or Q4_K/Q5_K tensor, rows un-permuted like :meth:`dense`.

        Returns:
            ``(weight, scales, biases, bits)``: ``weight`` uint32 ``(*shape[:-1], shape[-1]*bits/32)``,
            ``scales``/``biases`` ``(*shape[:-1], shape[-1]/32)``. They are the block fields
            themselves (float16, exact) for the 32-value block types, and float32 for Q4_K/Q5_K
            (``d*sc`` and ``-dmin*m``; ``mx.dequantize`` in float32 then equals
            ``gguf.quants.dequantize`` exactly, while a cast to float16/bfloat16 rounds them).

        Raises:
            GGUFError: another type.
        """
        if not self.is_native or self.offset:
            raise GGUFError(f"{self.gguf_name}: {self.ggml_type} has no MLX affine layout"
                            + (" (its values need an offset)" if self.offset else ""))
        rows = int(np.prod(self.shape[:-1]))
        blocks = np.asarray(self.data).reshape(rows, -1)
        repack = _repack_k if self.ggml_type in _K_BLOCKS else _repack_native
        step = max(1, (1 << 22) // max(1, self.shape[-1]))  # ~4 M values at a time: bounded temporaries
        parts = [repack(blocks[r : r + step], self.ggml_type) for r in range(0, rows, step)]
        bits = parts[0][3]
        w, s, b = (np.concatenate([p[i] for p in parts]) for i in range(3))
        w = w.reshape(*self.shape[:-1], -1)
        s = s.reshape(*self.shape[:-1], -1)
        b = b.reshape(*self.shape[:-1], -1)
        return self._rows(w), self._rows(s), self._rows(b), bits


    def packed(self) -> tuple[mx.array, mx.array, mx.array, int, int, bool]:
        """This tensor in MLX affine layout: :meth:`native` where exact, else a requantization of
        :meth:`dense` per :data:`REQUANTIZED` (Q6_K -> 8-bit, group 32, ``mx.quantize``).

        Returns:
            ``(weight uint32, scales, biases, bits, group_size, exact)``; shapes as in
            :meth:`native`; scales/biases float16 for the 32-value block types, float32 otherwise.

        Raises:
            GGUFError: a type with neither (F32, Q2_K, IQ*...), or a tensor with an offset.
        """
        if self.is_native:
            w, s, b, bits = self.native()
            return mx.array(w), mx.array(s), mx.array(b), bits, 32, True
        if self.ggml_type not in REQUANTIZED or self.offset or len(self.shape) < 2:
            raise GGUFError(f"{self.gguf_name}: {self.ggml_type} has no MLX affine layout")
        bits, gs = REQUANTIZED[self.ggml_type]
        if self.shape[-1] % gs:
            raise GGUFError(f"{self.gguf_name}: {self.shape[-1]} columns are not a multiple of {gs}")
        w, s, b = mx.quantize(mx.array(self.dense()), group_size=gs, bits=bits)
        return w, s, b, bits, gs, False

    @property
    def packable(self) -> bool:
        """True if :meth:`packed` accepts this tensor (exact layout, or a requantized type)."""
        return (self.is_native and not self.offset) or (
            self.ggml_type in REQUANTIZED and not self.offset and len(self.shape) >= 2
            and self.shape[-1] % REQUANTIZED[self.ggml_type][1] == 0)


def gguf_tensors(h: GGUFHeader, cfg: dict | None = None) -> dict[str, GGUFTensor]:
    """All tensors of a GGUF file under their mlx-lm names (nothing decoded yet).

    The llama architecture's q/k row permutation is recorded on the q/k tensors
    and undone by :meth:`GGUFTensor.dense` / :meth:`GGUFTensor.native`.

    Raises:
        GGUFError: tensors with unknown names (nothing is dropped silently; only
            ``rope_freqs``, derivable from the config, is skipped).
    """
    cfg = cfg or gguf_model_config(h)
    reader = h.reader if h.reader is not None else GGUFFile(h.path)
    out: dict[str, GGUFTensor] = {}
    unknown = []
    for t in reader.tensors:
        new = _mlx_name(t.name, h.arch)
        if new is None:
            if not t.name.startswith("rope_freqs"):
                unknown.append(t.name)
            continue
        heads = None
        if h.arch == "llama":
            if ".self_attn.q_proj." in new:
                heads = int(cfg["num_attention_heads"])
            elif ".self_attn.k_proj." in new:
                heads = int(cfg["num_key_value_heads"])
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        offset = -_NORM_SHIFT.get(h.arch, 0.0) if t.name.endswith("norm.weight") else 0.0
        out[new] = GGUFTensor(t.name, new, t.tensor_type.name, shape, t.data, t.tensor_type, heads, offset)
    if unknown:
        raise GGUFError(f"{h.path.name}: unexpected tensors {unknown[:5]} (and {max(0, len(unknown) - 5)} more)")
    return out


def _unpermute_mx(w: mx.array, n_head: int) -> mx.array:
    """Inverse of llama.cpp's q/k ``permute`` over the row axis (mx arrays; see :class:`GGUFTensor`)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_tensors(h: GGUFHeader, cfg: dict, dequantize: bool = False) -> tuple[dict[str, mx.array], dict[str, dict]]:
    """Return (mlx-lm named weights, per-module quantization settings ``{"group_size", "bits"}``).

    Files whose tensors are all F32/F16/Q4_0/Q4_1/Q8_0 are read with ``mx.load`` (MLX's own exact
    GGUF decoding, natively quantized; MLX >= 0.32.0). Any other file is decoded tensor by tensor:
    2-D weights of a packable type (:attr:`GGUFTensor.packable`) in MLX affine layout
    (:meth:`GGUFTensor.packed`), everything else with ``gguf.quants.dequantize``; with
    ``dequantize`` every tensor of such a file is dense.
    """
    tensors = gguf_tensors(h, cfg)
    native = all(t.ggml_type in _MX_NATIVE_TYPES and not t.offset for t in tensors.values())
    weights: dict[str, mx.array] = {}
    quant: dict[str, dict] = {}
    if native:
        raw = mx.load(str(h.path))
        for t in tensors.values():
            base = t.gguf_name[: -len(".weight")] if t.gguf_name.endswith(".weight") else t.gguf_name
            module = t.name[: -len(".weight")] if t.name.endswith(".weight") else t.name
            parts = {"weight": raw[t.gguf_name]}
            if t.is_native:
                parts.update(scales=raw[f"{base}.scales"], biases=raw[f"{base}.biases"])
                bits = (parts["weight"].shape[-1] * 32) // (parts["scales"].shape[-1] * 32)
                quant[module] = {"group_size": 32, "bits": int(bits)}
            for suffix, arr in parts.items():
                if t.unpermute_heads is not None:
                    arr = _unpermute_mx(arr, t.unpermute_heads)
                weights[t.name if suffix == "weight" else f"{module}.{suffix}"] = arr
        return weights, quant
    for name, t in tensors.items():
        if not dequantize and name.endswith(".weight") and len(t.shape) == 2 and t.packable:
            module = name[: -len(".weight")]
            w, sc, bi, bits, gs, _ = t.packed()
            mx.eval(w, sc, bi)  # one tensor's temporaries at a time
            weights.update({name: w, f"{module}.scales": sc, f"{module}.biases": bi})
            quant[module] = {"group_size": gs, "bits": bits}
        else:
            weights[name] = mx.array(t.dense())
    return weights, quant


def load_gguf(path: str | Path, dtype: mx.Dtype | None = None, dequantize: bool = False):
    """Load a GGUF file as an mlx-lm model and tokenizer.

    Args:
        path: the ``.gguf`` file.
        dtype: floating dtype for non-packed parameters and quantization
            scales/biases (e.g. ``mx.float32`` on CPU, ``mx.float16`` on GPU).
            ``None`` keeps the file's own dtypes (float16 scales for the 32-value block
            types, float32 for Q4_K/Q5_K and the requantized Q6_K; float16 or bfloat16 rounds
            the K-quant scales ``d*sc`` by up to 2**-11 resp. 2**-8 relative).
        dequantize: dense weights of ``dtype`` everywhere (``gguf.quants.dequantize``'s values;
            for an all-Q4_0/Q4_1/Q8_0 file ``mx.dequantize`` of its exact packing) instead of
            packed layers.

    Returns:
        ``(model, tokenizer, config)``: an ``mlx_lm.models.<arch>.Model`` (``gemma3``:
        ``gemma3_text``) whose linear and embedding layers are ``QuantizedLinear`` /
        ``QuantizedEmbedding`` with each layer's own bits (4 for Q4_x/Q4_K, 5 for Q5_x/Q5_K,
        8 for Q8_0 and the Q6_K requantized to 8 bits) at group size 32 (see the module doc),
        an ``mlx_lm`` ``TokenizerWrapper`` and the mlx-lm config dict, whose ``"quantization"``
        maps each packed module path to its ``{"group_size", "bits"}`` (absent when nothing is
        packed).

    Raises:
        FileNotFoundError, GGUFError: missing, malformed or unsupported file.
    """
    import importlib

    h = read_gguf_header(path)
    cfg = gguf_model_config(h)
    module = importlib.import_module(f"mlx_lm.models.{_MLX_MODULE[h.arch]}")
    args = module.ModelArgs.from_dict(cfg)
    model = module.Model(args)
    weights, quant = _load_tensors(h, cfg, dequantize=dequantize)

    if cfg["tie_word_embeddings"]:
        for k in [k for k in weights if k.startswith("lm_head.")]:
            weights.pop(k)
        if h.arch == "gemma3":  # its Model always builds an lm_head; sanitize drops it when tied
            weights = model.sanitize(weights)

    if dtype is not None:
        weights = {
            k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()
        }

    if quant:
        nn.quantize(model, class_predicate=lambda p, m: quant.get(p, False))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise GGUFError(f"{h.path.name}: tensors do not match the {h.arch} architecture: {e}") from e
    if quant and dequantize:  # an all-Q4_0/Q4_1/Q8_0 file, read packed with mx.load
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        if dtype is not None:
            model.update(tree_map(lambda v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v,
                                  model.parameters()))
        quant = {}
    mx.eval(model.parameters())
    model.eval()
    if quant:
        cfg["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
        cfg["quantization"].update({k: v for k, v in quant.items()})
    tokenizer = build_tokenizer(h)
    return model, tokenizer, cfg


# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------


def _eos_ids(h: GGUFHeader, tokens: list[str], token_types: list[int]) -> list[int]:
    """EOS id, then the end-of-turn id: ``tokenizer.ggml.eot_token_id``, or else a control token
    ``<end_of_turn>`` (Gemma's, which its GGUFs do not mark; HF's generation config stops on it)."""
    md = h.metadata
    ids = [int(md["tokenizer.ggml.eos_token_id"])] if "tokenizer.ggml.eos_token_id" in md else []
    eot = md.get("tokenizer.ggml.eot_token_id")
    if eot is None and "<end_of_turn>" in tokens:
        i = tokens.index("<end_of_turn>")
        eot = i if token_types[i] == 3 else None
    if eot is not None and int(eot) not in ids:
        ids.append(int(eot))
    return ids


def spm_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece-BPE's score-driven merging.

    SentencePiece merges, at each step, the adjacent pair whose concatenation is the
    highest-scoring *normal* piece (type 1). As HF merges: every split ``(l, r)`` of a normal
    piece into two normal pieces, ranked by the merged piece's score (descending), then its id
    (what ``transformers``' ``SpmConverter`` does for a SentencePiece BPE model).
    """
    normal = {t: (float(sc), i) for i, (t, sc, tt) in enumerate(zip(tokens, scores, token_types)) if int(tt) == 1}
    ranked = []
    for tok, (score, i) in normal.items():
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in normal and right in normal:
                ranked.append((-score, i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _build_spm_tokenizer(h: GGUFHeader):
    """SentencePiece BPE (``tokenizer.ggml.model == "llama"``: tokens, scores, token types, no
    merges; Gemma 3) as an HF ``tokenizers`` BPE, matching Gemma's own ``tokenizer.json``:

    * normalizer: ``" "`` -> ``"▁"`` (a dummy ``"▁"`` prefix only if ``add_space_prefix``);
    * model: BPE over all tokens, merges from the scores (:func:`spm_merges`), byte fallback to
      the ``<0xNN>`` tokens, ``<unk>`` otherwise;
    * control (type 3) tokens are special added tokens, user-defined (type 4: Gemma's runs of
      newlines / spaces / tabs and HTML tags) are non-special added tokens, both matched whole
      on the raw text, as SentencePiece's prefix matcher does;
    * decoder: ``"▁"`` -> ``" "``, byte fallback, fuse; BOS prepended if ``add_bos_token``.
    """
    import functools

    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    md = h.metadata
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    scores = md.get("tokenizer.ggml.scores")
    if scores is None:
        raise GGUFError(f"{h.path.name}: SentencePiece tokenizer without tokenizer.ggml.scores")
    scores = [float(x) for x in scores]
    token_types = [int(x) for x in (md.get("tokenizer.ggml.token_type") or [1] * len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{h.path.name}: duplicate tokens in the SentencePiece vocabulary")

    def tok(key):
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    unk = tok("unknown") or ("<unk>" if "<unk>" in vocab else None)
    byte_fallback = any(tt == 6 for tt in token_types)
    bpe = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores, token_types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=byte_fallback,
    )
    tk = Tokenizer(bpe)
    norm = [normalizers.Replace(" ", "▁")]
    add_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", False))
    if add_prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tk.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(content=" ", left=1))
    tk.decoder = decoders.Sequence(dec)
    tk.add_tokens(
        [AddedToken(t, special=(tt == 3), normalized=False) for t, tt in zip(tokens, token_types) if tt in (3, 4)]
    )
    bos, eos = tok("bos"), tok("eos")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=tok("padding"),
        chat_template=md.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        # transformers builds the BOS post-processor from this flag
        add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", False)) and bos is not None,
        add_eos_token=False,
    )
    detok = functools.partial(SPMStreamingDetokenizer, trim_space=add_prefix)
    return TokenizerWrapper(hf, detokenizer_class=detok, eos_token_ids=_eos_ids(h, tokens, token_types))


def build_tokenizer(h: GGUFHeader):
    """Build an mlx-lm ``TokenizerWrapper`` from GGUF tokenizer metadata.

    Supports byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with the
    pre-tokenizers ``smollm`` (individual digits + GPT-2 regex, as llama.cpp's
    ``LLAMA_VOCAB_PRE_TYPE_SMOLLM``), ``gpt2``/``default`` and ``qwen2``, and
    SentencePiece BPE (``"llama"``, e.g. Gemma 3): see :func:`_build_spm_tokenizer`.

    Raises:
        GGUFError: another tokenizer model or pre-tokenizer.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    md = h.metadata
    kind = md.get("tokenizer.ggml.model")
    if kind == "llama":
        return _build_spm_tokenizer(h)
    if kind != "gpt2":
        raise GGUFError(
            f"{h.path.name}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', SentencePiece 'llama')"
        )
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    merges: list[str] = list(md.get("tokenizer.ggml.merges") or [])
    token_types = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    pre = md.get("tokenizer.ggml.pre", "default")

    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=False,
    )
    tk = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default"):
        tk.pre_tokenizer = byte_level
    elif pre == "qwen2":
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise GGUFError(f"{h.path.name}: pre-tokenizer {pre!r} is not supported (smollm, gpt2, qwen2)")
    tk.decoder = decoders.ByteLevel()
    # token_type 3 = CONTROL, 4 = USER_DEFINED: never split by BPE
    specials = [AddedToken(t, special=(tt == 3), normalized=False) for t, tt in zip(tokens, token_types) if tt in (3, 4)]
    tk.add_tokens(specials)

    def tok(key):
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = tok("bos"), tok("eos")
    if md.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=bos,
        eos_token=eos,
        unk_token=tok("unknown"),
        pad_token=tok("padding"),
        chat_template=md.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    eos_ids = [int(md["tokenizer.ggml.eos_token_id"])] if "tokenizer.ggml.eos_token_id" in md else []
    if "tokenizer.ggml.eot_token_id" in md:
        eos_ids.append(int(md["tokenizer.ggml.eot_token_id"]))
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer, eos_token_ids=eos_ids)
