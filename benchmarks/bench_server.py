"""Load test of the OpenAI-compatible server on loopback: ours with and without a drafter vs ``mlx_lm.server``.

For each server (``--server``: ``ours:DRAFTER`` starts ``python -m mlx_dflash2.server --drafter DRAFTER``,
``scripted:TAU`` starts ``benchmarks/scripted_server.py serve --tau TAU``, our server with a scripted drafter for the
speed-only runs at the random 8B shape, ``mlx_lm`` starts ``mlx_lm.server`` on the same weights: ``--mlx-model``,
an MLX directory, e.g. the dense float32 conversion of the embedded GGUF that ``python -m convert`` writes) on a
free 127.0.0.1 port with the prompt cache off, it first answers every prompt of a pool one at a time (concurrency 1:
each request alone, the solo reference), then, for each concurrency ``c`` of ``--concurrency``, runs
``c`` streaming clients with ``--requests`` requests each over the pool. It checks that there are no
errors and no cross-talk (each output equals its solo output; greedy) and reports, per server and
concurrency: aggregate completion tokens/s (all tokens / wall time), request latency p50/p95 and time
to first token p50 (seconds), plus a plot of aggregate tokens/s and p50 latency against concurrency.
Where an output differs from its solo one (bf16 on a GPU: batched matmuls round differently), one more solo request
with ``top_logprobs`` gives the target's margin (top-1 minus top-2 log-probability) at the token where it departs:
the lossless contract allows a departure only at a near-tie. The request loops are bounded; the servers are
stopped at the end.

    scripts/run python benchmarks/bench_server.py                      # ours lookup / none, c = 1 and 8
    scripts/run python -m convert mlx_dflash2/... .cache/smollm2-f32 --no-quantize --dtype float32
    scripts/run python benchmarks/bench_server.py --server ours:lookup --server ours:none --server mlx_lm \
        --mlx-model .cache/smollm2-f32 --concurrency 1,2,4,8,16,32 --requests 2

``--spy DIR`` (with ``py-spy`` installed: ``pip install py-spy``) samples every server's threads through each phase
past the solo one (``py-spy record --threads --idle --nonblocking``: idle samples included, so a thread that waits on
the GPU shows the line it waits in) and writes ``DIR/<server>-c<N>.txt`` (py-spy's raw stacks) with a summary beside it
(``.top.txt``: samples per thread; per thread the lines it spends most samples in, its own and inclusive), the top of
which is printed: where a server's time goes under load that its step counters do not split (session 47).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
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


def handoffs_path(folder: str, server: str) -> Path:
    """Where ``--handoffs`` writes ``server``'s report (``gil_handoffs.py``)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder) / f"{server.replace(':', '-').replace('/', '_')}.json"


def print_handoffs(path: Path, steps: int, top: int = 10) -> None:
    """Summarise a ``gil_handoffs.py`` report: the worker's handoffs per batched step, by line."""
    try:
        rep = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"--handoffs: no report at {path} ({e})", flush=True)
        return
    n = max(steps, 1)
    print(f"--handoffs {path.name}: {rep['handoffs'] / n:.2f} per step ({rep['handoffs']} in {steps} steps):",
          flush=True)
    for where, src, k, sec in rep["lines"][:top]:
        print(f"    {k / n:6.2f}/step {k:6d} {sec:8.3f} s  {where:40s} {src}", flush=True)


