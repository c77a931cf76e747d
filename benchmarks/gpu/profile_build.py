"""Where the host time of a routed forward's graph build goes (issue 19, session 17).

Session 17's trace (``trace_chain.py --forward``, H200): the routed one-token forward of the random 8B shape
needs 5.9 ms of GPU (MLX's own: 7.4 ms) but 5.9 ms of Python graph build (MLX's: 1.65 ms), so it runs
host-bound (13.8 ms pipelined against 9.6). This script attributes that build time:

1. the build (no evaluation; the cache put back after each) of the forward, median of ``--repeats``, at
   M = 1 and 16, for the unrouted model and for twins routed step by step as the target adapter routes:
   quantized linears, + SwiGLU MLPs (gate and up fused), + attention (q, k, v fused; verify_attention);
2. per call: a bound routed linear, ``verify_attention`` and MLX's attention on the same arrays, and the
   trivial one-thread-per-element ``cuda_kernel`` with a small and with an 8 KB header (what MLX's
   custom-kernel path costs per byte of source);
3. ``cProfile`` of the forward's build as the target adapter routes it (compiled layers on a GPU, session 20) at
   M = 1 and 16 (top functions by own and cumulative time) -> ``--out`` ``.M1.prof.txt``, ``.M16.prof.txt``.

    python benchmarks/gpu/profile_build.py --out $OUT/build.json
"""

from __future__ import annotations

import mlx_dflash2  # noqa: F401  (before MLX)

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def log(msg):
    print(f"[build {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def med_us(fn, repeats, after=None):
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
        if after is not None:
            after(out)
    return statistics.median(ts) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--compile-on-cpu", action="store_true", help="the compiled variant on the CPU too (a check)")
    a = p.parse_args(argv)
    from mlx_lm.models.cache import make_prompt_cache
    from random_targets import build_target, twin

    from mlx_dflash2.kernels import backend, route_attention, route_mlps, route_quantized_linears, verify_attention

    be = backend()
    res = {"backend": be, "mlx": mx.__version__, "rows": []}

    def save():
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))

    model, cfg = build_target(a.shape)
    mode = "kernel" if be != "cpu" else None
    variants = [("mlx", model)]
    for steps in (("linears",), ("linears", "mlps"), ("linears", "mlps", "attention")):
        m = twin(model, cfg)
        route_quantized_linears(m, mode=mode)
        if "mlps" in steps:
            route_mlps(m.model.layers, mode=mode)
        if "attention" in steps:
            route_attention(m.model.layers, mode=mode)
        variants.append(("+".join(steps), m))
    if be != "cpu" or a.compile_on_cpu:  # the routed layers' graphs built by compiled functions (kernels/block.py)
        from mlx_dflash2.kernels.block import route_blocks

        m = twin(model, cfg)
        route_quantized_linears(m, mode=mode)
        route_mlps(m.model.layers, mode=mode)
        route_attention(m.model.layers, mode=mode)
        route_blocks(m.model.layers)
        variants.append(("linears+mlps+attention+compile", m))
    ctx = 1024
    for name, m in variants:
        for M in (1, 16):
            cache = make_prompt_cache(m)
            mx.eval(m(mx.zeros((1, ctx), dtype=mx.int32), cache=cache))
            ids = mx.zeros((1, M), dtype=mx.int32)

            def fwd(m=m, cache=cache, ids=ids):
                return m(ids, cache=cache)

            def reset(y, cache=cache, M=M):
                mx.eval(y, [c.state for c in cache])
                for c in cache:
                    c.trim(M)

            for _ in range(3):
                reset(fwd())
            us = med_us(fwd, a.repeats, reset)
            row = {"what": "forward build", "variant": name, "M": M, "build_us": round(us, 1)}
            res["rows"].append(row)
            log(json.dumps(row))
            save()
            if name == variants[-1][0]:  # the last variant (the target adapter's routing) at both widths
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(a.repeats):
                    reset(fwd())
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
                s.write("\n\n---- by cumulative time ----\n")
                pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
                text = s.getvalue().replace(str(Path(__file__).resolve().parents[2]) + "/", "").replace(str(Path.home()), "~")
                if a.out:
                    Path(a.out).with_suffix(f".M{M}.prof.txt").write_text(text)
                print(text[:6000], flush=True)

    # per call: one routed linear (bound), verify_attention vs MLX's attention, trivial kernels
    routed = variants[3][1]  # linears+mlps+attention
    lin = routed.model.layers[0].self_attn.inner.o_proj
    for M in (1, 16):
        x = mx.zeros((1, M, lin.weight.shape[1] * 32 // lin.bits), dtype=mx.bfloat16)
        mx.eval(lin(x))
        us = med_us(lambda: lin(x), a.repeats * 10)
        res["rows"].append({"what": "routed o_proj call", "M": M, "build_us": round(us, 2), "type": type(lin).__name__})
        log(json.dumps(res["rows"][-1]))
    H, Hk, D, S = cfg.get("num_attention_heads", 32), cfg.get("num_key_value_heads", 8), 128, 1280
    k = mx.zeros((1, Hk, S, D), dtype=mx.bfloat16)
    v = mx.zeros((1, Hk, S, D), dtype=mx.bfloat16)
    for M in (1, 16):
        q = mx.zeros((1, H, M, D), dtype=mx.bfloat16)
        mask = "causal" if M > 1 else None
        ops = [("mlx sdpa", lambda: mx.fast.scaled_dot_product_attention(q, k[:, :, :1024], v[:, :, :1024],
                                                                         scale=D**-0.5, mask=mask))]
        if be != "cpu":
            ops.append(("verify_attention", lambda: verify_attention(q, k, v, 1024, D**-0.5)))
        for nm, fn in ops:
            mx.eval(fn())
            us = med_us(fn, a.repeats * 10)
            res["rows"].append({"what": f"{nm} call", "M": M, "build_us": round(us, 2)})
            log(json.dumps(res["rows"][-1]))
    if be == "cuda":
        body = "  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < x_shape[0]) y[i] = x[i] + T(1);\n"
        big = "".join(f"__device__ inline float dflash_pad_{i}(float a) {{ return a * {i}.0f + 1.0f; }}\n"
                      for i in range(120))  # ~8 KB of real definitions
        x = mx.zeros((4096,), dtype=mx.bfloat16)
        for nm, header in (("small header", ""), (f"{len(big)} B header", big)):
            kern = mx.fast.cuda_kernel(name="plus_one_" + nm.split()[0], input_names=["x"], output_names=["y"],
                                       source=body, header=header)

            def call(kern=kern):
                return kern(inputs=[x], template=[("T", mx.bfloat16)], grid=(4096, 1, 1), threadgroup=(256, 1, 1),
                            output_shapes=[(4096,)], output_dtypes=[mx.bfloat16])[0]

            mx.eval(call())
            us = med_us(call, a.repeats * 10)
            res["rows"].append({"what": f"trivial cuda_kernel call, {nm}", "build_us": round(us, 2)})
            log(json.dumps(res["rows"][-1]))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
