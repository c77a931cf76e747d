"""The single-request generator of two trees, side by side (session 45: the old solo loop of a1b9f22 against the
batch of one): tokens, log-probabilities, statistics (timings excluded) and the final state, for the embedded
SmolLM2 in float32, 2 prompts x {shipped drafter, lookup, plain} x {greedy, seeded sampled} x consumer stops at
{1, 5, 17, none}, 40 tokens, non-adaptive. Run once per tree from outside both (so PYTHONPATH picks the package)::

    cd /tmp && PYTHONPATH=<tree> <venv>/bin/python <tree>/benchmarks/one_loop_ab.py OUT.json

then compare the two JSONs (every key's ``toks``, ``lps``, ``stats``, ``state_tokens``, ``cache``)."""
import json, sys
import mlx_dflash2  # noqa
import mlx.core as mx
from mlx_dflash2.loading import load_target, make_proposer
from mlx_dflash2.speculative import GenerationState, SpecStats, speculative_generate_step
from mlx_dflash2.api import request_sampling
from mlx_dflash2.target import cache_length

target, tok, _ = load_target(None, dtype=mx.float32)
prompts = ["Write a Python function that checks whether a number is prime.",
           "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog."]
out = {}
for pname, text in enumerate(prompts):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    for dname in ("shipped", "lookup", "none"):
        prop = None if dname == "none" else make_proposer(dname, target, tok, "smollm2-135m-instruct", adaptive=False)
        for stop in (1, 5, 17, None):
            for samp in (False, True):
                key = f"{pname}/{dname}/{stop}/{samp}"
                st, state = SpecStats(), GenerationState()
                kw = {}
                if samp:
                    from mlx_dflash2.sampling import SamplingParams
                    rs = request_sampling(SamplingParams(temp=0.8, seed=7))
                    kw = dict(verifier=rs.verifier, draft_key=rs.draft_key, draft_temperature=rs.draft_temperature,
                              adaptive=False)
                gen = speculative_generate_step(ids, target, prop, max_tokens=40, stats=st, state=state, **kw)
                toks, lps = [], []
                for t, lp, fd in gen:
                    toks.append(t); lps.append(float(lp[t].item()))
                    if stop is not None and len(toks) == stop:
                        gen.close(); break
                d = st.as_dict()
                for k in ("prefill_s", "decode_s", "prefill_tps", "decode_tps"):
                    d.pop(k, None)
                out[key] = dict(toks=toks, lps=[round(x, 4) for x in lps], stats=d, state_tokens=state.tokens,
                                cache=cache_length(state.cache))
json.dump(out, open(sys.argv[1], "w"), indent=0, default=str)
print(len(out), "runs")
