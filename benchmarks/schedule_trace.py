"""Trace the adaptive schedule over consecutive requests on one proposer.

For one prompt of ``bench_generate.py``, runs ``--requests`` greedy requests in a row
through the default proposer (``--drafter auto``: the shipped drafter fused with
lookup under :class:`mlx_dflash2.proposers.AdaptiveSchedule`, whose statistics carry
over requests) and prints, per request: decode tokens/s and its ratio to plain
decoding (measured first, same target), rounds by draft source, the share of the
decode time inside the schedule's timed windows, each arm's actual tokens/s over
the request (sum of tokens / sum of timed seconds) and the schedule's estimate of
each (context, arm) at the end of the request (its EMA). Output is checked against
plain decoding (exit status 1 if any request differs).

    scripts/run python benchmarks/schedule_trace.py --prompt chat --requests 6 --dtype float32
    scripts/run python benchmarks/schedule_trace.py --prompt chat --decay 0.97   # another EMA decay
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS, mlx_dflash2/_blas.py)
import mlx.core as mx  # noqa: E402

from bench_generate import PROMPTS, run_once  # noqa: E402
from mlx_dflash2.loading import drafter_dequantize, load_target, make_proposer  # noqa: E402
from mlx_dflash2.proposers import AdaptiveSchedule  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--prompt", default="chat", choices=sorted(PROMPTS))
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decay", type=float, default=None, help="EMA decay of a fresh schedule (default: its own)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=None,
                    help="dense weights (default: as the product decides, loading.auto_dequantize)")
    args = ap.parse_args(argv)
    target, tok, name = load_target(args.model, dtype=args.dtype, dequantize=args.dequantize)
    dq = drafter_dequantize(args.dequantize, target)  # as load() decides
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[args.prompt]}], add_generation_prompt=True)
    prop = make_proposer(args.drafter, target, tok, name, dequantize=dq)
    sch = getattr(prop, "schedule", None)
    if sch is not None and args.decay is not None:
        sch = prop.schedule = AdaptiveSchedule(decay=args.decay)
    arms: dict[bool, list] = {}
    if sch is not None:  # sum what the schedule is told, per arm
        record = sch.record

        def counted(ctx, arm, tokens, seconds):
            a = arms.setdefault(arm, [0, 0.0])
            a[0] += tokens
            a[1] += seconds
            return record(ctx, arm, tokens, seconds)

        sch.record = counted
    run_once(target, ids, None, 1, 8)  # warm-up
    ref, ps = run_once(target, ids, None, 1, args.max_tokens)
    print(f"{args.prompt}: plain {ps.decode_tps:.2f} tok/s" + (f"; decay {sch.decay}" if sch else ""))
    same = True
    for i in range(args.requests):
        arms.clear()
        out, st = run_once(target, ids, prop, getattr(prop, "block_size", 1), args.max_tokens)
        timed = sum(s for _, s in arms.values())
        actual = {("drafter" if a else "other"): round(t / s, 1) for a, (t, s) in arms.items() if s > 0}
        est = {f"{c}/{name}": round(r, 1) for c, rates in (sch.summary() if sch else {}).items()
               for name, r in rates.items() if r}
        print(f"request {i}: {st.decode_tps:.2f} tok/s ({st.decode_tps / ps.decode_tps:.2f}x), tau {st.tau:.2f}, "
              f"rounds {st.rounds_by_source}, timed {timed / max(st.decode_s, 1e-9):.0%} of decode, "
              f"actual tok/s {actual}, estimates {est}" + ("" if out == ref else "  OUTPUT DIFFERS FROM PLAIN"))
        same = same and out == ref
        mx.clear_cache()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
