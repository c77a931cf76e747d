"""Fitted drafter blocks vs whole blocks: tokens per row-round and time of a batch whose width cap cuts the drafts.

``DFlashProposer.fit_blocks`` (default on) runs the drafter over ``draft_block(n, B)`` slots for ``n`` drafts
(2, 4, 8, 16) instead of all ``B``. The drafter attends within its block both ways, so fewer mask slots may move
its drafts; this measures by how much: ``--rows`` chat requests (``bench_server.py``'s prompts) decode together
at each width cap (``--caps``, verify width per row, anchor included) with whole and with fitted blocks, greedy
(the outputs must be equal: verification is exact). Reported: tokens, row-rounds, tokens per row-round (tau),
seconds.

    scripts/run python benchmarks/bench_fit_blocks.py --rows 8 --caps 2,3,4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout
import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS)

from bench_server import prompts  # noqa: E402

from mlx_dflash2.batch import SpeculativeBatch  # noqa: E402
from mlx_dflash2.loading import load  # noqa: E402
from mlx_dflash2.proposers import DFlashProposer  # noqa: E402


def run(model, ids, eos, cap: int, fit: bool, max_tokens: int) -> dict:
    d = model.proposer
    prop = DFlashProposer(d.model, model.target, d.valid_vocab, d.min_confidence, d.context_window, fit_blocks=fit)
    batch = SpeculativeBatch(model.target, prop, block_size=cap)  # every row verifies cap tokens at most
    for p in ids:
        batch.add(p, max_tokens, eos_token_ids=eos)
    for j in batch._joining:  # a drafter session's block size is the drafter's B (16): the drafts are cut to cap - 1
        assert j.req.session.block_size == prop.block_size
    out: dict = {}
    row_rounds, t0 = 0, time.perf_counter()
    while batch.active or batch.pending:
        for e in batch.step():
            out.setdefault(e.uid, []).extend(e.tokens)
        row_rounds += batch.last_round["rows"]
    n = sum(len(v) for v in out.values())
    return {"tokens": n, "row_rounds": row_rounds, "tau": (n - len(out)) / max(row_rounds, 1),
            "seconds": time.perf_counter() - t0, "outputs": [out[u] for u in sorted(out)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    ap.add_argument("--drafter", default="auto", help="a DFlash drafter (default: the shipped one)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--caps", default="2,3,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, tok = load(args.model, args.drafter, lookup=False, adaptive=False)
    if not isinstance(model.proposer, DFlashProposer):
        ap.error(f"--drafter must be a DFlash drafter, got {type(model.proposer).__name__}")
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
           for p in prompts(args.rows)]
    eos = list(tok.eos_token_ids)
    res, same = {}, True
    for cap in [int(c) for c in args.caps.split(",")]:
        r = {fit: run(model, ids, eos, cap, fit, args.max_tokens) for fit in (False, True)}
        same &= r[False]["outputs"] == r[True]["outputs"]
        for fit in (False, True):
            x = r[fit]
            print(f"cap {cap} {'fitted' if fit else 'whole '}: tokens {x['tokens']} row-rounds {x['row_rounds']} "
                  f"tau {x['tau']:.3f} {x['seconds']:.1f} s", flush=True)
            res[f"{cap}-{'fitted' if fit else 'whole'}"] = {k: v for k, v in x.items() if k != "outputs"}
    print("outputs equal:", same)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": res, "outputs_equal": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
