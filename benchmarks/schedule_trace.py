"""Trace the adaptive schedule over consecutive requests on one proposer.

For one prompt of ``bench_generate.py``, runs ``--requests`` greedy requests in a row
through the default proposer (``--drafter auto``: the shipped drafter fused with
lookup under :class:`mlx_dflash2.proposers.AdaptiveSchedule`, whose statistics carry
over requests) and prints, per request: decode tokens/s, rounds by draft source, and
the schedule's measured tokens/s of each (context, arm). Plain decoding's tokens/s
is printed first for reference. Output is checked against plain decoding.

    scripts/run python benchmarks/schedule_trace.py --prompt chat --requests 6 --dtype float32 --dequantize
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from bench_generate import PROMPTS, run_once  # noqa: E402
from mlx_dflash2.loading import load_target, make_proposer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--prompt", default="chat", choices=sorted(PROMPTS))
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--dequantize", action="store_true")
    args = ap.parse_args(argv)
    target, tok, name = load_target(args.model, dtype=args.dtype, dequantize=args.dequantize)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[args.prompt]}], add_generation_prompt=True)
    prop = make_proposer(args.drafter, target, tok, name, dequantize=args.dequantize)
    sch = getattr(prop, "schedule", None)
    run_once(target, ids, None, 1, 8)  # warm-up
    ref, ps = run_once(target, ids, None, 1, args.max_tokens)
    print(f"plain: {ps.decode_tps:.2f} tok/s")
    for i in range(args.requests):
        out, st = run_once(target, ids, prop, getattr(prop, "block_size", 1), args.max_tokens)
        rates = {f"{c}/{'drafter' if a else 'other'}": round(sch.rate(c, a), 1)
                 for c in ("none", "match") for a in (True, False) if sch and sch.rate(c, a)}
        print(f"request {i}: {st.decode_tps:.2f} tok/s, tau {st.tau:.2f}, rounds {st.rounds_by_source}, "
              f"measured tok/s {rates}" + ("" if out == ref else "  OUTPUT DIFFERS FROM PLAIN"))
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
