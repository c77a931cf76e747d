"""Kernels of the registry against MLX's built-in ops and their references, timed as dependent chains.

Every figure is a chain of the op over the layers of a real target shape, each layer with its own
weights (rotated: nothing stays in cache between layers), each layer's output feeding the next, as a
forward runs them. Independent calls queued together hide latency: that is how a 2.3x verify cost went
unseen (h200-profile.md), so none are timed here. Medians of ``--repeats`` synchronous chains.

    python benchmarks/bench_kernels.py                       # all shapes, M = 1, 2, 4, 8, 16
    python benchmarks/bench_kernels.py --shapes qwen3-8b --sweep   # + the qmm launch-geometry sweep
    python benchmarks/bench_kernels.py --check-only          # numerics only (what the CPU can do)

Per shape and M: the MLP chain (gate, up -> swiglu -> down) and the attention projections (q -> o with
k, v side branches) over the target's layers, with ``mx.quantized_matmul`` (MLX built-in = the
reference) and the ``qmm`` kernel; the ``verify_attention`` chain over the layers' KV caches (1K, 8K,
32K keys) against ``mx.fast.scaled_dot_product_attention``. Writes JSON (and a plot with --plot).
On a backend without kernels (CPU) it checks numerics only.
"""

from __future__ import annotations

import mlx_dflash2  # noqa: F401  (before MLX: the optimized OpenBLAS on Linux)

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from mlx_dflash2.kernels import backend, qmm, verify_attention
from mlx_dflash2.kernels.registry import KernelError

# name: (hidden, intermediate, heads, kv heads, head dim, layers)
SHAPES = {
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 24),
    "qwen2.5-1.5b": (1536, 8960, 12, 2, 128, 28),
    "qwen3-8b": (4096, 12288, 32, 8, 128, 36),
    "dense-27b": (5120, 17408, 40, 8, 128, 64),
}


def timed(fn, repeats: int) -> float:
    """Median wall-clock ms of ``fn()`` (which evaluates its own result), after two warm-ups."""
    fn(), fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def make_layers(hidden, inter, heads, kv, hd, n_layers, bits, gs, dtype, seed=0):
    """Per layer: quantized q, k, v, o, gate, up, down (each its own random weights)."""
    shapes = dict(q=(heads * hd, hidden), k=(kv * hd, hidden), v=(kv * hd, hidden), o=(hidden, heads * hd),
                  gate=(inter, hidden), up=(inter, hidden), down=(hidden, inter))
    layers = []
    key = mx.random.key(seed)
    for i in range(n_layers):
        layer = {}
        for name, shp in shapes.items():
            key, sub = mx.random.split(key)
            w = (mx.random.normal(shp, key=sub) * 0.02).astype(dtype)
            wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
            layer[name] = (wq, s.astype(dtype), b.astype(dtype))
        mx.eval(layer)
        layers.append(layer)
    return layers


def matmul_fn(kind: str, gs: int, bits: int, config=None):
    if kind == "mlx":
        return lambda x, p: mx.quantized_matmul(x, *p, transpose=True, group_size=gs, bits=bits)
    return lambda x, p: qmm(x, *p, gs, bits, mode="kernel", config=config)


def mlp_chain(layers, x, mm):
    for L in layers:
        g, u = mm(x, L["gate"]), mm(x, L["up"])
        x = x + mm(mx.sigmoid(g) * g * u, L["down"])
    return x


