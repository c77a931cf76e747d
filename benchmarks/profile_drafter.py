"""Where the drafter's share of a batched round goes: one drafter proposal for ``N`` rows, piece by piece.

In process (no server): ``N`` chat requests (the prompts of ``bench_server.py``) run in one
:class:`~mlx_dflash2.batch.SpeculativeBatch` with the shipped drafter and block size ``--cap`` (``cap - 1``
drafts per row, a width-capped round of the server's schedule) for ``--rounds`` rounds; the drafter calls of
the last round are snapshotted (each session's context and queued feature rows copied), then every piece of
:meth:`~mlx_dflash2.proposers.DFlashProposer.propose_many` is timed on fresh copies, interleaved,
``--repeats`` times (medians, each piece evaluated and synchronised on its own):

* ``flush``: the queued context rows' projection (``fc`` + norm + every layer's K/V) and their writes;
* ``ctx_pad``: every layer's padded context K/V ``[N, KV, S, hd]`` and mask (what ``forward_rows`` builds);
* ``forward_rows``: padding + layers + final norm over every slot of the block (what ran before
  ``last_layer_slots``), and asked for the slots ``0..n`` a proposal reads (what runs now);
* ``layers``: the drafter's layers over the ``[N, B, D]`` blocks (given the padded context, every slot); the
  first layer alone, its attention, its MLP and the MLP's activation;
* ``head``: the LM head over the draft vocabulary on the ``n`` sliced slots;
* ``walk``: the candidate selector (top-K candidates, hidden projection, greedy walk);
* ``propose_many``: the whole call (host-side Python included; its graph building alone too), and three
  batches advanced in step: whole rounds with the drafter (``batch.step``), the same with the last layer over
  every slot (before), and plain steps of the same rows (``--rounds-only``: these alone). The two drafter
  batches must emit the same tokens.

    scripts/run python benchmarks/profile_drafter.py --concurrency 8 --cap 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout
import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS)

import mlx.core as mx  # noqa: E402
from mlx_lm.models.activations import swiglu  # noqa: E402
from bench_server import prompts  # noqa: E402

import mlx_dflash2.drafter.model as dmodel  # noqa: E402
from mlx_dflash2.batch import SpeculativeBatch  # noqa: E402
from mlx_dflash2.loading import load  # noqa: E402
from mlx_dflash2.proposers import DFlashProposer, DraftCall, _DFlashSession  # noqa: E402


def snapshot(s: _DFlashSession) -> _DFlashSession:
    """A copy of ``s`` (its context and its queue of feature rows), nothing appended."""
    new = _DFlashSession.__new__(_DFlashSession)
    new.p, new.block_size = s.p, s.block_size
    new._ctx = s._ctx.clone()
    new._pending = list(s._pending)
    return new


@contextmanager
def whole_last_layer(on: bool):
    """With ``on``, the drafter's last layer computes every slot of the block (as before ``last_layer_slots``)."""
    if not on:
        yield
        return
    orig = dmodel.last_layer_slots
    dmodel.last_layer_slots = lambda slots, blocks, block_size: block_size
    try:
        yield
    finally:
        dmodel.last_layer_slots = orig


