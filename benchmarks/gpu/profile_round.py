"""Where a speculative round's time goes on the device, per round and per Python function (issue 19, session 20).

Session 20's first H200 run: with the verify forward submitted in parts (``MLX_DFLASH2_SUBMIT_EVERY=9``) a round
with the fresh drafter cost 127 ms against 19 ms without (the scripted drafter's round got faster: 14.6 vs 16.1 ms).
This script runs rounds of the random 8B shape's routed target with the fresh drafter and with a scripted drafter,
for each value of ``--submit`` (set on the routed layers between runs), and records each round's wall time (the
first rounds apart: first-use costs) and a ``cProfile`` of the drafter runs (top functions by own time).

    python benchmarks/gpu/profile_round.py --out $OUT/round.json [--submit 0,9] [--tokens 48]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import random_targets as rt  # noqa: E402  (imports mlx_dflash2 before MLX)

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from mlx_dflash2.kernels.block import set_submit_every  # noqa: E402
from mlx_dflash2.proposers import DFlashProposer  # noqa: E402
from mlx_dflash2.speculative import speculative_generate_step  # noqa: E402
from mlx_dflash2.target import TargetAdapter  # noqa: E402
from mlx_dflash2.verify import GreedyVerifier  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--submit", default="0,9", help="layers per early submission, comma-separated (0: none)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--force-route", action="store_true", help="route on the CPU too (a check of the script)")
    a = p.parse_args(argv)
    res = {"mlx": mx.__version__, "device": str(mx.default_device()), "rows": []}

    def save():
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))

    model, cfg = rt.build_target(a.shape)
    V = cfg["vocab_size"]
    ref = TargetAdapter(model, cfg, probe=False, kernels="reference")
    t = TargetAdapter(rt.twin(model, cfg), cfg, probe=False, kernels="reference")
    res["routed"] = t.route_kernels("kernel", force=a.force_route)
    drafter = rt.make_drafter(ref, V)
    res["drafter_routed"] = rt.drafter_mode(drafter, "kernel" if res["routed"] else "reference", a.force_route)
    B, taps = drafter.config.block_size, tuple(drafter.config.target_layer_ids)
    ids = rt.random_ids(V, a.context, seed=1)
    verifier = GreedyVerifier(kernel_mode="kernel" if res["routed"] else "reference")
    plain = [int(x) for x, _, _ in speculative_generate_step(ids, t, None, verifier=verifier, max_tokens=16 * 5 + 2)]
    props = {"drafter": DFlashProposer(drafter, t, valid_vocab=V, min_confidence=0.0),
             "scripted": rt.ScriptedProposer(len(ids), plain, [4], B, V, taps)}

    def run(prop, n, profile=None):
        times, last = [], time.perf_counter()
        gen = speculative_generate_step(ids, t, prop, verifier=verifier, block_size=B, max_tokens=n)
        if profile is not None:
            profile.enable()
        for _tok, _lp, drafted in gen:
            if not drafted:  # the round's last token (its bonus or correction)
                now = time.perf_counter()
                times.append((now - last) * 1e3)
                last = now
        if profile is not None:
            profile.disable()
        return times[1:]  # the first: prefill

    for k in (int(x) for x in a.submit.split(",")):
        set_submit_every(t.inner.layers, k)
        for name, prop in props.items():
            run(prop, 2 * B + 2)  # first use (a full block: every verify width compiled)
            pr = cProfile.Profile() if name == "drafter" else None
            ms = run(prop, a.tokens, pr)
            row = {"submit": k, "proposer": name, "rounds": len(ms), "first_ms": [round(x, 2) for x in ms[:8]],
                   "median_ms": round(statistics.median(ms), 2) if ms else None}
            if pr is not None:
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
                row["profile"] = s.getvalue().replace(str(Path(__file__).resolve().parents[2]) + "/", "").replace(str(Path.home()), "~")[-6000:]
            res["rows"].append(row)
            rt.log(json.dumps({k2: v for k2, v in row.items() if k2 != "profile"}))
            if pr is not None:
                print(row["profile"][:4000], flush=True)
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
