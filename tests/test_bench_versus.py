"""benchmarks/bench_versus.py builds our proposer as ``mlx_dflash2.load`` does (issue 21's head to head)."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_dflash2.assets import embedded_model_path
from mlx_dflash2.drafter.io import is_quantized

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_versus.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_versus", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU rule expands drafters on the CPU backend only")
def test_ours_beside_a_dense_target_runs_a_dense_drafter(smol_f32, quick_calibration):
    """The shipped 4-bit drafter beside a dense target is expanded, as ``load`` does on the CPU (the bench kept it
    packed until session 34: a 16-row quantized matmul per layer, rounds ~2x the CLI's); beside a packed target
    (``--dequantize`` off) it stays packed."""
    target, tok = smol_f32
    bench, name = _bench(), str(embedded_model_path())
    p = bench.ours_proposer("auto", target, tok, name, dequantize=True)
    assert not is_quantized(p.drafter.model)
    p = bench.ours_proposer("auto", target, tok, name, dequantize=False)
    assert is_quantized(p.drafter.model)
