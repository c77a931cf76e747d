"""Where one speculative round's time goes, piece by piece (milliseconds, medians).

Times, each evaluated on its own (``mx.eval`` then the wall clock), on the same
target and drafter in one run:

* ``target L=n``: one target forward over ``n`` new tokens with taps (what a
  verify of ``n - 1`` drafts costs; ``L=1`` is a plain decode step), cache cut
  back after each;
* ``drafter forward``: the drafter over one block ``[anchor, mask x (B-1)]``;
* ``unary logits``: that plus the target's LM head on the B-1 block rows;
* ``propose``: the whole proposal (drafter, LM head, DFlash2 selector walk);
* ``context append``: committing ``k`` rows of tap features to the drafter context;
* ``round``: propose + verify forward + accept, as the loop runs it;
* ``... growing``: the same with a context that grows every call (the loop's
  real situation: attention shapes never repeat), and the verify forward with an
  explicit array mask instead of mlx-lm's ``"causal"``.

    scripts/run python benchmarks/profile_round.py --drafter shipped
    python benchmarks/profile_round.py --model X.gguf --drafter DIR --out results/profile-gpu.json

Each piece is timed on its own, with its own synchronisation, so the pieces
need not add up to a round (on a noisy host a round has read more than their
sum); the point is the ratios: a round costs ``propose + target L=B`` against a plain
step's ``target L=1``, so speculative decoding wins only when
``tau > (propose + verify) / plain step``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS, mlx_dflash2/_blas.py)
import mlx.core as mx

from mlx_dflash2.loading import load_target, make_proposer
from mlx_dflash2.proposers import FusedProposer
from mlx_dflash2.target import cache_length, trim_cache
from mlx_dflash2.verify import GreedyVerifier

PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."


def timed(fn, repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in ms; ``fn`` returns the arrays to evaluate."""
    for _ in range(warmup):
        mx.eval(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default="shipped")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--dequantize", action="store_true")
    ap.add_argument("--draft-confidence", type=float, default=0.0,
                    help="the drafter's dynamic draft length for propose/round (default 0: full blocks, so a round "
                    "verifies B tokens)")
    ap.add_argument("--context", type=int, default=256, help="tokens of context before the block")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    target, tok, name = load_target(args.model, dtype=args.dtype, dequantize=args.dequantize)
    proposer = make_proposer(args.drafter, target, tok, name, dequantize=args.dequantize,
                             min_confidence=args.draft_confidence)
    dp = proposer.drafter if isinstance(proposer, FusedProposer) else proposer
    B = dp.block_size
    tap_ids = dp.tap_ids
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    ids = (ids * (args.context // len(ids) + 1))[: args.context]
    cache = target.make_cache()
    res = target.forward(mx.array(ids, mx.int32), cache, tap_ids)
    session = dp.start(ids)
    session.extend(ids, res.features)
    mx.eval([c.state for c in cache] + session.state_arrays())
    P = cache_length(cache)
    anchor = ids[-1]
    r = {}

    def target_fwd(n):
        def f():
            out = target.forward(mx.array(ids[:n], mx.int32), cache, tap_ids)
            mx.eval(out.logits, out.features)
            trim_cache(cache, n)
            return []
        return f

    for n in sorted({1, 2, 4, 8, B}):
        r[f"target L={n}"] = timed(target_fwd(n), args.repeats)
    assert cache_length(cache) == P

    model, cfg = dp.model, dp.model.config
    block = mx.array([anchor] + [cfg.mask_token_id] * (B - 1), dtype=mx.int32)

    def drafter_fwd():
        return model(target.embed(block)[None], session.ctx)

    def unary():
        return model.unary_logits(drafter_fwd()[0, 1:], target.lm_head)

    r["drafter forward"] = timed(drafter_fwd, args.repeats)
    r["unary logits"] = timed(unary, args.repeats)
    r["propose (drafter)"] = timed(lambda: session.propose(anchor, B - 1).tokens, args.repeats)
    if isinstance(proposer, FusedProposer):
        fs = proposer.start(ids)
        fs.d, fs.l.index = session, fs.l.index
        fs.l.extend(ids, None)
        r["propose (fused with lookup)"] = timed(lambda: fs.propose(anchor, B - 1).tokens, args.repeats)

    feats = res.features
    for k in (1, 4):
        def append(k=k):
            session.ctx.append(model, feats[:k])
            out = session.state_arrays()
            mx.eval(out)
            session.ctx.trim(k)
            return []
        r[f"context append k={k}"] = timed(append, args.repeats)

    verifier = GreedyVerifier()

    def one_round(grow: bool = False):
        """One round as the loop runs it; ``grow``: keep the verified rows (the target cache grows
        by the block, the drafter context by 4 rows, tau ~ 4) instead of cutting back to the start."""
        prop = session.propose(anchor, B - 1)
        x = mx.concatenate([mx.array([anchor], mx.int32), prop.tokens.astype(mx.int32)])
        out = target.forward(x, cache, tap_ids)
        vr = verifier.verify(out.logits, prop, ids)
        mx.eval(vr.num_accepted, vr.tokens, vr.logprobs)
        int(vr.num_accepted.item())
        if grow:
            session.extend([], out.features[:4])
        else:
            trim_cache(cache, prop.n + 1)
        return []

    r["round (propose + verify)"] = timed(one_round, args.repeats)

    # The loop's real situation: the context grows every round, so the attention shapes never repeat.
    from mlx_lm.models.base import create_attention_mask

    def grow_fwd(n, array_mask):
        def f():
            x = mx.array(ids[:n], mx.int32)
            h = target.inner.embed_tokens(x[None])
            mask = create_attention_mask(h, cache[0], return_array=array_mask) if n > 1 else None
            for layer, c in zip(target.layers, cache):
                h = layer(h, mask, c)
            mx.eval(target.lm_head(target.inner.norm(h)))
            return []
        return f

    r["target L=1 growing"] = timed(grow_fwd(1, False), args.repeats)
    trim_cache(cache, cache_length(cache) - P)
    for am in (False, True):
        r[f"target L={B} growing{' (array mask)' if am else ''}"] = timed(grow_fwd(B, am), args.repeats)
        trim_cache(cache, cache_length(cache) - P)

    r["round growing"] = timed(lambda: one_round(grow=True), args.repeats)
    plain = r["target L=1"]
    print(f"{name} on {mx.default_device()} (dequantize={args.dequantize}, dtype={args.dtype}), B={B}, "
          f"context {P} tokens, medians of {args.repeats}")
    for k, v in r.items():
        print(f"  {k:32} {v:8.2f} ms  {v / plain:6.2f} plain steps")
    print(f"  break-even tau = round / plain step = {r['round (propose + verify)'] / plain:.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {"target": Path(str(name)).name, "device": str(mx.default_device()), "block_size": B,
                "context": P, "dequantize": args.dequantize, "dtype": args.dtype, "drafter": args.drafter,
                "draft_confidence": args.draft_confidence}
        Path(args.out).write_text(json.dumps({"meta": meta, "ms": r}, indent=2) + "\n")


if __name__ == "__main__":
    main()
