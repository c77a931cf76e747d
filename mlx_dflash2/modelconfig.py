"""Model ``config.json`` normalisation shared by the runtime loader and the converter.

**RoPE.** transformers >= 5 writes ``rope_theta`` and the scaling block (YaRN, llama3,
linear, dynamic NTK) under ``rope_parameters``; older configs use top-level
``rope_theta`` / ``rope_scaling``. mlx-lm's llama (also used for ``mistral``) and qwen2
model classes read only the old fields, so a transformers-5 config would silently build
the class's default theta with no scaling. :func:`normalize_rope` rewrites both layouts
into explicit ``rope_theta`` / ``rope_scaling`` fields whose meaning under mlx-lm's
``initialize_rope`` equals the transformers definition (``modeling_rope_utils``):

* ``rope_theta``: ``rope_parameters.rope_theta``, else the top-level one, else
  transformers' default 10000 (mlx-lm's qwen2 class would default to 1e6);
* ``original_max_position_embeddings`` of YaRN / llama3: transformers' rule (a top-level
  field first, then the block's, then ``max_position_embeddings``; mlx-lm would default
  to 4096 / 8192);
* YaRN ``factor`` defaults to ``max_position_embeddings / original``; ``beta_fast`` /
  ``beta_slow`` that are unset or 0 become 32 / 1; ``mscale`` and ``mscale_all_dim`` are
  kept only when both are set (transformers ignores them otherwise, mlx-lm would not);
  an explicit ``attention_factor`` must equal the one these imply.

For the families the speculative loop supports (``llama``, ``mistral``, ``qwen2``,
``qwen3``) only the rope types checked against the transformers formulas
(:data:`ROPE_TYPES`) are accepted; any other ``rope_type``, a ``partial_rotary_factor``
other than 1, YaRN's ``truncate: false`` and contradictory fields are errors naming the
field. Other families (converter only) get ``rope_parameters`` mirrored as given, and an
unknown ``rope_type`` is an error there too.

**Sliding windows.** :func:`sliding_window_layers` says which layers of a config attend
through a sliding window, with transformers' semantics per family.
"""

from __future__ import annotations

import copy
import math

__all__ = [
    "ModelConfigError",
    "ROPE_FAMILIES",
    "ROPE_TYPES",
    "DEFAULT_ROPE_THETA",
    "normalize_rope",
    "rope_overrides",
    "sliding_window_layers",
]

# families whose mlx-lm classes build their rope with mlx_lm.models.rope_utils.initialize_rope
# from (rope_theta, rope_scaling, max_position_embeddings) of the config, as llama does
ROPE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# rope types whose mlx-lm implementation equals transformers' for those families
# (tests/test_rope_config.py checks the built models' inverse frequencies and attention scale)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# further types some other mlx-lm model classes implement (converter: mirrored as given)
_OTHER_ROPE_TYPES = ("longrope", "su", "mrope", "proportional", "deepseek_yarn", "telechat3-yarn")
DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
_MISSING = object()


class ModelConfigError(ValueError):
    """A model ``config.json`` field is invalid, contradictory or not supported.

    Attributes:
        field: the offending field's dotted path (e.g. ``rope_parameters.rope_type``).
        detail: what is wrong with it.
        source: the config file, when known (it prefixes the message).
    """

    def __init__(self, field: str, detail: str, source=None):
        where = f"{source}: " if source is not None else ""
        super().__init__(f"{where}config field {field!r}: {detail}")
        self.field, self.detail, self.source = field, detail, source


def _number(params: dict, key: str, where: str, required: bool = True, positive: bool = True):
    v = params.get(key)
    if v is None:
        if required:
            raise ModelConfigError(f"{where}.{key}", "missing")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ModelConfigError(f"{where}.{key}", f"must be a positive number, got {v!r}")
    return v


