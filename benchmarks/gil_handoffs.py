"""Our server with every thread traced: where its generation worker let another thread run Python (issue 22).

Runs ``python -m mlx_dflash2.server`` (the arguments after ``--``) with a trace function on every thread
(``sys.settrace`` and ``threading.settrace``, line and return events). Each event notes which thread ran Python
last; when the generation worker (the thread ``mlx_dflash2-generation``) finds that another thread ran since its
own last event, it had let go of the GIL at the line of that event (an MLX evaluation, a transfer, a lock, I/O, or
a forced switch after the interpreter's switch interval), and that line is charged with a handoff and the
seconds until the worker ran again (the line's own work and the wait for the GIL together). In a server the
other thread is the HTTP event loop: every handoff in a step can cost the step up to the switch interval
(``gil_release.py``). Tracing slows every thread several times: the counts are what this measures, not speed.

At exit (``bench_server.py`` terminates its servers) the report goes to ``--out`` (JSON): per line
``[file:line, source, handoffs, seconds]``, most handoffs first, and the worker's total line events.

    scripts/run python benchmarks/bench_server.py --server ours:auto --server ours:none --concurrency 8 \\
        --requests 3 --handoffs benchmarks/results/handoffs-cpu
    scripts/run python benchmarks/gil_handoffs.py --out h.json -- --port 8080 --drafter auto
"""

from __future__ import annotations

import argparse
import atexit
import json
import linecache
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

WORKER = "mlx_dflash2-generation"


class Handoffs:
    """The trace function and its counts (see the module docstring)."""

    def __init__(self) -> None:
        self.last_thread = 0
        self.worker = None  # the worker's thread ident, once seen
        self.where = ("", 0, 0.0, None)  # the worker's last event: file, line, time, frame
        self.count: Counter = Counter()
        self.seconds: Counter = Counter()
        self.events = 0

    def trace(self, frame, event, arg):
        if event not in ("line", "return"):
            return self.trace
        tid = threading.get_ident()
        if self.worker is None and threading.current_thread().name == WORKER:
            self.worker = tid
        if tid == self.worker:
            now = time.perf_counter()
            self.events += 1
            if self.last_thread != tid and self.where[0]:
                f, ln, t, fr = self.where
                while fr is not None and "mlx_dflash2" not in fr.f_code.co_filename:
                    fr = fr.f_back
                key = (f, ln) + ((fr.f_code.co_filename, fr.f_lineno) if fr is not None and fr.f_code.co_filename != f
                                 else ())
                self.count[key] += 1
                self.seconds[key] += now - t
            self.where = (frame.f_code.co_filename, frame.f_lineno, now, frame)
        self.last_thread = tid
        return self.trace

    def report(self, n: int = 60) -> dict:
        """``lines``: ``[file:line (<- this package's line that led there), source, handoffs, seconds]``."""
        rows = []
        for key, k in self.count.most_common(n):
            f, ln = key[:2]
            via = f" <- {Path(key[2]).name}:{key[3]}" if len(key) > 2 else ""
            src = linecache.getline(*(key[2:] if via else key[:2])).strip()[:90]
            rows.append([f"{Path(f).name}:{ln}{via}", src, k, round(self.seconds[key], 4)])
        return {"worker_line_events": self.events, "handoffs": sum(self.count.values()), "lines": rows}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, server_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the report (JSON), written at exit")
    args = ap.parse_args(ours)
    h = Handoffs()
    atexit.register(lambda: Path(args.out).write_text(json.dumps(h.report(), indent=1)))
    # uvicorn handles SIGTERM itself, then raises it again with the handler it found: an exit that runs atexit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # this checkout
    from mlx_dflash2.server.cli import main as serve

    threading.settrace(h.trace)
    sys.settrace(h.trace)
    serve(server_args)


if __name__ == "__main__":
    main()
