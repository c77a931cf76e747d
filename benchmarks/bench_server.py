"""Load test of the OpenAI-compatible server on loopback: drafter on vs off, concurrency 1 vs 8.

For each drafter setting it starts ``python -m mlx_dflash2.server`` on a free
127.0.0.1 port (prompt cache off, so that both settings prefill every prompt),
then runs ``--clients`` x ``--requests`` streaming chat requests twice: one
client at a time (concurrency 1: every request alone, the solo reference) and
all clients at once (concurrency ``--clients``). It checks that there are no
errors and no cross-talk (each concurrent output equals its solo output) and
reports, per setting and concurrency: aggregate completion tokens/s (all tokens
/ wall time), request latency p50/p95 and time to first token p50 (seconds).
The request loops are bounded; the servers are stopped at the end.

    scripts/run python benchmarks/bench_server.py                      # lookup vs none, 8 clients x 5
    scripts/run python benchmarks/bench_server.py --drafter auto --drafter none --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

TOPICS = ["the ocean", "volcanoes", "the moon", "bees", "chess", "coffee", "rainbows", "libraries"]
TASKS = [
    "Explain {t} in a few sentences.",
    "Write a short poem about {t}.",
    "List three facts about {t}.",
    "Repeat exactly, word for word: 'Many people find {t} interesting, and {t} has a long and rich history "
    "that is worth learning about.'",
    "Summarize what you know about {t}.",
]


def prompts(n: int) -> list[str]:
    all_ = [task.format(t=t) for task in TASKS for t in TOPICS]
    return [all_[i % len(all_)] for i in range(n)]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server(drafter: str, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "mlx_dflash2.server", "--port", str(port), "--drafter", drafter,
           "--prompt-cache-size", "0", "--dtype", args.dtype, "--log-level", "WARNING",
           "--decode-concurrency", str(max(args.clients, 1))]
    if args.max_batch is not None:
        cmd += ["--max-batch", str(args.max_batch)]
    if args.model:
        cmd += ["--model", args.model]
    if args.dequantize:
        cmd.append("--dequantize")
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=root, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"server for drafter {drafter!r} did not start")
        time.sleep(0.5)


def one_request(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage, spec = None, "", None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(d["error"])
            for c in d.get("choices", []):
                t = c.get("delta", {}).get("content")
                if t:
                    ttft = ttft or time.perf_counter() - t0
                    text += t
            usage = d.get("usage") or usage
            spec = d.get("speculative") or spec
    return {"text": text, "latency": time.perf_counter() - t0, "ttft": ttft or 0.0,
            "tokens": usage["completion_tokens"], "tau": spec["acceptance_length"]}


def run_phase(url: str, plist: list[str], clients: int, max_tokens: int) -> tuple[list[dict], float]:
    """``clients`` threads share the prompts in order (client c takes prompts c, c+clients, ...)."""
    results: list = [None] * len(plist)

    def client(c: int):
        for i in range(c, len(plist), clients):
            results[i] = one_request(url, plist[i], max_tokens)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        for f in [ex.submit(client, c) for c in range(clients)]:
            f.result()
    return results, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def summarize(results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    lat = [r["latency"] for r in results]
    return {
        "requests": len(results),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "aggregate_tps": round(tokens / wall, 2),
        "latency_p50_s": round(statistics.median(lat), 3),
        "latency_p95_s": round(pct(lat, 0.95), 3),
        "ttft_p50_s": round(statistics.median(r["ttft"] for r in results), 3),
        "tau_median": round(statistics.median(r["tau"] for r in results), 3),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", action="append", default=None, help="repeatable; default: lookup and none")
    ap.add_argument("--model", default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=5, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="the server's --max-batch (default: its default; 0: round-robin, no batching)")
    ap.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=True,
                    help="dense target (default on: the fast exact target on CPU)")
    ap.add_argument("--out", default="benchmarks/results/server.json")
    args = ap.parse_args(argv)
    drafters = args.drafter or ["lookup", "none"]
    plist = prompts(args.clients * args.requests)
    report, ok = {}, True
    for drafter in drafters:
        proc, url = start_server(drafter, args)
        try:
            one_request(url, "Hello!", 4)  # warm-up
            solo, wall1 = run_phase(url, plist, 1, args.max_tokens)
            conc, wallc = run_phase(url, plist, args.clients, args.max_tokens)
            metrics = httpx.get(f"{url}/metrics", params={"format": "json"}).json()
        finally:
            proc.terminate()
            proc.wait(30)
        crosstalk = [i for i, (a, b) in enumerate(zip(solo, conc)) if a["text"] != b["text"]]
        ok &= not crosstalk and metrics["request_errors_total"] == 0
        report[drafter] = {
            "c1": summarize(solo, wall1),
            f"c{args.clients}": summarize(conc, wallc),
            "mismatches": crosstalk,
            "errors": metrics["request_errors_total"],
        }
    print(f"\n{args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}, streaming; "
          f"latency = request start to last byte (s)")
    print(f"{'drafter':<10} {'conc':>4} {'agg tok/s':>10} {'p50 lat':>8} {'p95 lat':>8} {'p50 ttft':>8} "
          f"{'tau':>5} {'errors':>6} {'cross-talk':>10}")
    for d, r in report.items():
        for c in ("c1", f"c{args.clients}"):
            s = r[c]
            print(f"{d:<10} {c[1:]:>4} {s['aggregate_tps']:>10.1f} {s['latency_p50_s']:>8.2f} "
                  f"{s['latency_p95_s']:>8.2f} {s['ttft_p50_s']:>8.2f} {s['tau_median']:>5.2f} {r['errors']:>6} "
                  f"{len(r['mismatches']):>10}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": report}, indent=2))
    print(f"results: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
