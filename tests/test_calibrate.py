"""Per-machine calibration of the verify cost (mlx_dflash2.calibrate) and the width policy that uses it
(proposers.WidthPolicy under the adaptive schedule)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from conftest import LONG_REF, PROMPTS, REF_TOKENS, chat_ids, plain_reference
from mlx_dflash2 import calibrate as C
from mlx_dflash2.calibrate import DEFAULT_WIDTHS, VerifyCosts
from mlx_dflash2.proposers import AdaptiveSchedule, DFlashProposer, FusedProposer, LookupProposer, WidthPolicy
from mlx_dflash2.speculative import SpecStats, speculative_generate_step
from scripted import ScriptedProposer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen2-class target (2 layers, hidden 64) and a fresh 1-layer DFlash2 drafter for it."""
    from tiny_models import tiny_mlx_lm_dir

    from mlx_dflash2.drafter import init_drafter
    from mlx_dflash2.loading import load_target

    path = tiny_mlx_lm_dir(tmp_path_factory.mktemp("calib") / "tiny", "qwen2", num_layers=2)
    target, tok, name = load_target(str(path))
    drafter = DFlashProposer(init_drafter(target, tok, num_layers=1, block_size=4, selector_rank=8), target, len(tok))
    return path, target, tok, name, drafter


def _leaves(d: dict, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,)


def test_cache_key_changes_with_every_fingerprint_field(tiny, monkeypatch):
    """Every field of the fingerprint is in the key, and each thing that changes costs changes the fingerprint:
    the target's name, its shape, weights (dtype, quantization), kernel mode, the drafter, MLX's version and
    the device (its name, the processor, the cores this process may use)."""
    from mlx_dflash2.loading import load_target

    path, target, tok, name, drafter = tiny
    fp = C.fingerprint(target, name, drafter)
    key = C.cache_key(fp)
    assert C.cache_key(C.fingerprint(target, name, drafter)) == key  # stable
    fields = list(_leaves(fp))
    for want in [("target",), ("hidden_size",), ("layers",), ("vocab_rows",), ("weights",), ("dtype",),
                 ("kernels",), ("mlx",), ("device", "device"), ("device", "processor"), ("device", "cores"),
                 ("drafter", "weights"), ("drafter", "shape")]:
        assert want in fields, want
    for f in fields:
        other = copy.deepcopy(fp)
        d = other
        for k in f[:-1]:
            d = d[k]
        d[f[-1]] = [d[f[-1]], "changed"]
        assert C.cache_key(other) != key, f

    def changed(fp2, *fields):
        assert C.cache_key(fp2) != key
        diff = [f for f in fields if _get(fp2, f) != _get(fp, f)]
        assert diff == list(fields), (fields, diff)

    changed(C.fingerprint(target, name + "-copy", drafter), ("target",))
    half, _, _ = load_target(str(path), dtype="float16")
    changed(C.fingerprint(half, name, drafter), ("weights",), ("dtype",))
    quant, _, _ = load_target(str(path))
    nn.quantize(quant.model, group_size=32, bits=4)
    changed(C.fingerprint(quant, name, drafter), ("weights",))
    assert "q4g32 affine" in C.fingerprint(quant, name, drafter)["weights"]
    monkeypatch.setattr(target, "kernels", "kernel")
    changed(C.fingerprint(target, name, drafter), ("kernels",))
    monkeypatch.undo()
    assert C.cache_key(C.fingerprint(target, name, None)) != key  # no drafter timed
    monkeypatch.setattr(mx, "__version__", "0.0.1")
    changed(C.fingerprint(target, name, drafter), ("mlx",))
    monkeypatch.undo()
    monkeypatch.setattr(C, "_processor_name", lambda: "Some Other CPU")
    changed(C.fingerprint(target, name, drafter), ("device", "processor"))
    monkeypatch.undo()
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
        changed(C.fingerprint(target, name, drafter), ("device", "cores"))
        monkeypatch.undo()
    real_info = mx.device_info
    monkeypatch.setattr(mx, "device_info", lambda *a: {**real_info(*a), "device_name": "Another device"})
    changed(C.fingerprint(target, name, drafter), ("device", "device_name"))


