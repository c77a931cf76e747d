"""Issue 22: the server's engine under ``bench_server.py``'s load, without HTTP: where the drafter's server loses.

Session 49 on an H100: with 8 streaming clients the drafter's server ran its plain batched steps at 14.3 ms against
10.9 ms for our server without a drafter, while in one process (``profile_batch.py --server``, the same rows and
prompt cache, no threads) the two ran level (0.98). This script keeps everything of the server but HTTP: the engine
is built by the server's own ``build_app`` from ``bench_server.py``'s flags for our servers (``--prompt-cache-size
0 --decode-concurrency N --max-batch 32``) and yours (``--server-arg``), its generation worker runs on
its own thread, the load is ``bench_server.py``'s (``--pool`` chat prompts answered alone first, then ``N`` clients
each sending ``--requests`` in a row, ``--max-tokens`` tokens, greedy), and the requests' events are delivered

* ``--deliver direct``: on the worker's thread, into queues the clients' threads wait on (no other thread runs
  Python while the worker works), or
* ``--deliver asyncio``: to an asyncio event loop on its own thread (the server's HTTP thread), whose handlers
  format one server-sent-event chunk per token (``json.dumps``) as the server's do.

``--warm-up loading`` runs the server's warm-up of the batched shapes on the thread that loaded the model (as the
server did before session 49) instead of the worker's (MLX keeps compiled traces per thread). Reported per
configuration (``--config``: a drafter path for ``--drafter``, ``auto``, or ``none``): aggregate tok/s of the
phase, the batched steps by kind (count, mean and median ms per step), the worker thread's CPU seconds per step
(``time.thread_time`` on the worker: Python and graph building, without the device's work), the worker's parts
(``GET /metrics``' ``worker_*``). One run each; ratios between configurations of one run only. The configurations
share one process, so MLX's CUDA settings are the environment's for all of them (``benchmarks/gpu/engine_ab.sh``
runs one process per setting): the server's ``--cuda-graphs auto`` (graphs off where it batches drafting rows,
session 52) is not applied here.

    scripts/run python benchmarks/engine_load.py --config auto --config none --concurrency 8 --requests 5
    python3 benchmarks/engine_load.py --model "$TMPDIR/smol-q4" --config mlx_dflash2/drafters/smollm2-135m-instruct \\
        --config none --deliver direct --deliver asyncio --server-arg=--dtype --server-arg=bfloat16 --out x.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout
import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS)

from bench_server import prompts  # noqa: E402

from mlx_dflash2.server.cli import build_app, setup_arg_parser  # noqa: E402
from mlx_dflash2.server.engine import BATCH_STEP_KINDS, WORKER_PARTS, Failed, Job  # noqa: E402

GREEDY = dict(temp=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=None, repetition_context_size=20,
              presence_penalty=None, presence_context_size=20, frequency_penalty=None, frequency_context_size=20,
              logit_bias=None, seed=None, stop=[])


class DirectLoop:
    """An event loop stand-in whose ``call_soon_threadsafe`` runs the callback at once, on the caller's thread."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


class Inbox:
    """A request's event queue for ``--deliver direct``: ``put_nowait`` from the worker, ``wait`` from a client."""

    def __init__(self):
        self.events: list = []
        self.cv = threading.Condition()

    def put_nowait(self, ev) -> None:
        with self.cv:
            self.events.append(ev)
            self.cv.notify()

    def wait_end(self) -> list:
        with self.cv:
            while not self.events or not _final(self.events[-1]):
                self.cv.wait()
            return self.events


def _final(ev) -> bool:
    return isinstance(ev, Failed) or getattr(ev, "finish_reason", None) is not None


def _chunk(ev) -> str:
    """What the server's stream handler writes for a token (a chat completion chunk as SSE), to load the loop."""
    d = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": {"content": ev.text}, "finish_reason": ev.finish_reason}]}
    return f"data: {json.dumps(d)}\n\n"