def start_server(server: str, args) -> tuple[subprocess.Popen, str]:
    """Start ``server`` (``ours:DRAFTER`` or ``mlx_lm``) on a free port; returns (process, base URL)."""
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    conc = str(max(max(args.levels), 1))
    if server == "mlx_lm":
        if not args.mlx_model:
            raise SystemExit("--server mlx_lm needs --mlx-model (an MLX model directory of the same weights)")
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", args.mlx_model, "--port", str(port),
               "--prompt-cache-size", "0", "--decode-concurrency", conc, "--log-level", "WARNING"]
    else:
        kind, drafter = server.split(":", 1)
        drafter, *own = drafter.split("@")  # (ours:DRAFTER@--flag=value...: that server's own arguments)
        launch = ([sys.executable, "-m", "mlx_dflash2.server"] if not args.handoffs else  # (gil_handoffs.py)
                  [sys.executable, str(root / "benchmarks" / "gil_handoffs.py"), "--out",
                   str(handoffs_path(args.handoffs, server)), "--"])
        if kind == "scripted":  # our server with a scripted drafter of fixed acceptance (scripted_server.py)
            # (its references: this run's pool, each as long as its answers; a prompt outside it drafts wrong tokens)
            launch = [sys.executable, str(root / "benchmarks" / "scripted_server.py"), "serve", "--tau", drafter,
                      "--pool", str(args.pool), "--horizon", str(max(args.max_tokens, 1))]
            drafter = "none"
        cmd = launch + ["--port", str(port), "--drafter", drafter,
               "--prompt-cache-size", "0", "--dtype", args.dtype, "--log-level", "WARNING",
               "--decode-concurrency", conc]
        if args.max_batch is not None:
            cmd += ["--max-batch", str(args.max_batch)]
        if args.model:
            cmd += ["--model", args.model]
        if args.dequantize:
            cmd.append("--dequantize")
        if args.block_size:
            cmd += ["--block-size", str(args.block_size)]
        cmd += args.server_arg + own
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if server == "mlx_lm":
        # the same optimized OpenBLAS as ours on MLX's Linux CPU backend (mlx_dflash2._blas): without it
        # mlx_lm.server would run on MLX's bundled reference BLAS, several times slower (an unfair baseline)
        from mlx_dflash2 import _blas

        env.update(_blas.subprocess_env())
    proc = subprocess.Popen(cmd, cwd=root, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.start_timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"server {server!r} did not start")
        time.sleep(0.5)


def one_request(url: str, prompt: str, max_tokens: int, token_strings: bool = False) -> dict:
    """One streamed greedy chat request: its text, latency, TTFT (s), completion tokens and tau; with
    ``token_strings`` it also asks for ``logprobs`` and keeps the streamed tokens' strings (``"token_strings"``:
    where an answer departs from the solo one, :func:`divergence_margin` then finds the departing token even
    where the text departs later; the logprobs change what the server computes, so timed tables leave it off)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if token_strings:
        body["logprobs"] = True
    t0 = time.perf_counter()
    ttft, text, usage, spec, toks = None, "", None, None, []
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
                lp = c.get("logprobs")
                toks += [token_bytes(x) for x in ((lp.get("content") if isinstance(lp, dict) else None) or [])]
            usage = d.get("usage") or usage
            spec = d.get("speculative") or spec
    ntok = usage["completion_tokens"] if usage else None
    out = {"text": text, "latency": time.perf_counter() - t0, "ttft": ttft or 0.0,
           "tokens": ntok if ntok is not None else max_tokens, "tau": spec["acceptance_length"] if spec else 1.0}
    if token_strings:  # (None where the server sent no tokens, or tokens that do not spell the text)
        ok = bool(toks) and b"".join(toks) == text.encode("utf-8")
        out["token_bytes"] = toks if ok else None
        out["token_strings"] = [t.decode("utf-8", errors="replace") for t in toks] if ok else None
    return out


def token_bytes(entry: dict) -> bytes:
    """A ``logprobs.content`` entry's token as UTF-8 bytes: its ``bytes`` field where the server sends one (a
    character split over byte-level tokens has no text of its own: its ``token`` strings read U+FFFD), else
    its ``token`` string encoded."""
    b = entry.get("bytes")
    return bytes(b) if isinstance(b, list) else entry["token"].encode("utf-8")


def solo_margins(url: str, prompt: str, max_tokens: int) -> list[tuple[bytes, float]]:
    """The solo greedy answer's tokens (UTF-8 bytes: :func:`token_bytes`), each with the target's margin there:
    top-1 minus top-2 log-probability (nats; ``inf`` with one candidate), by one non-streaming request with
    ``logprobs`` and ``top_logprobs: 2``."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    out = []
    for c in r.json()["choices"][0]["logprobs"]["content"]:
        top = sorted((t["logprob"] for t in c.get("top_logprobs") or []), reverse=True)
        out.append((token_bytes(c), top[0] - top[1] if len(top) > 1 else float("inf")))
    return out


