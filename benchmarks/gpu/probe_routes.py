"""Which route moves a routed target's logits (issue 20: the hybrid 27B's route probe read 0.421 on the H200).

``TargetAdapter.route_kernels`` routes a target's quantized linears (``kernels.qmm``), the attention of dense
families (``verify_attention``) and the GatedDeltaNet mixers of hybrids (stepping mixers over
``gated_delta_steps``) at once, then compares the probe's logits with the unrouted model's (relative tolerance 0.1
in 16-bit). On the H200 the random-weight 64-layer hybrid read 0.421 (the dense 27B shape 0.036) and the routes were
put back. On the CPU, where every route runs its reference, the same 64-layer hybrid geometry (GatedDeltaNet 16/48
heads of 128) reads exactly 0.0, so the difference comes from the GPU kernels, or from how much a deep random
hybrid amplifies their (legitimate) bf16 rounding differences. This script separates the two:

* each route alone and all together: relative logit difference against the unrouted model (the probe's measure);
* the model's own sensitivity to rounding: the unrouted model with bf16 vs float32 activations
  (``TargetAdapter.rounding_sensitivity``).

On this CPU (every route its reference): ``hybrid-tiny`` (8 layers, 6 GatedDeltaNet) 0.0 for every route and 0.29
between bf16 and float32 activations; the dense ``tiny`` (6 layers) 0.0 and 0.048; a 64-layer hybrid with the 27B's
GatedDeltaNet heads (16/48 of 128, hidden 256) 0.0 for all routes.

Run on the device: ``PYTHONPATH=. python3 benchmarks/gpu/probe_routes.py --shape hybrid-27b --shape dense-27b
--out $OUT/probe.json`` (``benchmarks/gpu/run.sh probe``); on a CPU ``--shape hybrid-tiny`` checks the logic (every
route runs its reference there: all differences 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mlx_dflash2  # noqa: E402,F401  (first: the CPU backend's BLAS)
import mlx.core as mx  # noqa: E402

import random_targets as rt  # noqa: E402
from mlx_dflash2 import kernels as K  # noqa: E402
from mlx_dflash2.target import TargetAdapter, _relative_difference as rel  # noqa: E402


def probe_shape(name: str) -> dict:
    t0 = time.perf_counter()
    model, cfg = rt.build_target(name, bits=4, dtype=mx.bfloat16)
    t = TargetAdapter(model, cfg, probe=False, kernels="reference")
    rt.log(f"{name}: built in {time.perf_counter() - t0:.0f} s")
    ref = t._probe_logits(own=False)
    own = t._probe_logits(own=True)
    row = {"shape": name, "backend": K.backend(), "adapter_vs_model_own": rel(ref, own), "routes": {}}
    routes = {
        "qmm (quantized linears)": lambda: K.route_quantized_linears(t.model, "kernel"),
        "gated_delta stepping": lambda: K.route_gated_delta(t.model, "kernel"),
        "verify_attention (dense families)": lambda: K.route_attention(t.layers, "kernel"),
    }
    for label, route in routes.items():
        try:
            swaps = route()
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            row["routes"][label] = {"error": f"{type(e).__name__}: {e}"}
            continue
        if not swaps:
            continue
        try:
            d = rel(ref, t._probe_logits(own=False))
            row["routes"][label] = {"modules": len(swaps), "relative_difference": d}
        except Exception as e:  # noqa: BLE001 - e.g. a kernel refused in mode "kernel"
            row["routes"][label] = {"modules": len(swaps), "error": f"{type(e).__name__}: {e}"}
        K.undo_routes(swaps)
        rt.log(f"{name}: {label}: {row['routes'][label]}")
    t2 = TargetAdapter(model, cfg, probe=False, kernels="reference")
    try:
        n = t2.route_kernels("kernel", force=True)
        row["routes"]["all (route_kernels)"] = {"modules": n, "kept": t2.kernels == "kernel"}
        if n:
            row["routes"]["all (route_kernels)"]["relative_difference"] = rel(ref, t2._probe_logits(own=False))
            K.undo_routes(t2._routes)
    except Exception as e:  # noqa: BLE001
        row["routes"]["all (route_kernels)"] = {"error": f"{type(e).__name__}: {e}"}
    # the model's own sensitivity: bf16 vs float32 activations (what route_kernels reports when it refuses)
    row["bf16_vs_float32_activations"] = t.rounding_sensitivity(ref)
    row["seconds"] = time.perf_counter() - t0
    rt.log(f"{name}: {json.dumps(row)}")
    del model, t, t2
    mx.clear_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help="random_targets shape (repeatable; default hybrid-tiny)")
    ap.add_argument("--out", default=None, help="JSON report")
    a = ap.parse_args(argv)
    rows = [probe_shape(s) for s in (a.shape or ["hybrid-tiny"])]
    report = {"device": rt.device_meta(), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
