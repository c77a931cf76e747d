"""Where a drafter's training step spends its time: the parts of ``dflash_loss`` forward and backward, timed apart.

One DFlash2 training step (what ``Trainer.train_step`` runs after the target's forward: ``dflash_loss``, its
gradients, clipping, AdamW) on a random-weight target of a given shape, and its parts each evaluated on its own
(``mx.eval`` boundaries, medians of ``--repeats``): the context K/V, the drafter's forward, its forward and
backward, one layer's attention / MLP / dynamic convolutions forward and backward, the loss's vocabulary-sized
part (logits, cross-entropy, distillation, top-1, the selector's top-K) forward and backward from fixed states,
the selector's low-rank part, the optimizer. Also counts the primitives in the step's graph (each one a kernel
launch on a GPU, unless compiled). Issue 21's recipe by default: distillation, half the blocks in the selector
loss, a draft vocabulary of 32,768 ids, data labels.

    scripts/run python benchmarks/profile_train_step.py --batch-size 2 --anchors 16 --max-len 384

Not a test: a measurement (numbers vary with the machine and its load).
"""

from __future__ import annotations

import random_targets as rt  # noqa: I001  (imports mlx_dflash2 before MLX)

import argparse
import collections
import re
import tempfile
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mlx_dflash2.drafter.io import init_drafter
from mlx_dflash2.target import TargetAdapter
from mlx_dflash2.train.trainer import DraftVocab, _vocab_terms, _VocabSpec, dflash_loss, make_update, value_and_grad_in