def _get(d, path):
    for k in path:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def test_calibrate_caches_per_fingerprint_measures_wider_and_reruns_on_request(tiny, tmp_path, monkeypatch, caplog):
    path, target, tok, name, drafter = tiny
    cache = tmp_path / "sub" / "cal.json"
    monkeypatch.setenv(C.CACHE_ENV, str(cache))
    calls = []
    real = C.measure_verify_costs

    def fake(t, widths, **kw):
        calls.append(list(widths))
        return real(t, widths, **{**kw, "context": 8, "repeats": 1})

    monkeypatch.setattr(C, "measure_verify_costs", fake)
    a = C.calibrate(target, name, drafter, block_size=4, progress=False)
    assert calls == [[1, 2, 3, 4]] and sorted(a.verify_s) == [1, 2, 3, 4] and sorted(a.drafter_s) == [1, 3]
    assert a.fingerprint == json.loads(json.dumps(C.fingerprint(target, name, drafter)))
    b = C.calibrate(target, name, drafter, block_size=4, progress=False)  # cached: nothing measured
    assert len(calls) == 1 and b.verify_s == a.verify_s and b.drafter_s == a.drafter_s
    C.calibrate(target, name, drafter, block_size=4, rerun=True, progress=False)  # --calibrate
    assert len(calls) == 2
    C.calibrate(target, name, drafter, block_size=8, progress=False)  # wider than the entry: measured again
    assert calls[-1] == [1, 2, 3, 4, 6, 8]
    C.calibrate(target, name, drafter, block_size=6, progress=False)  # covered by the wider entry
    assert len(calls) == 3
    C.calibrate(target, name + "-other", drafter, block_size=4, progress=False)  # another key, both kept
    entries = json.loads(cache.read_text())["entries"]
    assert len(calls) == 4 and len(entries) == 2
    assert not list(cache.parent.glob(".*.tmp"))  # written atomically, nothing left behind
    cache.write_text("{not json")
    with caplog.at_level("WARNING", logger="mlx_dflash2"):
        C.calibrate(target, name, drafter, block_size=4, progress=False)
    assert len(calls) == 5 and "unreadable" in caplog.text
    assert len(json.loads(cache.read_text())["entries"]) == 1


def test_entries_of_the_first_protocol_stay_in_the_file_and_are_measured_again(tiny, tmp_path, monkeypatch):
    """A protocol-1 entry (no long-context table) is not this protocol's: the calibration is measured again
    (now with the long context) and stored beside it, which an older package still finds."""
    path, target, tok, name, drafter = tiny
    cache = tmp_path / "cal.json"
    monkeypatch.setenv(C.CACHE_ENV, str(cache))
    fp1 = {**C.fingerprint(target, name, drafter), "protocol": 1}
    old = {"verify_s": {"1": 1.0, "2": 1.0, "3": 1.0, "4": 1.0}, "drafter_s": {}, "fingerprint": fp1,
           "meta": {"context": 128}}
    cache.write_text(json.dumps({"version": C.CACHE_VERSION, "entries": {C.cache_key(fp1): old}}))
    costs = C.calibrate(target, name, drafter, block_size=4, progress=False, repeats=1, max_repeats=1)
    assert costs.verify_long_s and costs.fingerprint["protocol"] == C.PROTOCOL == 3
    entries = json.loads(cache.read_text())["entries"]
    assert len(entries) == 2 and entries[C.cache_key(fp1)] == old


class _Slow:
    """The tiny target with ``delay`` seconds added to every forward (a large target, in time)."""

    def __init__(self, target, delay):
        self.t, self.delay = target, delay

    def __getattr__(self, k):
        return getattr(self.t, k)

    def forward(self, *a, **kw):
        time.sleep(self.delay)
        return self.t.forward(*a, **kw)


