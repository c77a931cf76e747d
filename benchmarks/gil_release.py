"""What an MLX evaluation costs a thread while another thread runs Python (issue 22, session 47).

Every MLX call that evaluates (``mx.eval``, ``mx.async_eval``, ``.item()``, ``.tolist()`` of an array not yet
evaluated) releases the GIL while MLX works. The thread must take it back afterwards: beside a thread that is
running Python it waits until that thread lets go, at the latest after the interpreter's switch interval
(``sys.getswitchinterval()``, 5 ms by default). Building the graph (lazy ops) does not release it. In the server the
other thread is the HTTP event loop, busy with the streamed chunks: every evaluation of the generation worker
outside its round's own can cost it up to the switch interval (on an H100, 8 drafter rows' plain rounds ran 15.8 ms
in the server against 9.6 ms for plain rows; in one process without an HTTP thread, the same). This measures each
call alone and beside a spinning thread, at the default switch interval and at ``--interval``.

    scripts/run python benchmarks/gil_release.py [--interval 0.0005] [--out benchmarks/results/gil-release-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # this checkout

import mlx_dflash2  # noqa: F401,E402  (before MLX: the optimized OpenBLAS)
import mlx.core as mx  # noqa: E402


def cases(a: mx.array) -> dict:
    b = a + 1
    mx.eval(b)
    return {
        "lazy op (a + 1)": lambda: a + 1,
        "mx.eval of a new op": lambda: mx.eval(a + 1),
        "mx.async_eval of a new op": lambda: mx.async_eval(a + 1),
        ".tolist() of a new op": lambda: (a + 1).tolist(),
        ".item() of a new op": lambda: (a + 1)[0, 0].item(),
        "mx.eval of an evaluated array": lambda: mx.eval(b),
    }


def timed(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.0005, help="a second switch interval to measure (s)")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    a = mx.ones((4, 4))
    mx.eval(a)
    fns = cases(a)
    out: dict = {"alone": {k: timed(f, args.repeats) for k, f in fns.items()}}
    stop = threading.Event()

    def spin():
        x = 0
        while not stop.is_set():
            x += 1

    default = sys.getswitchinterval()
    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        for iv in (default, args.interval):
            sys.setswitchinterval(iv)
            out[f"beside a busy thread, switch interval {iv * 1e3:g} ms"] = {
                k: timed(f, args.repeats) for k, f in fns.items()}
    finally:
        sys.setswitchinterval(default)
        stop.set()
        th.join()
    cols = list(out)
    print(f"{'ms per call':32s}" + "".join(f"{c[:40]:>42s}" for c in cols))
    for k in fns:
        print(f"{k:32s}" + "".join(f"{out[c][k]:42.3f}" for c in cols))
    if args.out:
        Path(args.out).write_text(json.dumps({"mlx": mx.__version__, "python": sys.version.split()[0],
                                              "ms_per_call": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