def divergence_margin(solo: str, other: str, tokens: list[tuple[str | bytes, float]],
                      other_tokens: list[str | bytes] | None = None) -> float | None:
    """The solo run's margin (:func:`solo_margins`) at the token where ``other`` first departs from ``solo``
    (a near-tie there, e.g. < 0.1 nats, is what batched bf16 matmuls may decide the other way); None if the
    texts are equal (and, given, the token splits too) or the tokens do not spell ``solo`` that far.

    With ``other_tokens`` (the other run's token strings) the departure is the first token that differs:
    a run that splits the same text differently (``"\\n\\n"`` vs ``"\\n"`` + ``"\\n"``) departs there, though
    its text departs later. Without them only the text is known: the departure is the solo token covering
    the first differing character, which is the true one only where the other run tokenised the common
    prefix the same way. Tokens may be strings or UTF-8 bytes (compared as bytes: a character split over
    byte-level tokens is spelled by their bytes only)."""
    def enc(t):
        return t if isinstance(t, bytes) else t.encode("utf-8")

    solo, other = enc(solo), enc(other)
    tokens = [(enc(t), m) for t, m in tokens]
    if other_tokens is not None:
        other_tokens = [enc(t) for t in other_tokens]
        pos = 0
        for k, (tok, margin) in enumerate(tokens):
            if solo[pos:pos + len(tok)] != tok:
                return None  # the tokens do not spell ``solo`` (another answer than the reference)
            if k >= len(other_tokens) or other_tokens[k] != tok:
                return margin
            pos += len(tok)
        return None
    if solo == other:
        return None
    i = next((k for k, (a, b) in enumerate(zip(solo, other)) if a != b), min(len(solo), len(other)))
    pos = 0
    for tok, margin in tokens:
        if solo[pos:pos + len(tok)] != tok:
            return None  # the tokens do not spell ``solo`` (another answer than the reference)
        pos += len(tok)
        if pos > i:
            return margin
    return None


def run_phase(url: str, plist: list[str], clients: int, max_tokens: int,
              token_strings: bool = False) -> tuple[list[dict], float]:
    """``clients`` threads share the prompts in order (client c takes prompts c, c+clients, ...)."""
    results: list = [None] * len(plist)

    def client(c: int):
        for i in range(c, len(plist), clients):
            results[i] = one_request(url, plist[i], max_tokens, token_strings)

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
        "latency_max_s": round(max(lat), 3),  # a first-use cost (kernel builds) shows here, not in p50 / p95
        "ttft_p50_s": round(statistics.median(r["ttft"] for r in results), 3),
        "tau_median": round(statistics.median(r["tau"] for r in results), 3),
    }


