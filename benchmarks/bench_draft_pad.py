"""The dynamic draft length's cut verified as cut (``old``) or padded to the cheapest calibrated width at or past
it (``new``, :func:`mlx_dflash2.proposers.padded_length`, session 41), in one process on the same target and
proposer: the default of ``mlx_dflash2.load`` (``drafter="auto"``: the shipped drafter fused with lookup under the
adaptive schedule, its calibration cached or measured), greedy. Per prompt the two run back to back, in turns
(``new`` first on even prompts); tok/s of the whole request (prefill included, the same for both), tau, the
verify widths, and whether the two outputs are identical.

    scripts/run python benchmarks/bench_draft_pad.py --model ~/.cache/mlx_dflash2/qwen2.5-coder-1.5b-instruct/\
qwen2.5-coder-1.5b-instruct.gguf --prompts 2 --max-tokens 128 --out benchmarks/results/draft-pad-cpu-15b-s41.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx_dflash2  # noqa: F401  (before MLX: the optimized OpenBLAS, mlx_dflash2/_blas.py)
import mlx.core as mx  # noqa: F401

from mlx_dflash2.loading import drafter_dequantize, load_target, make_proposer
from mlx_dflash2.speculative import SpecStats, speculative_generate_step
from mlx_dflash2.train.data import load_eval_set

SETS = ("humaneval", "mtbench", "gsm8k")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="the target (a GGUF or MLX directory with a shipped drafter; "
                    "default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=2, help="first prompts per set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="JSON of every request and the medians")
    args = ap.parse_args(argv)
    target, tok, name = load_target(args.model, dtype="float32", dequantize=True)
    prop = make_proposer("auto", target, tok, name, dequantize=drafter_dequantize(True, target))
    dp = getattr(prop, "drafter", None)
    costs = getattr(dp, "verify_costs", None)
    if costs is None:
        raise SystemExit("error: the default proposer has no calibrated verify costs here (no shipped drafter for "
                         "this target, or a GPU where the dynamic draft length is off): nothing to compare")
    ratios = {m: round(v / costs.verify_s[1], 3) for m, v in sorted(costs.verify_s.items())}
    print(f"{name}: T(M)/T(1) {ratios}, dynamic draft length {dp.min_confidence}", flush=True)
    rows = []
    for s in SETS:
        for i, p in enumerate(load_eval_set(s, args.prompts)):
            ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True)
            outs = {}
            for v in (("new", "old") if i % 2 == 0 else ("old", "new")):
                dp.verify_costs = costs if v == "new" else None
                st = SpecStats()
                t0 = time.perf_counter()
                toks = [t for t, _, _ in speculative_generate_step(ids, target, prop, max_tokens=args.max_tokens,
                                                                   stats=st)]
                dt = time.perf_counter() - t0
                outs[v] = toks
                rows.append({"set": s, "prompt": i, "variant": v, "tokens": len(toks), "seconds": dt,
                             "tok_s": len(toks) / dt, "tau": st.tau, "verify_widths": dict(sorted(st.verify_widths.items()))})
                print(f"{s} {i} {v}: {len(toks) / dt:.2f} tok/s, tau {st.tau:.2f}, widths {rows[-1]['verify_widths']}",
                      flush=True)
            for r in rows[-2:]:
                r["identical"] = outs["new"] == outs["old"]
    dp.verify_costs = costs
    summary = {}
    for s in SETS:
        by = {(r["prompt"], r["variant"]): r for r in rows if r["set"] == s}
        rs = [by[(i, "new")]["tok_s"] / by[(i, "old")]["tok_s"] for i in sorted({k[0] for k in by})]
        summary[s] = {"new_over_old": [round(x, 3) for x in rs], "median": round(statistics.median(rs), 3),
                      "identical": all(by[k]["identical"] for k in by)}
        print(f"{s}: new / old {summary[s]['new_over_old']}, median {summary[s]['median']}, identical "
              f"{summary[s]['identical']}")
    if args.out:
        meta = {"target": Path(str(name)).name, "prompts": args.prompts, "max_tokens": args.max_tokens,
                "verify_cost_ratios": ratios, "min_confidence": dp.min_confidence}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
