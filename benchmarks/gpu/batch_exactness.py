"""Does a batched round draft, verify and accept what each request would alone? (issue 22, the H200's question)

On the H200 (SmolLM2 Q4_1, bf16 scales, session 25), batched drafting rounds of 16 rows emitted exactly one token per
row for their first ~15 rounds at widths 2, 4 and 8: every draft of every row rejected, where the same requests
alone accept ~40 % of theirs; and about half of all greedy outputs under load differed from their solo ones, for
our server and for ``mlx_lm.server`` alike. Rounding (bf16 matmuls over more rows) allows departures at near-ties
only; a wrong drafter forward or verify over many rows would do what the H200 showed. This script tells them apart
on one machine, for every row count of ``--rows``:

* **drafts**: ``N`` requests decode ``--warm-rounds`` plain batched rounds (their drafter contexts filled the way a
  batch fills them), then for every draft length ``n`` of ``--lengths`` the batch's drafter forward
  (``DFlashProposer.propose_many``, what a batched round runs) is compared, row by row, with each request's own
  forward (``propose``, what the solo loop runs) on the same context: tokens equal per slot;
* **accept**: each prompt alone (a batch of one) and all ``N`` together, the DFlash drafter alone (no lookup, no
  dynamic draft length, no schedule: every round verifies ``B`` tokens) at every ``B`` of ``--blocks``: drafts,
  accepted drafts, outputs equal to the solo ones, and the batch's first rounds (tokens emitted per row);
* **verify**: each prompt's plain greedy output alone, with the top-1 minus top-2 log-probability margin at every
  position; then all ``N`` together, plainly and with an oracle proposer that drafts each request's solo
  continuation at every ``B`` of ``--blocks``: where a row departs from its solo output, the solo margin there
  (a near-tie: rounding; a wide margin: a wrong verify), and the oracle's acceptance before the departure (1.0
  unless the batched verify disagrees with the solo one inside the block).

In float32 on MLX's CPU backend everything must agree exactly (exit status 1 otherwise); on a GPU in bf16 the
script reports and fails only on departures at margins above ``--tie`` and drafter slots that disagree with the
solo forward at more than ``--slot-tol`` of the slots.

    scripts/run python benchmarks/gpu/batch_exactness.py --rows 4 --max-tokens 16 --out $TMPDIR/bx.json  # CPU check
    python3 benchmarks/gpu/batch_exactness.py --model $PAYLOAD/SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16 \\
        --rows 8,16,32 --out $OUT/batch-exactness.json                                                      # H200
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

import random_targets as rt  # noqa: E402  (imports mlx_dflash2 before MLX)

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from bench_server import prompts as bench_prompts  # noqa: E402
from mlx_dflash2.batch import SpeculativeBatch, WidthSchedule  # noqa: E402
from mlx_dflash2.proposers import DFlashProposer, DraftCall  # noqa: E402
from random_targets import log  # noqa: E402


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode(target, prompts, max_tokens, eos, *, proposer=None, block=1, logprobs=False, schedule="full",
           trace_rounds=0):
    """All ``prompts`` in one batch: per request ``(tokens, stats, margins)`` (margins: top-1 minus top-2
    log-probability per emitted token, with ``logprobs``) and the first ``trace_rounds`` rounds' tokens per row."""
    b = SpeculativeBatch(target, schedule=schedule)
    uids = [b.add(p, max_tokens, proposer=proposer, block_size=block, eos_token_ids=eos, logprobs=logprobs)
            for p in prompts]
    out = {u: [] for u in uids}
    marg = {u: [] for u in uids}
    stats = {}
    trace = []
    while b.active or b.pending:
        evs = b.step()
        for e in evs:
            out[e.uid] += e.tokens
            if e.stats is not None:
                stats[e.uid] = e.stats
            if logprobs and e.logprobs:
                for lp in e.logprobs:
                    top = mx.topk(lp.astype(mx.float32), 2)
                    marg[e.uid].append(float(mx.max(top) - mx.min(top)))
        r = b.last_round
        if r["rows"] and len(trace) < trace_rounds:
            trace.append(round(sum(len(e.tokens) for e in evs) / r["rows"], 2))
    return [(out[u], stats.get(u), marg[u]) for u in uids], trace


def solo_runs(cache: dict, key, prompts, run) -> list:
    """``run(prompt)`` for every prompt, each computed once per ``key`` (a smaller batch's solo runs are reused)."""
    got = cache.setdefault(key, [])
    got += [run(p) for p in prompts[len(got):]]
    return got[: len(prompts)]


