"""Create, save, load and validate drafter checkpoints.

Checkpoint directory: ``config.json`` (:class:`~.config.DrafterConfig`) and
``*.safetensors`` with the published tensor names (spec §5.6). Loading
validates the checkpoint against the target it will draft for and names the
offending field on any mismatch (spec §7 step 1; known-bugs rows 12-13).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import DrafterConfig, DrafterConfigError, default_target_layer_ids
from .model import DraftModel

__all__ = [
    "DrafterLoadError",
    "DrafterNeedsConversionError",
    "load_drafter",
    "save_drafter",
    "init_drafter",
    "validate_for_target",
    "pick_mask_token_id",
    "read_draft_vocab",
    "write_draft_vocab",
    "DRAFT_VOCAB_FILE",
    "draft_vocab_file",
    "CODEBOOKS",
    "codebook_quantization",
    "dequantize_codebooks",
    "refuse_unannounced_quantization",
    "check_layer_shape",
    "mlx_quantization",
    "check_quantized",
]

#: the DFlash2 selector's codebooks (``[vocab, rank]`` each), by their checkpoint names
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")

#: a drafter directory's draft vocabulary (:func:`read_draft_vocab`)
DRAFT_VOCAB_FILE = "draft_vocab.json"


class DrafterLoadError(ValueError):
    """The drafter checkpoint is missing, malformed or has wrong tensors."""


class DrafterNeedsConversionError(DrafterLoadError):
    """A GPTQ/AWQ-packed drafter checkpoint: MLX loads it once converted (``mlx_dflash2.convert``).

    Attributes:
        method: the quantization method (``"gptq"`` / ``"awq"``).
        command: the conversion command line (the message shows it too).
    """

    def __init__(self, message: str, method: str, command: str):
        super().__init__(message)
        self.method, self.command = method, command


def _refuse_packed(path: Path, raw: dict, target_name: str | None) -> None:
    """Raise for a drafter checkpoint whose linear layers are packed by another engine's quantizer."""
    import shlex

    from .config import DRAFTER_QUANT_METHODS, drafter_quant_method

    method = drafter_quant_method(path, raw)
    if method is None:
        return
    if method not in DRAFTER_QUANT_METHODS:
        raise DrafterLoadError(
            f"{path}: drafter quantization method {method!r} is not supported (packed drafters "
            f"mlx_dflash2.convert reads: {', '.join(DRAFTER_QUANT_METHODS)}; float and MLX-quantized drafters load directly)"
        )
    out = path.with_name(path.name + "-mlx")
    command = shlex.join(["mlx_dflash2.convert", str(path), str(out), "--target", target_name or "TARGET"])
    raise DrafterNeedsConversionError(
        f"{path} is a {method.upper()}-packed drafter checkpoint; MLX loads MLX-quantized layers, so convert it once "
        f"(its codes are kept exactly where MLX has the layout):\n    {command}\nthen pass {out} as the drafter",
        method,
        command,
    )


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            ids.add(v)
    return ids


def validate_for_target(cfg: DrafterConfig, target, tokenizer) -> None:
    """Check that a drafter config fits the target.

    Args:
        cfg: the drafter config.
        target: a :class:`~mlx_dflash2.target.TargetAdapter`.
        tokenizer: the target's tokenizer (``len()`` = real vocabulary).

    Raises:
        DrafterConfigError: naming the field: ``hidden_size`` (must equal the
            target's, embedding and LM head are shared), ``target_layer_ids``
            (must exist in the target), ``num_target_layers``,
            ``mask_token_id`` (inside the vocabulary, not EOS/BOS/pad/unk),
            ``vocab_size`` (must cover the tokenizer; padding-only differences
            are accepted).
    """
    if cfg.hidden_size != target.hidden_size:
        raise DrafterConfigError(
            "hidden_size", f"{cfg.hidden_size} != target hidden size {target.hidden_size} (they share embeddings)"
        )
    L = target.num_layers
    bad = [i for i in cfg.target_layer_ids if i >= L]
    if bad:
        raise DrafterConfigError("target_layer_ids", f"{bad} do not exist in the target ({L} layers: 0..{L - 1})")
    if cfg.num_target_layers is not None and cfg.num_target_layers != L:
        raise DrafterConfigError("num_target_layers", f"{cfg.num_target_layers} != the target's {L} layers")
    n_real = len(tokenizer)
    limit = min(n_real, target.vocab_rows)
    if cfg.mask_token_id >= limit:
        raise DrafterConfigError("mask_token_id", f"{cfg.mask_token_id} is outside the target vocabulary (< {limit})")
    if cfg.mask_token_id in _special_ids(tokenizer):
        raise DrafterConfigError(
            "mask_token_id", f"{cfg.mask_token_id} is the target's EOS/BOS/pad/unk token; the mask must be unused"
        )
    if cfg.vocab_size < n_real:
        raise DrafterConfigError("vocab_size", f"{cfg.vocab_size} < the tokenizer's {n_real} tokens")