def test_measurement_runs_in_bounded_time(tiny):
    """The timed passes stop at the time budget (at least one runs): a slow target gets fewer passes, and
    the whole measurement ends within the budget plus one pass and the untimed first one. Without a budget
    in the way, passes go on from `repeats` until the costs settle, at most `max_repeats`."""
    path, target, tok, name, drafter = tiny
    t0 = time.perf_counter()
    costs = C.measure_verify_costs(_Slow(target, 0.03), drafter=drafter, repeats=5, time_budget=0.3, progress=False)
    took = time.perf_counter() - t0
    # a whole-block drafter (the default) at 1 and B - 1 drafts; a fitted one at the top of each block size
    assert sorted(costs.verify_s) == list(DEFAULT_WIDTHS) and sorted(costs.drafter_s) == [1, 15]
    drafter.fit_blocks = True
    try:
        fitted = C.measure_verify_costs(target, (1, 16), drafter=drafter, repeats=1, long_context=0, progress=False)
    finally:
        drafter.fit_blocks = False
    assert sorted(fitted.drafter_s) == [1, 3, 7, 15]
    # the budget stopped the passes after the first (a wall-clock bound here would only measure the host's load)
    assert costs.meta["passes"] == 1 and not costs.meta["settled"], (costs.meta, took)
    assert all(t >= 0.03 for t in costs.verify_s.values())
    # the second context (the cost of a verify row grows with the context it attends to)
    assert sorted(costs.verify_long_s) == list(DEFAULT_WIDTHS) and costs.long_context > costs.context
    assert costs.meta["long_context"] == costs.long_context
    assert C.measure_verify_costs(target, (1, 4), long_context=0, repeats=1, progress=False).verify_long_s == {}
    fast = C.measure_verify_costs(target, (1, 4), repeats=3, max_repeats=6, time_budget=30.0, progress=False)
    assert 3 <= fast.meta["passes"] <= 6 and fast.drafter_s == {} and sorted(fast.verify_s) == [1, 4]
    loose = C.measure_verify_costs(target, (1, 4), repeats=2, tolerance=100.0, time_budget=30.0, progress=False)
    assert loose.meta["passes"] == 2 and loose.meta["settled"]  # settled at once: stops at `repeats`
    for bad in (dict(widths=(0, 4)), dict(context=0), dict(repeats=0), dict(max_repeats=1, repeats=2),
                dict(tolerance=-1), dict(time_budget=0), dict(long_context=100)):
        with pytest.raises(ValueError, match=list(bad)[-1]):
            C.measure_verify_costs(target, **{"widths": (1, 2), **bad})


def test_verify_costs_interpolate_and_validate():
    c = VerifyCosts({1: 1.0, 4: 2.5, 8: 2.0}, {1: 0.3, 15: 0.6})
    assert c.verify(4) == 2.5 and c.verify(2) == 1.5 and c.verify(6) == 2.25
    assert c.verify(15) == pytest.approx(2.0 + (2.0 - 1.0) / 7 * 7)  # past the widest: the mean slope
    # a drafter proposal costs what the smallest measured n' >= n cost (the block that holds n drafts)
    assert c.drafter(8) == c.drafter(15) == 0.6 and c.drafter(1) == 0.3 and c.ratios() == {1: 1.0, 4: 2.5, 8: 2.0}
    assert c.drafter(29) == pytest.approx(0.6 + 0.3 / 14 * 14)  # past the largest: the mean slope
    fitted = VerifyCosts({1: 1.0}, {1: 0.1, 3: 0.2, 7: 0.4, 15: 0.8})
    assert [fitted.drafter(n) for n in (1, 2, 3, 4, 7, 8, 15)] == [0.1, 0.2, 0.2, 0.4, 0.4, 0.8, 0.8]
    assert VerifyCosts.from_json(json.loads(json.dumps(c.to_json()))).verify_s == c.verify_s
    for bad in ({2: 1.0}, {1: 0.0}, {1: float("nan")}, {1: 1.0, 0: 1.0}):
        with pytest.raises(ValueError):
            VerifyCosts(bad)


