"""DFlash / DFlash2 drafter checkpoints -> this project's drafter format.

Input: a published-style drafter directory (``config.json`` with
``architectures: ["DFlashDraftModel" | "DFlash2DraftModel"]`` and
``dflash_config``; safetensors with the reference tensor names, optionally
prefixed ``model.``; DFlash2 selector codebooks with or without ``.weight``;
spec §1.7, §5.3, §5.6; a ``draft_vocab.json`` is read, checked and carried over). Output: a directory
:func:`mlx_dflash2.drafter.load_drafter` accepts: the canonical ``config.json``
(:meth:`DrafterConfig.to_dict`, keeping ``mask_token_id``, ``target_layer_ids``,
``block_size``, ``num_target_layers`` and the DFlash2 conv/selector/logit fields)
plus ``model.safetensors``; in bf16/fp16/fp32 or with the linear layers MLX-quantized
(one spec for all of them, the ``quantization`` block ``load_drafter`` reads) while
norms, conv base kernels and selector codebooks, and so the activations, stay in
the float dtype.

GPTQ- and AWQ-packed drafters (a ``quantization_config`` in ``config.json``, as
community int4 drafters have) are read by the model converter's own readers
(:func:`~.gptq.read_gptq`, :func:`~.gptq.read_awq`): layers with a trivial group map
are repacked exactly (their own group size when MLX has it and it divides every
quantized layer, else 4-bit g64 by repeating scales), act-order layers are
dequantized through ``g_idx`` and quantized with MLX round-to-nearest. Any other
quantization method is refused, naming it. An MLX-quantized drafter (``quantization`` in ``config.json``: this
converter's or ``save_drafter``'s output, the shipped drafters) is a source too: to the same spec its layers are
kept as stored, to another they are expanded and quantized again (a note says so), so e.g. the shipped drafter
takes ``--codebook-bits`` directly.

Missing or invalid fields are an error naming the field, never a silent default
(known-bugs row 13): the config goes through :class:`DrafterConfig` validation,
and additionally ``mask_token_id`` must be inside ``vocab_size`` and the tap ids
inside ``num_target_layers`` (when given), and with ``target`` the whole
:func:`validate_for_target` check runs (mask not EOS/BOS/pad, hidden size, taps).
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_dflash2.drafter.config import DRAFTER_QUANT_METHODS, drafter_quant_method
from mlx_dflash2.drafter.io import (
    CODEBOOKS,
    DRAFT_VOCAB_FILE,
    DrafterLoadError,
    _remap,
    check_quantized,
    codebook_quantization,
    dequantize_codebooks,
    mlx_quantization,
    read_draft_vocab,
    refuse_unannounced_quantization,
)

from .errors import ConvertError, CorruptCheckpointError, MissingTensorError, ShapeMismatchError, UnsupportedFormatError
from .hf import open_safetensors, read_config
from .mlxq import QSpec, QuantPlan
from .writer import AtomicOutput, ShardWriter

__all__ = ["convert_drafter", "DrafterFieldError", "DRAFTER_QUANT_METHODS", "drafter_quant_method"]



class DrafterFieldError(CorruptCheckpointError):
    """A drafter config field is missing or invalid (``field`` names it)."""

    def __init__(self, path: Path, field: str, message: str):
        super().__init__(f"{path}/config.json: drafter config field {field!r}: {message}")
        self.field = field


def _quantized_source(path: Path, raw: dict):
    """The GPTQ/AWQ reader's :class:`~.source.SourceModel` of a packed drafter, or ``None``.

    Raises:
        UnsupportedFormatError: another quantization method (named).
    """
    method = drafter_quant_method(path, raw)
    if method is None:
        return None
    if method not in DRAFTER_QUANT_METHODS:
        raise UnsupportedFormatError(
            f"{path}: drafter quantization method {method!r} is not supported "
            f"(packed drafters readable: {', '.join(DRAFTER_QUANT_METHODS)}; float drafters)"
        )
    from .gptq import read_awq, read_gptq

    return (read_gptq if method == "gptq" else read_awq)(path)


def _expand_mlx_quantized(path: Path, raw: dict, src: dict) -> tuple[tuple[int, int] | None, dict]:
    """Expand an MLX-quantized drafter's layers (``quantization`` in ``config.json``, ``NAME.weight`` packed with
    ``NAME.scales`` / ``NAME.biases``: what this converter and ``save_drafter`` write) in ``src`` in place, to
    float32, so the drafter converts like a float one (e.g. the shipped drafter with ``--codebook-bits``).

    Returns:
        ``((bits, group_size) or None, {module: (packed weight, scales, biases)})``: the source's spec and its
        layers as stored, which a conversion to the same spec keeps as they are (quantizing the expanded values
        again is a second rounding: 3.5 % relative on the shipped drafter's layers, MLX's grid is zero-aligned).

    Raises:
        DrafterLoadError: a malformed ``quantization`` block, or a layer that is not that spec's layout
            (:func:`~mlx_dflash2.drafter.io.check_quantized`); the caller makes it a CorruptCheckpointError.
    """
    spec = mlx_quantization(raw, path / "config.json")
    if spec is None:
        return None, {}
    bits, group = spec
    orig = {}
    for k in sorted(k for k in src if k.endswith(".scales")):
        mod = k[: -len(".scales")]
        w, s, b = src.get(f"{mod}.weight"), src[k], src.get(f"{mod}.biases")
        check_quantized(mod, w, s, b, bits, group, path)
        # expanded in float32 (the values the codes, scales and biases stand for; MLX computes in the scales' dtype)
        src[f"{mod}.weight"] = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group,
                                             bits=bits)
        del src[k], src[f"{mod}.biases"]
        orig[mod] = (w, s, b)
    return (bits, group), orig


def _module(prefix: str) -> str:
    """A packed layer's module path in the drafter's naming (``model.`` prefix dropped)."""
    return _remap(prefix + ".weight")[: -len(".weight")]


def _drafter_plan(plan: QuantPlan, native: dict, linears: dict) -> QuantPlan:
    """The plan with the source's own spec as the drafter's one spec when the source layout is kept,
    every packed layer shares that spec, and it divides every linear layer's inputs; else ``plan``."""
    specs = set(native.values())
    if not plan.keep_source_layout or plan.default is None or len(specs) != 1:
        return plan
    spec = specs.pop()
    if any(in_dim % spec.group_size for in_dim in linears.values()):
        return plan
    return QuantPlan(spec, plan.overrides, plan.keep_source_layout, plan.requantize_reason)


