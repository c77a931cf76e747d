"""Acceptance length tau with sampling (temperature 0.7 and 1.0) vs greedy, real loop.

Runs the speculative loop itself (rejection-sampling verification for T > 0) on
the first ``--limit`` prompts of each held-out set, with a drafter checkpoint,
and reports tau = emitted tokens / target forwards per (set, temperature),
pooled over the prompts, plus the median over seeds. Greedy runs use the same
loop, so the three columns are comparable.

    scripts/run python benchmarks/bench_sampled_tau.py --drafter path/to/drafter --limit 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS, mlx_dflash2/_blas.py)
import mlx.core as mx

from mlx_dflash2.api import stream_generate
from mlx_dflash2.loading import SpeculativeModel, load_target, make_proposer
from mlx_dflash2.train.data import load_eval_set


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--no-lookup", action="store_true")
    ap.add_argument("--sets", default="humaneval,mtbench,gsm8k")
    ap.add_argument("--temps", default="0,0.7,1.0")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dequantize", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/sampled_tau.json")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    target, tok, name = load_target(args.model, dtype=args.dtype, dequantize=args.dequantize)
    proposer = make_proposer(args.drafter, target, tok, name, lookup=not args.no_lookup)
    model = SpeculativeModel(target, proposer, args.block_size, name, target.config)
    temps = [float(t) for t in args.temps.split(",")]
    rows = []
    jobs = [(s, t) for s in args.sets.split(",") for t in temps]
    for set_name, temp in tqdm(jobs, desc="sampled tau", file=sys.stderr):
        prompts = load_eval_set(set_name, args.limit)
        rounds = tokens = 0
        tic = time.perf_counter()
        for i, p in enumerate(prompts):
            ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True)
            last = None
            for last in stream_generate(model, tok, ids, max_tokens=args.max_tokens, block_size=args.block_size,
                                        temp=temp, seed=args.seed + i):
                pass
            rounds += last.stats.rounds
            tokens += last.stats.round_tokens
        rows.append({"set": set_name, "temp": temp, "prompts": len(prompts), "rounds": rounds,
                     "tau": tokens / max(rounds, 1), "seconds": time.perf_counter() - tic})
        print(f"{set_name:10} T={temp:<4} tau={rows[-1]['tau']:.3f}", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"drafter": args.drafter, "lookup": not args.no_lookup, "block_size": args.block_size,
            "limit": args.limit, "max_tokens": args.max_tokens, "device": str(mx.default_device())}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"{'set':10} " + " ".join(f"T={t:<5}" for t in temps))
    for s in args.sets.split(","):
        print(f"{s:10} " + " ".join(f"{r['tau']:<7.3f}" for r in rows if r["set"] == s))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