def test_verify_costs_grow_with_the_context_and_read_old_entries():
    """With a table measured after a long context, the cost at a context is the line through the two per width
    (extended past the long one, never below the short one); without it (protocol-1 entries, which have no
    such table and keep their context in `meta`) every context costs the same. Round trip through JSON."""
    c = VerifyCosts({1: 1.0, 16: 2.0}, {1: 0.3}, verify_long_s={1: 2.0, 16: 8.0}, context=128, long_context=1024)
    assert c.verify(16) == 2.0 and c.verify(16, 100) == 2.0 and c.verify(16, 1024) == pytest.approx(8.0)
    assert c.verify(1, 8064) == pytest.approx(1.0 + 1.0 * (8064 - 128) / 896)
    assert c.verify(8, 1024) == pytest.approx(2.0 + 6.0 * 7 / 15)  # interpolated in the width at each context
    assert c.ratios(1024) == pytest.approx({1: 1.0, 16: 4.0}) and c.ratios() == {1: 1.0, 16: 2.0}
    back = VerifyCosts.from_json(json.loads(json.dumps(c.to_json())))
    assert (back.verify_long_s, back.context, back.long_context) == (c.verify_long_s, 128, 1024)
    old = {"verify_s": {"1": 1.0, "16": 2.0}, "drafter_s": {}, "fingerprint": {}, "meta": {"context": 64}}
    v1 = VerifyCosts.from_json(old)
    assert v1.context == 64 and v1.verify_long_s == {} and v1.verify(16, 8000) == 2.0
    assert "after 1024 tokens 1:1.00 16:4.00" in c.table()
    for bad in (dict(verify_long_s={1: 2.0}), dict(long_context=128), dict(verify_long_s={1: 2.0, 16: -1.0}),
                dict(context=-1)):
        with pytest.raises(ValueError, match=list(bad)[-1]):
            VerifyCosts({1: 1.0, 16: 2.0}, **{"verify_long_s": {1: 2.0, 16: 8.0}, "long_context": 1024, **bad})