def convert_drafter(
    path: Path,
    out: AtomicOutput,
    plan: QuantPlan,
    *,
    dtype: str | None = None,
    target: str | None = None,
    progress: bool = True,
    t0: float | None = None,
    codebook_bits: int | None = None,
    measure_error: bool = False,
):
    """Convert a drafter checkpoint directory (see the module doc).

    Args:
        path: the source directory.
        out: the atomic output (destination).
        plan: quantization plan; only its default spec and ``none`` overrides apply (drafter
            checkpoints carry one quantization spec). With ``keep_source_layout``, a GPTQ/AWQ
            drafter's own spec replaces the default where it fits every linear layer.
        dtype: float dtype (default: the source's ``torch_dtype``/``dtype``, else bfloat16).
        target: optional target model (path / hub id / embedded name) to validate against;
            the converted output is then also loaded with ``load_drafter``.
        codebook_bits: MLX-quantize the DFlash2 selector's two codebooks (``[vocab, rank]`` each) at
            these bits (4 or 8; group 32, a row's rank in groups of 32): they are a third of a 4-bit
            drafter for a 152k vocabulary; ``load_drafter`` expands them again
            (:func:`mlx_dflash2.drafter.io.dequantize_codebooks`). ``0`` stores them in ``dtype``;
            ``None``: as the source stores them (float codebooks in ``dtype``, an MLX drafter's
            quantized ones kept bit for bit). Codebooks the source stores quantized at other bits are
            expanded and quantized again (a second rounding; a note says so).
        measure_error: fill the result's ``layer_errors`` (relative Frobenius error of each quantized layer and
            codebook as written, dequantized, against the source's float values: 0 where kept bit for bit from a
            float source's own rounding) and ``total_error``.

    Returns:
        :class:`~.pipeline.ConvertResult`.

    Raises:
        DrafterFieldError, MissingTensorError, ShapeMismatchError, CorruptCheckpointError,
        UnsupportedFormatError (a quantization method other than GPTQ/AWQ, or a GPTQ/AWQ
        variant the readers refuse), ConvertError: nothing is written then.
    """
    from mlx.utils import tree_flatten
    from tqdm import tqdm

    from mlx_dflash2.drafter import DrafterConfig, DrafterConfigError, DraftModel

    from .pipeline import ConvertResult, _measure

    t0 = t0 or time.perf_counter()
    path = Path(path)
    raw = read_config(path)
    try:
        cfg = DrafterConfig.from_dict(raw)
    except DrafterConfigError as e:
        raise DrafterFieldError(path, e.field, str(e).split(": ", 1)[-1]) from e
    if cfg.mask_token_id >= cfg.vocab_size:
        raise DrafterFieldError(path, "mask_token_id", f"{cfg.mask_token_id} >= vocab_size {cfg.vocab_size}")
    if len(set(cfg.target_layer_ids)) != len(cfg.target_layer_ids):
        raise DrafterFieldError(path, "target_layer_ids", f"duplicate ids in {cfg.target_layer_ids}")
    if cfg.num_target_layers is not None and max(cfg.target_layer_ids) >= cfg.num_target_layers:
        raise DrafterFieldError(
            path, "target_layer_ids", f"{cfg.target_layer_ids} outside the target's {cfg.num_target_layers} layers"
        )
    tgt = None
    if target is not None:
        from mlx_dflash2.drafter import validate_for_target
        from mlx_dflash2.loading import load_target

        try:
            tgt = load_target(target)
        except (OSError, ValueError) as e:  # not found, not a model (ModelNotFoundError, GGUFError, ...)
            raise ConvertError(f"--target {target}: {e}") from None
        try:
            validate_for_target(cfg, tgt[0], tgt[1])
        except DrafterConfigError as e:
            raise DrafterFieldError(path, e.field, str(e).split(": ", 1)[-1] + f" (target {target})") from e

    vocab_file = path / DRAFT_VOCAB_FILE  # the drafter's draft vocabulary (FR-Spec) travels with it
    try:
        vocab_ids = read_draft_vocab(path)
    except DrafterLoadError as e:
        raise CorruptCheckpointError(str(e)) from None
    if vocab_ids is not None and max(vocab_ids) >= cfg.vocab_size:
        raise CorruptCheckpointError(f"{vocab_file}: id {max(vocab_ids)} is outside the drafter's vocabulary "
                                     f"of {cfg.vocab_size} (made for another tokenizer?)")
    if codebook_bits is not None and (type(codebook_bits) is not int or codebook_bits not in (0, 4, 8)):
        raise ConvertError(f"codebook bits {codebook_bits}: choose 4 or 8 (0: float)")
    if codebook_bits and cfg.architecture != "DFlash2DraftModel":
        raise ConvertError(f"--codebook-bits: {cfg.architecture} has no selector codebooks (DFlash2 drafters do)")
    if codebook_bits and cfg.selector_rank % 32:
        raise ConvertError(f"--codebook-bits: selector rank {cfg.selector_rank} is not a multiple of 32 (MLX's groups)")
    source = _quantized_source(path, raw)  # GPTQ / AWQ packed layers, or None for a float drafter
    src = {}
    for k, v in (source.weights if source is not None else open_safetensors(path)).items():
        new = _remap(k)
        if new in src:
            raise CorruptCheckpointError(f"{path}: tensors {k!r} and another both map to {new!r}")
        src[new] = v
    try:  # an MLX drafter converted again: its quantized codebooks and layers expanded
        cb_spec = codebook_quantization(raw, path / "config.json") if source is None else None
        if source is None:
            refuse_unannounced_quantization(src, [b for b, sp in (("quantization", mlx_quantization(raw, path)),
                                                                  ("codebook_quantization", cb_spec)) if sp is None],
                                            path)
        stored_cb = {n: (src[n], src[f"{n}.scales"], src[f"{n}.biases"]) for n in CODEBOOKS
                     if cb_spec is not None and all(k in src for k in (n, f"{n}.scales", f"{n}.biases"))}
        for n in stored_cb:  # expanded in float32 (as the layers below)
            src[f"{n}.scales"], src[f"{n}.biases"] = (t.astype(mx.float32) for t in stored_cb[n][1:])
        dequantize_codebooks(src, cb_spec, path)
        mlx_spec, mlx_layers = _expand_mlx_quantized(path, raw, src) if source is None else (None, {})
    except DrafterLoadError as e:
        raise CorruptCheckpointError(str(e)) from None
    packed = {_module(p): fn for p, fn in source.packed.items()} if source is not None else {}
    native = {_module(p): sp for p, sp in source.native.items()} if source is not None else {}
    dequantized = {_remap(k) for k in source.dequantized} if source is not None else {f"{m}.weight" for m in mlx_layers}
    model = DraftModel(cfg)
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    missing = sorted(set(expected) - set(src))
    unexpected = sorted(set(src) - set(expected))
    if missing:
        raise MissingTensorError(f"{path}: missing drafter tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    if unexpected:
        raise MissingTensorError(
            f"{path}: tensors unknown to {cfg.architecture} (a drafter has no embedding or LM head of its own): "
            f"{unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"
        )
    for k, shape in expected.items():
        if tuple(src[k].shape) != shape:
            raise ShapeMismatchError(f"{path}: tensor {k} has shape {tuple(src[k].shape)}, expected {shape}")

    dtype_name = dtype or raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    if dtype_name not in ("float16", "bfloat16", "float32"):
        raise ConvertError(f"drafter dtype {dtype_name!r}: choose float16, bfloat16 or float32")
    fdtype = getattr(mx, dtype_name)
    linears = {name: m.weight.shape[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    plan = _drafter_plan(plan, native, linears)
    if mlx_spec is not None and plan.keep_source_layout and plan.default is not None \
            and all(in_dim % mlx_spec[1] == 0 for in_dim in linears.values()):
        # an MLX-quantized source keeps its own spec unless --q-bits / --q-group-size ask for another (as GGUF, GPTQ)
        plan = QuantPlan(QSpec(*mlx_spec), plan.overrides, plan.keep_source_layout, plan.requantize_reason)
    spec = plan.default
    quantized = set()
    for name, in_dim in linears.items():
        s, _ = plan.spec_for(name, in_dim)
        if s is None:
            continue
        if spec is None or s != spec:
            raise ConvertError(
                f"drafter layer {name}: per-layer bits/group sizes differ from the default; drafter checkpoints "
                "carry one quantization spec (overrides may only keep layers unquantized: REGEX=none)"
            )
        quantized.add(name)

    result = ConvertResult(out.dest, "drafter", notes=list(source.notes) if source is not None else [])
    if cb_spec is not None and not stored_cb:  # a stray block (a DFlash v1 drafter has no codebooks): not carried on
        result.notes.append(f"config.json's codebook_quantization is ignored: this {cfg.architecture} has no "
                            "selector codebooks")
        cb_spec = None
    keep_cb, cb_group = False, 32  # the output's codebooks: the source's codes kept, their group size
    if cb_spec is not None:  # the source's codebooks are MLX-quantized: kept as stored unless asked otherwise
        if codebook_bits is None:  # --no-quantize asks for float weights: the codebooks too
            codebook_bits = 0 if plan.default is None else cb_spec[0]
        keep_cb = codebook_bits == cb_spec[0]
        if keep_cb:
            cb_group = cb_spec[1]
            lossless = all(mx.array_equal(t.astype(fdtype).astype(t.dtype), t).item()
                           for w in stored_cb.values() for t in w[1:])
        result.notes.append(
            f"the selector's codebooks are stored {cb_spec[0]}-bit g{cb_spec[1]} in the source: "
            + (("kept as stored" if lossless else f"codes kept as stored, their scales and biases rounded to "
                f"{dtype_name}") if keep_cb else f"expanded to {dtype_name}" if not codebook_bits
               else f"quantized again at {codebook_bits}-bit g32 (a second rounding)"))
    keep_mlx = spec is not None and mlx_spec == (spec.bits, spec.group_size)
    if mlx_layers:
        kept = sum(1 for m in mlx_layers if m in quantized) if keep_mlx else 0
        rest = len(mlx_layers) - kept
        result.notes.append(
            f"the source is MLX-quantized ({mlx_spec[0]}-bit g{mlx_spec[1]}): {kept} layers kept as stored"
            + (f", {rest} expanded" + ("" if spec is None or keep_mlx else " and quantized again (a second rounding)")
               if rest else ""))

    def measure(key, ref, wq, s, b, bits, group):  # --report-error: the written layer against the source's values
        if measure_error and isinstance(ref, mx.array) and mx.issubdtype(ref.dtype, mx.floating):
            f32 = mx.float32  # both expanded in float32: a layer kept bit for bit measures 0
            _measure(result, key, ref, mx.dequantize(wq, s.astype(f32), b.astype(f32), group_size=group, bits=bits))

    with out as tmp:
        writer = ShardWriter(tmp)
        bar = tqdm(total=len(expected), unit="tensor", disable=not progress, desc="convert drafter")
        try:
            for name in expected:
                v = src.pop(name)
                mod = name[: -len(".weight")] if name.endswith(".weight") else None
                exact = packed.pop(mod)(spec) if mod in quantized and mod in packed else None
                if exact is not None:  # the source's codes kept bit for bit
                    exact, lossless = exact.cast(fdtype)
                    writer.add(name, exact.weight, logical_params=math.prod(expected[name]))
                    writer.add(f"{mod}.scales", exact.scales, logical_params=0)
                    writer.add(f"{mod}.biases", exact.biases, logical_params=0)
                    (result.exact if lossless else result.rounded).append(mod)
                    measure(mod, v, exact.weight, exact.scales, exact.biases, spec.bits, spec.group_size)
                elif keep_mlx and mod in quantized and mod in mlx_layers:  # an MLX-quantized source's own codes
                    wq, s, b = mlx_layers[mod]
                    writer.add(name, wq, logical_params=math.prod(expected[name]))
                    writer.add(f"{mod}.scales", s.astype(fdtype), logical_params=0)
                    writer.add(f"{mod}.biases", b.astype(fdtype), logical_params=0)
                    lossless = all(mx.array_equal(t.astype(fdtype).astype(t.dtype), t).item() for t in (s, b))
                    (result.exact if lossless else result.rounded).append(mod)
                    measure(mod, v, wq, s.astype(fdtype), b.astype(fdtype), spec.bits, spec.group_size)
                elif mod in quantized:
                    # float sources: cast, then quantize (as before); dequantized GPTQ/AWQ: from float32
                    w = v if name in dequantized else v.astype(fdtype)
                    wq, s, b = mx.quantize(w, spec.group_size, spec.bits)
                    writer.add(name, wq, logical_params=int(w.size))
                    writer.add(f"{mod}.scales", s.astype(fdtype), logical_params=0)
                    writer.add(f"{mod}.biases", b.astype(fdtype), logical_params=0)
                    result.requantized.append(mod)
                    measure(mod, v, wq, s.astype(fdtype), b.astype(fdtype), spec.bits, spec.group_size)
                elif codebook_bits and name in CODEBOOKS:
                    wq, s, b = stored_cb[name] if keep_cb else mx.quantize(v.astype(fdtype), 32, codebook_bits)
                    writer.add(name, wq, logical_params=int(v.size))
                    writer.add(f"{name}.scales", s.astype(fdtype), logical_params=0)
                    writer.add(f"{name}.biases", b.astype(fdtype), logical_params=0)
                    measure(name, v, wq, s.astype(fdtype), b.astype(fdtype), codebook_bits, cb_group)
                else:
                    writer.add(name, v.astype(fdtype) if mx.issubdtype(v.dtype, mx.floating) else v)
                bar.update(1)
            writer.close()
        finally:
            bar.close()
        from .pipeline import _layout_notes

        _layout_notes(plan, native, result.requantized, list(linears), result.notes, drafter=True)
        out_cfg = cfg.to_dict()
        out_cfg["torch_dtype"] = dtype_name
        if quantized:
            out_cfg["quantization"] = spec.as_dict()
        if codebook_bits:
            out_cfg["codebook_quantization"] = {"bits": codebook_bits, "group_size": cb_group}
        out_cfg["mlx_dflash2_convert"] = {
            "source_format": "drafter",
            "source": str(path),
            "source_quantization_config": source.source_quantization if source is not None else None,
            "exact_layers": len(result.exact),
            "rounded_layers": len(result.rounded),
            "requantized_layers": len(result.requantized),
            "notes": result.notes,
        }
        import json

        (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2) + "\n")
        if vocab_ids is not None:
            shutil.copyfile(vocab_file, tmp / DRAFT_VOCAB_FILE)
        # the written config must parse back to the same drafter
        if DrafterConfig.from_dict(json.loads((tmp / "config.json").read_text())) != cfg:
            raise ConvertError("internal error: the written drafter config does not round-trip")
        if tgt is not None:
            from mlx_dflash2.drafter import load_drafter

            load_drafter(tmp, tgt[0], tgt[1])
        result.tensors = sum(len(k) for _, k in writer.files)
        result.weights = writer.total_params
    result.path = out.dest
    result.seconds = time.perf_counter() - t0
    return result
