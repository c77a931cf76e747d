"""``mlx_dflash2.selftest``: run every registered kernel against its reference on this machine.

For Mac users (and any GPU machine): each op of the registry (:mod:`mlx_dflash2.kernels`) on a few
representative shapes and dtypes goes through the same numerics gate the package runs at first use
(kernel vs pure-MLX reference, row-count invariance where promised), then both are timed. One line
per case: op, shape, dtype, max relative error, kernel / reference / MLX built-in time (ms, median
of single calls: a health check, not a benchmark; ``benchmarks/bench_kernels.py`` times chains), and
``pass`` or ``fallback: <why>`` (the package would then use the reference, with one warning). On the
CPU backend there are no kernels: the table says so and the reference path is checked.

Exit status 0 when every kernel that exists for the backend passes (fallbacks exit 1).
"""

from __future__ import annotations

from . import _blas  # noqa: F401  (the package's __init__ has loaded OpenBLAS first)

import argparse
import statistics
import sys
import time

import mlx.core as mx

__all__ = ["main", "cases"]


def cases(quick: bool = False, cpu: bool = False) -> list[tuple[str, tuple]]:
    """``(op name, shape key)`` of the cases the selftest runs (small float32 ones on the CPU, where
    only the references run and half-precision matmuls are slow)."""
    out = []
    if cpu:
        dtypes, mats, heads = ("float32",), ((256, 512),), ((4, 2, 64),)
    else:
        dtypes = ("bfloat16", "float16") if quick else ("bfloat16", "float16", "float32")
        mats = ((1024, 4096),) if quick else ((1024, 4096), (4096, 4096))
        heads = ((32, 8, 128), (14, 2, 64)) if quick else ((32, 8, 128), (14, 2, 64), (24, 4, 256))
    for dt in dtypes:
        for bits, gs in ((4, 64), (8, 64), (4, 32), (4, 128)):
            for n, k in mats:
                out.append(("qmm", (f"mlx.core.{dt}", bits, gs, n, k)))
        n, k = mats[0]  # o_proj and the MLP's down projection: the layer's residual added in the launch
        out.append(("qmm", (f"mlx.core.{dt}", 4, 64, n, k, "residual")))
        for h, hk, d in heads:
            out.append(("verify_attention", (f"mlx.core.{dt}", h, hk, d)))
            if (h, hk, d) == heads[0]:  # o_proj's layout (the routed layers' verify and plain step)
                out.append(("verify_attention", (f"mlx.core.{dt}", h, hk, d, "rows")))
            if d % 64 == 0:
                out.append(("qk_norm_rope", (f"mlx.core.{dt}", h, hk, d, True)))
        for dk in ((64,) if cpu else (128,) if quick else (128, 64)):
            out.append(("gated_delta_steps", (dt, dk)))
            out.append(("gated_delta_final", (dt, dk)))
        # the drafter side (one case each: small, fixed-size ops)
        out.append(("dynamic_conv", (dt, dt, "float32")))
        out.append(("selector_walk", (dt, 32)))
        out.append(("greedy_accept", (dt,)))
    return out


def _median_ms(fn, n=5) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main(argv=None) -> int:
    from . import kernels
    from .kernels.registry import backend

    p = argparse.ArgumentParser(prog="mlx_dflash2.selftest", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes and dtypes")
    args = p.parse_args(argv)
    be = backend()
    print(f"mlx {mx.__version__}, device {mx.default_device()}, kernel backend: {be}")
    if be == "cpu":
        print("No kernels run on MLX's CPU backend: every op uses its MLX reference (checked below).")
    header = f"{'op':17s} {'shape':34s} {'dtype':9s} {'max err':>9s} {'kernel':>8s} {'refer.':>8s} {'MLX':>8s}  status"
    print(header)
    print("-" * len(header))
    failed = 0
    for name, key in cases(args.quick, cpu=be == "cpu"):
        op = kernels.OPS[name]
        dt = key[0].split(".")[-1]
        shape = ",".join(str(v) for v in key[1:])
        call_args, kw = op.sample(key)
        ref_kw = {k: v for k, v in kw.items() if k != "config"}
        ref_ms = _median_ms(lambda: mx.eval(op.reference(*call_args, **ref_kw)))
        if be == "cpu" or be not in op.sources:
            ref = op.reference(*call_args, **ref_kw)
            ok = all(bool(mx.all(mx.isfinite(r)).item()) for r in (ref if isinstance(ref, tuple) else (ref,)))
            failed += not ok
            print(f"{name:17s} {shape:34s} {dt:9s} {'-':>9s} {'-':>8s} {ref_ms:8.3f} {ref_ms:8.3f}  "
                  f"{'reference only' if ok else 'reference NOT finite'}")
            continue
        gate = op.gate(be, key)
        if gate.ok:
            k_ms = _median_ms(lambda: mx.eval(op.launch(be, *call_args, **kw)))
            status = "pass"
        else:
            k_ms, status = float("nan"), f"fallback: {gate.reason}"
            failed += 1
        print(f"{name:17s} {shape:34s} {dt:9s} {gate.max_error:9.2e} {k_ms:8.3f} {ref_ms:8.3f} {ref_ms:8.3f}  {status}")
    if be == "cpu":
        print(f"\n{'the reference path runs' if not failed else 'the reference path FAILED'} (no kernels on the CPU backend)")
    else:
        print(f"\n{'all kernels pass' if not failed else f'{failed} case(s) fall back to the reference'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