def phase(engine, ids: list, n: int, requests: int, max_tokens: int, deliver: str) -> dict:
    """``n`` clients, each sending ``requests`` chat requests in a row (prompts ``ids`` in turn); returns tokens,
    wall seconds and errors."""
    nxt, lock, out = [0], threading.Lock(), {"tokens": 0, "errors": 0}

    def job_for(loop, queue) -> Job:
        with lock:
            msgs = ids[nxt[0] % len(ids)]
            nxt[0] += 1
        return Job(kind="chat", messages=msgs, max_tokens=max_tokens, gen_kwargs=dict(GREEDY), loop=loop,
                   queue=queue)

    def count(events) -> None:
        with lock:
            out["tokens"] += sum(1 for e in events if hasattr(e, "token"))
            out["errors"] += sum(1 for e in events if isinstance(e, Failed))

    t0 = time.perf_counter()
    if deliver == "direct":
        loop = DirectLoop()

        def client():
            for _ in range(requests):
                box = Inbox()
                engine.submit(job_for(loop, box))
                count(box.wait_end())

        threads = [threading.Thread(target=client) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        async def client():
            for _ in range(requests):
                q: asyncio.Queue = asyncio.Queue()
                engine.submit(job_for(asyncio.get_running_loop(), q))
                events, written = [], 0
                while not events or not _final(events[-1]):
                    ev = await q.get()
                    events.append(ev)
                    if hasattr(ev, "token"):
                        written += len(_chunk(ev))
                count(events)

        async def main():
            await asyncio.gather(*(client() for _ in range(n)))

        th = threading.Thread(target=lambda: asyncio.run(main()))
        th.start()
        th.join()
    out["seconds"] = time.perf_counter() - t0
    return out


def trace_steps(engine) -> list:
    """Record every batched step of ``engine`` (its batch instance's ``step`` wrapped, on the worker's thread):
    ``[(kind, ms)]``, the kinds as ``GET /metrics`` counts them."""
    out: list = []

    def install():
        batch = engine._batch
        step = batch.step

        def timed():
            t = time.perf_counter()
            evs = step()
            dt = 1e3 * (time.perf_counter() - t)
            r, pre = batch.last_round, batch.last_prefill
            if r["rows"] or pre["rows"]:
                out.append(("join" if pre["rows"] else "lone" if r["rows"] == 1
                            else "drafting" if r["verified"] > r["rows"] else "plain", dt))
            return evs

        batch.step = timed

    engine.call(install)
    return out


def snapshot(engine) -> dict:
    """The engine's counters now, and its worker thread's CPU seconds (read on that thread)."""
    return {"cpu": engine.call(time.thread_time), "steps": dict(engine.metrics.batch_steps),
            "step_s": dict(engine.metrics.batch_step_s), "worker": dict(engine.metrics.worker_s),
            "busy": engine.metrics.busy_s}


def diff(a: dict, b: dict) -> dict:
    steps = {k: b["steps"][k] - a["steps"][k] for k in BATCH_STEP_KINDS}
    secs = {k: b["step_s"][k] - a["step_s"][k] for k in BATCH_STEP_KINDS}
    n = sum(steps.values())
    return {"steps": steps, "ms_per_step": {k: round(1e3 * secs[k] / steps[k], 2) for k in steps if steps[k]},
            "worker_cpu_s": round(b["cpu"] - a["cpu"], 4),
            "worker_cpu_ms_per_step": round(1e3 * (b["cpu"] - a["cpu"]) / n, 3) if n else None,
            "busy_s": round(b["busy"] - a["busy"], 4),
            "parts_s": {k: round(b["worker"][k] - a["worker"][k], 4) for k in WORKER_PARTS}}


def top_functions(prof, n: int, steps: int) -> list:
    """The ``n`` functions of ``prof`` with the most own time: ``[(name, ms per step, calls per step)]``."""
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:n]
    k = max(steps, 1)
    return [(f"{Path(f).name}:{ln} {fn}", round(1e3 * tt / k, 4), round(nc / k, 3))
            for (f, ln, fn), (cc, nc, tt, ct, callers) in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the server's --model (default: the embedded SmolLM2)")
    ap.add_argument("--config", action="append", default=None,
                    help="a server's --drafter (a path, auto) or none; repeatable (default: auto and none)")
    ap.add_argument("--deliver", action="append", choices=("direct", "asyncio"), default=None,
                    help="where the events go (repeatable; default: direct and asyncio)")
    ap.add_argument("--server-arg", action="append", default=[], help="one more server flag (repeatable)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--pool", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="phases per configuration and delivery")
    ap.add_argument("--warm-up", choices=("server", "loading", "off"), default="server",
                    help="the batched rounds' warm-up: as the server runs it (where its flags turn it on: on the "
                    "worker's thread, before it serves), on the thread that loaded the model (the server before "
                    "session 49), or none")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="profile the worker thread (cProfile) in each phase and print its N costliest functions "
                    "(own time; the profiler slows the worker: compare configurations, not tok/s)")
    ap.add_argument("--no-solo", action="store_true",
                    help="skip bench_server.py's solo pass (the prompts answered alone first): a sampling profiler "
                    "then sees the load's steps only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configs = args.config or ["auto", "none"]
    delivers = args.deliver or ["direct", "asyncio"]
    res = []
    for cfg in configs:
        # bench_server.py's flags for our servers (no prompt cache, as many active requests as clients), then yours
        flags = ((["--model", args.model] if args.model else []) + ["--drafter", cfg, "--prompt-cache-size", "0",
                 "--decode-concurrency", str(args.concurrency), "--max-batch", "32"] + args.server_arg)
        if args.warm_up != "server":
            flags.append("--no-warmup")
        sargs = setup_arg_parser().parse_args(flags)
        _, engine = build_app(sargs)
        if args.warm_up == "loading":  # before session 49's change: on the thread that loaded the model
            tic = time.perf_counter()
            w = engine.warm_up()
            print(f"{cfg}: warmed up on the loading thread: {w['shapes']} shapes in "
                  f"{time.perf_counter() - tic:.1f} s", flush=True)
        engine.start()
        try:
            trace = trace_steps(engine)
            ids = [[{"role": "user", "content": p}] for p in prompts(args.pool)]
            if not args.no_solo:
                solo = phase(engine, ids, 1, len(ids), args.max_tokens, "direct")  # bench_server.py's solo pass
                print(f"{cfg}: solo pass {solo['tokens']} tokens in {solo['seconds']:.1f} s", flush=True)
            for rep in range(args.repeats):
                for d in delivers:
                    prof = cProfile.Profile() if args.cprofile else None
                    if prof is not None:
                        engine.call(prof.enable)  # (on the worker's thread: cProfile watches the thread it runs on)
                    a, trace[:] = snapshot(engine), []
                    r = phase(engine, ids, args.concurrency, args.requests, args.max_tokens, d)
                    row = {"config": cfg, "deliver": d, "rep": rep, "tok_s": round(r["tokens"] / r["seconds"], 1),
                           "errors": r["errors"], **diff(a, snapshot(engine))}
                    row["median_ms"] = {k: round(statistics.median(ms for kk, ms in trace if kk == k), 2)
                                        for k in BATCH_STEP_KINDS if any(kk == k for kk, _ in trace)}
                    if prof is not None:
                        engine.call(prof.disable)
                        row["cprofile"] = top_functions(prof, args.cprofile, sum(row["steps"].values()))
                        print(f"{cfg} {d} worker's costliest functions (own ms per step, calls per step):\n  "
                              + "\n  ".join(f"{ms:8.3f} {calls:8.2f}  {name}" for name, ms, calls in row["cprofile"]))
                    res.append(row)
                    print(f"{cfg} {d:7s} rep {rep}: {row['tok_s']:7.1f} tok/s, ms/step {row['ms_per_step']}, "
                          f"median {row['median_ms']}, "
                          f"steps {row['steps']}, worker CPU {row['worker_cpu_ms_per_step']} ms/step, "
                          f"parts {row['parts_s']}, errors {row['errors']}", flush=True)
        finally:
            engine.stop()
            del engine
    print("\nmedian tok/s and plain steps' median ms by configuration and delivery:")
    for cfg in configs:
        for d in delivers:
            rows = [r for r in res if r["config"] == cfg and r["deliver"] == d]
            if rows:
                plain = [r["median_ms"].get("plain") for r in rows if r["median_ms"].get("plain")]
                print(f"  {cfg:40s} {d:7s} {statistics.median(r['tok_s'] for r in rows):7.1f} tok/s  plain "
                      f"{statistics.median(plain) if plain else float('nan'):6.2f} ms  worker CPU "
                      f"{statistics.median(r['worker_cpu_ms_per_step'] or 0 for r in rows):6.2f} ms/step")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
