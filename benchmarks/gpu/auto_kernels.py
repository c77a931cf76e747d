"""What ``kernels="auto"`` decides on this GPU for random-weight targets of given shapes (issue 21's 1.5B, the 8B):
the one-token step and the 16-row verify timed with MLX's ops and routed (``TargetAdapter.route_kernels``),
printed with the decision (``kernel_choice``). Random weights: the routes' stack-level probe is skipped (it cannot
tell a kernel's rounding from a fault on random 16-bit weights; each kernel still passes its own numerics gate).

    PYTHONPATH=$PWD python3 benchmarks/gpu/auto_kernels.py --shapes qwen2.5-1.5b,qwen3-8b --out $OUT/auto.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import random_targets as rt  # noqa: E402  (imports mlx_dflash2 before MLX)

import argparse  # noqa: E402
import json  # noqa: E402

import mlx.core as mx  # noqa: E402

from mlx_dflash2.target import TargetAdapter  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-1.5b,qwen3-8b")
    ap.add_argument("--repeats", type=int, default=3, help="route decisions per shape (fresh adapters)")
    ap.add_argument("--out", default="auto-kernels.json")
    args = ap.parse_args(argv)
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "shapes": {}}
    for name in args.shapes.split(","):
        model, cfg = rt.build_target(name)
        runs = []
        for i in range(args.repeats):
            t = TargetAdapter(rt.twin(model, cfg), cfg, probe=False, kernels="reference")
            n = t.route_kernels("auto", probe=False)
            runs.append({"routed_modules": n, **t.kernel_choice})
            c = t.kernel_choice
            print(f"{name} #{i}: step {c.get('step_ms_reference', 0):.2f} ms MLX / {c.get('step_ms_kernel', 0):.2f} "
                  f"routed; verify of 16 {c.get('verify_ms_reference', 0):.2f} / {c.get('verify_ms_kernel', 0):.2f}; "
                  f"routed: {c.get('routed')}", flush=True)
        out["shapes"][name] = runs
        del model
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