def _yarn_mscale(factor: float, m: float = 1.0) -> float:
    # transformers' and mlx-lm's get_mscale
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _scaling(params: dict, sub: dict, where: str, family: bool) -> dict | None:
    """The mlx-lm ``rope_scaling`` of one rope block (``params`` without ``rope_theta``), or None."""
    a, b = params.get("rope_type"), params.get("type")
    if a is not None and b is not None and a != b:
        raise ModelConfigError(f"{where}.rope_type", f"{a!r} disagrees with {where}.type {b!r}")
    rtype = a if a is not None else b if b is not None else "default"
    if not isinstance(rtype, str):
        raise ModelConfigError(f"{where}.rope_type", f"must be a string, got {rtype!r}")
    if not family:
        if rtype not in ROPE_TYPES + _OTHER_ROPE_TYPES:
            raise ModelConfigError(f"{where}.rope_type", f"unknown rope type {rtype!r}")
        if rtype == "default":
            return None
        return dict(params, rope_type=rtype, type=rtype)  # other classes read either key
    if rtype not in ROPE_TYPES:
        raise ModelConfigError(
            f"{where}.rope_type",
            f"rope type {rtype!r} is not supported for model_type {sub.get('model_type')!r} "
            f"(supported: {', '.join(ROPE_TYPES)})",
        )
    prf = params.get("partial_rotary_factor", sub.get("partial_rotary_factor"))
    if prf is not None and prf != 1:
        raise ModelConfigError(
            f"{where}.partial_rotary_factor", f"{prf!r}: mlx-lm's {sub.get('model_type')} rotates the whole head (1 only)"
        )
    if rtype == "default":
        return None
    max_pos = sub.get("max_position_embeddings")
    if rtype in ("linear", "dynamic"):
        factor = _number(params, "factor", where)
        if rtype == "dynamic" and not max_pos:
            raise ModelConfigError("max_position_embeddings", "dynamic rope scaling needs it (the original context)")
        return {"rope_type": rtype, "factor": factor}
    # llama3 / yarn: transformers' standardize_rope_params gives a top-level
    # original_max_position_embeddings priority, then the block's, then max_position_embeddings
    orig = sub.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_pos
    if not orig:
        raise ModelConfigError(f"{where}.original_max_position_embeddings", "missing (and no max_position_embeddings)")
    if rtype == "llama3":
        out = {"rope_type": "llama3", "factor": _number(params, "factor", where)}
        for k in ("low_freq_factor", "high_freq_factor"):
            out[k] = _number(params, k, where)
        if out["high_freq_factor"] == out["low_freq_factor"]:
            raise ModelConfigError(f"{where}.high_freq_factor", "must differ from low_freq_factor")
        out["original_max_position_embeddings"] = orig
        return out
    # yarn
    factor = _number(params, "factor", where, required=False)
    if factor is None:
        if not max_pos:
            raise ModelConfigError(f"{where}.factor", "missing (and no max_position_embeddings to derive it)")
        factor = max_pos / orig
    if params.get("truncate", True) is False:
        raise ModelConfigError(f"{where}.truncate", "false is not supported (mlx-lm's YaRN always truncates)")
    out = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": orig,
        "beta_fast": _number(params, "beta_fast", where, required=False, positive=False) or 32,
        "beta_slow": _number(params, "beta_slow", where, required=False, positive=False) or 1,
    }
    m = _number(params, "mscale", where, required=False, positive=False)
    m_all = _number(params, "mscale_all_dim", where, required=False, positive=False)
    if m and m_all:  # transformers uses them only together; mlx-lm's defaults (1, 0) give get_mscale(factor)
        out["mscale"], out["mscale_all_dim"] = m, m_all
        implied = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
    else:
        implied = _yarn_mscale(factor)
    af = _number(params, "attention_factor", where, required=False)
    if af is not None and not math.isclose(af, implied, rel_tol=1e-9):
        raise ModelConfigError(
            f"{where}.attention_factor",
            f"{af!r} differs from {implied!r}, the value mlx-lm's YaRN derives from factor/mscale/mscale_all_dim",
        )
    return out


