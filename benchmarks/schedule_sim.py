"""The batched rounds' width schedule (``WidthSchedule``) fed synthetic round costs: how close to the best fixed cap?

No model runs: each round's cost in ms is drawn from a scenario (a cost and tokens per row per width cap, log-normal
noise, stalls of a fixed cost, extra cost on rounds after the row set changed, row counts wandering inside a range),
``WidthSchedule.choose`` picks the cap and ``WidthSchedule.record`` gets the round, as in ``SpeculativeBatch.step``.
Reported per scenario: the schedule's tokens/s as a fraction of the best fixed cap's under the same draws (min .. max
over seeds) and the rounds it ran at each cap. A fraction well under 1 is a way the real schedule can lose; session
25 found none of these (0.93-1.00), while the H200 server chose drafting rounds that ran at half the plain rate.
Session 26 added the H200's in-process trace of 16 drafting rows (drafts all rejected, plain rounds after drafting
ones measured 2x): the schedule then ran width 4 for nothing (0.5x), until plain's seconds per round were bounded by
a wider cap's (``WidthSchedule._rate``).

    scripts/run python benchmarks/schedule_sim.py                   # every scenario
    scripts/run python benchmarks/schedule_sim.py --rounds 2000 --seeds 2 --out sim.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # this checkout
import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS)

from mlx_dflash2.batch import WidthSchedule  # noqa: E402

# ms per round and tokens per row per round, by width cap: the H200 step traces of session 25 (SmolLM2, 8 rows:
# drafting loses ~20 % per round), a target where drafting wins (cap 4 best), and the H200's 16 drafting rows of
# session 25 whose drafts were all rejected (rounds of any width ~11 ms, 1.0 token per row)
TARGETS = {
    "gpu-drafting-loses": ({1: 15, 2: 29, 4: 31, 8: 43, 16: 60}, {1: 1.0, 2: 1.44, 4: 1.55, 8: 1.62, 16: 1.7}),
    "gpu-drafting-wins": ({1: 15, 2: 17, 4: 19, 8: 26, 16: 40}, {1: 1.0, 2: 1.44, 4: 1.75, 8: 2.1, 16: 2.3}),
    "gpu-drafts-rejected": ({1: 11, 2: 11.5, 4: 11, 8: 13, 16: 18}, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}),
}
# sigma: log-normal noise of a round's cost; stall_p / stall_ms: rounds with a fixed extra cost; change_p /
# change_ms: rounds after the row set changed (the row count steps by one) and what they cost more; rows: range;
# after_draft_ms: what a plain round right after a drafting one costs more (the H200's 16 drafting rows measured
# their plain rounds at 21-24 ms, plain rounds without a drafter at 11 ms)
SCENARIOS = {
    "quiet": dict(sigma=0.05),
    "noisy": dict(sigma=0.5),
    "stalls": dict(sigma=0.1, stall_p=0.1, stall_ms=40.0),
    "rows-wander-17-32": dict(sigma=0.1, change_p=0.5, rows=(17, 32)),
    "row-changes-cost": dict(sigma=0.1, change_p=0.3, change_ms=15.0, rows=(17, 32)),
    "plain-after-drafting": dict(sigma=0.1, after_draft_ms=11.0, rows=(16, 16)),
}


def simulate(cost: dict, toks: dict, rounds: int, seed: int, fixed: int | None = None, sigma: float = 0.1,
             stall_p: float = 0.0, stall_ms: float = 0.0, change_p: float = 0.0, change_ms: float = 0.0,
             rows: tuple = (8, 8), after_draft_ms: float = 0.0) -> tuple[float, dict]:
    """One run: tokens/s and rounds per cap; ``fixed``: every round at that cap (no schedule)."""
    rnd = random.Random(seed)
    s = WidthSchedule()
    total_ms = total_tokens = 0.0
    caps: dict = {}
    n = rows[1]
    last = 1
    for _ in range(rounds):
        changed = rnd.random() < change_p
        if changed:
            n = min(rows[1], max(rows[0], n + rnd.choice((-1, 1))))
        c = fixed or s.choose(n, max(cost))
        ms = cost[c] * math.exp(rnd.gauss(0.0, sigma)) + (stall_ms if rnd.random() < stall_p else 0.0)
        ms += change_ms if changed else 0.0
        ms += after_draft_ms if c == 1 and last > 1 else 0.0
        last = c
        emitted = round(n * toks[c])
        if fixed is None:
            s.record(n, c, emitted, ms / 1e3)
        total_ms += ms
        total_tokens += emitted
        caps[c] = caps.get(c, 0) + 1
    return 1e3 * total_tokens / total_ms, caps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4000)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    results = {}
    for tname, (cost, toks) in TARGETS.items():
        for sname, sc in SCENARIOS.items():
            fracs, caps = [], None
            for seed in range(args.seeds):
                best = max(simulate(cost, toks, args.rounds, seed, fixed=c, **sc)[0] for c in cost)
                rate, caps_seen = simulate(cost, toks, args.rounds, seed, **sc)
                fracs.append(rate / best)
                caps = caps if caps is not None else caps_seen
            results[f"{tname}/{sname}"] = {"fraction_of_best_fixed_cap": fracs, "rounds_by_cap_seed0": caps}
            print(f"{tname:<20} {sname:<20} schedule / best fixed cap {min(fracs):.2f} .. {max(fracs):.2f}; "
                  f"rounds by cap (seed 0) {dict(sorted(caps.items()))}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "scenarios": SCENARIOS, "results": results},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