def plot(report: dict, levels: list[int], path: Path) -> Path | None:
    """Aggregate tokens/s and p50 latency against concurrency, one line per server."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in report.items():
        cs = [c for c in levels if f"c{c}" in r]
        a1.plot(cs, [r[f"c{c}"]["aggregate_tps"] for c in cs], marker="o", label=name)
        a2.plot(cs, [r[f"c{c}"]["latency_p50_s"] for c in cs], marker="o", label=name)
    for a, t in ((a1, "aggregate completion tokens/s"), (a2, "request latency p50 (s)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent streaming clients")
        a.set_title(t)
        a.grid(alpha=0.3)
    a1.legend()
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    return png


STEP_KINDS = ("join", "lone", "drafting", "plain")
WORKER_PARTS = ("start", "add", "emit", "close", "post")


def step_seconds(url: str, server: str) -> dict | None:
    """Our server's batched steps by kind so far (``GET /metrics``: steps and seconds), or None (mlx_lm, or a
    server without them)."""
    if server == "mlx_lm":
        return None
    try:
        m = httpx.get(f"{url}/metrics", params={"format": "json"}).json()
        out = {k: (m[f"batch_{k}_steps_total"], m[f"batch_{k}_seconds_total"]) for k in STEP_KINDS}
        out.update({k: (0, m.get(f"worker_{k}_seconds_total", 0.0)) for k in WORKER_PARTS})
        out["busy"] = (0, m.get("busy_s", 0.0))
        return out
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def add_steps(row: dict, url: str, server: str, before: dict | None, label: str = "") -> dict | None:
    """Put the phase's batched steps by kind (``{kind: [steps, seconds]}``, since ``before``) into ``row``
    (``steps``), the worker's other parts (``{part: seconds}``: :data:`WORKER_PARTS` and ``busy``, its busy time in
    all) into ``row["worker"]``, and print them; returns the counts now."""
    now = step_seconds(url, server)
    if now is not None and before is not None:
        row["steps"] = {k: [now[k][0] - before[k][0], round(now[k][1] - before[k][1], 4)] for k in STEP_KINDS}
        row["worker"] = {k: round(now[k][1] - before[k][1], 4) for k in WORKER_PARTS + ("busy",)}
        print(f"{server} {label} steps by kind (steps, seconds): " + ", ".join(
            f"{k} {n} {sec:.2f}" for k, (n, sec) in row["steps"].items()) + "; worker seconds: " + ", ".join(
            f"{k} {sec:.2f}" for k, sec in row["worker"].items()), flush=True)
    return now


def start_spy(pid: int, out: Path) -> subprocess.Popen | None:
    """Start ``py-spy record`` on process ``pid`` (raw stacks to ``out``), or None (no py-spy here)."""
    exe = Path(sys.executable).with_name("py-spy")
    exe = str(exe) if exe.exists() else shutil.which("py-spy")
    if exe is None:
        print("--spy: py-spy is not installed (pip install py-spy); not sampling", flush=True)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--threads", "--idle",
                             "--nonblocking", "--rate", "500", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_spy(spy: subprocess.Popen | None, out: Path, top: int = 14) -> None:
    """Stop a :func:`start_spy` recorder, summarise its stacks into ``out.top.txt`` and print the top lines."""
    if spy is None:
        return
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        return
    if not out.exists():
        return
    threads: dict = {}  # thread name -> [samples, {frame: own samples}, {frame: inclusive samples}]
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        name = frames[0].split(": ", 1)[-1]
        t = threads.setdefault(name, [0, {}, {}])
        t[0] += int(n)
        if len(frames) > 1:
            t[1][frames[-1]] = t[1].get(frames[-1], 0) + int(n)
        for f in set(frames[1:]):
            t[2][f] = t[2].get(f, 0) + int(n)
    lines = []
    for name, (total, own, incl) in sorted(threads.items(), key=lambda kv: -kv[1][0]):
        if total < 0.05 * max(v[0] for v in threads.values()):
            continue
        lines.append(f"thread {name}: {total} samples")
        for label, d in (("own", own), ("inclusive", incl)):
            for f, k in sorted(d.items(), key=lambda kv: -kv[1])[:top]:
                lines.append(f"  {label:9s} {100.0 * k / total:5.1f}%  {f}")
    out.with_suffix(".top.txt").write_text("\n".join(lines) + "\n")
    print(f"--spy {out.name}:\n" + "\n".join(lines[:2 * top + 2]), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", default=None,
                    help="ours:DRAFTER (our server with --drafter DRAFTER), scripted:TAU (our server with a scripted "
                    "drafter of fixed acceptance on a random-weight target: scripted_server.py) or mlx_lm "
                    "(mlx_lm.server on --mlx-model); ours and scripted take arguments of their own after @ (e.g. "
                    "ours:lookup@--cuda-graphs=on@--max-batch=8: two servers that differ in a flag, in one run; so a DRAFTER "
                    "path cannot hold an @); "
                    "repeatable (default: ours:lookup and ours:none)")
    ap.add_argument("--drafter", action="append", default=[], help="shorthand for --server ours:DRAFTER")
    ap.add_argument("--model", default=None, help="our servers' --model (default: the embedded SmolLM2)")
    ap.add_argument("--mlx-model", default=None, help="mlx_lm.server's model directory (the same weights)")
    ap.add_argument("--server-arg", action="append", default=[], help="one more argument for our servers (repeatable)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--concurrency", default="1,8", help="concurrent clients per phase, comma-separated (1 = the solo pass)")
    ap.add_argument("--clients", type=int, default=None, help="shorthand for --concurrency 1,N")
    ap.add_argument("--requests", type=int, default=5, help="requests per client in each phase")
    ap.add_argument("--pool", type=int, default=40, help="distinct prompts (each answered alone first)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--start-timeout", type=float, default=900,
                    help="seconds a server may take to answer /health (a fresh CUDA machine's first start builds "
                    "kernels and warms the batch shapes up: session 24's passed 300 s)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="our server's --max-batch (default: its default; 0: round-robin, no batching)")
    ap.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=True,
                    help="dense target (default on: the fast exact target on CPU)")
    ap.add_argument("--token-strings", action="store_true",
                    help="ask for logprobs in every phase and keep the streamed tokens' strings, so an answer's "
                         "departure from its solo one is placed by token (diagnostic: logprobs change the work)")
    ap.add_argument("--out", default="benchmarks/results/server.json")
    ap.add_argument("--handoffs", default=None, metavar="DIR",
                    help="run our servers under gil_handoffs.py (every thread traced, several times slower): where "
                    "the generation worker let another thread run Python, per line, written to DIR at each server's "
                    "exit and printed per batched step")
    ap.add_argument("--spy", default=None, metavar="DIR",
                    help="sample each server's threads with py-spy through each phase past the solo one; stacks and "
                    "their summaries to DIR")
    args = ap.parse_args(argv)
    conc = f"1,{args.clients}" if args.clients else args.concurrency
    try:
        args.levels = sorted({int(c) for c in conc.split(",")} | {1})
    except ValueError:
        ap.error(f"--concurrency: integers, comma-separated, got {conc!r}")
    if args.levels[0] < 1:
        ap.error("--concurrency values must be >= 1")
    servers = (args.server or []) + [f"ours:{d}" for d in args.drafter] or ["ours:lookup", "ours:none"]
    for sv in servers:
        if sv != "mlx_lm" and not re.fullmatch(r"(ours:[^@]+|scripted:[1-9][0-9]*)(@--[^@\s]+)*", sv):
            ap.error(f"--server: ours:DRAFTER, scripted:TAU (either with @--flag=value arguments of its own) or "
                     f"mlx_lm, got {sv!r}")
        if sv.startswith("scripted:") and args.handoffs:
            ap.error("--handoffs: not with a scripted:TAU server")
        if sv.startswith("scripted:") and int(sv.split(":")[1].split("@")[0]) > (args.block_size or 16):
            ap.error(f"--server {sv}: TAU past the block size {args.block_size or 16} (a round emits B tokens at most)")
    pool = prompts(args.pool)
    report, ok = {}, True
    for server in servers:
        proc, url = start_server(server, args)
        r: dict = {"errors": 0, "mismatches": {}}
        diverged: dict = {}  # concurrency -> [(prompt, text)] of the outputs unlike the solo ones
        try:
            # warm-up outside the timed phases: a short request, two of the pool's prompts at full length alone
            # (the solo path's first rounds: on a fresh GPU machine, kernel builds took ~70 s of one timed request
            # of session 31's c=1 pass) and two together (the batched path)
            one_request(url, "Hello!", 4)
            run_phase(url, pool[:2], 1, args.max_tokens)
            run_phase(url, pool[:2], 2, args.max_tokens)
            before = step_seconds(url, server)
            solo, wall1 = run_phase(url, pool, 1, args.max_tokens, args.token_strings)
            ref = {p: x["text"] for p, x in zip(pool, solo)}
            r["c1"] = summarize(solo, wall1)
            before = add_steps(r["c1"], url, server, before, "c=1")
            for c in args.levels[1:]:
                plist = [pool[i % len(pool)] for i in range(c * args.requests)]
                spy_out = (Path(args.spy) / f"{server.replace(':', '-').replace('/', '_')}-c{c}.txt"
                           if args.spy else None)
                spy = start_spy(proc.pid, spy_out) if spy_out else None
                res, wall = run_phase(url, plist, c, args.max_tokens, args.token_strings)
                stop_spy(spy, spy_out) if spy_out else None
                r[f"c{c}"] = summarize(res, wall)
                before = add_steps(r[f"c{c}"], url, server, before, f"c={c}")
                bad = [i for i, (p, x) in enumerate(zip(plist, res)) if x["text"] != ref[p]]
                if bad:
                    r["mismatches"][f"c{c}"] = bad
                    diverged[c] = [(plist[i], res[i]) for i in bad]
                print(f"{server} c={c}: {r[f'c{c}']['aggregate_tps']:.1f} tok/s, {len(bad)} mismatches", flush=True)
            if diverged:  # after the timed phases: is each divergence a near-tie of the solo run?
                try:
                    margins = {p: solo_margins(url, p, args.max_tokens) for p in {p for v in diverged.values()
                                                                                   for p, _ in v}}
                    r["divergence_margins"] = {
                        f"c{c}": [divergence_margin(ref[p], x["text"], margins[p], x.get("token_bytes"))
                                  for p, x in v] for c, v in diverged.items()}
                    # departures that are no near-tie (> 1 nat): both answers kept, to be read
                    r["departures"] = [
                        {"clients": c, "prompt": pool.index(p), "margin": m, "solo": ref[p], "text": x["text"],
                         "completion_tokens": x["tokens"], "token_strings": x.get("token_strings"),
                         "solo_tokens": [t.decode("utf-8", errors="replace") for t, _ in margins[p]]}
                        for c, v in diverged.items()
                        for (p, x), m in zip(v, r["divergence_margins"][f"c{c}"]) if m is not None and m > 1.0]
                    for c, ms in r["divergence_margins"].items():
                        known = sorted(m for m in ms if m is not None)
                        print(f"{server} {c}: {len(ms)} outputs unlike the solo ones; the solo run's margin where "
                              f"they depart (nats): median {statistics.median(known) if known else float('nan'):.3f}, "
                              f"max {max(known) if known else float('nan'):.3f}, under 0.1: "
                              f"{sum(m < 0.1 for m in known)} of {len(known)}", flush=True)
                except (httpx.HTTPError, KeyError, IndexError, TypeError) as e:  # no logprobs on this server
                    print(f"{server}: divergence margins not measured ({type(e).__name__}: {e})", flush=True)
            if server != "mlx_lm":
                metrics = httpx.get(f"{url}/metrics", params={"format": "json"}).json()
                r["errors"] = metrics["request_errors_total"]
                r["server_metrics"] = {k: v for k, v in metrics.items() if k.startswith(("batch_", "busy"))}
                for rows, v in (metrics.get("batch_schedule") or {}).items():  # what the width schedule measured
                    print(f"{server} schedule {rows}: best cap {v['best_cap']}, " + ", ".join(
                        f"cap {c}: {x['rounds']} rounds ({x['stalls']} stalls, {x['settling']} settling, "
                        f"{x.get('joined', 0)} with joins) {x['ms_per_round']:.1f} ms {x['tokens_per_s']:.0f} tok/s "
                        f"(per row {x['tokens_per_row_s']:.1f}, compared {x['compared_tokens_per_row_s']:.1f}, "
                        f"score {x['score']:.1f})"
                        for c, x in v["caps"].items()), flush=True)
        except RuntimeError as e:  # an HTTP or stream error: counted, the run goes on with the next server
            r["errors"] += 1
            r["error"] = str(e)
        finally:
            # every batched step since the start (warm-ups included), as the handoffs' report counts them
            total = step_seconds(url, server) if args.handoffs else None
            proc.terminate()
            proc.wait(30)
            if total is not None:
                print_handoffs(handoffs_path(args.handoffs, server), sum(n for n, _ in total.values()))
        ok &= not r["mismatches"] and r["errors"] == 0
        report[server] = r
        out = Path(args.out)  # written after every server: a run stopped by a timeout keeps what finished
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "results": report}, indent=2))
    print(f"\nconcurrency {args.levels}, {args.requests} requests per client, pool {args.pool}, max_tokens "
          f"{args.max_tokens}, streaming, greedy; latency = request start to last byte (s)")
    print(f"{'server':<14} {'conc':>4} {'agg tok/s':>10} {'p50 lat':>8} {'p95 lat':>8} {'p50 ttft':>8} "
          f"{'tau':>5} {'errors':>6} {'cross-talk':>10}")
    for d, r in report.items():
        for c in args.levels:
            if f"c{c}" not in r:
                continue
            s = r[f"c{c}"]
            print(f"{d:<14} {c:>4} {s['aggregate_tps']:>10.1f} {s['latency_p50_s']:>8.2f} "
                  f"{s['latency_p95_s']:>8.2f} {s['ttft_p50_s']:>8.2f} {s['tau_median']:>5.2f} {r['errors']:>6} "
                  f"{len(r['mismatches'].get(f'c{c}', [])):>10}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": report}, indent=2))
    png = plot(report, args.levels, out)
    print(f"results: {out}" + (f", {png}" if png else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