def median_time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (which evaluates what it builds), after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def count_primitives(*outputs) -> collections.Counter:
    """Primitives in the graph of ``outputs`` (not evaluated), by name (``mx.export_to_dot``)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.read()))


def _at_least(lo: int):
    """argparse type: an int >= ``lo``."""
    def parse(text: str) -> int:
        v = int(text)
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    shapes = [k for k in rt.SHAPES if not k.startswith("_")]
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=shapes, help="target shape")
    p.add_argument("--target-layers", type=_at_least(1), default=6,
                   help="layers of the target (its forward is not timed)")
    p.add_argument("--draft-vocab", type=_at_least(1), default=32768,
                   help="draft vocabulary size (at most the shape's vocabulary; its size: the whole)")
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the drafter's compute dtype (fit --compute-dtype)")
    p.add_argument("--batch-size", type=_at_least(1), default=2)
    p.add_argument("--anchors", type=_at_least(1), default=16, help="blocks per sequence (at most MAX_LEN - 17)")
    p.add_argument("--max-len", type=_at_least(18), default=384)
    p.add_argument("--layers", type=_at_least(1), default=4)
    p.add_argument("--intermediate", type=_at_least(1), default=3072)
    p.add_argument("--kd-weight", type=float, default=1.0)
    p.add_argument("--selector-fraction", type=float, default=0.5, help="in (0, 1]")
    p.add_argument("--repeats", type=_at_least(1), default=5)
    p.add_argument("--eager-update", action="store_true",
                   help="clip + AdamW uncompiled (the step before the trainer compiled its update)")
    p.add_argument("--parts", default="all", help="comma-separated subset of the parts, by substring (default: all)")
    a = p.parse_args(argv)
    if not 0 < a.selector_fraction <= 1:
        p.error(f"--selector-fraction: must be in (0, 1], got {a.selector_fraction}")
    if a.kd_weight < 0:
        p.error(f"--kd-weight: must be >= 0, got {a.kd_weight}")
    if a.anchors > a.max_len - 17:
        p.error(f"--anchors: at most --max-len - 17 = {a.max_len - 17} blocks fit a sequence, got {a.anchors}")
    interval = rt.SHAPES[a.shape].get("full_attention_interval")
    if interval and a.target_layers < interval:
        p.error(f"--target-layers: the hybrid {a.shape} shape needs at least {interval} (one full-attention layer)")
    if a.draft_vocab > rt.SHAPES[a.shape]["vocab_size"]:
        p.error(f"--draft-vocab: the {a.shape} shape has {rt.SHAPES[a.shape]['vocab_size']} ids, got {a.draft_vocab}")
    cfg = dict(rt.SHAPES[a.shape])
    cfg["num_hidden_layers"] = a.target_layers
    rt.SHAPES["_prof"] = cfg
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    model, full = rt.build_target("_prof", bits=0, dtype=dtype)
    target, V = TargetAdapter(model, full, probe=False), cfg["vocab_size"]
    d = init_drafter(target, rt.StubTokenizer(V), num_layers=a.layers, block_size=16, num_taps=5,
                     intermediate_size=a.intermediate, mask_token_id=V - 2, selector_rank=32, selector_top_k=16)
    d.update(tree_map(lambda x: x.astype(mx.float32), d.parameters()))
    mx.eval(d.parameters())
    cdt = getattr(mx, a.compute_dtype)
    N, A, T, B = a.batch_size, a.anchors, a.max_len, 16
    Bm1, M = B - 1, N * A
    rng = np.random.RandomState(0)
    tokens = mx.array(rng.randint(100, V - 100, size=(N, T)).astype(np.int32))
    anchors = mx.array(np.sort(np.stack([rng.choice(np.arange(1, T - 16), A, replace=False) for _ in range(N)]), 1)
                       .astype(np.int32))
    feats, final = target.taps(tokens, tuple(d.config.target_layer_ids), final=True)
    pos = mx.minimum(anchors[..., None] + mx.arange(Bm1)[None, None, :], T - 1).reshape(N, -1)
    states = mx.take_along_axis(final, pos[..., None], axis=1).reshape(M, Bm1, -1)
    labels = mx.array(rng.randint(100, V - 100, size=(N, A, Bm1)).astype(np.int32))
    valid = mx.ones((N, A, Bm1), dtype=mx.bool_)
    weights = mx.array([np.exp(-(k - 1) / 7) for k in range(1, B)], dtype=mx.float32)
    dv = DraftVocab.build(target, sorted(rng.choice(V, a.draft_vocab, replace=False).tolist()), V)
    mx.eval(feats, states)
    opt = optim.AdamW(learning_rate=1e-6)
    R = M * Bm1
    rt.log(f"{a.shape}: drafter {a.layers} x {d.config.hidden_size} (MLP {a.intermediate}), {N} x {A} blocks of {B}, "
           f"T {T}: {R} rows, {M * B} block slots; vocab {dv.size}, compute {a.compute_dtype}")

    def loss_fn(model, alpha=1.0, kd=a.kd_weight):
        return dflash_loss(model, target, feats, tokens, anchors, labels, valid, weights, alpha, valid_vocab=V,
                           teacher_states=states, kd_weight=kd, selector_fraction=a.selector_fraction,
                           draft_vocab=dv)

    def vg(**kw):
        return value_and_grad_in(d, lambda m: loss_fn(m, **kw), cdt)(d)

    emb = target.embed(mx.concatenate([mx.take_along_axis(tokens, anchors, axis=1)[..., None],
                                       mx.full((N, A, Bm1), V - 2, dtype=mx.int32)], -1).reshape(M, B)).astype(cdt)
    fc = feats.astype(cdt)
    dd = tree_map(lambda x: x.astype(cdt), d.parameters())
    from mlx_dflash2.drafter.model import DraftModel

    dc = DraftModel(d.config)
    dc.update(dd)
    h_fixed = dc.forward_blocks(emb, fc, anchors)
    mx.eval(emb, fc, h_fixed, dc.parameters())
    hf = h_fixed[:, 1:].reshape(R, -1).astype(mx.float32)
    mx.eval(hf)
    layer = dc.layers[0]
    ctx_kv = dc.context_kv_all(fc)
    mx.eval(ctx_kv)
    ck, cv = ctx_kv[0]
    x0 = (mx.random.normal((M, B, d.config.hidden_size)) * 0.5).astype(cdt)
    cot = mx.random.normal(x0.shape).astype(cdt)
    mx.eval(x0, cot)

    def vjp_time(f, primals):
        def run():
            out, g = mx.vjp(f, primals, [cot])
            mx.eval(out, g)
        return run

    spec = _VocabSpec(
        logits=lambda x: d.unary_logits(x.astype(target.dtype), dv.head).astype(mx.float32),
        teacher=lambda s: dv.head(s).astype(mx.float32), kd=a.kd_weight > 0, top_k=16, block=Bm1,
        stride=max(1, int(round(1 / a.selector_fraction))))
    spec_nosel = _VocabSpec(spec.logits, spec.teacher, spec.kd, 0, Bm1, spec.stride)
    spec_plain = _VocabSpec(spec.logits, spec.teacher, False, 0, Bm1, spec.stride)
    tf = states.reshape(R, -1)
    lab_in = mx.maximum(dv.pos[labels.reshape(R)], 0)

    def vocab_run(sp, grad=True):
        def f(h):
            vt = _vocab_terms(sp, h, tf, lab_in, 0)
            loss = vt["ce"].sum() + (vt["kd"].sum() if "kd" in vt else 0)
            if "cand_logits" in vt:
                loss = loss + mx.logsumexp(vt["cand_logits"], axis=-1).sum()
            return loss, vt["top1"]

        def run():
            if grad:
                (loss, t1), g = mx.value_and_grad(lambda h: f(h))(hf)
                mx.eval(loss, t1, g)
            else:
                mx.eval(f(hf))
        return run

    update = make_update(d, opt, 1.0, compiled=not a.eager_update)  # as the trainer's

    def step():
        (loss, m), g = vg()
        n = update(g)
        mx.eval(d.parameters(), opt.state, loss, m, n)

    (loss0, _), g0 = vg()
    mx.eval(loss0, g0)

    def opt_only():
        n = update(g0)
        mx.eval(d.parameters(), opt.state, n)

    def conv4(x, mode):  # a layer's four convolution sides, each on the previous one's output
        ac, mc = layer.attention_conv, layer.mlp_conv
        y = ac.apply(ac.apply(x, 0, ac.coefficients(x), mode), 1, ac.coefficients(x), mode)
        return mc.apply(mc.apply(y, 0, mc.coefficients(y), mode), 1, mc.coefficients(y), mode)

    parts = {
        "step (loss, grads, clip, AdamW)": step,
        "loss + grads": lambda: mx.eval(vg()),
        "loss + grads, no selector": lambda: mx.eval(vg(alpha=0.0)),
        "loss + grads, no KD": lambda: mx.eval(vg(kd=0.0)),
        "loss forward only": lambda: mx.eval(loss_fn(dc)),
        f"drafter forward ({a.layers} layers, ctx K/V)": lambda: mx.eval(dc.forward_blocks(emb, fc, anchors)),
        "context K/V (fc, norms, k/v of T rows)": lambda: mx.eval(dc.context_kv_all(fc)),
        "drafter fwd+bwd (to h, all params)": lambda: mx.eval(nn.value_and_grad(
            dc, lambda m: (m.forward_blocks(emb, fc, anchors) * cot[:, :].astype(cdt)).sum())(dc)),
        "1 layer fwd+bwd": vjp_time(lambda x: layer(x, lambda at, v: at.blocks(v, ck, cv, anchors), "compiled"), [x0]),
        "1 layer attention (blocks) fwd+bwd": vjp_time(lambda x: layer.self_attn.blocks(x, ck, cv, anchors), [x0]),
        "1 layer MLP fwd+bwd": vjp_time(lambda x: layer.mlp(x), [x0]),
        "1 layer 4 conv sides fwd+bwd (compiled, as trained)": vjp_time(lambda x: conv4(x, "compiled"), [x0]),
        "1 layer 4 conv sides fwd+bwd (eager reference)": vjp_time(lambda x: conv4(x, "reference"), [x0]),
        "vocab part fwd+bwd (CE, KD, top1, top-K)": vocab_run(spec),
        "vocab part fwd only": vocab_run(spec, grad=False),
        "vocab part fwd+bwd, no top-K": vocab_run(spec_nosel),
        "vocab part fwd+bwd, CE + top1 only": vocab_run(spec_plain),
        "head matmul fwd+bwd alone": lambda: mx.eval(mx.vjp(lambda x: dv.head(x), [hf.astype(target.dtype)],
                                                            [mx.ones((R, dv.size), target.dtype)])),
        "clip + AdamW" + (" (eager)" if a.eager_update else " (compiled)"): opt_only,
    }
    want = None if a.parts == "all" else set(a.parts.split(","))
    if want and not any(w in name for w in want for name in parts):
        p.error(f"--parts: {a.parts!r} matches none of: {'; '.join(parts)}")
    print(f"\n| part | median s ({a.repeats} repeats) |\n|---|---:|")
    for name, fn in parts.items():
        if want and not any(w in name for w in want):
            continue
        print(f"| {name} | {median_time(fn, a.repeats):.3f} |", flush=True)
    (loss, m), g = vg()
    gc, n = optim.clip_grad_norm(g, 1.0)
    prims = count_primitives(loss, *[v for _, v in tree_flatten(gc)], n)
    total = sum(prims.values())
    print(f"\nprimitives in loss + grads + clip graph: {total}; most common: "
          + ", ".join(f"{k} {v}" for k, v in prims.most_common(14)))
    n_params = len(tree_flatten(d.trainable_parameters()))
    print(f"trainable parameter arrays: {n_params}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
