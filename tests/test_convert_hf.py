"""Converter: Hugging Face float checkpoints -> MLX (parity with mlx_lm.convert), config
handling (tied/untied heads, rope_parameters), overrides, atomic output and corrupt inputs."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from convert_helpers import load_dir_tensors, random_weights, tiny_config, write_hf
from mlx_dflash2.convert import (
    ConvertError,
    CorruptCheckpointError,
    MissingTensorError,
    OutputExistsError,
    OutputWriteError,
    ShapeMismatchError,
    UnsupportedFormatError,
    convert,
    parse_override,
)

ROOT = Path(__file__).resolve().parents[1]


def _mlx_lm_convert(src, dst, **kw):
    importlib.import_module("mlx_lm.convert").convert(str(src), str(dst), quantize=True, **kw)


def _assert_same_tensors(a_dir, b_dir):
    a, b = load_dir_tensors(a_dir), load_dir_tensors(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert mx.array_equal(a[k], b[k]).item(), f"{k} differs from mlx_lm.convert"


@pytest.mark.parametrize(
    "arch,tied,kw",
    [
        ("llama", True, {}),
        ("qwen2", False, {}),
        ("qwen3", True, {"q_bits": 3, "q_group_size": 32}),
        ("llama", False, {"q_bits": 8, "q_group_size": 128}),
    ],
)
def test_bit_identical_to_mlx_lm_convert(tmp_path, arch, tied, kw):
    cfg = tiny_config(arch, tied=tied)
    src = write_hf(tmp_path / "src", cfg, random_weights(cfg), shards=2)
    res = convert(src, tmp_path / "ours", progress=False, **kw)
    _mlx_lm_convert(src, tmp_path / "ref", **kw)
    _assert_same_tensors(tmp_path / "ours", tmp_path / "ref")
    ours = json.loads((tmp_path / "ours/config.json").read_text())
    ref = json.loads((tmp_path / "ref/config.json").read_text())
    assert ours["quantization"] == ref["quantization"] == ours["quantization_config"]
    assert len(res.requantized) > 0 and not res.exact


def test_fp16_and_fp32_sources(tmp_path):
    for dt, name in ((mx.float16, "float16"), (mx.float32, "float32")):
        cfg = tiny_config("llama", torch_dtype=name)
        src = write_hf(tmp_path / f"src-{name}", cfg, random_weights(cfg, dtype=dt))
        convert(src, tmp_path / f"ours-{name}", progress=False)
        _mlx_lm_convert(src, tmp_path / f"ref-{name}")
        _assert_same_tensors(tmp_path / f"ours-{name}", tmp_path / f"ref-{name}")


def _greedy_agreement(src_dir, out_dir, n=48):
    """Teacher-forced top-1 agreement between the float source and the converted model."""
    import mlx_lm

    ref, _ = mlx_lm.load(str(src_dir))
    got, _ = mlx_lm.load(str(out_dir))
    ids = mx.array(np.random.default_rng(1).integers(0, 250, size=(1, n)))
    a = mx.argmax(ref(ids).astype(mx.float32), -1)
    b = mx.argmax(got(ids).astype(mx.float32), -1)
    return float(mx.mean(a == b).item())


@pytest.mark.parametrize("layout", ["tied", "untied", "tied+redundant_head"])
def test_head_layouts_load_and_agree(tmp_path, layout):
    """known-bugs row 14: tied, untied, and tied with a redundant lm_head tensor."""
    import mlx_lm

    cfg = tiny_config("llama", tied=layout != "untied", torch_dtype="float32")
    w = random_weights(cfg, dtype=mx.float32, with_head=layout != "tied")
    src = write_hf(tmp_path / "src", cfg, w)
    res = convert(src, tmp_path / "out", progress=False, q_bits=8, q_group_size=32)
    out = load_dir_tensors(tmp_path / "out")
    heads = [k for k in out if k.startswith("lm_head.")]
    if layout == "untied":
        assert heads == ["lm_head.biases", "lm_head.scales", "lm_head.weight"] or sorted(heads) == sorted(
            ["lm_head.weight", "lm_head.scales", "lm_head.biases"]
        )
    else:
        assert heads == []
    if layout == "tied+redundant_head":
        assert any("redundant" in n for n in res.notes)
    mlx_lm.load(str(tmp_path / "out"))
    assert _greedy_agreement(src, tmp_path / "out") >= 0.95


def test_missing_tie_flag_and_rope_parameters(tmp_path):
    import mlx_lm

    cfg = tiny_config("llama", tied=False)
    del cfg["tie_word_embeddings"]
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    src = write_hf(tmp_path / "src", cfg, random_weights(cfg, with_head=True))
    res = convert(src, tmp_path / "out", progress=False)
    out_cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert out_cfg["tie_word_embeddings"] is False and any("tie_word_embeddings" in n for n in res.notes)
    assert out_cfg["rope_theta"] == 500000.0
    assert "lm_head.weight" in load_dir_tensors(tmp_path / "out")
    model, _ = mlx_lm.load(str(tmp_path / "out"))
    assert model.model.layers[0].self_attn.rope.base == 500000.0


def test_rope_parameters_with_scaling_and_conflict(tmp_path):
    cfg = tiny_config("llama")
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}
    src = write_hf(tmp_path / "src", cfg, random_weights(cfg))
    convert(src, tmp_path / "out", progress=False)
    out_cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert out_cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    cfg["rope_theta"] = 5.0
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="rope_theta"):
        convert(src, tmp_path / "out2", progress=False)
    assert not (tmp_path / "out2").exists()


def test_overrides_keep_head_and_embeddings_at_8_bits(tmp_path):
    import mlx_lm

    cfg = tiny_config("qwen2", tied=False)
    src = write_hf(tmp_path / "src", cfg, random_weights(cfg))
    ov = [parse_override("embed_tokens=8"), parse_override("lm_head=8:32"), parse_override(r"layers\.1\.mlp\.down_proj=none")]
    convert(src, tmp_path / "out", progress=False, overrides=ov)
    q = json.loads((tmp_path / "out/config.json").read_text())["quantization"]
    assert q["model.embed_tokens"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert q["lm_head"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    out = load_dir_tensors(tmp_path / "out")
    assert "model.layers.1.mlp.down_proj.scales" not in out and out["model.layers.1.mlp.down_proj.weight"].dtype == mx.bfloat16
    model, _ = mlx_lm.load(str(tmp_path / "out"))
    assert model.lm_head.bits == 8 and model.lm_head.group_size == 32


def test_float_output_and_dtype(tmp_path):
    cfg = tiny_config("llama")
    src = write_hf(tmp_path / "src", cfg, random_weights(cfg))
    convert(src, tmp_path / "out", progress=False, quantize=False, dtype="float16")
    out = load_dir_tensors(tmp_path / "out")
    assert all(v.dtype == mx.float16 for v in out.values())
    assert "quantization" not in json.loads((tmp_path / "out/config.json").read_text())


def test_tokenizer_and_chat_template_carried_over(tmp_path):
    from mlx_dflash2.loading import load_target

    cfg = tiny_config("llama")
    src = write_hf(tmp_path / "src", cfg, random_weights(cfg))
    convert(src, tmp_path / "out", progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / f).read_bytes() == (src / f).read_bytes()
    target, tok, _ = load_target(str(tmp_path / "out"))  # our own loader
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------
# output handling and corrupt inputs
# ---------------------------------------------------------------------------


def _no_leftovers(parent: Path, name: str):
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_refuses_to_overwrite_unless_asked(tmp_path):
    cfg = tiny_config("llama")
    src = write_hf(tmp_path / "src", cfg, random_weights(cfg))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(OutputExistsError):
        convert(src, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "keep.txt").exists()
    convert(src, tmp_path / "out", progress=False, overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_override_matching_nothing_is_noted(tmp_path):
    cfg = tiny_config("llama")  # tied: there is no lm_head layer
    src = write_hf(tmp_path / "src", cfg, random_weights(cfg))
    res = convert(src, tmp_path / "out", progress=False, overrides=[parse_override("lm_head=8"),
                                                                    parse_override("embed_tokens=8")])
    assert [n for n in res.notes if "--q-override 'lm_head' matches no quantizable layer" in n]
    assert not [n for n in res.notes if "'embed_tokens' matches no" in n]


def test_unwritable_output_is_a_clear_error(tmp_path, monkeypatch):
    cfg = tiny_config("llama")
    src = write_hf(tmp_path / "src", cfg, random_weights(cfg))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputWriteError, match="cannot create the output"):
        convert(src, tmp_path / "afile" / "out", progress=False)  # a file where a directory must be
    import mlx_dflash2.convert.writer as writer

    def full_disk(*a, **k):
        raise RuntimeError("[write] Unable to write 34655 bytes to file.")

    monkeypatch.setattr(writer.mx, "save_safetensors", full_disk)
    with pytest.raises(OutputWriteError, match="cannot write shard"):
        convert(src, tmp_path / "new" / "deep" / "out", progress=False)
    assert not (tmp_path / "new").exists()  # the parents it created are gone too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "src"]


def _src(tmp_path, **kw):
    cfg = tiny_config("llama", **kw)
    return write_hf(tmp_path / "src", cfg, random_weights(cfg), shards=2), cfg


def test_truncated_safetensors(tmp_path):
    src, _ = _src(tmp_path)
    f = src / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-00002.safetensors"):
        convert(src, tmp_path / "out", progress=False)
    _no_leftovers(tmp_path, "out")


def test_garbage_header(tmp_path):
    src, _ = _src(tmp_path)
    (src / "model-00001-of-00002.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CorruptCheckpointError, match="model-00001-of-00002"):
        convert(src, tmp_path / "out", progress=False)
    _no_leftovers(tmp_path, "out")


def test_missing_tensor(tmp_path):
    cfg = tiny_config("llama")
    w = random_weights(cfg)
    del w["model.layers.1.mlp.up_proj.weight"]
    src = write_hf(tmp_path / "src", cfg, w)
    with pytest.raises(MissingTensorError, match="model.layers.1.mlp.up_proj.weight"):
        convert(src, tmp_path / "out", progress=False)
    _no_leftovers(tmp_path, "out")


def test_unexpected_tensor_is_not_dropped(tmp_path):
    cfg = tiny_config("llama")
    w = random_weights(cfg)
    w["model.layers.0.mystery.weight"] = mx.zeros((4, 4))
    src = write_hf(tmp_path / "src", cfg, w)
    with pytest.raises(MissingTensorError, match="mystery"):
        convert(src, tmp_path / "out", progress=False)


def test_shape_mismatch(tmp_path):
    cfg = tiny_config("llama")
    w = random_weights(cfg)
    w["model.layers.0.self_attn.k_proj.weight"] = mx.zeros((32, 128), dtype=mx.bfloat16)
    src = write_hf(tmp_path / "src", cfg, w)
    with pytest.raises(ShapeMismatchError, match=r"k_proj.weight has shape \(32, 128\), expected \(64, 128\)"):
        convert(src, tmp_path / "out", progress=False)
    _no_leftovers(tmp_path, "out")


def test_index_names_missing_shard(tmp_path):
    src, _ = _src(tmp_path)
    os.remove(src / "model-00002-of-00002.safetensors")
    with pytest.raises(MissingTensorError, match="model-00002-of-00002"):
        convert(src, tmp_path / "out", progress=False)


@pytest.mark.parametrize(
    "qc,match",
    [
        ({"quant_method": "fp8", "fmt": "e4m3"}, "fp8"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
        ({"quant_method": "mystery"}, "mystery"),
    ],
)
def test_unknown_quantization_refused(tmp_path, qc, match):
    src, cfg = _src(tmp_path, quantization_config=qc)
    with pytest.raises(UnsupportedFormatError, match=match):
        convert(src, tmp_path / "out", progress=False)
    _no_leftovers(tmp_path, "out")


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    """An error while writing tensors (after shards began) removes the temporary output."""
    from mlx_dflash2.convert import writer

    src, _ = _src(tmp_path)
    calls = {"n": 0}
    orig = writer.ShardWriter.add

    def boom(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 12:
            raise KeyboardInterrupt
        return orig(self, *a, **k)

    monkeypatch.setattr(writer.ShardWriter, "add", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "out", progress=False, shard_bytes=20_000)
    _no_leftovers(tmp_path, "out")


def test_cli_and_python_m(tmp_path):
    src, _ = _src(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "mlx_dflash2.convert", str(src), str(tmp_path / "out"), "--quiet",
         "--q-override", "embed_tokens=8"],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["format"] == "hf" and info["tensors"] > 0
    r = subprocess.run(
        [sys.executable, "-m", "mlx_dflash2.convert", str(src), str(tmp_path / "out"), "--quiet"],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )
    assert r.returncode == 2 and "exists" in r.stderr


def test_hub_id_resolved_offline_from_cache(tmp_path, monkeypatch):
    """A hub id is resolved through huggingface_hub's cache without network access."""
    cfg = tiny_config("llama")
    cache = tmp_path / "hub"
    snap = cache / "models--someorg--tiny-llama" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    write_hf(snap, cfg, random_weights(cfg))
    (cache / "models--someorg--tiny-llama" / "refs").mkdir(parents=True)
    (cache / "models--someorg--tiny-llama" / "refs" / "main").write_text(snap.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    res = convert("someorg/tiny-llama", tmp_path / "out", progress=False)
    assert res.format == "hf" and (tmp_path / "out" / "model.safetensors").exists()
    with pytest.raises(ConvertError, match="someorg/absent"):
        convert("someorg/absent", tmp_path / "out2", progress=False)


def test_forced_format_and_mlx_input(tmp_path):
    cfg = tiny_config("llama")
    src = write_hf(tmp_path / "src", cfg, random_weights(cfg))
    convert(src, tmp_path / "out", progress=False)
    with pytest.raises(UnsupportedFormatError, match="already an MLX model"):
        convert(tmp_path / "out", tmp_path / "again", progress=False)
    with pytest.raises(UnsupportedFormatError, match="uint32"):
        convert(tmp_path / "out", tmp_path / "again", progress=False, from_format="hf")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("cpu_only,dtype_flag,noted", [(True, [], True), (False, [], False),
                                                       (True, ["--dtype", "float32"], False)])
def test_cpu_half_precision_note(tmp_path, monkeypatch, capsys, cpu_only, dtype_flag, noted):
    """On a CPU-only MLX a half-precision default output gets a printed note recommending float32."""
    import mlx_dflash2.convert.pipeline as pipeline
    from mlx_dflash2.convert.cli import main

    monkeypatch.setattr(pipeline, "_cpu_only", lambda: cpu_only)
    src, _ = _src(tmp_path)  # bfloat16 source: bfloat16 output by default
    assert main([str(src), str(tmp_path / "out"), "--quiet", *dtype_flag]) == 0
    err = capsys.readouterr().err
    assert ("note: this MLX runs on the CPU" in err and "--dtype float32" in err) == noted, err