def _normalize_one(sub: dict, prefix: str) -> None:
    rp = sub.get("rope_parameters")
    rs = sub.get("rope_scaling")
    for name, v in (("rope_parameters", rp), ("rope_scaling", rs)):
        if v is not None and not isinstance(v, dict):
            raise ModelConfigError(prefix + name, f"must be an object, got {type(v).__name__}")
    family = sub.get("model_type") in ROPE_FAMILIES
    if rp and all(isinstance(v, dict) or v is None for v in rp.values()):
        # nested per layer type ({"full_attention": {...}, "sliding_attention": {...}})
        if family:
            raise ModelConfigError(prefix + "rope_parameters", "per-layer-type rope parameters are not supported")
        return  # the model class reads its own layout
    top = sub.get("rope_theta")
    inner = rp.get("rope_theta") if rp else None
    for name, v in (("rope_theta", top), ("rope_parameters.rope_theta", inner)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ModelConfigError(prefix + name, f"must be a positive number, got {v!r}")
    if top is not None and inner is not None and float(top) != float(inner):
        raise ModelConfigError(prefix + "rope_theta", f"{top} disagrees with rope_parameters.rope_theta {inner}")
    theta = inner if inner is not None else top
    if rp is None and rs is None and not family:
        return
    from_rp = _scaling({k: v for k, v in (rp or {}).items() if k != "rope_theta"}, sub, prefix + "rope_parameters",
                       family) if rp is not None else None
    from_rs = _scaling({k: v for k, v in rs.items() if k != "rope_theta"}, sub, prefix + "rope_scaling",
                       family) if rs is not None else None
    if rp is not None and rs is not None and from_rp != from_rs:
        raise ModelConfigError(prefix + "rope_scaling", f"{rs} disagrees with rope_parameters {rp}")
    if not family and rs is not None:
        from_rs = rs  # other model classes read their own layout: keep it as written
    if theta is None and family:
        theta = DEFAULT_ROPE_THETA
    if theta is not None:
        sub["rope_theta"] = float(theta)
    sub["rope_scaling"] = from_rs if rs is not None else from_rp


def normalize_rope(cfg: dict) -> dict:
    """A copy of a model config with its RoPE settings explicit for mlx-lm (see the module doc).

    Args:
        cfg: a ``config.json`` dict (transformers 4 or 5 layout; a ``text_config`` sub-dict
            is normalised too). Not modified.

    Returns:
        A deep copy with ``rope_theta`` (float) and ``rope_scaling`` (an mlx-lm
        ``initialize_rope`` scaling dict, or ``None`` for plain RoPE) set; ``rope_parameters``
        is left as it was. For families outside :data:`ROPE_FAMILIES` without any rope
        field, nothing is added.

    Raises:
        ModelConfigError: naming the field: an unknown or unsupported ``rope_type``, a
            missing or non-numeric parameter, ``rope_theta`` / ``rope_scaling``
            disagreeing with ``rope_parameters``, or a setting mlx-lm cannot reproduce.
    """
    cfg = copy.deepcopy(cfg)
    _normalize_one(cfg, "")
    if isinstance(cfg.get("text_config"), dict):
        _normalize_one(cfg["text_config"], "text_config.")
    return cfg


def rope_overrides(cfg: dict) -> dict:
    """The top-level fields :func:`normalize_rope` changes in ``cfg`` (for ``mlx_lm.load``'s
    ``model_config=``, which updates the loaded config with them before building the model).

    Raises:
        ModelConfigError: as :func:`normalize_rope`.
    """
    norm = normalize_rope(cfg)
    return {k: v for k, v in norm.items() if cfg.get(k, _MISSING) != v}


MISTRAL_DEFAULT_WINDOW = 4096  # transformers' MistralConfig.sliding_window default


def sliding_window_layers(cfg: dict) -> tuple[int | None, list[int]]:
    """Which decoder layers attend through a sliding window that changes the model's output.

    transformers' semantics per family: ``qwen2`` / ``qwen3`` use a window only with
    ``use_sliding_window: true`` (then on ``layer_types``' sliding layers, or layers
    ``>= max_window_layers``); other families on ``layer_types``' ``sliding_attention``
    layers, or on every layer when there are no ``layer_types`` (Mistral; a ``mistral``
    config without the field has transformers' default window of 4096). A window that is
    null, 0, or at least ``max_position_embeddings`` (the model's context) changes
    nothing and yields no layers.

    Args:
        cfg: a model config dict (``num_hidden_layers`` gives the layer count).

    Returns:
        ``(window, layer ids)``; ``(None, [])`` when no layer is windowed.

    Raises:
        ModelConfigError: ``sliding_window`` or ``layer_types`` malformed.
    """
    model_type = cfg.get("model_type")
    window = cfg.get("sliding_window", MISTRAL_DEFAULT_WINDOW if model_type == "mistral" else None)
    if window is None or window == 0:
        return None, []
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ModelConfigError("sliding_window", f"must be a non-negative integer or null, got {window!r}")
    ctx = cfg.get("max_position_embeddings")
    if ctx and window >= int(ctx):
        return None, []
    n = int(cfg.get("num_hidden_layers") or 0)
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n):
        raise ModelConfigError("layer_types", f"must be a list of {n} layer types")
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return None, []
        if types is None:
            first = int(cfg.get("max_window_layers", 28))
            layers = list(range(first, n))
        else:
            layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif types is not None and model_type != "mistral":  # transformers' Mistral ignores layer_types
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    else:
        layers = list(range(n))
    return (window, layers) if layers else (None, [])
