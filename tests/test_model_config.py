"""Model config normalisation (mlx_dflash2/modelconfig.py), through the runtime loader and
the converter: RoPE under ``rope_parameters`` (transformers >= 5) and sliding windows.

The expected inverse frequencies and attention scales are the transformers 5 definitions
(``transformers/modeling_rope_utils.py``: ``_compute_*_parameters`` and
``standardize_rope_params``), restated below in float64 numpy; they never call our code or
mlx-lm's rope code. (transformers' own ``ROPE_INIT_FUNCTIONS`` need torch, which is not
installed.) The built model is measured from the outside: its layer-0 rope module rotates
unit vectors at two consecutive positions, the angle step is the inverse frequency and the
length the q/k multiplier, so the attention scale is ``attn.scale * length**2``."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest

from convert_helpers import random_weights, tiny_config, write_hf

HEAD_DIM = 32


# ---------------------------------------------------------------------------
# The reference: transformers 5 modeling_rope_utils, restated
# ---------------------------------------------------------------------------


def hf_rope(rtype: str, theta: float, p: dict, max_pos: int, seq_len: int | None = None, dim: int = HEAD_DIM):
    """``(inv_freq [dim/2] float64, attention_factor)`` of transformers 5 for one rope block
    ``p`` (already standardized: ``original_max_position_embeddings`` defaults to
    ``max_position_embeddings``)."""
    idx = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv = 1.0 / theta**idx
    if rtype == "default":
        return inv, 1.0
    if rtype == "linear":  # _compute_linear_scaling_rope_parameters
        return inv / p["factor"], 1.0
    if rtype == "dynamic":  # _compute_dynamic_ntk_parameters (seq_len = max position id + 1)
        s = max(seq_len or max_pos, max_pos)
        base = theta * ((p["factor"] * s / max_pos) - (p["factor"] - 1)) ** (dim / (dim - 2))
        return 1.0 / base**idx, 1.0
    if rtype == "yarn":  # _compute_yarn_parameters
        orig = p.get("original_max_position_embeddings", max_pos)
        factor = p.get("factor") or max_pos / orig

        def get_mscale(scale, mscale=1.0):
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        af = p.get("attention_factor")
        if af is None:
            if p.get("mscale") and p.get("mscale_all_dim"):
                af = get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"])
            else:
                af = get_mscale(factor)
        beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

        def correction_dim(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        extrapolation = 1 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
        pos_freqs = theta**idx
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, af
    if rtype == "llama3":  # _compute_llama3_parameters
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p.get("original_max_position_embeddings", max_pos)
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return np.where(medium, smoothed, out), 1.0
    raise ValueError(rtype)


def test_reference_matches_published_values():
    """Sanity of the restated formulas on two hand-checkable points."""
    inv, af = hf_rope("yarn", 10000.0, {"factor": 4.0, "original_max_position_embeddings": 32}, 128)
    assert af == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert inv[0] == 1.0 and inv[-1] == pytest.approx(1.0 / (4.0 * 10000.0 ** (30 / 32)))
    inv, _ = hf_rope("llama3", 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}, 131072, dim=128)
    assert inv[0] == 1.0 and inv[-1] == pytest.approx(500000.0 ** (-126 / 128) / 8.0)


# ---------------------------------------------------------------------------
# Measuring a built model
# ---------------------------------------------------------------------------


def probe(attn, pos: int):
    """An attention module's rope at positions ``pos`` and ``pos + 1``: ``(inverse frequencies,
    attention scale)``.

    A non-traditional rope rotates the pairs ``(i, i + d/2)``: a unit vector ``(1, 0)`` in each
    pair comes back as ``m * (cos(p*f_i), sin(p*f_i))``; the angle step between the two rows is
    ``f_i`` and ``m`` multiplies queries and keys alike, so the logits scale by ``m**2``."""
    d = HEAD_DIM
    x = mx.concatenate([mx.ones((1, 1, 2, d // 2)), mx.zeros((1, 1, 2, d // 2))], axis=-1)
    y = np.array(attn.rope(x, offset=pos).astype(mx.float32), dtype=np.float64)[0, 0]
    c, s = y[:, : d // 2], y[:, d // 2 :]
    ang = np.arctan2(s, c)
    step = (ang[1] - ang[0] + np.pi) % (2 * np.pi) - np.pi
    m = np.hypot(c, s)
    assert np.allclose(m, m[0, 0], rtol=1e-5)
    return step, float(attn.scale) * float(m[0, 0]) ** 2


# (config fields, reference type, reference params, max_position_embeddings, probe position)
CASES = {
    "default-theta-in-rope_parameters": ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
                                         "default", {}, 512, 1),
    "linear": ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0}},
               "linear", {"factor": 4.0}, 512, 1),
    "dynamic-short": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 20000.0}},
                      "dynamic", {"factor": 2.0}, 64, 5),
    "dynamic-long": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 20000.0}},
                     "dynamic", {"factor": 2.0}, 64, 150),
    "yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                  "rope_theta": 1000000.0}},
             "yarn", {"factor": 4.0, "original_max_position_embeddings": 32}, 128, 1),
    "yarn-theta-beside-not-inside": ({"rope_theta": 50000.0, "rope_parameters": {"rope_type": "yarn", "factor": 8.0}},
                                     "yarn", {"factor": 8.0}, 128, 1),
    "yarn-mscale-betas": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                               "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                                               "rope_theta": 10000.0}},
                          "yarn", {"factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                                   "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2}, 128, 1),
    "yarn-mscale-alone-ignored": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.7,
                                                       "original_max_position_embeddings": 32, "rope_theta": 10000.0}},
                                  "yarn", {"factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.7}, 128, 1),
    "yarn-legacy-rope_scaling": ({"rope_theta": 1000000.0, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                            "original_max_position_embeddings": 32}},
                                 "yarn", {"factor": 4.0, "original_max_position_embeddings": 32}, 128, 1),
    "llama3": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                    "rope_theta": 10000.0}},
               "llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}, 512, 1),
}


def _theta(fields):
    return float((fields.get("rope_parameters") or {}).get("rope_theta") or fields.get("rope_theta") or 10000.0)


def model_dir(path, arch, fields, max_pos, **over):
    cfg = tiny_config(arch, torch_dtype="float32", max_position_embeddings=max_pos, **over)
    if arch == "qwen2":
        cfg.pop("head_dim")  # mlx-lm's qwen2 derives hidden_size // heads (= 32)
    cfg.pop("rope_theta")
    cfg.update(fields)
    plain = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}  # shapes only
    w = random_weights(plain, dtype=mx.float32)
    return write_hf(path, cfg, w)


def _check(model, rtype, fields, params, max_pos, pos):
    """Layer 0 of ``model`` (an mlx-lm model or a drafter) against the reference."""
    layers = model.model.layers if hasattr(model, "model") else model.layers
    inv, scale = probe(layers[0].self_attn, pos)
    want_inv, af = hf_rope(rtype, _theta(fields), params, max_pos, seq_len=pos + 2)
    np.testing.assert_allclose(inv, want_inv, rtol=2e-4, atol=0)
    assert scale == pytest.approx(HEAD_DIM**-0.5 * af**2, rel=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_runtime_loader_builds_the_transformers_rope(tmp_path, arch, case):
    from mlx_dflash2.loading import load_target

    fields, rtype, params, max_pos, pos = CASES[case]
    src = model_dir(tmp_path / "m", arch, fields, max_pos)
    target, _, _ = load_target(str(src), dtype=mx.float32)
    _check(target.model, rtype, fields, params, max_pos, pos)
    assert target.config["rope_theta"] == _theta(fields)  # what init_drafter copies


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_converter_writes_the_transformers_rope(tmp_path, arch, case):
    """The converted directory gives the same rope in plain mlx-lm (no normalisation at load)."""
    import mlx_lm

    from mlx_dflash2.convert import convert
    from mlx_dflash2.loading import load_target

    fields, rtype, params, max_pos, pos = CASES[case]
    src = model_dir(tmp_path / "m", arch, fields, max_pos)
    convert(src, tmp_path / "out", progress=False, quantize=False, dtype="float32")
    out_cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert out_cfg["rope_theta"] == _theta(fields)
    model, _ = mlx_lm.load(str(tmp_path / "out"))
    _check(model, rtype, fields, params, max_pos, pos)
    load_target(str(tmp_path / "out"))  # rope_scaling next to rope_parameters: consistent, accepted


def test_mistral_uses_llama_rope_normalisation(tmp_path):
    from mlx_dflash2.loading import load_target

    fields, rtype, params, max_pos, pos = CASES["yarn"]
    cfg_over = {"sliding_window": None, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    src = model_dir(tmp_path / "m", "llama", fields, max_pos, **cfg_over)
    target, _, _ = load_target(str(src), dtype=mx.float32)
    _check(target.model, rtype, fields, params, max_pos, pos)


@pytest.mark.parametrize(
    "fields,field,match",
    [
        ({"rope_parameters": {"rope_type": "foo", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters.rope_type", "'foo'"),
        ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.0] * 16,
                              "rope_theta": 1e4}}, "rope_parameters.rope_type", "'longrope' is not supported"),
        ({"rope_scaling": {"type": "foo", "factor": 2.0}}, "rope_scaling.rope_type", "'foo'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5, "rope_theta": 1e4}},
         "rope_parameters.attention_factor", "1.5"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "truncate": False, "rope_theta": 1e4}},
         "rope_parameters.truncate", "truncates"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters.factor", "missing"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "rope_parameters.partial_rotary_factor", "0.5"),
        ({"rope_theta": 5.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_theta", "disagrees"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
          "rope_scaling": {"rope_type": "linear", "factor": 3.0}}, "rope_scaling", "disagrees"),
    ],
)
def test_bad_rope_settings_are_errors_naming_the_field(tmp_path, fields, field, match):
    from mlx_dflash2.convert import ConvertError, convert
    from mlx_dflash2.loading import load_target
    from mlx_dflash2.modelconfig import ModelConfigError

    src = model_dir(tmp_path / "m", "llama", fields, 512)
    with pytest.raises(ModelConfigError, match=match) as e:
        load_target(str(src))
    assert e.value.field == field and str(src) in str(e.value)
    with pytest.raises(ConvertError, match=match) as e2:
        convert(src, tmp_path / "out", progress=False)
    assert repr(field) in str(e2.value)
    assert not (tmp_path / "out").exists()


def test_accepted_attention_factor_and_unset_betas(tmp_path):
    """An explicit attention_factor equal to the derived one, and beta_fast/beta_slow null, load."""
    from mlx_dflash2.loading import load_target

    af = 0.1 * math.log(4.0) + 1.0
    fields = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": af, "beta_fast": None,
                                  "beta_slow": None, "rope_theta": 1e4}}
    src = model_dir(tmp_path / "m", "qwen2", fields, 128)
    target, _, _ = load_target(str(src), dtype=mx.float32)
    _check(target.model, "yarn", fields, {"factor": 4.0}, 128, 1)


def test_normalize_rope_unit():
    from mlx_dflash2.modelconfig import normalize_rope

    raw = {"model_type": "qwen2", "max_position_embeddings": 128,
           "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}
    got = normalize_rope(raw)
    assert raw["rope_parameters"] == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}  # input untouched
    assert got["rope_theta"] == 1e6
    assert got["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                   "beta_fast": 32, "beta_slow": 1}
    assert normalize_rope({"model_type": "qwen2"})["rope_theta"] == 10000.0  # transformers' default, not mlx-lm's 1e6
    # a top-level original_max_position_embeddings wins (transformers' standardize_rope_params)
    got = normalize_rope(dict(raw, original_max_position_embeddings=64))
    assert got["rope_scaling"]["original_max_position_embeddings"] == 64
    # other families: mirrored as given; unknown types refused
    other = normalize_rope({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                                                      "short_factor": [1], "long_factor": [2]}})
    assert other["rope_theta"] == 1e4 and other["rope_scaling"]["type"] == "longrope"
    assert normalize_rope({"model_type": "gemma3", "rope_theta": 1e4}) == {"model_type": "gemma3", "rope_theta": 1e4}


def test_drafter_config_uses_the_same_rope_normalisation():
    """A drafter config with YaRN under rope_parameters (no original_max_position_embeddings): the
    drafter's rope is transformers' (mlx-lm alone would take an original context of 4096)."""
    from mlx_dflash2.drafter import DrafterConfig, DrafterConfigError, DraftModel

    cfg = {
        "architectures": ["DFlash2DraftModel"], "hidden_size": 128, "num_hidden_layers": 1, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": HEAD_DIM, "vocab_size": 100,
        "max_position_embeddings": 128, "is_causal": False,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
        "dflash_config": {"block_size": 8, "mask_token_id": 99, "target_layer_ids": [0], "conv_kernel_size": 2,
                          "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4},
    }
    c = DrafterConfig.from_dict(cfg)
    assert c.rope_theta == 1e6 and c.rope_scaling["original_max_position_embeddings"] == 128
    assert DrafterConfig.from_dict(c.to_dict()) == c
    model = DraftModel(c)
    _check(model, "yarn", cfg, {"factor": 4.0}, 128, 1)
    cfg["rope_parameters"]["rope_type"] = "foo"
    with pytest.raises(DrafterConfigError, match="foo") as e:
        DrafterConfig.from_dict(cfg)
    assert e.value.field == "rope_parameters.rope_type"


# ---------------------------------------------------------------------------
# Sliding windows
# ---------------------------------------------------------------------------

MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}


@pytest.mark.parametrize(
    "arch,over,refused",
    [
        ("llama", dict(MISTRAL, sliding_window=16), None),  # every layer: honoured through window caches
        ("llama", dict(MISTRAL, sliding_window=None), None),
        ("llama", dict(MISTRAL, sliding_window=512), None),  # >= max_position_embeddings (512): no effect
        ("llama", dict(MISTRAL), None),  # transformers' default window 4096 >= 512
        ("llama", dict(MISTRAL, max_position_embeddings=8192), None),  # ... < 8192: honoured
        ("qwen2", {"sliding_window": 16, "use_sliding_window": False}, None),  # Qwen2's usual setting
        ("qwen2", {"sliding_window": 16}, None),  # use_sliding_window defaults to false
        ("qwen2", {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1}, "layers [1]"),
        ("qwen2", {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 0}, None),
        ("llama", {"sliding_window": 16}, None),  # no layer_types: Mistral's meaning, every layer (honoured)
        ("llama", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}, "layers [0]"),
    ],
)
def test_sliding_window_in_config_honoured_or_refused(tmp_path, arch, over, refused):
    """A window mlx-lm's dense classes would ignore: on every layer it is honoured (window caches: one mask
    serves every layer), on some layers only it is refused; never run as full attention."""
    from mlx_dflash2.loading import load_target
    from mlx_dflash2.target import TargetCompatibilityError

    over = dict(over)
    fields = {"rope_theta": 10000.0}
    src = model_dir(tmp_path / "m", arch, fields, over.pop("max_position_embeddings", 512), **over)
    if "sliding_window" not in over:
        cfg = json.loads((src / "config.json").read_text())
        cfg.pop("sliding_window", None)
        (src / "config.json").write_text(json.dumps(cfg))
    if refused is None:
        target = load_target(str(src))[0]
        window = over.get("sliding_window", 4096 if over.get("model_type") == "mistral" else None)
        ctx = json.loads((src / "config.json").read_text()).get("max_position_embeddings")
        honoured = bool(window) and window < ctx and (arch != "qwen2" or over.get("use_sliding_window"))
        assert set(target.layer_kinds) == ({"window"} if honoured else {"attention"})
        return
    with pytest.raises(TargetCompatibilityError, match="sliding_window") as e:
        load_target(str(src))
    assert refused in str(e.value)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_sliding_window_metadata_honoured_or_refused(tmp_path, arch):
    from convert_helpers import write_gguf

    from mlx_dflash2.loading import load_target

    cfg = tiny_config(arch, head_dim=32)
    w = random_weights(cfg, dtype=mx.float32)
    f = write_gguf(tmp_path / "w.gguf", cfg, w, arch=arch, sliding_window=16)
    assert set(load_target(str(f))[0].layer_kinds) == {"window"}  # every layer windowed: honoured
    load_target(str(write_gguf(tmp_path / "full.gguf", cfg, w, arch=arch, sliding_window=512)))  # = the context
    load_target(str(write_gguf(tmp_path / "none.gguf", cfg, w, arch=arch)))


def test_converter_notes_a_window_mlx_lm_ignores(tmp_path):
    from mlx_dflash2.convert import convert

    src = model_dir(tmp_path / "m", "llama", {"rope_theta": 1e4}, 512, **dict(MISTRAL, sliding_window=16))
    res = convert(src, tmp_path / "out", progress=False, quantize=False)
    assert any("sliding_window=16 on 2 layers" in n for n in res.notes), res.notes
    src2 = model_dir(tmp_path / "m2", "llama", {"rope_theta": 1e4}, 512, **dict(MISTRAL, sliding_window=None))
    res = convert(src2, tmp_path / "out3", progress=False, quantize=False)
    assert not any("sliding_window" in n for n in res.notes)


def test_honoured_window_equals_an_independent_windowed_forward(tmp_path):
    """A Mistral-style window (every layer, mlx-lm's llama class ignores it) run through window caches:
    plain and speculative greedy equal a cache-free recompute with an explicit window mask per step."""
    import numpy as np

    from mlx_dflash2.loading import load_target
    from mlx_dflash2.speculative import speculative_generate_step

    from scripted import ScriptedProposer

    src = model_dir(tmp_path / "m", "llama", {"rope_theta": 10000.0}, 512, sliding_window=6)
    target = load_target(str(src), dtype=mx.float32)[0]
    inner = target.inner
    prompt = [(31 * i + 5) % 200 + 3 for i in range(9)]

    def windowed_next(seq):
        n = len(seq)
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        mask = mx.array((j <= i) & (j > i - 6))
        h = inner.embed_tokens(mx.array(seq)[None])
        for layer in inner.layers:
            h = layer(h, mask, None)
        return int(mx.argmax(target.logits(inner.norm(h))[0, -1]).item())

    ref = []
    for _ in range(20):
        ref.append(windowed_next(prompt + ref))
    plain = [t for t, _, _ in speculative_generate_step(prompt, target, None, max_tokens=20)]
    assert plain == ref
    prop = ScriptedProposer(len(prompt), ref, [0, 3, 1, 4], 5, target.vocab_rows)
    assert [t for t, _, _ in speculative_generate_step(prompt, target, prop, block_size=5, max_tokens=20)] == ref
