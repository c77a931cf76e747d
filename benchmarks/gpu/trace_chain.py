"""Where a routed matmul's time goes on MLX's CUDA backend: host graph build, encode + GPU, GPU kernel time.

Issue 19: on the H200 the ``qmm`` kernel is flat in M (M = 16 costs ~1.05x its M = 1) but its M = 1 costs
1.3-2.3x MLX's ``qmv`` when chained over the 36 layers of the 8B shape, and a routed one-token forward of
the 8B shape cost 16.3 ms pipelined against 7.8 ms unrouted (session 12). The weights of one call are
8 MB (~3 us of bandwidth), so both kernels are far from bandwidth-bound and the difference is a per-call
cost: this script says whose. For each chain (36 dependent calls, each layer its own weights):

* ``build_ms``: the Python graph build alone (no evaluation);
* ``eval_ms``: ``mx.eval`` of a graph built beforehand (MLX's encode of every node + the GPU);
* ``sync_ms``: build + eval, as ``bench_kernels.py`` times it;
* ``pipe_ms``: per chain when the host builds the next chain while the GPU runs the previous one
  (``mx.async_eval``): max(host, GPU), what a pipelined decode loop pays;
* ``gpu_*`` (``--trace``, with PyTorch's CUPTI profiler where it imports): per kernel name the count and
  mean GPU duration, the sum of kernel time per chain and the span from the first kernel's start to the
  last one's end (span - sum = the GPU's idle gaps between dependent kernels).

Chains: the q projection (4096 x 4096, 4-bit g64, bf16) with MLX's ``quantized_matmul``, the ``qmm``
kernel as the registry launches it, and the kernel with its parameter array made on the GPU (MLX puts a
host-made array in managed memory); a trivial one-thread-per-element ``cuda_kernel`` (``y = x + 1``) next
to ``x + 1``: the cost of MLX's custom-kernel path itself. Then the one-token forward of the random 8B
shape, unrouted and routed as the target adapter routes it (``--forward``: quantized linears, gate and up
fused, q, k and v fused, the verify attention).

    python benchmarks/gpu/trace_chain.py --out $OUT/trace.json [--trace] [--forward]

On the CPU (no CUDA) it runs the MLX chains only, to check the script.
"""

from __future__ import annotations

import mlx_dflash2  # noqa: F401  (before MLX)

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import make_layers  # noqa: E402
from bench_kernels import timed as med_ms  # noqa: E402  (median ms after two warm-ups)

from mlx_dflash2.kernels import backend, qmm  # noqa: E402
from mlx_dflash2.kernels import registry  # noqa: E402