def proj_chain(layers, x, mm):
    for L in layers:
        q, k, v = mm(x, L["q"]), mm(x, L["k"]), mm(x, L["v"])
        x = x + mm(q + mx.tile(k + v, (1, q.shape[-1] // k.shape[-1])), L["o"])
    return x


def bench_qmm(shape, layers, M, repeats, dtype, gs, bits, kinds=("mlx", "kernel"), config=None):
    hidden = SHAPES[shape][0]
    x = (mx.random.normal((M, hidden)) * 0.1).astype(dtype)
    out = {}
    ref_out = {}
    for kind in kinds:
        mm = matmul_fn(kind, gs, bits, config)
        for fam, chain in (("mlp", mlp_chain), ("proj", proj_chain)):
            try:
                res = chain(layers[:2], x, mm)
                mx.eval(res)
                ref_out.setdefault(fam, {})[kind] = res
                out[f"{fam}_{kind}_ms"] = timed(lambda: mx.eval(chain(layers, x, mm)), repeats)
            except KernelError as e:
                out[f"{fam}_{kind}_ms"] = None
                out[f"{fam}_{kind}_error"] = str(e)[:300]
    for fam, r in ref_out.items():
        if "mlx" in r and "kernel" in r:
            a, b = r["mlx"].astype(mx.float32), r["kernel"].astype(mx.float32)
            out[f"{fam}_rel_err"] = float(mx.abs(a - b).max().item() / max(mx.abs(a).max().item(), 1e-6))
    return out


def bench_attention(shape, M, kv_len, repeats, dtype, configs=()):
    hidden, inter, heads, kv, hd, n_layers = SHAPES[shape]
    key = mx.random.key(1)
    caches = []
    S = ((kv_len + 255) // 256) * 256
    for i in range(n_layers):
        key, a, b = mx.random.split(key, 3)
        caches.append((mx.random.normal((1, kv, S, hd), key=a).astype(dtype),
                       mx.random.normal((1, kv, S, hd), key=b).astype(dtype)))
    mx.eval(caches)
    q0 = mx.random.normal((1, heads, M, hd)).astype(dtype)
    scale = hd**-0.5

    def chain(fn):
        q = q0
        for k, v in caches:
            q = fn(q, k, v)
        return q

    def mlx_fn(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k[:, :, :kv_len], v[:, :, :kv_len], scale=scale,
                                                    mask="causal" if M > 1 else None)

    def ker_fn(q, k, v, config=None):
        return verify_attention(q, k, v, kv_len, scale, mode="kernel", config=config)

    out = {}
    for cfg in configs:  # --sweep-attention: the kernel's geometry (ROWS, WARPS, KD, VB, PF; None: its default)
        try:
            t = timed(lambda: mx.eval(chain(lambda q, k, v: ker_fn(q, k, v, cfg))), max(3, repeats // 2))
        except Exception as e:  # a geometry that does not build
            t = f"error: {str(e)[:120]}"
        out.setdefault("attn_sweep", []).append(dict(zip(("ROWS", "WARPS", "KD", "VB", "PF"), cfg), ms=t))
        print(f"attention sweep {shape} M={M} kv={kv_len} ROWS/WARPS/KD/VB/PF={cfg}: {t}", flush=True)
    for kind, fn in (("mlx", mlx_fn), ("kernel", ker_fn)):
        try:
            out[f"attn_{kind}_ms"] = timed(lambda: mx.eval(chain(fn)), repeats)
        except KernelError as e:
            out[f"attn_{kind}_ms"] = None
            out[f"attn_{kind}_error"] = str(e)[:300]
    a, b = mlx_fn(q0, *caches[0]).astype(mx.float32), None
    try:
        b = ker_fn(q0, *caches[0]).astype(mx.float32)
        out["attn_rel_err"] = float(mx.abs(a - b).max().item() / max(mx.abs(a).max().item(), 1e-6))
    except KernelError:
        pass
    return out


def sweep(shape, layers, repeats, dtype, gs, bits):
    """Chained time of each qmm launch geometry (NT, WARPS, U) at M = 1 and 16, per weight shape: the routed target's
    own calls (q, k and v fused, o, gate and up fused, down: :class:`~mlx_dflash2.kernels.KernelMLP` and
    ``KernelAttention.qkv`` fuse them) and the unfused q and gate."""
    hidden, inter = SHAPES[shape][:2]
    rows = []
    for L in layers:  # the fused weights, as the routed target holds them
        for name, parts in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
            L[name] = tuple(mx.concatenate([L[p][i] for p in parts], axis=0) for i in range(3))
    mx.eval([(L["qkv"], L["gate_up"]) for L in layers])
    for name in ("qkv", "o", "gate_up", "down", "q", "gate"):
        n, k = layers[0][name][0].shape[0], layers[0][name][0].shape[1] * 32 // bits
        for M in (1, 16):
            x = (mx.random.normal((M, k)) * 0.1).astype(dtype)

            def chain(mm):
                y = x
                for L in layers:
                    z = mm(y, L[name])
                    y = z[..., :k] if n >= k else mx.concatenate([z] * (k // n) + [z[..., : k % n]], axis=-1)
                return y

            base = timed(lambda: mx.eval(chain(matmul_fn("mlx", gs, bits))), repeats)
            for nt, w, u in itertools.product((1, 2, 4), (4, 8), (1, 2, 4)):
                try:
                    t = timed(lambda: mx.eval(chain(matmul_fn("kernel", gs, bits, (nt, w, u)))), repeats)
                except KernelError as e:
                    t = None
                rows.append(dict(shape=shape, weight=name, n=n, k=k, M=M, NT=nt, WARPS=w, U=u, kernel_ms=t,
                                 mlx_ms=base))
                print(f"sweep {shape} {name} {n}x{k} M={M} NT={nt} WARPS={w} U={u}: "
                      f"{t if t is None else round(t, 3)} ms (mlx {base:.3f})", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--kv", default="1024,8192,32768", help="KV lengths of the attention chains")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sweep", action="store_true", help="also sweep qmm's launch geometry")
    p.add_argument("--sweep-attention", action="store_true",
                   help="also time verify_attention at other geometries (ROWS, WARPS, KD, VB, PF)")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    be = backend()
    result = dict(backend=be, device=str(mx.default_device()), mlx=mx.__version__, dtype=args.dtype,
                  bits=args.bits, group_size=args.group_size, rows=[])
    if be == "cpu" or args.check_only:
        from mlx_dflash2.kernels import OPS

        for op in OPS.values():
            print(f"{op.name}: {'no kernels on the CPU backend; the reference runs' if be == 'cpu' else 'check'}")
        if be == "cpu":
            return 0
    for shape in args.shapes.split(","):
        t0 = time.perf_counter()
        hidden, inter, heads, kv, hd, n_layers = SHAPES[shape]
        layers = make_layers(hidden, inter, heads, kv, hd, n_layers, args.bits, args.group_size, dtype)
        print(f"{shape}: {n_layers} layers built in {time.perf_counter() - t0:.1f} s", flush=True)
        for M in (int(m) for m in args.rows.split(",")):
            row = dict(shape=shape, M=M, **bench_qmm(shape, layers, M, args.repeats, dtype, args.group_size, args.bits))
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        if args.sweep:
            result.setdefault("sweep", []).extend(sweep(shape, layers, max(3, args.repeats // 2), dtype,
                                                        args.group_size, args.bits))
        del layers
        for kvl in (int(v) for v in args.kv.split(",")):
            for M in (1, 16):
                cfgs = ([(None, 8, None, vb, pf) for vb in (1, 4, 8, 16) for pf in (0, 1)]
                        + [(r, 8, kd, 8, 1) for r in (2, 4, 8) for kd in (32, 16)] if args.sweep_attention else ())
                row = dict(shape=shape, M=M, kv=kvl, **bench_attention(shape, M, kvl, args.repeats, dtype, cfgs))
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
