"""Where a batched round's time goes: ``SpeculativeBatch.step`` phase by phase, drafter on vs off.

In process (no server): ``N`` chat requests (the prompts of ``bench_server.py``, through the chat
template) join one :class:`~mlx_dflash2.batch.SpeculativeBatch` (``schedule="auto"``, what the server
runs) and decode ``--max-tokens`` tokens each, once with the model's proposer (``--drafter``, default
``auto``: the shipped drafter fused with lookup) and once without (plain batched decoding), interleaved,
``--repeats`` times. Reported per ``N`` and configuration (medians over the repeats): aggregate tokens/s
(all tokens / wall time of the whole batch, joins included), milliseconds per step in each phase of
:attr:`SpeculativeBatch.timings` (``prefill``, ``propose``, ``verify``, ``commit``; each phase
synchronised, so the sum can exceed an unprofiled step), the rounds run at each width cap and the tau
of the batch (tokens per row per round).

``--requests R``: each of the ``N`` clients sends ``R`` requests in a row (the server's load: joins in every
phase); reported also the in-process time to first token (median) and the drafter's context projections.
``--plain-only``: the drafter's batches run plain rounds only (what drafter rows cost where a batch does not draft).
``--gil``: one more run per configuration beside a thread that runs Python (as the server's HTTP thread does), every
call into C of this thread watched: the calls that let the other thread run (they released the GIL, and taking it back
waits for that thread, up to the switch interval: ``gil_release.py``) are counted per step by call site.

    scripts/run python benchmarks/profile_batch.py --concurrency 8,16,32 --repeats 3
    scripts/run python benchmarks/profile_batch.py --concurrency 8 --requests 5 --no-profile
    scripts/run python benchmarks/profile_batch.py --concurrency 8 --requests 5 --server --repeats 0 --gil
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout
import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS)

from bench_server import prompts  # noqa: E402

from mlx_dflash2.batch import SpeculativeBatch, WidthSchedule, warm_up_shapes  # noqa: E402
from mlx_dflash2.loading import load  # noqa: E402
from mlx_dflash2.server.engine import PromptCache  # noqa: E402
from mlx_dflash2.speculative import PLAIN_PROPOSER  # noqa: E402


class PlainOnly(WidthSchedule):
    """A width schedule fixed at plain rounds (cap 1) for batches of two rows or more (``--plain-only``: what
    drafter rows cost in the rounds where a batch does not draft, without trial rounds)."""

    def choose(self, n_rows: int, max_width: int, explore: bool = True) -> int | None:
        return 1 if n_rows >= 2 and max_width > 1 else None


def _projections(model) -> list:
    """Counts the drafter's context projections (``context_kv`` calls: joins' prompts, flushes of queued rounds,
    the drafting rounds' appends) through an attribute of this process's drafter instance; returns the counter."""
    count = [0]
    dp = getattr(model.proposer, "drafter", model.proposer)
    dm = getattr(dp, "model", None)
    if dm is not None and hasattr(dm, "context_kv"):
        orig = type(dm).context_kv.__get__(dm)

        def context_kv(features, offset):
            count[0] += 1
            return orig(features, offset)

        dm.context_kv = context_kv
    return count


class GilProbe:
    """Counts where this thread released the GIL, by line, while another thread waits to run Python.

    While the probe is on, the interpreter's switch interval is 1 s (this thread is not preempted while it runs
    Python) and a second thread counts loops, each ending in ``time.sleep(0)``: it runs only while this thread has
    released the GIL (``mx.eval``, ``mx.async_eval``, ``.item()`` / ``.tolist()`` of an array not yet evaluated, a
    lock's wait, I/O). A trace function (``sys.settrace``, line and return events) attributes each move of the count to
    the line that ran since the last event: a call into code not traced (MLX, a tokenizer) is charged to its caller's
    line, and to the innermost line of this package that led there. In a server every such release waits to take the
    GIL back from the HTTP thread, up to the switch interval (``gil_release.py``). ``releases``: ``(file, line,
    package file, package line) -> times``. Use as a context manager around the work.
    """

    def __init__(self) -> None:
        self.ticks = 0
        self.releases: Counter = Counter()
        self._last = ("", 0, None)
        self._seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self._stop.is_set():
            self.ticks += 1
            time.sleep(0)

    def _trace(self, frame, event, arg):
        if event in ("line", "return"):
            if self.ticks != self._seen:
                self._seen = self.ticks
                f, ln, fr = self._last
                while fr is not None and "mlx_dflash2" not in fr.f_code.co_filename:
                    fr = fr.f_back
                ours = (fr.f_code.co_filename, fr.f_lineno) if fr is not None and fr.f_code.co_filename != f else ()
                self.releases[(f, ln) + ours] += 1
            self._last = (frame.f_code.co_filename, frame.f_lineno, frame)
        return self._trace

    def __enter__(self) -> "GilProbe":
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(1.0)
        self._thread.start()
        self._seen = self.ticks
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._interval)

    def sites(self, n: int = 12) -> list:
        """The ``n`` lines that released most often: ``[(file:line, source line, times)]`` (a line outside this
        package followed by `` <- `` and the package's line that led there)."""
        import linecache

        def at(f, ln):
            return f"{Path(f).name}:{ln}", linecache.getline(f, ln).strip()

        out = []
        for key, k in self.releases.most_common(n):
            (w, src), via = at(*key[:2]), (at(*key[2:]) if len(key) > 2 else None)
            out.append((w + (f" <- {via[0]}" if via else ""), (via[1] if via else src)[:70], k))
        return out


def _time_by(trace: list) -> dict:
    """Where the wall went, from a step trace (ms, rows, cap, tokens, prefilled, verified): seconds in steps that
    prefilled joins, in plain rounds (every row verified one token), in drafting rounds (more than one per row on
    average: trials), in a lone row's rounds, and in stalls (steps without joins over 4x the median: kernel builds),
    each with its step count."""
    med = statistics.median(t[0] for t in trace) if trace else 0.0
    out = {k: [0.0, 0] for k in ("joins", "plain", "drafting", "lone", "stalls")}
    for ms, rows, cap, _, pre, ver in trace:
        k = ("joins" if pre else "stalls" if ms > 4 * med else "lone" if rows == 1
             else "plain" if ver <= rows else "drafting")
        out[k][0] += ms / 1e3
        out[k][1] += 1
    return {k: (round(v[0], 3), v[1]) for k, v in out.items()}


def run(model, tok, n: int, max_tokens: int, drafter: bool, profile: bool, requests: int = 1,
        plain_only: bool = False, counter: list | None = None, server: bool = False, temp: float = 0.0,
        logprobs: bool = False, cache_size: int = 10) -> dict:
    """``n`` requests at once (``requests`` > 1: ``n`` clients that each send ``requests`` in a row, the next as
    soon as the last finished, prompts from a pool of 24: the server's load, with joins in every phase);
    ``server``: the requests as the server adds them (``adaptive`` greedy rows, their states kept in the engine's
    prompt cache of ``cache_size`` entries and fetched from it; 0: none, every join cold, as ``bench_server.py`` runs
    our servers); ``temp`` > 0: sampled requests (seeded, one seed each),
    ``logprobs``: requests that ask for them."""
    pool = prompts(n if requests == 1 else 24)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in pool]
    batch = SpeculativeBatch(model.target, schedule=PlainOnly() if plain_only else "auto")
    if profile and hasattr(batch, "timings"):
        batch.timings = {}
    left, owner, added, first, nxt = {c: requests for c in range(n)}, {}, {}, [], [0]
    cache = PromptCache(cache_size) if server and cache_size > 0 else None
    proposer = model.proposer if drafter else PLAIN_PROPOSER

    def add(c: int) -> None:
        p = ids[nxt[0] % len(ids)]
        kw = (dict(state=cache.fetch(p, proposer) if cache else None, keep_state=cache is not None, adaptive=True)
              if server else {})
        if temp > 0:
            from mlx_dflash2.api import request_sampling
            from mlx_dflash2.sampling import SamplingParams

            rs = request_sampling(SamplingParams(temp=temp, seed=nxt[0]))
            kw.update(verifier=rs.verifier, draft_temperature=rs.draft_temperature, draft_key=rs.draft_key,
                      adaptive=rs.adaptive)
        if logprobs:
            kw["logprobs"] = True
        uid = batch.add(p, max_tokens, proposer=proposer, block_size=model.block_size if drafter else 1,
                        eos_token_ids=list(tok.eos_token_ids), **kw)
        owner[uid], added[uid] = c, time.perf_counter()
        left[c] -= 1
        nxt[0] += 1

    for c in range(n):
        add(c)
    if counter is not None:
        counter[0] = 0
    t0 = time.perf_counter()
    tokens = steps = rounds = row_rounds = 0
    caps: dict = {}
    by_cap: dict = {}
    # per step: ms, rows of the round, its width cap, tokens emitted, rows prefilled (spikes: compiles), tokens
    # verified (rows + drafts: a drafting round that verified no drafts shows as verified == rows)
    trace = []
    while batch.active or batch.pending:
        t = time.perf_counter()
        evs = batch.step()
        dt = time.perf_counter() - t
        steps += 1
        for e in evs:
            if e.uid in added and e.tokens:
                first.append(time.perf_counter() - added.pop(e.uid))
            if e.finish_reason is not None and cache is not None:
                st = batch.take_state(e.uid)
                if st is not None:
                    cache.put(st)
            if e.finish_reason is not None and left[owner[e.uid]] > 0:
                add(owner[e.uid])
        emitted = sum(len(e.tokens) for e in evs)
        tokens += emitted
        r = batch.last_round
        trace.append((round(1e3 * dt, 2), r["rows"], r["cap"], emitted, batch.last_prefill["rows"], r["verified"]))
        if r["rows"]:
            rounds += 1
            row_rounds += r["rows"]
            caps[str(r["cap"])] = caps.get(str(r["cap"]), 0) + 1
            if r["rows"] == n and not batch.last_prefill["rows"]:  # full-batch rounds without joins (n clients)
                by_cap.setdefault(str(r["cap"]), []).append((dt, emitted / n))
    wall = time.perf_counter() - t0
    out = {"tok_s": tokens / wall, "wall_s": wall, "steps": steps, "rounds": rounds, "caps": caps,
           "tau": (tokens - nxt[0]) / max(row_rounds, 1),
           # per cap: median ms of a full round (every row, no join) and mean tokens per row of those rounds
           "round_ms": {c: (1e3 * statistics.median(d for d, _ in v), sum(e for _, e in v) / len(v))
                        for c, v in by_cap.items()},
           "step_trace": trace, "requests": nxt[0], "time_by": _time_by(trace),
           # in process: from add() to the step that returned the request's first token (its join and prefill)
           "ttft_p50_ms": 1e3 * statistics.median(first) if first else None,
           "projections": counter[0] if counter is not None else None}
    if getattr(batch, "timings", None) is not None:
        out["ms_per_step"] = {k: 1e3 * v / steps for k, v in batch.timings.items()}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", default="8,16,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true", help="no phase timings (no extra synchronisation)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="skip SpeculativeBatch.warm_up (the server's start-up run of every batch shape)")
    ap.add_argument("--cprofile", action="store_true",
                    help="one more drafter run per concurrency under cProfile: its top functions (cumulative and own "
                    "time) printed and written beside --out as .prof.txt")
    ap.add_argument("--fit-blocks", action="store_true",
                    help="the drafter proposes n drafts over a fitted block of draft_block(n) slots "
                    "(DFlashProposer fit_blocks) instead of its trained block")
    ap.add_argument("--requests", type=int, default=1,
                    help="requests per client (> 1: each of the N clients sends its next request as soon as its last "
                    "finished, as bench_server.py's clients do: joins in every phase)")
    ap.add_argument("--server", action="store_true",
                    help="add the requests as the server does: adaptive greedy rows whose states are kept in the "
                    "engine's prompt cache (--prompt-cache entries) and fetched from it")
    ap.add_argument("--prompt-cache", type=int, default=10, metavar="N",
                    help="with --server: the prompt cache's entries (0: none, every join cold, as bench_server.py "
                    "runs our servers; session 49's in-process run with 10 ran level where the server did not)")
    ap.add_argument("--plain-only", action="store_true",
                    help="the drafter's batches run plain rounds only (width cap 1, no trials): what drafter rows "
                    "cost where a batch does not draft")
    ap.add_argument("--temp", type=float, default=0.0, help="sampled requests at this temperature (seeded)")
    ap.add_argument("--logprobs", action="store_true", help="requests that ask for their tokens' logprobs")
    ap.add_argument("--gil", action="store_true",
                    help="one more run per concurrency and configuration beside a thread running Python: the calls "
                    "that released the GIL, per step by call site (GilProbe)")
    ap.add_argument("--verbose", action="store_true",
                    help="the package's INFO lines (kernel gates with their seconds, routing, calibration), "
                    "timestamped")
    args = ap.parse_args(argv)
    if args.verbose:
        import logging

        logging.basicConfig(format="%(asctime)s %(message)s")
        logging.getLogger("mlx_dflash2").setLevel(logging.INFO)
    model, tok = load(args.model, args.drafter, dtype=args.dtype)
    if args.fit_blocks:
        dp = getattr(model.proposer, "drafter", model.proposer)
        if not hasattr(dp, "fit_blocks"):
            ap.error(f"--fit-blocks: drafter {args.drafter!r} has no drafter model")
        dp.fit_blocks = True
    levels = [int(x) for x in args.concurrency.split(",")]
    counter = _projections(model)
    run(model, tok, 2, 8, True, False)  # warm-up (kernels, calibration)
    if not args.no_warm_up:  # what the server runs at start on a GPU backend (every batch shape once)
        w = SpeculativeBatch(model.target).warm_up(*warm_up_shapes(max(levels), model.block_size),
                                                   proposer=model.proposer, block_size=model.block_size)
        print(f"warm-up: {w['shapes']} batch shapes in {w['seconds']:.1f} s", flush=True)
    res: dict = {}
    for n in levels:
        for rep in range(args.repeats):
            for drafter in (True, False):
                r = run(model, tok, n, args.max_tokens, drafter, not args.no_profile, args.requests,
                        args.plain_only, counter, args.server, args.temp, args.logprobs, args.prompt_cache)
                res.setdefault((n, drafter), []).append(r)
                print(f"N={n:3d} {'drafter' if drafter else 'none   '} rep {rep}: {r['tok_s']:6.1f} tok/s "
                      f"tau {r['tau']:.2f} ttft {r['ttft_p50_ms']:.1f} ms projections {r['projections']} "
                      f"caps {r['caps']} rounds "
                      + " ".join(f"[{c}: {ms:.0f} ms {e:.2f} tok/row]" for c, (ms, e) in r["round_ms"].items()) + " "
                      + " ".join(f"{k} {v:.1f}" for k, v in r.get("ms_per_step", {}).items()), flush=True)
                print(f"    seconds (steps) by kind: {r['time_by']}", flush=True)
                slow = sorted(r["step_trace"], key=lambda t: -t[0])[:5]
                print(f"    slowest steps (ms, rows, cap, tokens, prefilled, verified): {slow}; median "
                      f"{statistics.median(t[0] for t in r['step_trace']):.1f} ms", flush=True)
    gil: dict = {}
    for n in levels if args.gil else ():
        for drafter in (True, False):
            with GilProbe() as probe:
                r = run(model, tok, n, args.max_tokens, drafter, False, args.requests, args.plain_only, counter,
                        args.server, args.temp, args.logprobs, args.prompt_cache)
            name = "drafter" if drafter else "none"
            total = sum(probe.releases.values())
            print(f"N={n:3d} {name}: {total / r['steps']:.2f} GIL releases per step ({total} in {r['steps']} steps, "
                  f"{r['tok_s']:.1f} tok/s beside a spinning thread); by call site:", flush=True)
            for where, line, k in probe.sites():
                print(f"    {k / r['steps']:6.2f}/step {k:6d}  {where:24s} {line}", flush=True)
            gil[f"{n}-{name}"] = {"steps": r["steps"], "tok_s": r["tok_s"], "time_by": r["time_by"],
                                  "releases": [list(x) for x in probe.sites(40)]}
    if args.cprofile:
        import cProfile
        import io
        import pstats

        text = []
        for n in levels:
            pr = cProfile.Profile()
            pr.enable()
            r = run(model, tok, n, args.max_tokens, True, False)
            pr.disable()
            for key in ("cumulative", "tottime"):
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(30)
                text.append(f"N={n} drafter, {r['tok_s']:.1f} tok/s, sorted by {key}\n{buf.getvalue()}")
        print("\n".join(text), flush=True)
        if args.out:
            Path(args.out).with_suffix(".prof.txt").write_text("\n".join(text))
    print("\nmedians (ms per step by phase)")
    table = []
    for (n, drafter), rs in res.items():
        row = {"n": n, "drafter": drafter, "tok_s": statistics.median(r["tok_s"] for r in rs),
               "tau": statistics.median(r["tau"] for r in rs),
               "ttft_ms": statistics.median(r["ttft_p50_ms"] for r in rs),
               "projections": statistics.median(r["projections"] for r in rs)}
        for k in rs[0].get("ms_per_step", {}):
            row[k] = statistics.median(r["ms_per_step"].get(k, 0.0) for r in rs)
        table.append(row)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    for n in levels if table else ():
        on = next(r for r in table if r["n"] == n and r["drafter"])
        off = next(r for r in table if r["n"] == n and not r["drafter"])
        print(f"N={n}: drafter / none = {on['tok_s'] / off['tok_s']:.2f}")
    if args.out:
        runs = {f"{n}-{d}": rs for (n, d), rs in res.items()}
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs,
                                              "medians": table, "gil": gil}, indent=1))


if __name__ == "__main__":
    main()