def timed(fn) -> float:
    mx.synchronize()
    t = time.perf_counter()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    return time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default="shipped")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--cap", type=int, default=2, help="verify width of a round (cap - 1 drafts per row)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds before the snapshot")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds-only", action="store_true", help="time the whole rounds only (no pieces)")
    args = ap.parse_args(argv)
    model, tok = load(args.model, args.drafter, dtype=args.dtype)
    dp = getattr(model.proposer, "drafter", model.proposer)
    assert isinstance(dp, DFlashProposer), type(dp)
    n = args.concurrency
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts(n)]

    def make_batch(drafter: bool) -> SpeculativeBatch:
        b = SpeculativeBatch(model.target)
        for p in ids:
            b.add(p, 10_000, proposer=dp if drafter else None, block_size=args.cap if drafter else 1)
        return b

    seen: list = []
    orig = dp.propose_many

    def spy(calls):
        seen[:] = [DraftCall(snapshot(c.session), c.anchor, c.n, c.temperature, c.key) for c in calls]
        return orig(calls)

    dp.propose_many = spy
    on, whole, off = make_batch(True), make_batch(True), make_batch(False)
    for _ in range(args.rounds):
        for b in (on, whole, off):
            with whole_last_layer(b is whole):
                b.step()
    calls = seen
    print(f"N={n} cap={args.cap}: {len(calls)} calls, drafts {[c.n for c in calls]}, block "
          f"{dp.block_for(calls[0].n, calls[0].session.block_size)} slots, context rows "
          f"{[c.session._ctx.offset for c in calls]}, queued rows "
          f"{[sum(int(f.shape[0]) for f in c.session._pending) for c in calls]}", flush=True)
    dp.propose_many = orig
    cfg = dp.model.config

    def fresh():  # copies of the snapshot, evaluated (the copies' own work is not timed)
        cs = [DraftCall(snapshot(c.session), c.anchor, c.n, c.temperature, c.key) for c in calls]
        mx.eval([a for c in cs for a in c.session._ctx.state_arrays() + c.session._pending])
        return cs

    def flushed(cs=None):
        cs = cs or fresh()
        dp.flush([c.session for c in cs])
        mx.eval([a for c in cs for a in c.session._ctx.state_arrays()])
        return cs

    def flush_timed():
        cs = fresh()
        return timed(lambda: flushed(cs) and [])

    B = dp.block_for(max(c.n for c in calls), calls[0].session.block_size)
    base = flushed()
    ctxs = [c.session._ctx for c in base]
    blocks = mx.array([[c.anchor] + [cfg.mask_token_id] * (B - 1) for c in base], dtype=mx.int32)
    emb = dp.target.embed(blocks)
    mx.eval(emb)
    n_max = max(c.n for c in base)
    h_full = dp.model.forward_rows(emb, ctxs)
    h = h_full[:, 1 : n_max + 1]
    unary = dp.unary(h)
    anchors = mx.array([c.anchor for c in base], dtype=mx.int32)
    mx.eval(h, unary)

    def ctx_pad():  # forward_rows' per-layer context padding and masks
        out = []
        for i, layer in enumerate(dp.model.layers):
            kvs = [c.layer_kv(i) for c in ctxs]
            held = [0 if k is None else int(k.shape[2]) for k, _ in kvs]
            S = max(held)
            _, KV, _, hd = kvs[0][0].shape
            zk = mx.zeros((1, KV, S, hd), kvs[0][0].dtype)

            def pad(a, hh):
                return a if hh == S else mx.concatenate([zk[:, :, : S - hh], a], axis=2)

            out.append((mx.concatenate([pad(k, hh) for (k, _), hh in zip(kvs, held)], axis=0),
                        mx.concatenate([pad(v, hh) for (_, v), hh in zip(kvs, held)], axis=0),
                        layer.self_attn.rows_mask(B, S, held)))
        return out

    padded = ctx_pad()
    mx.eval([a for t in padded for a in t if a is not None])
    offsets = mx.array([c.offset for c in ctxs], dtype=mx.int32)

    def layers_only():
        x = emb
        for layer, (ck, cv, m) in zip(dp.model.layers, padded):
            x = layer(x, lambda a, v, ck=ck, cv=cv, m=m: a.rows(v, ck, cv, offsets, m), dp.model.kernel_mode)
        return dp.model.norm(x)

    def walk():
        return dp.model.candidate_selector.walk(unary, h, anchors, 0.0, None, dp.model.kernel_mode,
                                                dp.vocab_ids).tokens

    def propose_many():
        cs = fresh()
        mx.synchronize()
        t = time.perf_counter()
        ps = dp.propose_many(cs)
        mx.eval([p.tokens for p in ps])
        return time.perf_counter() - t

    L0 = dp.model.layers[0]
    ck0, cv0, m0 = padded[0]
    u0 = L0.input_layernorm(emb)
    g0 = L0.mlp.gate_proj(u0)
    mx.eval(u0, g0)

    def layer0():
        return L0(emb, lambda a, v: a.rows(v, ck0, cv0, offsets, m0), dp.model.kernel_mode)

    def host_build():  # the graph of a whole propose_many built on the host, nothing evaluated
        cs = fresh()
        t = time.perf_counter()
        ps = dp.propose_many(cs)
        dt = time.perf_counter() - t
        mx.eval([p.tokens for p in ps])
        return dt

    pieces = {
        "flush (fc + K/V of queued rows)": flush_timed,
        "ctx_pad (padded context K/V, masks)": lambda: timed(
            lambda: [a for t in ctx_pad() for a in t if a is not None]),
        "forward_rows, all B slots": lambda: timed(lambda: dp.model.forward_rows(emb, ctxs)),
        "forward_rows, slots 0..n": lambda: timed(lambda: dp.model.forward_rows(emb, ctxs, n_max + 1)),
        "layers (given padded context)": lambda: timed(layers_only),
        "  one layer (the first), every slot": lambda: timed(layer0),
        "    its attention (q/k/v, sdpa, o)": lambda: timed(lambda: L0.self_attn.rows(u0, ck0, cv0, offsets, m0)),
        "    its MLP (gate, up, swiglu, down)": lambda: timed(lambda: L0.mlp(u0)),
        "      the MLP's swiglu alone": lambda: timed(lambda: swiglu(g0, g0)),
        "head (draft vocabulary, n slots)": lambda: timed(lambda: dp.unary(h)),
        "walk (candidates + selector)": lambda: timed(walk),
        "propose_many (whole call)": propose_many,
        "propose_many host graph build (no eval)": host_build,
    }
    times: dict = {k: [] for k in pieces}
    rounds = {"round (cap, drafter)": on, "round, last layer over all B slots": whole, "plain step": off}
    if args.rounds_only:
        pieces, times = {}, {}
    times.update({k: [] for k in rounds})
    for _ in range(args.repeats):
        for k, f in pieces.items():
            times[k].append(f())
        for k, b in rounds.items():
            with whole_last_layer(b is whole):
                mx.synchronize()
                t = time.perf_counter()
                b.step()
                mx.synchronize()
            times[k].append(time.perf_counter() - t)
    same = [r.out for r in on._rows] == [r.out for r in whole._rows]
    print(f"the two drafter batches emitted the same tokens: {same}; drafts accepted "
          f"{sum(r.stats.accepted for r in on._rows)} / {sum(r.stats.accepted for r in whole._rows)}")
    plain = statistics.median(times["plain step"])
    print(f"{'piece':40s} {'median ms':>10s} {'/ plain step':>13s}")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"{k:40s} {1e3 * m:10.1f} {m / plain:13.3f}", flush=True)
    pairs = [("round (cap, drafter)", "round, last layer over all B slots"),
             ("forward_rows, slots 0..n", "forward_rows, all B slots")]
    for a, b in pairs:  # each repeat's own ratio (the host's load drifts between repeats, less within one)
        if times.get(a) and times.get(b):
            r = sorted(x / y for x, y in zip(times[a], times[b]))
            print(f"{a} / {b}: median of the repeats' ratios {statistics.median(r):.3f} "
                  f"(quartiles {r[len(r) // 4]:.3f} .. {r[3 * len(r) // 4]:.3f})")


if __name__ == "__main__":
    main()