def pick_mask_token_id(tokenizer) -> int:
    """Choose a mask token for a new drafter: a ``<|MASK|>``-like token if the
    vocabulary has one, otherwise the highest-id special token that is not
    EOS/BOS/pad/unk and does not appear in the chat template.

    Raises:
        DrafterConfigError: no suitable token.
    """
    vocab = tokenizer.get_vocab()
    for name in ("<|MASK|>", "<|mask|>", "<mask>", "[MASK]"):
        if name in vocab:
            return int(vocab[name])
    template = getattr(tokenizer, "chat_template", None) or ""
    avoid = _special_ids(tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    cands = [
        int(i) for i, t in added.items() if getattr(t, "special", False) and int(i) not in avoid and str(t) not in template
    ]
    if not cands:
        raise DrafterConfigError("mask_token_id", "the target vocabulary has no unused special token; pass one")
    return max(cands)


def init_drafter(
    target,
    tokenizer,
    architecture: str = "DFlash2DraftModel",
    num_layers: int = 2,
    block_size: int = 16,
    num_taps: int | None = None,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    intermediate_size: int | None = None,
    selector_rank: int = 64,
    selector_top_k: int = 16,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    seed: int = 0,
) -> DraftModel:
    """Create a freshly initialised drafter for ``target`` (``--init``).

    Geometry follows the target (hidden size, heads, head_dim, RoPE theta);
    taps follow :func:`~.config.default_target_layer_ids` (the reference rule,
    spec §1.2, with distinct valid ids on shallow targets; at most one tap per
    target layer) with one tap per drafter layer unless given. DFlash2's conv
    and selector start as exact no-ops.

    Returns:
        A :class:`DraftModel` in float32 (cast it as needed).
    """
    tc = target.text_config  # a vision-language checkpoint's text model (Qwen3.5+, Gemma 3/4)
    heads = int(tc["num_attention_heads"])
    cfg = DrafterConfig.from_dict(
        {
            "architectures": [architecture],
            "hidden_size": target.hidden_size,
            "num_hidden_layers": num_layers,
            "intermediate_size": int(intermediate_size or tc["intermediate_size"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(tc.get("num_key_value_heads") or heads),
            "head_dim": int(tc.get("head_dim") or target.hidden_size // heads),
            "vocab_size": target.vocab_rows,
            "rms_norm_eps": float(tc.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(tc.get("rope_theta") or (tc.get("rope_parameters") or {}).get("rope_theta")
                                or 10000.0),
            "max_position_embeddings": int(tc.get("max_position_embeddings") or 32768),
            "is_causal": False,
            "dflash_config": {
                "block_size": block_size,
                "mask_token_id": mask_token_id if mask_token_id is not None else pick_mask_token_id(tokenizer),
                "target_layer_ids": target_layer_ids
                or default_target_layer_ids(target.num_layers, num_taps or num_layers),
                "num_target_layers": target.num_layers,
                "conv_kernel_size": conv_kernel_size,
                "conv_group_size": conv_group_size,
                "selector_rank": selector_rank,
                "selector_top_k": selector_top_k,
            },
        }
    )
    validate_for_target(cfg, target, tokenizer)
    model = DraftModel(cfg)
    model.init_weights(seed)
    mx.eval(model.parameters())
    return model


def _remap(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model.") :]
    for cb in ("predecessor_codebook", "successor_codebook"):
        if name == f"candidate_selector.{cb}.weight":
            return f"candidate_selector.{cb}"
    return name


def _quant_spec(raw: dict, key: str, path, affine: bool) -> tuple[int, int] | None:
    """``raw[key]`` (``{"bits": b, "group_size": g}``, with ``affine``: no other ``mode``) as ``(bits, group)``."""
    q = raw.get(key)
    if q is None:
        return None
    ok = isinstance(q, dict) and (not affine or q.get("mode", "affine") == "affine")
    bits, group = (q.get("bits"), q.get("group_size")) if ok else (None, None)
    if type(bits) is not int or bits not in (2, 3, 4, 5, 6, 8) or type(group) is not int or group not in (32, 64, 128):
        raise DrafterLoadError(f"{path}: {key} {q!r}: expected {{\"bits\": 2|3|4|5|6|8, \"group_size\": 32|64|128}}"
                               + (", affine" if affine else ""))
    return bits, group


def mlx_quantization(raw: dict, path: str | Path = "config.json") -> tuple[int, int] | None:
    """A checkpoint's MLX ``quantization`` block (its linear layers: ``{"bits": b, "group_size": g}``, affine) as
    ``(bits, group_size)``, or ``None`` (float layers).

    Raises:
        DrafterLoadError: not such an object, bits / group size MLX does not have, or another ``mode``.
    """
    return _quant_spec(raw, "quantization", path, affine=True)


def codebook_quantization(raw: dict, path: str | Path = "config.json") -> tuple[int, int] | None:
    """A checkpoint's ``codebook_quantization`` (``{"bits": b, "group_size": g}``, written by
    ``mlx_dflash2.convert --codebook-bits``) as ``(bits, group_size)``, or ``None`` (float codebooks).

    Raises:
        DrafterLoadError: the block is not such an object, bits/group size MLX does not have, or another
            ``mode`` than affine.
    """
    return _quant_spec(raw, "codebook_quantization", path, affine=True)


def check_quantized(name: str, w, s, b, bits: int, group: int, path: str | Path = "") -> None:
    """That ``(w, s, b)`` is one MLX affine-quantized tensor of ``bits`` / ``group`` (``mx.quantize``'s layout:
    uint32 ``w`` ``[..., n * bits / 32]``, float ``s`` and ``b`` ``[..., n / group]``, finite): integer or NaN scales
    loaded and drafted badly before (a fresh user's find).

    Raises:
        DrafterLoadError: a part missing or not that layout, naming ``name`` and what was found.
    """
    def desc(t):
        return None if t is None else (tuple(t.shape), str(t.dtype))

    if w is None or s is None or b is None or w.dtype != mx.uint32 or s.shape != b.shape \
            or s.shape[:-1] != w.shape[:-1] or w.shape[-1] * 32 != s.shape[-1] * group * bits \
            or not (mx.issubdtype(s.dtype, mx.floating) and mx.issubdtype(b.dtype, mx.floating)):
        raise DrafterLoadError(f"{path}: {name}: not a {bits}-bit group-{group} MLX-quantized tensor "
                               f"(packed {desc(w)}, scales {desc(s)}, biases {desc(b)})")
    if not (mx.all(mx.isfinite(s)).item() and mx.all(mx.isfinite(b)).item()):
        raise DrafterLoadError(f"{path}: {name}: its scales or biases hold NaN or infinite values")


def refuse_unannounced_quantization(weights: dict, blocks: Sequence[str], path: str | Path = "") -> None:
    """Name quantized tensors whose ``config.json`` block is missing (deleted or lost in a hand edit), rather than
    leaving them to a long list of unexpected tensors. Call with the blocks absent from ``config.json``.

    Args:
        weights: the checkpoint's tensors (names as :func:`_remap` leaves them).
        blocks: among ``"quantization"`` (linear layers: ``NAME.weight`` packed, ``NAME.scales`` / ``.biases``
            beside it) and ``"codebook_quantization"`` (the selector's codebooks, ``NAME`` packed).
        path: the checkpoint, for the message.

    Raises:
        DrafterLoadError: ``.scales`` tensors of those kinds exist; the message names every such block and the
            first tensors of each.
    """
    mods = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    found = []
    for block in blocks:
        names = [m for m in mods if (m in CODEBOOKS) == (block == "codebook_quantization")]
        if names:
            example = ('{"bits": 8, "group_size": 32}' if block == "codebook_quantization"
                       else '{"bits": 4, "group_size": 64}')
            found.append(f"{len(names)} {'tensor is' if len(names) == 1 else 'tensors are'} stored MLX-quantized "
                         f"({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: packed, with .scales / .biases) "
                         f"but config.json has no {block!r} block (e.g. {example})")
    if found:
        raise DrafterLoadError(f"{path}: " + "; ".join(found) + " (the converter and save_drafter write them)")


def check_layer_shape(mod: str, packed, shape: tuple | None, bits: int, group: int, path: str | Path = "") -> None:
    """That a packed layer ``mod`` is the model's ``[out, in]`` layer (``shape``) at ``bits`` / ``group``: packed
    ``[out, in * bits / 32]``, ``in`` a multiple of ``group`` (a ``quantization`` block edited to another spec can
    describe the same packed widths and fail inside MLX's quantize with no file named).

    Raises:
        DrafterLoadError: naming the layer, the shapes and the block.
    """
    if shape is None or len(shape) != 2:
        return  # not a layer of this model: the unexpected-tensors check names it
    out, n = shape
    if n % group or tuple(packed.shape) != (out, n * bits // 32):
        raise DrafterLoadError(f"{path}: {mod}: packed {tuple(packed.shape)}, but this model's [{out}, {n}] layer at "
                               f"{bits}-bit g{group} (config.json's quantization) "
                               + (f"has {n} inputs, not a multiple of {group}" if n % group
                                  else f"packs to ({out}, {n * bits // 32})"))


def dequantize_codebooks(weights: dict, spec: tuple[int, int] | None, path: str | Path = "") -> dict:
    """Expand MLX-quantized selector codebooks in ``weights`` (names as :func:`_remap` leaves them) in place.

    A quantized codebook is stored as ``NAME`` (uint32, the packed ``[vocab, rank * bits / 32]``),
    ``NAME.scales`` and ``NAME.biases`` (``[vocab, rank / group_size]``, the float dtype), MLX's affine
    layout (``mx.quantize``); it becomes ``NAME`` ``[vocab, rank]`` in the scales' dtype. The selector
    gathers codebook rows by token id, so the runtime keeps them dense: quantizing them shrinks the file
    (a third of a 4-bit drafter for a 152k vocabulary), not the memory. ``spec``: ``(bits, group_size)``
    from :func:`codebook_quantization`; ``None`` leaves ``weights`` as they are.

    Raises:
        DrafterLoadError: a codebook, its scales or biases missing, or not the quantized layout.
    """
    if spec is None:
        return weights
    bits, group = spec
    for name in CODEBOOKS:
        parts = [weights.get(name), weights.get(f"{name}.scales"), weights.get(f"{name}.biases")]
        if any(p is None for p in parts):
            if all(p is None for p in parts):
                continue  # a DFlash (v1) drafter has no selector
            if parts[0] is not None and mx.issubdtype(parts[0].dtype, mx.floating) and parts[1] is None:
                raise DrafterLoadError(f"{path}: config.json's codebook_quantization does not match the weights: "
                                       f"{name} is stored in float (no .scales / .biases)")
            raise DrafterLoadError(f"{path}: codebook_quantization is set but {name}, .scales or .biases is missing")
        w, s, b = parts
        check_quantized(name, w, s, b, bits, group, path)
        weights[name] = mx.dequantize(w, s, b, group_size=group, bits=bits)
        del weights[f"{name}.scales"], weights[f"{name}.biases"]
    return weights


def read_drafter_checkpoint(path: str | Path, target_name: str | None = None):
    """What can be checked of a drafter checkpoint without its target: the directory, ``config.json``
    (parsed and validated), a format this runtime reads, and weight files present. ``load`` calls it
    before loading the target, so a bad drafter fails in a second, not after the target's load.

    Returns:
        ``(raw config dict, DrafterConfig, sorted *.safetensors paths)``.

    Raises:
        FileNotFoundError: no such directory / no config / no weights.
        DrafterConfigError: an invalid config (names the field).
        DrafterLoadError: malformed JSON, or another quantization method (named).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter checkpoint directory not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; not a drafter checkpoint")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DrafterLoadError(f"{cfg_file}: invalid JSON ({e})") from e
    _refuse_packed(path, raw, target_name)
    cfg = DrafterConfig.from_dict(raw)
    mlx_quantization(raw, cfg_file)
    codebook_quantization(raw, cfg_file)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    return raw, cfg, files


def load_drafter(path: str | Path, target, tokenizer, dtype: mx.Dtype | None = None,
                 target_name: str | None = None) -> DraftModel:
    """Load a drafter checkpoint directory and validate it against the target.

    Args:
        path: checkpoint directory (``config.json`` + ``*.safetensors``).
        target: the :class:`~mlx_dflash2.target.TargetAdapter` it drafts for.
        tokenizer: the target's tokenizer.
        dtype: cast floating weights to this dtype (``None`` keeps the file's).
        target_name: the target's name or path, for the conversion command a
            GPTQ/AWQ checkpoint's error shows.

    Raises:
        FileNotFoundError: no such directory / no config / no weights.
        DrafterConfigError: invalid or incompatible config (names the field).
        DrafterNeedsConversionError: a GPTQ/AWQ-packed checkpoint (the message
            gives the ``mlx_dflash2.convert`` command that makes it loadable).
        DrafterLoadError: another quantization method (named), malformed JSON or
            tensors missing / unexpected / of the wrong shape (names them).
    """
    path = Path(path)
    raw, cfg, files = read_drafter_checkpoint(path, target_name)
    validate_for_target(cfg, target, tokenizer)
    weights = {}
    for f in files:
        try:
            w = mx.load(str(f))
        except Exception as e:
            raise DrafterLoadError(f"{f}: cannot read safetensors ({e})") from e
        weights.update({_remap(k): v for k, v in w.items()})
    cb_spec = codebook_quantization(raw, path / "config.json")
    quant = mlx_quantization(raw, path / "config.json")
    missing_blocks = [b for b, sp in (("quantization", quant), ("codebook_quantization", cb_spec)) if sp is None]
    refuse_unannounced_quantization(weights, missing_blocks, path)
    dequantize_codebooks(weights, cb_spec, path)
    model = DraftModel(cfg)
    if quant is not None:
        shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
        for k in [k for k in weights if k.endswith(".scales")]:
            mod = k[: -len(".scales")]
            check_quantized(mod, weights.get(f"{mod}.weight"), weights[k], weights.get(f"{mod}.biases"), *quant, path)
            check_layer_shape(mod, weights[f"{mod}.weight"], shapes.get(f"{mod}.weight"), *quant, path)
    if quant:
        nn.quantize(
            model,
            group_size=quant[1],
            bits=quant[0],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise DrafterLoadError(
            f"{path}: tensors do not match {cfg.architecture}: missing {missing[:6]}"
            f"{'...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}"
        )
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise DrafterLoadError(f"{path}: tensor {k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}")
        if dtype is not None and mx.issubdtype(v.dtype, mx.floating):
            weights[k] = v.astype(dtype)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


def is_quantized(model: DraftModel) -> bool:
    """True if any layer of ``model`` is MLX-quantized (routed to the kernels or not)."""
    from ..kernels.qmm import KernelQuantizedLinear

    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, KernelQuantizedLinear)
    return any(isinstance(m, kinds) for _, m in model.named_modules())


def dequantize_drafter(model: DraftModel) -> DraftModel:
    """``model`` with its quantized linear layers expanded to dense weights
    (``mlx_lm.utils.dequantize_model``; the same values, in the scales' dtype).
    Used for training (quantized weights cannot be trained) and on MLX's CPU
    backend (a quantized matmul costs time linear in its rows). A model that is
    not quantized is returned unchanged. A drafter routed to the kernels
    (:meth:`DraftModel.route_kernels`) is unrouted first."""
    if getattr(model, "routed", False):  # the kernels' modules out: the quantized layers themselves are expanded
        model.unroute_kernels()
    if not is_quantized(model):
        return model
    from mlx_lm.utils import dequantize_model

    model = dequantize_model(model)
    mx.eval(model.parameters())
    return model


def _shards(weights: dict, max_bytes: int) -> list[dict]:
    shards, cur, size = [], {}, 0
    for k, v in weights.items():
        if cur and size + v.nbytes > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += v.nbytes
    if cur:
        shards.append(cur)
    return shards


def save_drafter(model: DraftModel, path: str | Path, overwrite: bool = False, max_shard_mb: float = 15,
                 draft_vocab: tuple[list[int], dict] | None = None) -> Path:
    """Write ``config.json`` + safetensors atomically (temp dir, rename); with ``draft_vocab``
    (``(ids, info)``) also its ``draft_vocab.json`` (:func:`write_draft_vocab`), in the same rename.

    Weights go to ``model.safetensors``, or, above ``max_shard_mb`` MiB, to
    ``model-0000i-of-0000n.safetensors`` shards with a
    ``model.safetensors.index.json`` (the Hugging Face layout).

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
    """
    path = Path(os.path.abspath(Path(path).expanduser()))  # "x/../x" would not resolve once x has moved aside
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; to replace it pass --overwrite (command line) or overwrite=True (Python)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        with model.unrouted():  # a drafter routed to the kernels (DraftModel.route_kernels) saved under its own names
            cfg = model.config.to_dict()
            weights = dict(tree_flatten(model.parameters()))
            q = {m: (mod.group_size, mod.bits) for m, mod in model.named_modules()
                 if isinstance(mod, nn.QuantizedLinear)}
        if q:
            gs, bits = next(iter(q.values()))
            cfg["quantization"] = {"group_size": gs, "bits": bits}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if draft_vocab is not None:
            write_draft_vocab(tmp, draft_vocab[0], **draft_vocab[1])
        shards = _shards(weights, int(max_shard_mb * 2**20))
        if len(shards) == 1:
            mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        else:
            index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": {}}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                mx.save_safetensors(str(tmp / name), shard, metadata={"format": "mlx"})
                index["weight_map"].update({k: name for k in shard})
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def draft_vocab_file(path: str | Path) -> Path:
    """Where :func:`read_draft_vocab` looks: ``path`` itself when it is a file, else ``path/draft_vocab.json``."""
    return Path(path) if Path(path).is_file() else Path(path) / DRAFT_VOCAB_FILE


def read_draft_vocab(path: str | Path) -> list[int] | None:
    """The draft vocabulary a drafter directory ships (``draft_vocab.json``: ``{"ids": [...], ...}``, the
    token ids its drafter may propose; :class:`~mlx_dflash2.proposers.DFlashProposer` ``draft_vocab``), or
    ``None`` when it has none. ``path`` may also be such a file itself (any name).

    Raises:
        DrafterLoadError: the file is not readable JSON (UTF-8, a byte-order mark allowed), or ``ids`` is
            not a list of ints >= 0 holding at least 2 distinct ids. (Whether they lie within the target's
            vocabulary is checked once it is loaded: :func:`~mlx_dflash2.proposers.check_vocab_ids`.)
    """
    f = draft_vocab_file(path)
    if not f.exists():
        return None
    try:
        raw = json.loads(f.read_text(encoding="utf-8-sig"))  # (a directory of that name: IsADirectoryError)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, a 5,000-digit int
        raise DrafterLoadError(f"{f}: cannot read the draft vocabulary ({type(e).__name__}: {str(e)[:200]})") from None
    ids = raw.get("ids") if isinstance(raw, dict) else None
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise DrafterLoadError(f'{f}: "ids" must be a non-empty list of token ids >= 0')
    if len(set(ids)) < 2:
        raise DrafterLoadError(f'{f}: "ids" must hold at least 2 distinct token ids, got {len(set(ids))}')
    return ids


def write_draft_vocab(path: str | Path, ids, **info) -> Path:
    """Write ``draft_vocab.json`` (ascending unique ``ids`` and ``info``, e.g. how it was chosen) into the
    drafter directory ``path`` (atomically: a temporary file renamed). Returns the file's path."""
    ids = sorted({int(i) for i in ids})
    if not ids or ids[0] < 0:
        raise ValueError("a draft vocabulary is a non-empty list of token ids >= 0")
    f = Path(path) / DRAFT_VOCAB_FILE
    tmp = f.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"size": len(ids), **info, "ids": ids}, separators=(",", ":")) + "\n")
    os.replace(tmp, f)
    return f