def test_width_policy_at_a_long_context_takes_plain_steps_where_a_verify_no_longer_pays():
    """Issue 20 (the default ran at 0.78x of plain decoding after an 8K-token prompt on the CPU): verify rows
    cost little more than a plain step after a short context but much more after a long one (attention over
    every cached key). A long lookup match is verified in full while the history is short, and not at all
    (a plain step, no drafter forward) once the history is long; a drafter round likewise."""
    from test_lookup import _Fixed

    cpu_like = VerifyCosts({m: 1.0 + 0.05 * (m - 1) for m in DEFAULT_WIDTHS}, {1: 0.1, 15: 0.2},
                           verify_long_s={m: 2.0 + 1.5 * (m - 1) for m in DEFAULT_WIDTHS}, context=128,
                           long_context=1024)
    w = WidthPolicy(cpu_like)
    assert w.choose(15, "lookup") == 15 and w.choose(15, "lookup", context=64) == 15
    assert w.choose(15, "lookup", context=8000) == 0 and w.choose(15, "drafter", context=8000) == 0
    t = [0.0]
    pattern = list(range(100, 140))

    def session(history_len):
        sch = AdaptiveSchedule(min_samples=1, warmup=0, clock=lambda: t[0], widths=WidthPolicy(cpu_like))
        fp = FusedProposer(_Fixed(list(range(50, 70))), LookupProposer(block_size=8), schedule=sch)
        s = fp.start([])
        s.extend((pattern * (history_len // len(pattern) + 1))[:history_len], None)
        return fp, s

    fp, s = session(120)  # the history repeats: a long match of the anchor's continuation
    assert s.propose(120 % 40 + 100, 15).n == 15
    fp, s = session(8000)
    p = s.propose(8000 % 40 + 100, 15)
    assert p.n == 0 and fp.drafter.calls == 0  # a plain step
    fp, s = session(8001)
    p = s.propose(7, 15)  # no match: the drafter's trial round, but no width pays at 8K: a plain step
    assert p.n == 0 and fp.drafter.calls == 0


def test_width_policy_acceptance_estimate_and_choice():
    """c_i from discounted conditional counts with a chained prior; the choice maximises tokens per second."""
    flat = VerifyCosts({m: 1.0 for m in DEFAULT_WIDTHS})
    w = WidthPolicy(flat, decay=0.5)
    assert w.acceptance(2) == pytest.approx([0.6, 0.36])  # the prior, geometric
    assert w.choose(15) == 15  # flat costs: every extra draft is free
    w.record(4, 1)  # positions 1, 2 verified after a full prefix; 1 accepted, 2 rejected
    hits, trials = w._counts["drafter"]
    assert trials == [1.0, 1.0] and hits == [1.0, 0.0]
    p1 = (1 + 2 * 0.6) / 3
    p2 = (0 + 2 * p1) / 3
    assert w.acceptance(3) == pytest.approx([p1, p1 * p2, p1 * p2 * p2])  # position 3 takes position 2's rate
    w.record(2, 2)
    assert w._counts["drafter"][1] == [1.5, 1.5]  # discounted, then counted
    # a verify row costs a plain step (quantized matmuls on MLX's CPU backend): no width pays, a plain step
    steep = VerifyCosts({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0})
    assert WidthPolicy(steep).choose(15) == 0 and WidthPolicy(steep).choose(15, "lookup") == 0
    assert WidthPolicy(steep).choose(0) == 0
    w3 = WidthPolicy(steep)
    w3._counts["lookup-short"] = ([0.5], [1.0])
    w3.record(0, 0, "lookup-short")  # a plain step instead: the counts are only discounted (back to the prior)
    assert w3._counts["lookup-short"] == ([0.5 * 0.95], [0.95])
    # the lookup kind has its own counts and no drafter cost
    w2 = WidthPolicy(VerifyCosts({1: 1.0, 16: 1.0}, {1: 100.0, 15: 100.0}))
    assert w2.rate(3, "lookup") > 1.0 > w2.rate(3, "drafter")
    w2.record(5, 0, "lookup")
    assert "lookup" in w2._counts and "drafter" not in w2._counts
    for bad in (dict(priors={"drafter": 1.0}), dict(prior_weight=0), dict(decay=1.0)):
        with pytest.raises(ValueError):
            WidthPolicy(flat, **bad)


def test_fused_rounds_follow_the_width_policy_and_a_plain_choice_runs_no_drafter():
    """Drafter rounds draft the policy's n, lookup rounds (long and short matches) propose its share of the
    match, and where no width pays the round is a plain step: no drafter forward, timed as the schedule's
    other arm (not the drafter's, which it would make look cheap)."""
    from test_lookup import _Fixed

    t = [0.0]
    gpu_like = VerifyCosts({1: 1.0, 2: 1.5, 4: 2.4, 8: 1.3, 16: 2.8})
    sch = AdaptiveSchedule(min_samples=1, warmup=0, clock=lambda: t[0], widths=WidthPolicy(gpu_like))
    fp = FusedProposer(_Fixed(list(range(50, 70))), LookupProposer(block_size=8), schedule=sch)
    s = fp.start([])
    s.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 1, 2, 3, 4, 5, 6, 7, 8], None)
    p = s.propose(9, 15)  # a long match of 19 tokens: the lookup's 15 cut to the policy's 7 (T(8) << T(16))
    assert p.source == "lookup" and p.tokens.tolist() == list(range(10, 17)) and fp.drafter.calls == 0
    s.verified(8)
    assert sch.widths._counts["lookup"][0] == [1.0] * 7
    s2 = fp.start([])
    s2.extend([40, 41, 42], None)
    p = s2.propose(77, 15)  # no match, context "none": the schedule's first trial is the drafter's
    assert p.n == 7 and fp.drafter.calls == 1  # T(8) is the cheap width
    t[0] += 1.0
    s2.verified(1)  # nothing accepted
    steep = AdaptiveSchedule(min_samples=1, warmup=0, clock=lambda: t[0],
                             widths=WidthPolicy(VerifyCosts({1: 1.0, 2: 2.0, 16: 16.0})))
    fp2 = FusedProposer(_Fixed(list(range(50, 70))), LookupProposer(block_size=8), schedule=steep)
    s3 = fp2.start([])
    p = s3.propose(77, 15)  # the drafter's turn, but no width pays: a plain step
    assert p.n == 0 and fp2.drafter.calls == 0
    t[0] += 1.0
    s3.verified(1)
    assert steep.rate("none", False) == 1.0 and steep.rate("none", True) is None


# ---------------------------------------------------------------------------
# through the loop: float32 embedded target, scripted drafter, fake cost tables
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def code_ref(smol_f32):
    target, tok = smol_f32
    ids = chat_ids(tok, PROMPTS["code"])
    # made LONG_REF tokens long: test_lossless's long asks of the code prompt share this run (one instead of two)
    return ids, plain_reference(target, ids, REF_TOKENS, at_least=LONG_REF)[0]


def _run_policy(smol_f32, code_ref, verify_s, offsets, n=64, drafter_s=None):
    """Greedy decoding of the code prompt by a scripted drafter (first error at ``offsets[r]`` in round r)
    fused with lookup under the adaptive schedule with a width policy over the cost table ``verify_s``; every
    round takes one tick of the schedule's clock, so the arm with more tokens per round wins."""
    target, tok = smol_f32
    ids, ref = code_ref
    scripted = ScriptedProposer(len(ids), ref, offsets, 16, len(tok))
    asked = []
    inner = scripted.start

    def start(prompt):
        s = inner(prompt)
        propose = s.propose
        s.propose = lambda anchor, k, *a, **kw: (asked.append(k), propose(anchor, k, *a, **kw))[1]
        return s

    scripted.start = start
    tick = [0.0]

    def clock():
        tick[0] += 0.5
        return tick[0]

    costs = verify_s if isinstance(verify_s, VerifyCosts) else VerifyCosts(verify_s, drafter_s or {1: 0.2, 15: 0.3})
    policy = WidthPolicy(costs)
    sch = AdaptiveSchedule(min_samples=1, warmup=0, clock=clock, widths=policy)
    prop = FusedProposer(scripted, LookupProposer(block_size=8), schedule=sch)
    stats = SpecStats()
    out = [t for t, _, _ in speculative_generate_step(ids, target, prop, block_size=16, max_tokens=n, stats=stats)]
    return out, ref[:n], stats, asked


def test_width_policy_never_verifies_16_where_16_costs_more(smol_f32, code_ref):
    """A cost table in which 16 rows cost more than twice 8 (GPU-like: narrow widths cheap, then a cliff):
    even with every draft right, no round verifies 16 or 12 rows (drafter or lookup) and the drafter is asked
    for 7; output equals plain decoding."""
    table = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 6: 1.2, 8: 1.25, 12: 2.6, 16: 2.8}
    out, ref, stats, asked = _run_policy(smol_f32, code_ref, table, [15])
    assert out == ref
    assert 16 not in stats.verify_widths and 12 not in stats.verify_widths, stats.verify_widths
    assert asked and max(asked) == 7 and asked.count(7) >= len(asked) - 3, asked  # the first from the prior
    assert stats.verify_widths.get(8, 0) >= 3 and stats.tau > 3


