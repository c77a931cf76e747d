"""The conversion pipeline: detect -> read -> plan -> quantize/repack -> write.

For every format the same steps run:

1. the reader opens the checkpoint lazily (:class:`~.source.SourceModel`);
2. the mlx-lm model class for ``config.json`` is instantiated as a *skeleton*
   (MLX parameters are lazy, so this costs no memory) to learn the expected
   tensor names, shapes and module types;
3. the model's own ``sanitize`` runs on the lazy tensors (HF-style sources), then
   rotary caches and a redundant tied ``lm_head`` are dropped with a note;
   missing / unexpected / mis-shaped tensors are errors;
4. tensors are produced one at a time: each quantizable layer is either repacked
   exactly (GPTQ/AWQ/GGUF where the source layout maps onto MLX affine groups) or
   quantized with ``mx.quantize`` (the same call ``mlx_lm.convert -q`` makes, after
   the same dtype cast, so HF float inputs give bit-identical outputs); each result
   is evaluated, handed to the shard writer and released;
5. config, index and tokenizer files are written; the temporary directory is
   renamed onto the destination.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .errors import ConvertError, CorruptCheckpointError, MissingTensorError, ShapeMismatchError, UnsupportedFormatError
from .mlxq import QSpec, QuantPlan
from .source import Deferred, SourceModel
from .writer import DEFAULT_SHARD_BYTES, AtomicOutput, ShardWriter, write_config

__all__ = ["FORMATS", "ConvertResult", "detect_format", "resolve_input", "convert", "normalize_config"]

FORMATS = ("hf", "gptq", "awq", "gguf", "exl3", "drafter")
DTYPES = ("float16", "bfloat16", "float32")
DRAFTER_ARCHS = ("DFlashDraftModel", "DFlash2DraftModel")


@dataclass
class ConvertResult:
    """What a conversion did.

    Attributes:
        path: the output directory.
        format: the source format.
        tensors: number of tensors written.
        weights: number of weights (logical parameters) written.
        seconds: wall time of the conversion.
        exact: module paths repacked exactly from the source's quantized layout.
        rounded: module paths whose codes were kept but whose scales/biases the output dtype
            rounds (e.g. float16 GGUF scales written as bfloat16, float32 Q4_K scales as float16).
        requantized: module paths quantized with MLX round-to-nearest.
        layer_errors: module path -> relative Frobenius error ``||W_out - W_src|| / ||W_src||``
            against the (dequantized) source, when ``measure_error`` was requested.
        notes: remarks (dropped redundant tensors, dtype decisions...).
    """

    path: Path
    format: str
    tensors: int = 0
    weights: int = 0
    seconds: float = 0.0
    exact: list = field(default_factory=list)
    rounded: list = field(default_factory=list)
    requantized: list = field(default_factory=list)
    layer_errors: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    err_num: float = 0.0
    err_den: float = 0.0

    @property
    def total_error(self) -> float:
        """Relative error over all measured layers: ``sqrt(sum ||dW||^2 / sum ||W||^2)``."""
        return (self.err_num / self.err_den) ** 0.5 if self.err_den else float("nan")


# ----------------------------------------------------------------------------
# Input
# ----------------------------------------------------------------------------


def resolve_input(src: str | Path) -> Path:
    """A local file/directory, or a Hugging Face hub id resolved through ``huggingface_hub``
    (offline when the snapshot is cached; ``HF_HUB_OFFLINE=1`` forbids network access).

    Raises:
        ConvertError: nothing found.
    """
    from mlx_dflash2.loading import ModelNotFoundError, _resolve_local

    try:
        return _resolve_local(str(src))
    except ModelNotFoundError as e:
        raise ConvertError(str(e)) from None


def detect_format(path: Path) -> str:
    """Detect the checkpoint format of ``path``.

    Rules: a ``.gguf`` file (or a directory holding exactly one) is GGUF; otherwise
    ``config.json``: ``architectures`` naming a DFlash drafter -> ``drafter``;
    ``quantization_config.quant_method`` gptq/awq/exl3 -> that; no quantization
    config (and no ``quantize_config.json``/``quant_config.json``) -> ``hf``.

    Raises:
        UnsupportedFormatError: a quantization method the converter cannot read (named),
            or an MLX checkpoint (already converted).
        CorruptCheckpointError: no config.json / invalid JSON.
    """
    from .hf import read_config

    path = Path(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf"
        raise UnsupportedFormatError(f"{path}: a single input file must be a .gguf; pass checkpoint directories")
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs and not (path / "config.json").exists():
        if len(ggufs) > 1:
            raise UnsupportedFormatError(f"{path}: holds several .gguf files; pass one of them")
        return "gguf"
    cfg = read_config(path)
    if any(a in DRAFTER_ARCHS for a in (cfg.get("architectures") or [])):
        return "drafter"
    if "quantization" in cfg:
        raise UnsupportedFormatError(f"{path}: config.json has an MLX 'quantization' block; it is already an MLX model")
    qc = cfg.get("quantization_config")
    if qc is None:
        if (path / "quantize_config.json").is_file():
            return "gptq"
        if (path / "quant_config.json").is_file():
            return "awq"
        return "hf"
    if not isinstance(qc, dict):
        raise CorruptCheckpointError(f"{path}/config.json: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if method in ("gptq", "awq", "exl3"):
        return method
    raise UnsupportedFormatError(
        f"{path}: quantization method {method or '(none given)'!r} is not supported "
        "(readable: gptq, awq, exl3, GGUF files and float checkpoints)"
    )


def _reader(fmt: str):
    if fmt == "hf":
        from .hf import read_hf

        return read_hf
    if fmt == "gptq":
        from .gptq import read_gptq

        return read_gptq
    if fmt == "awq":
        from .gptq import read_awq

        return read_awq
    if fmt == "gguf":
        from .ggufsrc import read_gguf

        return read_gguf
    if fmt == "exl3":
        from .exl3 import read_exl3

        return read_exl3
    raise UnsupportedFormatError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


def _layout_notes(plan: QuantPlan, native: dict, requantized: list, quantizable: list, notes: list,
                  drafter: bool = False) -> None:
    """Notes on the quantization decisions: layers that had an exact source layout (GPTQ/AWQ
    groups, GGUF blocks) but were requantized, and ``--q-override`` patterns matching no layer."""
    redone = [p for p in requantized if p in native]
    if redone:
        kinds: dict[str, int] = {}
        for p in redone:
            k = f"{native[p].bits}-bit g{native[p].group_size}"
            kinds[k] = kinds.get(k, 0) + 1
        how = "; --q-override named them" if plan.keep_source_layout else f"; {plan.requantize_reason}"
        notes.append(
            f"{len(redone)} layers with an exact source layout ("
            + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
            + f") are requantized (a second rounding, which adds error){how}"
        )
    for rx, _ in plan.overrides:
        if not any(rx.search(p) for p in quantizable):
            if drafter:
                hint = (" (the selector's codebooks: --codebook-bits)" if "codebook" in rx.pattern
                        else " (a drafter has no embedding or LM head of its own)"
                        if re.search(r"lm_head|embed", rx.pattern) else "")
            else:
                hint = " (the head of a tied model is embed_tokens)" if "lm_head" in rx.pattern else ""
            notes.append(f"--q-override {rx.pattern!r} matches no quantizable layer{hint}")


def normalize_config(cfg: dict, weights: dict, notes: list, source=None) -> dict:
    """Make rope and embedding-tying settings explicit for mlx-lm.

    * RoPE: :func:`mlx_dflash2.modelconfig.normalize_rope` (the runtime loader's own
      normalisation): ``rope_parameters`` (transformers >= 5) becomes explicit
      ``rope_theta`` / ``rope_scaling`` with transformers' defaults filled in (several
      mlx-lm model classes read only those and would silently fall back to a default
      theta and no scaling); an unknown ``rope_type`` or a disagreement is an error.
    * ``tie_word_embeddings`` missing: decided from the presence of ``lm_head.*``
      tensors (mlx-lm's default of ``True`` would silently drop a real head).

    Raises:
        ConvertError: an invalid, unsupported or contradictory rope setting (names the field).
    """
    from mlx_dflash2.modelconfig import ModelConfigError, normalize_rope

    try:
        cfg = normalize_rope(cfg)
    except ModelConfigError as e:
        raise ConvertError(f"{source or 'config.json'}: config field {e.field!r}: {e.detail}") from None
    if "tie_word_embeddings" not in cfg:
        has_head = any(k.startswith("lm_head.") for k in weights)
        cfg["tie_word_embeddings"] = not has_head
        notes.append(f"config had no tie_word_embeddings; set to {not has_head} (lm_head tensors {'present' if has_head else 'absent'})")
    return cfg


def _cpu_only() -> bool:
    """True when MLX computes on its CPU backend (no Metal or CUDA device as the default)."""
    return mx.default_device() == mx.cpu


def _window_note(cfg: dict, model, notes: list) -> None:
    """A note when the config's sliding window changes the model but mlx-lm's class builds no
    sliding layers (e.g. ``mistral`` without ``layer_types``): mlx-lm will run full attention."""
    from mlx_dflash2.modelconfig import ModelConfigError, sliding_window_layers

    try:
        window, layers = sliding_window_layers(cfg)
    except ModelConfigError:
        return
    inner = getattr(model, "model", model)
    if layers and not any(getattr(l, "use_sliding", False) for l in getattr(inner, "layers", [])):
        notes.append(
            f"config.json sets sliding_window={window} on {len(layers)} layers, which mlx-lm's "
            f"{cfg.get('model_type')} class runs as full attention (a different model past {window} tokens); "
            "mlx_dflash2.load refuses such a target"
        )


def _resolve_dtype(dtype: str | None, source: SourceModel, cfg: dict) -> mx.Dtype | None:
    if dtype is None:
        dtype = source.default_dtype
    if dtype is None:  # mlx_lm.convert's rule
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("dtype")
    if dtype is None:
        return None
    if dtype not in DTYPES:
        if source.format == "hf":
            return None
        raise ConvertError(f"--dtype {dtype!r}: choose one of {DTYPES}")
    return getattr(mx, dtype)


# ----------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------


def _values(v) -> mx.array:
    return v.load() if isinstance(v, Deferred) else v


def _measure(result: ConvertResult, module: str, ref: mx.array, got: mx.array) -> None:
    ref = ref.astype(mx.float32)
    d = mx.sum(mx.square(got.astype(mx.float32) - ref))
    n = mx.sum(mx.square(ref))
    d, n = float(d.item()), float(n.item())
    result.layer_errors[module] = (d / n) ** 0.5 if n else 0.0
    result.err_num += d
    result.err_den += n


CHUNK_ELEMENTS = 1 << 22  # decoded float32 values held at once when quantizing a large tensor in row chunks


def _chunkable(v) -> bool:
    return isinstance(v, Deferred) and v.load_rows is not None and len(v.shape) == 2 and math.prod(v.shape) > CHUNK_ELEMENTS


def _quantize_chunked(v: Deferred, spec: QSpec, dtype, result: ConvertResult | None, module: str):
    """Quantize a large decoded tensor in row chunks (MLX affine groups lie within rows, so the
    result is identical to quantizing it whole); each chunk is evaluated before the next."""
    rows, cols = v.shape
    step = max(v.row_align, (CHUNK_ELEMENTS // cols) // v.row_align * v.row_align)
    parts = []
    num = den = 0.0
    for r0 in range(0, rows, step):
        dense = v.load_rows(r0, min(rows, r0 + step))
        wq, s, b = mx.quantize(dense, spec.group_size, spec.bits)
        if dtype is not None:
            s, b = s.astype(dtype), b.astype(dtype)
        if result is not None:
            got = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), spec.group_size, spec.bits)
            d, n = mx.sum(mx.square(got - dense)), mx.sum(mx.square(dense))
            mx.eval(wq, s, b, d, n)
            num, den = num + float(d.item()), den + float(n.item())
        else:
            mx.eval(wq, s, b)
        parts.append((wq, s, b))
        del dense
        mx.clear_cache()
    if result is not None:
        result.layer_errors[module] = (num / den) ** 0.5 if den else 0.0
        result.err_num += num
        result.err_den += den
    return tuple(mx.concatenate([q[i] for q in parts], axis=0) for i in range(3))


def convert(
    src: str | Path,
    dest: str | Path,
    *,
    from_format: str | None = None,
    quantize: bool = True,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    dtype: str | None = None,
    overrides: list | tuple = (),
    keep_source_layout: bool | None = None,
    overwrite: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
    measure_error: bool = False,
    target: str | None = None,
    codebook_bits: int | None = None,
) -> ConvertResult:
    """Convert a checkpoint to an MLX model directory (or a drafter checkpoint).

    Args:
        src: input file/directory or hub id.
        dest: output directory (must not exist unless ``overwrite``).
        from_format: force the input format (one of :data:`FORMATS`); default: detected.
        quantize: write MLX affine quantized layers (False: a float checkpoint in ``dtype``).
        q_bits, q_group_size: the MLX affine spec of layers that get one (``None``: 4 bits,
            groups of 64). Passing either asks for that layout: unless ``keep_source_layout``
            is True, layers whose source layout differs are requantized to it (a note says
            how many); layers that map exactly (e.g. GPTQ g128 -> g64) stay exact.
        dtype: float dtype of unquantized tensors and of scales/biases (``float16``,
            ``bfloat16``, ``float32``). Default: the source config's ``torch_dtype`` as
            ``mlx_lm.convert`` does for float sources; the scale dtype of GPTQ/AWQ sources;
            float16 for GGUF and EXL3. On a CPU-only MLX a half-precision default gets a note
            recommending float32 (mlx-lm's CPU backend is ~30x slower in float16).
        overrides: ``(regex, (bits, group) | None)`` per-layer overrides
            (:func:`~.mlxq.parse_override`), e.g. keep embeddings / LM head at 8 bits.
        keep_source_layout: keep the source's own exact group layout where one exists
            (GPTQ/AWQ groups; GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K as 32-groups, K-quant
            scales exact in float32 only; GGUF Q6_K as 8-bit g32, near-lossless); the
            ``q_bits``/``q_group_size`` spec then applies to the other layers only.
            ``None`` (default): keep it unless ``q_bits``/``q_group_size`` are given.
            ``False`` (``--requantize``): every layer takes the ``q_bits``/``q_group_size``
            spec, exact where the source maps onto it, requantized otherwise.
        overwrite: replace an existing ``dest``.
        shard_bytes: maximum shard size in bytes.
        progress: show a tqdm progress bar.
        measure_error: compute each quantized layer's relative error against the
            dequantized source (extra time; reported in the result).
        target: drafters only: a target model to validate the drafter against.
        codebook_bits: DFlash2 drafters only: quantize the selector's codebooks at 4 or 8 bits, ``0``: float,
            ``None``: as the source stores them (:func:`~.drafter.convert_drafter`).

    Returns:
        :class:`ConvertResult`.

    Raises:
        OutputExistsError, UnsupportedFormatError, CorruptCheckpointError,
        MissingTensorError, ShapeMismatchError, ConvertError: nothing is written then.
    """
    t0 = time.perf_counter()
    out = AtomicOutput(dest, overwrite)
    out.check()  # refuse before any expensive work
    path = resolve_input(src)
    if overwrite and Path(path).resolve() != out.dest.resolve() and out.dest.resolve() in Path(path).resolve().parents:
        raise ConvertError(f"{dest} contains the source {src}: --overwrite would delete the source with it "
                           "(choose another DEST)")
    fmt = from_format or detect_format(path)
    if fmt not in FORMATS:
        raise UnsupportedFormatError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    explicit = q_bits is not None or q_group_size is not None
    if keep_source_layout is None:
        keep_source_layout = not explicit
        reason = "--q-bits/--q-group-size ask for that layout; without them the source layout is kept"
    else:
        reason = "--requantize asked for it; without it the source layout is kept"
    spec = QSpec(4 if q_bits is None else q_bits, 64 if q_group_size is None else q_group_size)
    plan = QuantPlan(spec if quantize else None, list(overrides), keep_source_layout, reason)
    if fmt == "drafter":
        from .drafter import convert_drafter

        return convert_drafter(path, out, plan, dtype=dtype, target=target, progress=progress, t0=t0,
                               codebook_bits=codebook_bits, measure_error=measure_error)
    if target is not None:
        raise ConvertError("target= (--target) validates drafter conversions only")
    if codebook_bits is not None:
        raise ConvertError("codebook_bits= (--codebook-bits) applies to DFlash2 drafters only")
    source = _reader(fmt)(path)
    with out as tmp:
        result = _convert_model(source, tmp, plan, dtype, shard_bytes, progress, measure_error)
    result.path = out.dest
    result.seconds = time.perf_counter() - t0
    return result


def _convert_model(
    source: SourceModel,
    tmp: Path,
    plan: QuantPlan,
    dtype_name: str | None,
    shard_bytes: int,
    progress: bool,
    measure_error: bool,
) -> ConvertResult:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from tqdm import tqdm

    result = ConvertResult(tmp, source.format, notes=list(source.notes))
    cfg = normalize_config(source.config, source.weights, result.notes, source.path / "config.json" if source.path.is_dir() else source.path)
    try:
        model_class, args_class = _get_classes(cfg)
    except (ValueError, KeyError) as e:
        raise UnsupportedFormatError(f"{source.path}: architecture not supported by mlx-lm ({e})") from e
    try:
        model = model_class(args_class.from_dict(cfg))
    except Exception as e:
        raise CorruptCheckpointError(f"{source.path}/config.json: cannot build the model ({type(e).__name__}: {e})") from e
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    _window_note(cfg, model, result.notes)
    if source.bind is not None:
        source.bind(expected)

    # take the tensors out of the source so that each one is freed once written
    weights = dict(source.weights)
    source.weights.clear()
    packed_fns = dict(source.packed)
    exact_capable = {p: sp for p, sp in source.native.items() if p in packed_fns}  # Q6_K etc. are never exact
    source.packed.clear()
    tied = bool(cfg.get("tie_word_embeddings", False))
    redundant_head = sorted(k for k in weights if k.startswith("lm_head.") and k not in expected) if tied else []
    if hasattr(model, "sanitize") and all(isinstance(v, mx.array) for v in weights.values()):
        try:
            weights = model.sanitize(weights)
        except Exception as e:
            raise CorruptCheckpointError(f"{source.path}: the model's sanitize() failed ({type(e).__name__}: {e})") from e
    for k in [k for k in weights if k.endswith("rotary_emb.inv_freq")]:
        weights.pop(k)
    if redundant_head:
        for k in redundant_head:
            weights.pop(k, None)
        result.notes.append(
            f"dropped redundant {redundant_head} (tie_word_embeddings is true: the head is the embedding)"
        )
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise MissingTensorError(f"{source.path}: missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    if unexpected:
        raise MissingTensorError(
            f"{source.path}: tensors unknown to {cfg.get('model_type')}: {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"
        )
    for k, shape in expected.items():
        got = tuple(weights[k].shape)
        if got != shape:
            raise ShapeMismatchError(f"{source.path}: tensor {k} has shape {got}, expected {shape}")

    dtype = _resolve_dtype(dtype_name, source, cfg)
    if dtype_name is None and dtype in (mx.float16, mx.bfloat16) and _cpu_only():
        result.notes.append(
            f"this MLX runs on the CPU (no GPU backend) and the output is {str(dtype).split('.')[-1]}, which MLX's "
            "CPU backend computes far more slowly than float32 (SmolLM2-135M in mlx_lm: 6.7 s per token in "
            "float16, 0.2 s in float32): for CPU use convert with --dtype float32 (mlx_dflash2.load casts to "
            "float32 on the CPU by itself)"
        )
    cast_predicate = getattr(model, "cast_predicate", lambda _k: True)
    quant_predicate = getattr(model, "quant_predicate", None)
    modules = dict(model.named_modules())

    def cast(name, v):
        if dtype is not None and cast_predicate(name) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    # decide per module
    specs: dict[str, QSpec] = {}
    quantizable: list[str] = []
    for name in expected:
        if not name.endswith(".weight"):
            continue
        p = name[: -len(".weight")]
        m = modules.get(p)
        if m is None or not hasattr(m, "to_quantized") or plan.default is None and not plan.overrides:
            continue
        if len(expected[name]) < 2:
            continue
        quantizable.append(p)
        choice = quant_predicate(p, m) if quant_predicate is not None else True
        spec, overridden = plan.spec_for(p, expected[name][-1], choice)
        if spec is None:
            continue
        if plan.keep_source_layout and not overridden and p in source.native:
            spec = source.native[p]
        specs[p] = spec

    writer = ShardWriter(tmp, shard_bytes)
    qconfig: dict = {}
    if plan.default is not None:
        qconfig.update(plan.default.as_dict())
    bar = tqdm(total=len(expected), unit="tensor", disable=not progress, desc=f"convert {source.format}")
    try:
        for name in expected:
            p = name[: -len(".weight")] if name.endswith(".weight") else None
            if p is not None and p in specs:
                spec = specs[p]
                packed = None
                fn = packed_fns.pop(p, None)
                if fn is not None:
                    packed = fn(spec)
                dense_ref = None
                if packed is not None:
                    packed, lossless = packed.cast(dtype)
                    wq, scales, biases = packed.weight, packed.scales, packed.biases
                    (result.exact if lossless else result.rounded).append(p)
                elif _chunkable(weights[name]):
                    wq, scales, biases = _quantize_chunked(weights[name], spec, dtype, result if measure_error else None, p)
                    result.requantized.append(p)
                else:
                    v = weights[name]
                    dense = _values(v)
                    if name not in source.dequantized and not isinstance(v, Deferred):
                        dense = cast(name, dense)
                    wq, scales, biases = mx.quantize(dense, spec.group_size, spec.bits)
                    if dtype is not None:
                        scales, biases = scales.astype(dtype), biases.astype(dtype)
                    elif scales.dtype != dense.dtype:
                        scales, biases = scales.astype(dense.dtype), biases.astype(dense.dtype)
                    result.requantized.append(p)
                    dense_ref = dense if measure_error else None
                if measure_error and p not in result.layer_errors:
                    if dense_ref is None:
                        dense_ref = _values(weights[name])
                    f32 = mx.float32
                    got = mx.dequantize(wq, scales.astype(f32), biases.astype(f32), spec.group_size, spec.bits)
                    _measure(result, p, dense_ref, got)
                writer.add(name, wq, logical_params=math.prod(expected[name]))
                writer.add(f"{p}.scales", scales, logical_params=0)
                writer.add(f"{p}.biases", biases, logical_params=0)
                if spec != plan.default:
                    qconfig[p] = spec.as_dict()
                del dense_ref
            else:
                v = weights[name]
                arr = _values(v)
                if name in source.dequantized or isinstance(v, Deferred):
                    if dtype is not None and mx.issubdtype(arr.dtype, mx.floating):
                        arr = arr.astype(dtype)
                else:
                    arr = cast(name, arr)
                writer.add(name, arr)
            weights.pop(name, None)
            if p is not None:
                packed_fns.pop(p, None)
            bar.update(1)
        writer.close()
        _layout_notes(plan, exact_capable, result.requantized, quantizable, result.notes)
    finally:
        bar.close()
    result.tensors = sum(len(k) for _, k in writer.files)
    result.weights = writer.total_params

    out_cfg = dict(cfg)
    out_cfg.pop("quantization_config", None)
    if qconfig:
        out_cfg["quantization"] = qconfig
    if dtype is not None:
        out_cfg["torch_dtype"] = str(dtype).split(".")[-1]
    out_cfg["mlx_dflash2_convert"] = {
        "source_format": source.format,
        "source_quantization_config": source.source_quantization,
        "exact_layers": len(result.exact),
        "rounded_layers": len(result.rounded),
        "requantized_layers": len(result.requantized),
        "notes": result.notes,
    }
    write_config(out_cfg, tmp / "config.json")
    for f in source.copy_files:
        shutil.copy(f, tmp / f.name)
    if source.tokenizer is not None:
        source.tokenizer.save_pretrained(str(tmp))
    return result