def log(msg):
    print(f"[trace {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure(chain, x0, repeats, pipe_n=20):
    """build / eval / sync / pipelined ms of ``chain(x)`` (a function building one chain's graph)."""
    out = {}
    out["build_ms"] = med_ms(lambda: chain(x0), repeats)
    ts = []
    for _ in range(repeats + 2):
        y = chain(x0)
        t = time.perf_counter()
        mx.eval(y)
        ts.append((time.perf_counter() - t) * 1e3)
    out["eval_ms"] = statistics.median(ts[2:])
    out["sync_ms"] = med_ms(lambda: mx.eval(chain(x0)), repeats)

    def pipe():
        y = x0
        t = time.perf_counter()
        for _ in range(pipe_n):
            y = chain(y)
            mx.async_eval(y)
        mx.eval(y)
        return (time.perf_counter() - t) * 1e3 / pipe_n

    pipe(), pipe()
    out["pipe_ms"] = statistics.median(pipe() for _ in range(max(3, repeats // 2)))
    return {k: round(v, 4) for k, v in out.items()}


class Tracer:
    """CUPTI kernel records through ``torch.profiler`` (None where PyTorch or CUDA is missing)."""

    def __init__(self):
        self.ok = False
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA")
            torch.cuda.init()
            self.torch, self.profile, self.act = torch, profile, ProfilerActivity
            self.ok = True
            self.why = f"torch {torch.__version__}"
        except Exception as e:  # noqa: BLE001
            self.why = f"{type(e).__name__}: {e}"[:200]

    def kernels(self, fn, n):
        """Run ``fn`` ``n`` times under the profiler; returns the kernel records [(name, ts_us, dur_us)]."""
        with self.profile(activities=[self.act.CUDA]) as prof:
            for _ in range(n):
                fn()
        path = tempfile.mktemp(suffix=".json")
        prof.export_chrome_trace(path)
        ev = json.load(open(path)).get("traceEvents", [])
        os.unlink(path)
        return sorted(((e.get("name", "?"), float(e["ts"]), float(e.get("dur", 0))) for e in ev
                       if e.get("cat") in ("kernel", "Kernel") and "ts" in e), key=lambda r: r[1])


def summarize(recs, n_chains):
    if not recs:
        return {"gpu_kernels": 0}
    by = {}
    for name, _, dur in recs:
        short = name.split("(")[0][-60:]
        c = by.setdefault(short, [0, 0.0])
        c[0] += 1
        c[1] += dur
    span = recs[-1][1] + recs[-1][2] - recs[0][1]
    total = sum(r[2] for r in recs)
    return {"gpu_kernels": len(recs), "gpu_sum_us_per_chain": round(total / n_chains, 1),
            "gpu_span_us_per_chain": round(span / n_chains, 1),
            "gpu_by_kernel": {k: {"count": v[0], "mean_us": round(v[1] / v[0], 2)} for k, v in
                              sorted(by.items(), key=lambda kv: -kv[1][1])[:12]}}


def device_params():
    """Replace the registry's host-made parameter arrays with copies computed on the GPU."""
    for k, p in list(registry._int_params.items()):
        q = p * 1
        mx.eval(q)
        registry._int_params[k] = q


def trivial_kernel(header: str = ""):
    return mx.fast.cuda_kernel(name="plus_one", input_names=["x"], output_names=["y"], header=header,
                               source="  unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                                      "  if (i < x_shape[0]) y[i] = x[i] + (T)1;\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--trace", action="store_true", help="GPU kernel records through torch.profiler")
    p.add_argument("--forward", action="store_true", help="also the 8B shape's one-token forward")
    p.add_argument("--tiny", action="store_true", help="small sizes (a CPU check of the script)")
    p.add_argument("--skip-q", action="store_true", help="skip the q-projection chains")
    p.add_argument("--tag", default="", help="a label stored in the JSON (e.g. the environment tried)")
    p.add_argument("--variants", default="mlx,kernel,compile,submit,inline,again",
                   help="the forward's variants to run (comma-separated): mlx, kernel, compile (kernel+compile at the "
                        "default submission), submit (submission every 0/4/18), inline (sources inline), again")
    a = p.parse_args(argv)
    be = backend()
    res = {"backend": be, "mlx": mx.__version__, "rows": [], "tag": a.tag,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "CUDA_"))}}
    tracer = Tracer() if a.trace and be == "cuda" else None
    res["tracer"] = None if tracer is None else tracer.why
    log(f"backend {be}; tracer {res['tracer']}")

    def save():
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))

    hidden = 256 if a.tiny else 4096
    n_layers = 4 if a.tiny else a.layers
    layers = make_layers(hidden, hidden, 4 if a.tiny else 32, 4 if a.tiny else 8, 64 if a.tiny else 128,
                         n_layers, 4, 64, mx.bfloat16)
    ws = [L["q"] for L in layers]
    for L in layers:
        L.clear()

    def chain_of(mm):
        def chain(x):
            for w in ws:
                x = mm(x, w)
            return x
        return chain

    mlx_mm = lambda x, w: mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)  # noqa: E731
    ker_mm = lambda x, w: qmm(x, *w, 64, 4, mode="kernel")  # noqa: E731
    kinds = [("mlx", mlx_mm)] + ([("kernel", ker_mm), ("kernel_devparams", ker_mm)] if be == "cuda" else [])
    for M in (() if a.skip_q else (1, 16)):
        x0 = (mx.random.normal((M, hidden)) * 0.1).astype(mx.bfloat16)
        for kind, mm in kinds:
            if kind == "kernel_devparams":
                device_params()
            ch = chain_of(mm)
            row = {"chain": "q", "M": M, "kind": kind, "calls": n_layers, **measure(ch, x0, a.repeats)}
            if tracer and tracer.ok:
                try:
                    row.update(summarize(tracer.kernels(lambda: mx.eval(ch(x0)), 5), 5))
                except Exception as e:  # noqa: BLE001
                    row["gpu_error"] = f"{type(e).__name__}: {e}"[:300]
            row["per_call_us"] = {k[:-3]: round(row[k] * 1e3 / n_layers, 2) for k in
                                  ("build_ms", "eval_ms", "sync_ms", "pipe_ms")}
            res["rows"].append(row)
            log(json.dumps({k: v for k, v in row.items() if k != "gpu_by_kernel"}))
            save()

    # MLX's custom-kernel path itself: a trivial kernel vs the same built-in op
    x0 = mx.zeros((hidden,), dtype=mx.bfloat16)
    kinds = [("mx_add", lambda x: x + 1)]
    if be == "cuda":
        k = trivial_kernel()
        kinds.append(("cuda_kernel_add", lambda x: k(inputs=[x], template=[("T", mx.bfloat16)],
                                                     grid=(hidden, 1, 1), threadgroup=(256, 1, 1),
                                                     output_shapes=[x.shape], output_dtypes=[x.dtype])[0]))
        # the same kernel with a registry-sized source (MLX builds the source at every call and hashes it at every
        # launch), and with that text #included from a file (NVRTC reads it; the source MLX hashes stays small)
        text = registry.source_text("qmm.cu")
        inc = Path(tempfile.gettempdir()) / f"dflash_trace_{abs(hash(text))}.cuh"
        inc.write_text(text)
        for tag, header in (("cuda_kernel_add_qmm_header", text), ("cuda_kernel_add_include", f'#include "{inc}"\n')):
            try:
                kk = trivial_kernel(header)
                f = (lambda x, kk=kk: kk(inputs=[x], template=[("T", mx.bfloat16)], grid=(hidden, 1, 1),
                                         threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype])[0])
                mx.eval(f(x0))
                kinds.append((tag, f))
            except Exception as e:  # noqa: BLE001
                res["rows"].append({"chain": "trivial", "kind": tag, "error": f"{type(e).__name__}: {e}"[:300]})
                log(f"{tag}: {type(e).__name__}: {e}"[:300])
    for kind, f in kinds:
        def ch(x, f=f):
            for _ in range(n_layers * 4):
                x = f(x)
            return x
        row = {"chain": "trivial", "kind": kind, "calls": n_layers * 4, **measure(ch, x0, a.repeats)}
        if tracer and tracer.ok:
            try:
                row.update(summarize(tracer.kernels(lambda: mx.eval(ch(x0)), 5), 5))
            except Exception as e:  # noqa: BLE001
                row["gpu_error"] = f"{type(e).__name__}: {e}"[:300]
        row["per_call_us"] = {k[:-3]: round(row[k] * 1e3 / row["calls"], 2) for k in
                              ("build_ms", "eval_ms", "sync_ms", "pipe_ms")}
        res["rows"].append(row)
        log(json.dumps({k: v for k, v in row.items() if k != "gpu_by_kernel"}))
        save()
    del ws, layers

    if a.forward:
        from random_targets import build_target, twin
        from mlx_lm.models.cache import make_prompt_cache

        from mlx_dflash2.kernels import route_attention, route_mlps, route_quantized_linears

        name = "tiny" if a.tiny else "qwen3-8b"
        model, cfg = build_target(name)
        routed = twin(model, cfg)
        if be == "cuda":  # as TargetAdapter.route_kernels routes a dense target (without its probes)
            route_quantized_linears(routed, mode="kernel")
            route_mlps(routed.model.layers, mode="kernel")
            route_attention(routed.model.layers, mode="kernel")
        ctx = 64 if a.tiny else 1024
        from mlx_dflash2.kernels import undo_routes
        from mlx_dflash2.kernels.block import route_blocks, set_submit_every, submit_every

        def reset_kernels():  # the ops build their mx.fast kernel objects again (with the header now chosen), and
            # every routed linear binds its calls again (a bound call keeps the kernel object it was bound to; the
            # fused q/k/v and gate/up linears sit outside the module tree: found through the garbage collector)
            import gc

            from mlx_dflash2 import kernels as K

            for op in K.OPS.values():
                op._kernels.clear()
            registry._headers.clear()
            for o in gc.get_objects():
                if isinstance(o, qmm.KernelQuantizedLinear):
                    o._bound.clear()

        want = set(a.variants.split(","))

        def variants():
            if "mlx" in want:
                yield "mlx", model
            if "kernel" in want:
                yield "kernel", routed
            if be == "cuda" or a.tiny:  # the routed layers' graphs built by compiled functions (kernels/block.py)
                swaps = route_blocks(routed.model.layers)
                if "compile" in want:
                    yield f"kernel+compile (submit every {submit_every()})", routed
                for k in ((0, 4, 18) if "submit" in want else ()):  # multi-row forwards queued in parts
                    set_submit_every(routed.model.layers, k)
                    yield f"kernel+compile (submit every {k})", routed
                set_submit_every(routed.model.layers, submit_every())
                if be == "cuda" and "inline" in want:  # the same with every kernel's source inline (no #include: registry.cuda_header);
                    # fresh compiled layers: a compiled trace keeps the kernel objects it recorded
                    undo_routes(swaps)
                    os.environ[registry.INCLUDE_ENV] = "0"
                    reset_kernels()
                    swaps = route_blocks(routed.model.layers)
                    yield "kernel+compile, sources inline", routed
                    del os.environ[registry.INCLUDE_ENV]
                    reset_kernels()
                undo_routes(swaps)
                if "again" in want:
                    yield "kernel (again: order effects)", routed

        for kind, m in variants():
            for M in (1, 16):
                cache = make_prompt_cache(m)
                mx.eval(m(mx.zeros((1, ctx), dtype=mx.int32), cache=cache))
                ids = mx.zeros((1, M), dtype=mx.int32)

                def fwd(_x, m=m, cache=cache, ids=ids, M=M):
                    y = m(ids, cache=cache)
                    for c in cache:
                        c.trim(M)  # the next call sees the same length
                    return y

                row = {"chain": f"forward-{name}", "M": M, "kind": kind, **measure(fwd, None, a.repeats)}
                if tracer and tracer.ok:
                    try:
                        row.update(summarize(tracer.kernels(lambda: mx.eval(fwd(None)), 3), 3))
                    except Exception as e:  # noqa: BLE001
                        row["gpu_error"] = f"{type(e).__name__}: {e}"[:300]
                res["rows"].append(row)
                log(json.dumps({k: v for k, v in row.items() if k != "gpu_by_kernel"}))
                save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