def test_width_policy_verifies_full_blocks_on_a_flat_cost_table(smol_f32, code_ref):
    """Flat verify cost and every draft right: the drafter rounds verify full blocks of 16 (the last rounds
    are capped by max_tokens); output equals plain decoding."""
    flat = {m: 1.0 for m in DEFAULT_WIDTHS}
    out, ref, stats, asked = _run_policy(smol_f32, code_ref, flat, [15])
    assert out == ref
    full = [k for k in asked if k == 15]
    assert len(full) >= len(asked) - 2 and len(full) >= 2, asked
    assert stats.verify_widths.get(16, 0) >= 2


def test_width_policy_follows_acceptance_lossless(smol_f32, code_ref):
    """A CPU-like table (T(16)/T(1) ~ 2, T(12) > T(16)): while every draft is right the policy widens to full
    blocks; then every first draft is wrong, and once its estimate has fallen no width pays: plain steps, no
    drafter forward. It never picks 12 rows, and output equals plain decoding throughout."""
    table = {1: 1.0, 2: 1.2, 3: 1.35, 4: 1.5, 6: 1.55, 8: 1.7, 12: 2.2, 16: 2.0}
    out, ref, stats, asked = _run_policy(smol_f32, code_ref, table, [15] * 3 + [0] * 60, n=64,
                                         drafter_s={1: 0.5, 15: 0.8})
    assert out == ref
    assert 11 not in asked and 15 in asked[:3], asked
    assert len(asked) <= 16 and stats.rounds_by_source.get("none", 0) >= 8, (asked, stats.rounds_by_source)