def dflash_of(proposer) -> DFlashProposer:
    """The DFlash drafter of ``proposer`` (itself, or the one a fused proposer holds)."""
    if isinstance(proposer, DFlashProposer):
        return proposer
    for name in ("drafter", "dflash", "primary"):
        p = getattr(proposer, name, None)
        if isinstance(p, DFlashProposer):
            return p
    raise SystemExit(f"no DFlash drafter in {type(proposer).__name__}")


def part_drafts(target, drafter, prompts, eos, args) -> dict:
    """The batched drafter forward vs each row's own, on the contexts a batch of plain rounds left."""
    b = SpeculativeBatch(target, schedule=WidthSchedule(caps=(1,)))
    for p in prompts:
        b.add(p, 10_000, proposer=drafter, block_size=drafter.block_size, eos_token_ids=())
    for _ in range(args.warm_rounds + 1):
        b.step()
    rows = b._rows  # noqa: SLF001  (a diagnostic: the rows' own sessions)
    res = {}
    for n in args.lengths:
        calls = [r.session.begin(r.history[-1], n) for r in rows]
        assert all(isinstance(c, DraftCall) for c in calls)
        many = [p.tokens.tolist() for p in drafter.propose_many(calls)]
        solo = [c.session.propose(c.anchor, n).tokens.tolist() for c in calls]
        slots = sum(len(s) for s in solo)
        bad = sum(x != y for m, s in zip(many, solo) for x, y in zip(m, s))
        rows_bad = sum(m != s for m, s in zip(many, solo))
        res[n] = {"slots": slots, "slots_differing": bad, "rows_differing": rows_bad}
        log(f"  drafts N={len(rows)} n={n}: {bad}/{slots} slots and {rows_bad}/{len(rows)} rows differ from the "
            "solo forward")
    return res


def part_accept(target, drafter, prompts, eos, args, solo_cache) -> dict:
    """Each prompt alone and all together, the drafter every round at block B: drafts accepted, outputs equal."""
    res = {}
    for B in args.blocks:
        solo = solo_runs(solo_cache, ("accept", B), prompts,
                         lambda p: decode(target, [p], args.max_tokens, eos, proposer=drafter, block=B)[0][0])
        batch, trace = decode(target, prompts, args.max_tokens, eos, proposer=drafter, block=B, trace_rounds=20)
        d_s = sum(s[1].drafted for s in solo)
        a_s = sum(s[1].accepted for s in solo)
        d_b = sum(x[1].drafted for x in batch)
        a_b = sum(x[1].accepted for x in batch)
        eq = sum(s[0] == x[0] for s, x in zip(solo, batch))
        res[B] = {"solo_drafted": d_s, "solo_accepted": a_s, "batch_drafted": d_b, "batch_accepted": a_b,
                  "solo_rate": a_s / max(d_s, 1), "batch_rate": a_b / max(d_b, 1), "outputs_equal": eq,
                  "first_rounds_tokens_per_row": trace}
        log(f"  accept N={len(prompts)} B={B}: accepted {a_s}/{d_s} ({a_s / max(d_s, 1):.2f}) alone, {a_b}/{d_b} "
            f"({a_b / max(d_b, 1):.2f}) together; outputs equal {eq}/{len(prompts)}; first rounds' tokens/row "
            f"{trace[:12]}")
    return res


