"""Drafter checkpoint configuration (the ``config.json`` contract).

A DFlash/DFlash2 drafter checkpoint is a directory with ``config.json`` and
safetensors with the published tensor names (DFlash2 spec §1.7, §5.3, §5.6,
§7 step 1). Fields are read from ``dflash_config`` with a fallback to the top
level, as the reference loader does. Missing required fields are an error,
never a silent default (known-bugs row 13).
"""

from __future__ import annotations

from pathlib import Path

from dataclasses import asdict, dataclass, field
from typing import Any

from ..modelconfig import ModelConfigError, normalize_rope

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


class DrafterConfigError(ValueError):
    """The drafter config is missing a field, malformed, or incompatible with the target."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"drafter config field {field_name!r}: {message}")
        self.field = field_name


def _dflash_field(cfg: dict, name: str, default: Any = ...) -> Any:
    sub = cfg.get("dflash_config") or {}
    if name in sub and sub[name] is not None:
        return sub[name]
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if default is ...:
        raise DrafterConfigError(name, "missing (looked in dflash_config and at the top level)")
    return default


def _int(cfg: dict, name: str, default: Any = ..., minimum: int | None = None) -> Any:
    v = cfg.get(name, default)
    if v is ...:
        raise DrafterConfigError(name, "missing")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise DrafterConfigError(name, f"must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise DrafterConfigError(name, f"must be >= {minimum}, got {v}")
    return v


@dataclass
class DrafterConfig:
    """Parsed drafter configuration.

    Geometry fields follow Hugging Face Qwen3 names; the DFlash fields are those
    of ``dflash_config``. ``is_causal`` is the in-block attention mode:
    ``None`` in the file means "causal iff the layer is sliding" (reference
    behaviour, spec §1.5); DFlash2 checkpoints set ``false`` (bidirectional).
    """

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None
    num_target_layers: int | None = None
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    input_embedding_scale: float = 1.0
    initializer_range: float = 0.02

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    def layer_is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention" and bool(self.sliding_window)

    def layer_is_causal(self, i: int) -> bool:
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_is_sliding(i)

    # -- (de)serialisation --------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict) -> "DrafterConfig":
        """Parse a ``config.json`` dict.

        Raises:
            DrafterConfigError: naming the first missing or invalid field.
        """
        if not isinstance(cfg, dict):
            raise DrafterConfigError("config.json", "must be a JSON object")
        archs = cfg.get("architectures")
        if not archs or not isinstance(archs, list):
            raise DrafterConfigError("architectures", "missing; expected one of " + ", ".join(ARCHITECTURES))
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise DrafterConfigError("architectures", f"{arch!r} is not one of {', '.join(ARCHITECTURES)}")
        hidden = _int(cfg, "hidden_size", minimum=1)
        heads = _int(cfg, "num_attention_heads", minimum=1)
        kv = _int(cfg, "num_key_value_heads", heads, minimum=1)
        if heads % kv:
            raise DrafterConfigError("num_key_value_heads", f"{kv} does not divide num_attention_heads={heads}")
        head_dim = _int(cfg, "head_dim", None) or hidden // heads
        layers = _int(cfg, "num_hidden_layers", minimum=1)
        layer_types = cfg.get("layer_types") or ["full_attention"] * layers
        if len(layer_types) != layers or any(t not in ("full_attention", "sliding_attention") for t in layer_types):
            raise DrafterConfigError("layer_types", f"expected {layers} of full_attention/sliding_attention")

        # rope: rope_parameters (new HF) or rope_theta/rope_scaling (old), normalised as for targets
        # (mlx_dflash2.modelconfig; the drafter is a Qwen3-style stack built with initialize_rope)
        rp = cfg.get("rope_parameters")
        if cfg.get("rope_theta") is None and (rp.get("rope_theta") if isinstance(rp, dict) else None) is None:
            raise DrafterConfigError("rope_theta", "missing (neither rope_theta nor rope_parameters.rope_theta)")
        max_pos = int(cfg.get("max_position_embeddings") or 32768)
        rope_keys = ("rope_theta", "rope_scaling", "rope_parameters", "original_max_position_embeddings",
                     "partial_rotary_factor")
        try:
            rope = normalize_rope(
                {"model_type": "qwen3", "max_position_embeddings": max_pos, **{k: cfg[k] for k in rope_keys if k in cfg}}
            )
        except ModelConfigError as e:
            raise DrafterConfigError(e.field, e.detail) from None
        rope_theta, rope_scaling = rope["rope_theta"], rope["rope_scaling"]

        block = _dflash_field(cfg, "block_size")
        mask = _dflash_field(cfg, "mask_token_id")
        taps = _dflash_field(cfg, "target_layer_ids")
        if not isinstance(block, int) or isinstance(block, bool) or block < 2:
            raise DrafterConfigError("block_size", f"must be an integer >= 2, got {block!r}")
        if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
            raise DrafterConfigError("mask_token_id", f"must be a non-negative integer, got {mask!r}")
        if (
            not isinstance(taps, list)
            or not taps
            or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in taps)
        ):
            raise DrafterConfigError("target_layer_ids", f"must be a non-empty list of layer indices, got {taps!r}")

        is_causal = cfg.get("is_causal", (cfg.get("dflash_config") or {}).get("is_causal"))
        dflash2 = arch == "DFlash2DraftModel"
        c = cls(
            architecture=arch,
            hidden_size=hidden,
            num_hidden_layers=layers,
            intermediate_size=_int(cfg, "intermediate_size", minimum=1),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            vocab_size=_int(cfg, "vocab_size", minimum=1),
            block_size=block,
            mask_token_id=mask,
            target_layer_ids=list(taps),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            layer_types=list(layer_types),
            sliding_window=cfg.get("sliding_window"),
            is_causal=None if is_causal is None else bool(is_causal),
            num_target_layers=_dflash_field(cfg, "num_target_layers", None),
            conv_kernel_size=int(_dflash_field(cfg, "conv_kernel_size", ...) if dflash2 else 2),
            conv_group_size=int(_dflash_field(cfg, "conv_group_size", ...) if dflash2 else 16),
            selector_rank=int(_dflash_field(cfg, "selector_rank", ...) if dflash2 else 0),
            selector_top_k=int(_dflash_field(cfg, "selector_top_k", ...) if dflash2 else 16),
            output_multiplier=float(_dflash_field(cfg, "output_multiplier", 1.0)),
            final_logit_softcapping=float(_dflash_field(cfg, "final_logit_softcapping", 0.0) or 0.0),
            input_embedding_scale=float(_dflash_field(cfg, "input_embedding_scale", 1.0)),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
        )
        if cfg.get("hidden_act", "silu") != "silu":
            raise DrafterConfigError("hidden_act", f"only silu is supported, got {cfg.get('hidden_act')!r}")
        if c.sliding_window is not None and (not isinstance(c.sliding_window, int) or c.sliding_window < 2):
            raise DrafterConfigError("sliding_window", f"must be an integer >= 2, got {c.sliding_window!r}")
        if dflash2:
            if c.conv_kernel_size < 1:
                raise DrafterConfigError("conv_kernel_size", "must be >= 1")
            if c.conv_group_size < 1 or hidden % c.conv_group_size:
                raise DrafterConfigError("conv_group_size", f"must divide hidden_size={hidden}")
            if c.selector_rank < 1:
                raise DrafterConfigError("selector_rank", "must be >= 1")
            if c.selector_top_k < 1:
                raise DrafterConfigError("selector_top_k", "must be >= 1")
        return c

    _DFLASH_KEYS = (
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "num_target_layers",
        "output_multiplier",
        "final_logit_softcapping",
        "input_embedding_scale",
    )
    _DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

    def to_dict(self) -> dict:
        """The ``config.json`` dict (HF-style top level + ``dflash_config``)."""
        d = asdict(self)
        dflash_keys = self._DFLASH_KEYS + (self._DFLASH2_KEYS if self.is_dflash2 else ())
        out = {
            "architectures": [d.pop("architecture")],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
        }
        dflash = {k: d.pop(k) for k in self._DFLASH_KEYS + self._DFLASH2_KEYS if k in dflash_keys}
        for k in self._DFLASH2_KEYS:
            d.pop(k, None)
        out.update(d)
        out["block_size"] = self.block_size
        out["dflash_config"] = dflash
        return out


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Tap layer ids for a new drafter: the reference rule where it is valid, distinct valid ids otherwise.

    The reference rule (``build_target_layer_ids``, spec §1.2): one tap is
    ``[L // 2]``; otherwise ``num_taps`` ids evenly spaced in ``[1, L - 3]``:
    ``round(1 + i * (L - 4) / (n - 1))``. It is returned unchanged whenever it
    gives strictly increasing ids inside ``0..L-1`` (every target of 5 or more
    layers with at most ``L - 3`` taps). On shallower targets, or with more
    taps than ``[1, L - 3]`` holds, it would give ids outside the target or
    duplicates (``[1, -1]`` for 2 layers): then the window ``[1, L - 3]`` is
    widened (first towards the last layer, then to layer 0) until it holds the
    taps, and the taps are spread evenly over it (rounding half up), so they are
    distinct. The number of taps is clamped to ``L`` (each layer tapped once).

    Args:
        num_target_layers: ``L``, the target's decoder layers (>= 1).
        num_taps: ``n``, taps wanted (>= 1; more than ``L`` gives ``L``).

    Returns:
        ``min(n, L)`` strictly increasing layer ids in ``0..L-1``.

    Raises:
        ValueError: ``L < 1`` or ``n < 1``.
    """
    L, n = int(num_target_layers), int(num_taps)
    if L < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if n < 1:
        raise ValueError(f"num_taps must be >= 1, got {num_taps}")
    n = min(n, L)
    if n == 1:
        return [L // 2]
    ref = [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
    if all(0 <= a < b <= L - 1 for a, b in zip(ref, ref[1:])):
        return ref
    lo, hi = 1, L - 3
    while hi - lo + 1 < n:  # widen [1, L - 3] until it holds n layers (n <= L: it always can)
        if hi < L - 1:
            hi += 1
        else:
            lo -= 1
    # lo + floor(i * (hi - lo) / (n - 1) + 1/2): steps of at least one layer, so distinct
    return [lo + (2 * i * (hi - lo) + (n - 1)) // (2 * (n - 1)) for i in range(n)]


DRAFTER_QUANT_METHODS = ("gptq", "awq")  # packed drafter checkpoints mlx_dflash2.convert reads


def drafter_quant_method(path: Path, raw: dict) -> str | None:
    """The quantization method of a drafter checkpoint (lower case; ``None``: a float checkpoint):
    ``config.json``'s ``quantization_config.quant_method``, or a ``quantize_config.json`` (GPTQ)
    / ``quant_config.json`` (AWQ) side file. A ``quantization_config`` without a method reads as
    ``"(none given)"``."""
    qc = raw.get("quantization_config")
    if qc is None:
        if (Path(path) / "quantize_config.json").is_file():
            return "gptq"
        if (Path(path) / "quant_config.json").is_file():
            return "awq"
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return str(method).lower() if method else "(none given)"