def test_loop_reads_the_verify_cost_at_the_context_it_has(smol_f32, code_ref):
    """The same flat short-context table (every draft right: full blocks pay), but verify rows that cost many
    plain steps after a long context; the prompt is long for this table (contexts of 8 and 16 tokens), so
    the loop, which passes each round's context to the width policy, takes plain steps only: no drafter
    forward, and the calibration in the stats is the one at the prompt's length. Output equals plain."""
    ids, _ = code_ref
    assert len(ids) > 32
    flat = {m: 1.0 for m in DEFAULT_WIDTHS}
    costs = VerifyCosts(flat, {1: 0.2, 15: 0.3}, verify_long_s={m: 1.0 + m for m in DEFAULT_WIDTHS}, context=8,
                        long_context=16)
    out, ref, stats, asked = _run_policy(smol_f32, code_ref, costs, [15], n=24)
    assert out == ref
    assert asked == [] and stats.verify_widths == {1: 23}, (asked, stats.verify_widths)
    assert stats.verify_cost[16] > 4 * stats.verify_cost[2]


def test_stats_show_the_calibration_of_the_widths_this_request_can_verify(smol_f32, code_ref):
    """A cached table may hold wider widths, measured by a run with a larger ``--block-size`` (a fresh user's demo
    printed ``1000:93.07`` and ``n=999:34.62`` from another run's entry): a request's stats show the widths up to its
    block only. Output equals plain."""
    table = {**{m: 1.0 + m / 16 for m in DEFAULT_WIDTHS}, 1000: 93.0}
    out, ref, stats, _ = _run_policy(smol_f32, code_ref, table, [15], n=8, drafter_s={1: 0.2, 15: 0.3, 999: 30.0})
    assert out == ref
    assert max(stats.verify_cost) == 16 and max(stats.drafter_cost) == 15, (stats.verify_cost, stats.drafter_cost)


def test_without_calibration_drafter_rounds_draft_full_blocks(smol_f32, code_ref):
    """No width policy (adaptive schedule alone, today's behaviour): every drafter round is asked for B - 1
    (or what max_tokens leaves)."""
    target, tok = smol_f32
    ids, ref = code_ref
    scripted = ScriptedProposer(len(ids), ref, [15], 16, len(tok))
    asked = []
    inner = scripted.start

    def start(prompt):
        s = inner(prompt)
        propose = s.propose
        s.propose = lambda anchor, k, *a, **kw: (asked.append(k), propose(anchor, k, *a, **kw))[1]
        return s

    scripted.start = start
    tick = [0.0]
    sch = AdaptiveSchedule(min_samples=1, warmup=0, clock=lambda: tick.__setitem__(0, tick[0] + 0.5) or tick[0])
    prop = FusedProposer(scripted, LookupProposer(block_size=8), schedule=sch)
    assert prop.calibration is None and sch.width(15) == 15
    stats = SpecStats()
    out = [t for t, _, _ in speculative_generate_step(ids, target, prop, block_size=16, max_tokens=48, stats=stats)]
    assert out == ref[:48] and asked and all(k == 15 for k in asked[:-1]), asked
    assert stats.verify_cost == {}


def test_make_proposer_calibrates_under_the_adaptive_schedule_only(tiny, tmp_path, monkeypatch):
    """`auto`/adaptive proposers get a width policy from the (cached) calibration; calibrate=False and
    proposers without the schedule measure nothing."""
    from mlx_dflash2.loading import make_proposer

    path, target, tok, name, drafter = tiny
    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "cal.json"))
    m = drafter.model
    adaptive = make_proposer(m, target, tok, name, adaptive=True, block_size=4)
    assert isinstance(adaptive, FusedProposer) and adaptive.calibration is not None
    assert sorted(adaptive.calibration.verify_s) == [1, 2, 3, 4]
    assert make_proposer(m, target, tok, name, adaptive=True, calibrate=False).calibration is None
    assert make_proposer(m, target, tok, name, adaptive=False).calibration is None
    assert len(json.loads((tmp_path / "cal.json").read_text())["entries"]) == 1