def part_verify(target, prompts, eos, args, solo_cache) -> dict:
    """Plain batched rounds and oracle drafts vs each prompt alone: where rows depart and at what margins."""
    solo = solo_runs(solo_cache, "plain", prompts,
                     lambda p: decode(target, [p], args.max_tokens, eos, logprobs=True)[0][0])
    V = target.vocab_size
    res = {}
    for B in [1] + list(args.blocks):
        if B == 1:
            batch, _ = decode(target, prompts, args.max_tokens, eos)
        else:
            props = [rt.ScriptedProposer(len(p), s[0], [B], B, V, ()) for p, s in zip(prompts, solo)]
            batch = []
            bb = SpeculativeBatch(target, schedule="full")
            uids = [bb.add(p, args.max_tokens, proposer=pr, block_size=B, eos_token_ids=eos)
                    for p, pr in zip(prompts, props)]
            out = {u: [] for u in uids}
            stats = {}
            while bb.active or bb.pending:
                for e in bb.step():
                    out[e.uid] += e.tokens
                    if e.stats is not None:
                        stats[e.uid] = e.stats
            batch = [(out[u], stats.get(u), []) for u in uids]
        departs = []
        for s, x in zip(solo, batch):
            d = first_diff(s[0], x[0])
            if d is not None and d < len(s[2]):
                departs.append({"at": d, "solo_margin": s[2][d]})
            elif d is not None:
                departs.append({"at": d, "solo_margin": None})
        wide = [x for x in departs if x["solo_margin"] is not None and x["solo_margin"] > args.tie]
        rec = {"rows": len(prompts), "departed": len(departs), "departures": departs, "wide_margin": len(wide)}
        if B > 1:
            rec["accepted"] = sum(x[1].accepted for x in batch)
            rec["drafted"] = sum(x[1].drafted for x in batch)
        res[B] = rec
        ms = sorted(x["solo_margin"] for x in departs if x["solo_margin"] is not None)
        log(f"  verify N={len(prompts)} {'plain' if B == 1 else f'oracle B={B}'}: {len(departs)} rows depart from "
            f"their solo output; solo margins there {[round(m, 3) for m in ms]}; {len(wide)} above --tie {args.tie}"
            + (f"; oracle drafts accepted {rec['accepted']}/{rec['drafted']}" if B > 1 else ""))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dequantize", action="store_true", help="dense weights (default: packed, as served on a GPU)")
    ap.add_argument("--rows", default="4", help="batch sizes N, comma-separated")
    ap.add_argument("--blocks", default="2,4,8", help="block sizes B of the accept and verify parts")
    ap.add_argument("--lengths", default="1,3,7", help="draft lengths n of the drafts part")
    ap.add_argument("--warm-rounds", type=int, default=6, help="plain rounds before the drafts part")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tie", type=float, default=0.25,
                    help="a departure at a solo margin (log-probability) above this is not a near-tie")
    ap.add_argument("--slot-tol", type=float, default=0.05,
                    help="on a GPU: most drafter slots (fraction) that may differ from the solo forward")
    ap.add_argument("--parts", default="drafts,accept,verify")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; later row counts are skipped past it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.blocks = [int(x) for x in args.blocks.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    parts = args.parts.split(",")

    from mlx_dflash2.loading import load_target, make_proposer

    budget = rt.Budget(args.budget)
    t0 = time.perf_counter()
    target, tok, name = load_target(args.model, dtype=args.dtype, dequantize=args.dequantize)
    drafter = dflash_of(make_proposer("shipped", target, tok, name, lookup=False, min_confidence=0.0, adaptive=False,
                                      calibrate=False))
    eos = list(tok.eos_token_ids or ())
    exact = mx.default_device() == mx.cpu and args.dtype == "float32"
    log(f"loaded in {time.perf_counter() - t0:.1f} s on {mx.default_device()}, dtype {args.dtype}, "
        f"{'exact' if exact else 'near-tie'} checks")
    res = {"meta": rt.device_meta(), "args": vars(args), "by_rows": {}, "failures": []}
    solo_cache: dict = {}
    all_prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p in bench_prompts(max(int(n) for n in args.rows.split(",")))]
    for n in [int(x) for x in args.rows.split(",")]:
        if budget.left() < 30:
            log(f"N={n}: skipped (budget)")
            continue
        prompts = all_prompts[:n]
        rec = res["by_rows"][n] = {}
        if "drafts" in parts:
            rec["drafts"] = part_drafts(target, drafter, prompts, eos, args)
            for ln, d in rec["drafts"].items():
                limit = 0 if exact else args.slot_tol * d["slots"]
                if d["slots_differing"] > limit:
                    res["failures"].append(f"N={n} n={ln}: {d['slots_differing']}/{d['slots']} drafter slots differ")
        if "accept" in parts:
            rec["accept"] = part_accept(target, drafter, prompts, eos, args, solo_cache)
            for B, a in rec["accept"].items():
                if exact and a["outputs_equal"] != n:
                    res["failures"].append(f"N={n} B={B}: {n - a['outputs_equal']} outputs differ (float32)")
                if exact and (a["solo_accepted"], a["solo_drafted"]) != (a["batch_accepted"], a["batch_drafted"]):
                    res["failures"].append(f"N={n} B={B}: acceptance differs alone and together (float32)")
        if "verify" in parts:
            rec["verify"] = part_verify(target, prompts, eos, args, solo_cache)
            for B, v in rec["verify"].items():
                if (exact and v["departed"]) or v["wide_margin"]:
                    res["failures"].append(f"N={n} verify B={B}: {v['departed']} rows depart, {v['wide_margin']} "
                                           f"at margins above {args.tie}")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    for f in res["failures"]:
        log(f"FAIL: {f}")
    log(f"done in {time.perf_counter() - t0:.0f} s: {len(res['failures'])} failures")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