def test_load_checks_calibrate_before_loading_and_notes_a_flag_with_nothing_to_calibrate(tiny, tmp_path, monkeypatch,
                                                                                         caplog):
    from mlx_dflash2.loading import load

    with pytest.raises(ValueError, match="calibrate"):
        load("/nonexistent/model", drafter="none", calibrate="yes")
    for drafter in ("lookup", "none"):  # no drafter, no adaptive schedule: refused before loading (session 26)
        with pytest.raises(ValueError, match=f'drafter="{drafter}" has none'):
            load("/nonexistent/model", drafter=drafter, calibrate=True)
    for kw in (dict(drafter="init"), dict(drafter="shipped"), dict(drafter="auto", adaptive=False),
               dict(drafter="auto", lookup=False)):  # a drafter without the adaptive schedule: refused too
        with pytest.raises(ValueError, match="^calibrate=True measures the verify widths of the adaptive schedule"):
            load("/nonexistent/model", calibrate=True, **kw)
    cli = ("--calibrate measures the verify widths of the adaptive schedule, which this drafter runs without "
           "(--drafter shipped or a path without --adaptive, --no-adaptive or --no-lookup): drop --calibrate, or add "
           "--adaptive")  # the commands' message names their flags
    with pytest.raises(ValueError, match="^" + re.escape(cli) + "$"):
        load("/nonexistent/model", drafter="init", calibrate=True, names="cli")
    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "cal.json"))
    with caplog.at_level("WARNING", logger="mlx_dflash2"):  # auto where no drafter ships (lookup): a note
        model, _ = load(str(tiny[0]), drafter="auto", calibrate=True)
    assert model.proposer.name == "lookup" and "nothing measured" in caplog.text
    assert not (tmp_path / "cal.json").exists()


@pytest.mark.slow  # two CLI processes on the real model (27 s); runs in make test-all
def test_cli_calibrate_flag_end_to_end():
    """`--calibrate` measures on the spot and stores the entry; `--verbose` prints the widths verified and
    the calibration table. It stores it in the session's cache (conftest), where the later tests of the
    default drafter on the embedded model (CLI, README snippet) find it instead of measuring again."""
    cache = Path(os.environ[C.CACHE_ENV])
    before = json.loads(cache.read_text())["entries"] if cache.exists() else {}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "mlx_dflash2.generate", "--prompt", "Write a haiku about the sea.",
                        "--max-tokens", "12", "--calibrate", "--verbose"], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    assert "Verify widths:" in r.stdout and "Verify cost T(M)/T(1): 1:1.00" in r.stdout, r.stdout
    entries = json.loads(cache.read_text())["entries"]
    (entry,) = [e for k, e in entries.items() if e != before.get(k)]  # this run's (new or measured again)
    assert sorted(map(int, entry["verify_s"])) == list(DEFAULT_WIDTHS)
    assert entry["fingerprint"]["target"] == "smollm2-135m-instruct" and entry["meta"]["passes"] >= 1, took


def test_padded_length_verifies_the_cheapest_width_at_or_past_the_cut():
    """The dynamic draft length's cut, given back where a wider verify costs no more (the 2-core CPU's 1.5B: 16 rows
    cheaper than 4-12, session 41); unchanged where the cost grows with the width, or without a calibration."""
    from mlx_dflash2.proposers import padded_length

    cpu = VerifyCosts({1: 0.48, 2: 0.59, 3: 0.70, 4: 0.85, 6: 0.88, 8: 0.91, 12: 1.47, 16: 0.75})
    assert padded_length(4, 15, cpu) == 15  # 5 rows (between 4 and 6: ~0.87 s) -> 16 rows (0.75 s)
    assert padded_length(1, 15, cpu) == 1  # 2 rows stay the cheapest
    assert padded_length(2, 15, cpu) == 2  # 3 rows (0.70) beat 16 (0.75)
    assert padded_length(4, 10, cpu) == 4  # 16 rows out of reach: 5 rows (~0.87) against 8 (0.91), 11 (~1.33)
    assert padded_length(5, 7, cpu) == 5  # 6 rows 0.88, 8 rows 0.91: the cut stands
    growing = VerifyCosts({1: 1.0, 4: 1.5, 8: 2.0, 16: 3.0})
    assert [padded_length(k, 15, growing) for k in (1, 3, 7, 14)] == [1, 3, 7, 14]
    flat = VerifyCosts({1: 1.0, 4: 2.0, 8: 2.0, 16: 2.0})
    assert padded_length(3, 15, flat) == 15  # equal costs: the longest
    assert padded_length(3, 15, None) == 3 and padded_length(15, 15, cpu) == 15
