"""benchmarks/bench_versus.py builds our proposer as ``mlx_dflash2.load`` does (issue 21's head to head) and checks
its arguments before loading; benchmarks/profile_train_step.py checks its arguments."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_dflash2.assets import embedded_model_path
from mlx_dflash2.drafter.io import is_quantized

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_versus.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_versus", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU rule expands drafters on the CPU backend only")
def test_ours_beside_a_dense_target_runs_a_dense_drafter(smol_f32, quick_calibration):
    """The shipped 4-bit drafter beside a dense target is expanded, as ``load`` does on the CPU (the bench kept it
    packed until session 34: a 16-row quantized matmul per layer, rounds ~2x the CLI's); beside a packed target
    (``--dequantize`` off) it stays packed."""
    target, tok = smol_f32
    bench, name = _bench(), str(embedded_model_path())
    p = bench.ours_proposer("auto", target, tok, name, dequantize=True)
    assert not is_quantized(p.drafter.model)
    p = bench.ours_proposer("auto", target, tok, name, dequantize=False)
    assert is_quantized(p.drafter.model)


@pytest.mark.parametrize("extra", [["--drafter", "{tmp}"], ["--drafter", ""], ["--drafter", "{tmp}/missing"],
                                   ["--drafter", "{tmp}", "--methods", "plain"]])
def test_a_bad_drafter_fails_before_the_models_load(tmp_path, monkeypatch, capsys, extra):
    """A directory without a drafter, an empty or missing path, or ``--drafter`` without the auto method: one
    usage error (exit 2) before minutes of model loading (a fresh user's findings, session 34)."""
    bench = _bench()
    monkeypatch.setattr(bench, "load_target", lambda *a, **k: pytest.fail("loaded a model before checking --drafter"))
    with pytest.raises(SystemExit) as e:
        bench.main([x.format(tmp=tmp_path) for x in extra])
    assert e.value.code == 2
    assert "--drafter" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--shape", "bogus"], ["--compute-dtype", "bogus"], ["--draft-vocab", "0"],
                                 ["--shape", "tiny", "--draft-vocab", "5000"], ["--anchors", "400"],
                                 ["--selector-fraction", "0"], ["--max-len", "10"], ["--batch-size", "0"],
                                 ["--repeats", "0"], ["--shape", "hybrid-tiny", "--target-layers", "2"]])
def test_profile_train_step_refuses_bad_arguments(bad, capsys, monkeypatch):
    """benchmarks/profile_train_step.py: each bad argument one usage error, not a traceback mid-way."""
    monkeypatch.syspath_prepend(str(BENCH.parent))  # its random_targets import
    spec = importlib.util.spec_from_file_location("profile_train_step", BENCH.parent / "profile_train_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        mod.main(bad)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_adaptive_method_needs_a_drafter_directory(monkeypatch, capsys):
    """``--methods adaptive`` runs a ``--drafter DIR`` (or ``shipped``) under the adaptive schedule: with ``--drafter
    auto``, which has it already, a usage error before any model loads."""
    bench = _bench()
    monkeypatch.setattr(bench, "load_target", lambda *a, **k: pytest.fail("loaded a model before checking"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--methods", "plain,adaptive"])
    assert e.value.code == 2
    assert "adaptive" in capsys.readouterr().err


@pytest.mark.slow  # the real SmolLM2 (~11 s on a 2-core host); runs in make test-all
def test_ours_adaptive_schedules_a_drafter_directory(smol_f32, quick_calibration):
    """The adaptive method: the same drafter as auto's, fused with lookup, under the adaptive schedule (auto runs a
    directory every round, as the CLI's ``--drafter DIR``)."""
    from mlx_dflash2.loading import shipped_drafter_path

    target, tok = smol_f32
    bench, name = _bench(), str(embedded_model_path())
    path = str(shipped_drafter_path(name))
    assert bench.ours_proposer(path, target, tok, name, dequantize=True).schedule is None
    assert bench.ours_proposer(path, target, tok, name, dequantize=True, adaptive=True).schedule is not None


def _saved_run(prompts, date="d"):
    """A saved bench_versus run in miniature: plain and mlx-spec k=2 rows for ``prompts`` of HumanEval."""
    meta = {"target": "t.gguf", "draft": "d.gguf", "dtype": "auto", "dequantize": False, "draft_dequantize": False,
            "device": "cpu", "mlx": "0", "sets": ["humaneval"], "prompts": len(prompts), "max_tokens": 4,
            "methods": ["plain", "mlx-spec"], "num_draft": [2], "repeats": 1, "same_as": {}, "drafter": "auto",
            "date": date}
    rows = []
    for i, p in enumerate(prompts):
        for method, k, tps in (("plain", None, 10.0), ("mlx-spec", 2, 10.0 + i)):
            rows.append({"set": "humaneval", "prompt": p, "method": method, "k": k, "tokens": 4,
                         "rounds": 2 if k else 4, "seconds": 4 / tps, "tps": tps, "tau": 2.0 if k else 1.0,
                         "identical": True, "tokens_out": [1, 2, 3, 4]})
    return {"meta": meta, "summary": [], "rows": rows}


def test_merge_joins_a_run_split_over_calls(tmp_path, capsys):
    """``--merge`` joins runs of one comparison (``--skip 0`` and ``--skip K``) into ``--out``: the summary is the
    one of all their rows; a prompt measured twice, or runs of different settings, are usage errors."""
    import json

    bench = _bench()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_saved_run(["HumanEval/0", "HumanEval/1"])))
    b.write_text(json.dumps(_saved_run(["HumanEval/2"], date="e")))
    out = tmp_path / "m.json"
    bench.main(["--merge", str(a), str(b), "--out", str(out)])
    m = json.loads(out.read_text())
    assert len(m["rows"]) == 6 and m["meta"]["prompts"] == 3
    spec = next(r for r in m["summary"] if r["method"] == "mlx-spec")
    assert spec["prompts"] == 3 and spec["speedup"] == pytest.approx(1.0)  # median of 1.0, 1.1 (a) and 1.0 (b)
    assert out.with_suffix(".png").exists()
    for bad in (_saved_run(["HumanEval/1"]), {**_saved_run(["HumanEval/5"]), "meta": {
            **_saved_run(["HumanEval/5"])["meta"], "max_tokens": 8}}):
        b.write_text(json.dumps(bad))
        with pytest.raises(SystemExit) as e:
            bench.main(["--merge", str(a), str(b), "--out", str(out)])
        assert e.value.code == 2
        assert "--merge" in capsys.readouterr().err


def test_merge_refuses_runs_of_other_methods(tmp_path, capsys):
    """Runs with other methods or other ``num_draft`` values are not one comparison: joined, a method's median
    would be over other prompts than plain's (session 37's note: ``--merge`` took the union of their methods)."""
    import json

    bench = _bench()
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    a.write_text(json.dumps(_saved_run(["HumanEval/0"])))
    other = _saved_run(["HumanEval/1"])
    for meta in ({**other["meta"], "methods": ["plain"]}, {**other["meta"], "num_draft": [6]}):
        b.write_text(json.dumps({**other, "meta": meta}))
        with pytest.raises(SystemExit) as e:
            bench.main(["--merge", str(a), str(b), "--out", str(out)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--merge" in err and ("methods" in err or "num_draft" in err)
    assert not out.exists()


def test_merge_refuses_runs_of_another_order(tmp_path, capsys):
    """A ``--order rotate`` run and a ``--order fixed`` one (or one saved before ``--order``: plain first) are not one
    comparison: joined, the merged ``meta.order`` named the first run's order for all the rows. Runs of one order
    merge, and the merged meta says which (``fixed`` for runs saved before ``--order``)."""
    import json

    bench = _bench()
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    rot = _saved_run(["HumanEval/0"])
    rot["meta"]["order"] = "rotate"
    a.write_text(json.dumps(rot))
    old = _saved_run(["HumanEval/1"])  # no "order": saved before it
    for other in ({**old, "meta": {**old["meta"], "order": "fixed"}}, old):
        b.write_text(json.dumps(other))
        with pytest.raises(SystemExit) as e:
            bench.main(["--merge", str(a), str(b), "--out", str(out)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--merge" in err and "order" in err
    assert not out.exists()
    assert bench.merge_runs([old, _saved_run(["HumanEval/2"])])["meta"]["order"] == "fixed"
    assert bench.merge_runs([rot, {**old, "meta": {**old["meta"], "order": "rotate"}}])["meta"]["order"] == "rotate"


def test_skip_must_not_be_negative(capsys):
    with pytest.raises(SystemExit) as e:
        _bench().main(["--skip", "-1"])
    assert e.value.code == 2


@pytest.mark.slow  # the real SmolLM2 (~11 s on a 2-core host); runs in make test-all
def test_ours_plain_runs_our_loop_without_a_proposer(tmp_path):
    """``--methods plain,ours-plain`` on the embedded SmolLM2 (no draft model loaded): our loop's plain steps, output
    identical to ``mlx_lm``'s, one token per target forward, counted as mlx-lm's are (the first token's forward over
    the prompt's last token included: until session 36 ours' tau left it out, 6 tokens in 5 rounds here)."""
    import json

    out = tmp_path / "v.json"
    _bench().main(["--model", str(embedded_model_path()), "--methods", "plain,ours-plain", "--sets", "gsm8k",
                   "--prompts", "2", "--max-tokens", "6", "--verify-widths", "0", "--dtype", "float32",
                   "--dequantize", "--out", str(out)])
    saved = json.loads(out.read_text())
    ours = next(r for r in saved["summary"] if r["method"] == "ours-plain")
    assert ours["identical"] == 2 and ours["tau"] == 1.0
    assert saved["meta"]["drafters"] == {"ours-plain": "none"} and saved["meta"]["order"] == "rotate"
    # the second prompt ran ours first (--order rotate); its rows are saved in the fixed order all the same
    assert [r["method"] for r in saved["rows"]] == ["plain", "ours-plain"] * 2


def test_rotate_runs_each_method_once_in_each_position():
    """``--order rotate``: over as many prompts as methods, each method runs once in each position, so none is always
    the first timed after a prompt's prefill (session 39: one MT-Bench request read our plain steps at 1.12x of
    ``mlx_lm``'s with plain timed first; every earlier run timed plain first)."""
    order = _bench().method_order
    todo = [("plain", 0), ("mlx-spec", 2), ("mlx-spec", 6), ("auto", 0), ("adaptive", 0)]
    runs = [order(todo, j) for j in range(len(todo))]
    assert runs[0] == todo and runs[1][0] == ("mlx-spec", 2)
    for pos in range(len(todo)):
        assert sorted(r[pos] for r in runs) == sorted(todo)
    assert order(todo, 7) == order(todo, 2) and order([], 3) == []


def test_rotate_turns_within_each_set_and_across_a_skip():
    """Each set's prompts take the turns in order, whatever the other sets (turned by the request's index in the run,
    two sets and two methods ran plain first on every prompt of one set and last on every prompt of the other), and a
    run split by ``--skip`` goes on where the first part stopped."""
    bench = _bench()
    per_set = {"gsm8k": ["g0", "g1", "g2", "g3"], "mtbench": ["m0", "m1"]}
    jobs = bench.prompt_jobs(per_set, 4, 0)
    assert jobs == [("gsm8k", "g0", 0), ("mtbench", "m0", 0), ("gsm8k", "g1", 1), ("mtbench", "m1", 1),
                    ("gsm8k", "g2", 2), ("gsm8k", "g3", 3)]
    todo = [("plain", 0), ("ours-plain", 0)]
    for s in per_set:
        firsts = [bench.method_order(todo, turn)[0] for name, _, turn in jobs if name == s]
        assert sorted(firsts[:2]) == sorted(todo)
    assert [t for _, _, t in bench.prompt_jobs({"gsm8k": ["g2", "g3"]}, 2, 2)] == [2, 3]


@pytest.mark.slow  # the real SmolLM2, two runs (~25 s on a 2-core host); runs in make test-all
def test_rotate_runs_each_sets_prompts_in_turn(tmp_path, capsys):
    """The run order the log shows: with two sets and two methods each set's two prompts start at different methods,
    and ``--skip 1`` starts its one prompt at the second method; each prompt's last line counts the methods other
    than plain that are identical to it."""
    import re

    def firsts(args):
        _bench().main(["--model", str(embedded_model_path()), "--methods", "plain,ours-plain", "--max-tokens", "2",
                       "--verify-widths", "0", "--dtype", "float32", "--dequantize", "--out", str(tmp_path / "v.json"),
                       *args])
        out = {}
        identical.clear()
        for line in capsys.readouterr().err.splitlines():
            m = re.search(r"\[\d+/\d+\] (\S+) (\S+) (.+?): \d+ tokens in ", line)
            if m:
                out.setdefault((m[1], m[2]), m[3])
            identical.extend(re.findall(r"; (\d+ of \d+) identical to plain$", line))
        return out

    identical = []

    first = firsts(["--sets", "gsm8k,mtbench", "--prompts", "2"])
    assert identical == ["1 of 1"] * 4  # ours-plain against plain, plain itself not counted (it said 2 of 2)
    assert len(first) == 4
    for s in ("gsm8k", "mtbench"):
        assert len({m for (name, _), m in first.items() if name == s}) == 2, first
    assert list(firsts(["--sets", "gsm8k", "--prompts", "1", "--skip", "1"]).values()) == [
        _bench().LABELS["ours-plain"]]


@pytest.mark.parametrize("text", ["[1, 2]", '"x"', "{", '{"rows": []}', '{"meta": {}}', '{"meta": [], "rows": []}'])
@pytest.mark.parametrize("flag", ["--merge", "--replot"])
def test_a_bad_saved_run_is_one_usage_error_naming_its_file(tmp_path, capsys, text, flag):
    """``--merge`` / ``--replot`` of a file that is not a saved run (not JSON, not an object, no ``meta`` or
    ``rows``): one usage error naming the file (exit 2), never a traceback (a JSON list was a TypeError, ``--replot``
    of a missing or bad file a traceback; session 36's breaker)."""
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as e:
            _bench().main([flag, str(path), "--out", str(tmp_path / "m.json")])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"{flag}: {path}" in err and "Traceback" not in err


def test_skip_beyond_a_set_is_a_usage_error_before_loading(monkeypatch, capsys):
    """``--skip K`` at or past a set's size leaves no prompt to run: a usage error before any model loads (it loaded
    the target, ran nothing and failed drawing an empty plot; session 36's breaker)."""
    bench = _bench()
    monkeypatch.setattr(bench, "load_target", lambda *a, **k: pytest.fail("loaded a model before checking"))
    for skip in ("80", str(10**20)):
        with pytest.raises(SystemExit) as e:
            bench.main(["--sets", "humaneval,mtbench", "--skip", skip])
        assert e.value.code == 2
        assert "--skip" in capsys.readouterr().err


def test_an_empty_summary_draws_no_plot(tmp_path):
    """A run with no prompt done (a time budget spent while loading, a merge of empty runs) draws no plot instead of
    failing in matplotlib."""
    bench = _bench()
    assert bench.plot([], tmp_path / "p.png", _saved_run([])["meta"]) is None


def test_merge_counts_an_older_runs_rounds_as_a_new_run_does(tmp_path):
    """A run saved before ours' rounds counted the first token's forward (no ``meta["rounds"]``, e.g. the committed
    ``versus-gpu-15b-c7-h100.json``) merged with a new one: its ours rows get that forward (one more round each), so
    the joined tau is one count, not two (merging them added over-counted taus silently; session 36's breaker)."""
    bench = _bench()

    def run(prompt, rounds, new):
        r = _saved_run([prompt])
        r["meta"]["methods"] = ["plain", "auto"]
        r["rows"] = [x for x in r["rows"] if x["method"] == "plain"]
        r["rows"].append({**r["rows"][0], "method": "auto", "rounds": rounds, "tau": 4 / rounds})
        if new:
            r["meta"]["rounds"] = bench.ROUNDS
        return r

    old, new = run("HumanEval/0", 1, False), run("HumanEval/1", 2, True)
    m = bench.merge_runs([old, new])
    ours = [x for x in m["rows"] if x["method"] == "auto"]
    assert [x["rounds"] for x in ours] == [2, 2] and [x["tau"] for x in ours] == [2.0, 2.0]
    assert next(r for r in m["summary"] if r["method"] == "auto")["tau"] == 2.0
    assert m["meta"]["rounds"] == bench.ROUNDS
    assert m["rows"][0]["method"] == "plain" and m["rows"][0]["rounds"] == 4  # mlx-lm's were always counted so
    skipped = run("HumanEval/2", 2, False)
    skipped["meta"]["skip"] = 2  # saved with --skip (session 36, after the fix) but before meta["rounds"]: counted
    m = bench.merge_runs([skipped])
    assert [x["rounds"] for x in m["rows"]] == [4, 2] and m["meta"]["rounds"] == bench.ROUNDS


def test_replot_counts_an_older_runs_rounds_as_merge_does(tmp_path, capsys):
    """``--replot`` of a run saved before ``meta["rounds"]``: ours' tau with the first token's forward, as ``--merge``
    and benchmarks/README's corrected tables count it (the committed GPU run replotted 4.17 where the README says
    4.06)."""
    import json

    bench = _bench()
    r = _saved_run(["HumanEval/0"])
    r["meta"]["methods"] = ["plain", "auto"]
    r["rows"] = [x for x in r["rows"] if x["method"] == "plain"]
    r["rows"].append({**r["rows"][0], "method": "auto", "rounds": 1, "tau": 4.0})
    path = tmp_path / "old.json"
    path.write_text(json.dumps(r))
    bench.main(["--replot", str(path)])
    assert "| humaneval | ours (auto) | 10.00 | 1.00x | 2.00 | 1/1 |" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--dtype", "bogus"], ["--model", "{tmp}/missing.gguf", "--methods", "plain"],
                                 ["--model", "{model}", "--draft-model", "{tmp}/missing.gguf", "--methods",
                                  "plain,mlx-spec", "--verify-widths", "0", "--dtype", "float32"]])
def test_a_bad_model_or_dtype_is_one_usage_error(tmp_path, capsys, bad):
    """A missing ``--model`` / ``--draft-model`` or an unknown ``--dtype``: one usage error (exit 2), not a traceback
    of ``load_target`` (session 36's breaker)."""
    args = [a.format(tmp=tmp_path, model=embedded_model_path()) for a in bad]
    with pytest.raises(SystemExit) as e:
        _bench().main([*args, "--out", str(tmp_path / "v.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and ("--dtype" in err or "not found" in err)


def test_the_title_names_the_draft_model_only_where_it_ran():
    bench = _bench()
    meta = {"target": "t", "draft": "d.gguf", "device": "cpu", "prompts": 2, "max_tokens": 8}
    assert "vs draft d.gguf" in bench._title({**meta, "methods": ["plain", "mlx-spec"]})
    assert "draft" not in bench._title({**meta, "methods": ["plain", "ours-plain"]})


def test_a_run_directory_drafter_is_labelled_by_its_run():
    """A drafter given as ``runs/<run>/drafter`` (how the training chain leaves one) is labelled by its run, not
    as "drafter drafter"; another directory by its own name; lookup-only auto says so."""
    labels = _bench().labels
    assert labels({"drafter": "$WORK/runs/c8-q4/drafter"})["adaptive"] == "ours (drafter c8-q4, adaptive schedule)"
    assert labels({"drafter": ".cache/train/c7-q4"})["auto"] == "ours (drafter c7-q4, every round)"
    assert labels({"drafter": "drafter"})["auto"] == "ours (drafter drafter, every round)"
    assert "lookup" in labels({"same_as": {"auto": "lookup"}})["auto"]


def test_repeats_that_give_other_tokens_are_not_identical(tmp_path, monkeypatch):
    """``--repeats 2``: a method whose second run gives other tokens than its first is not identical to plain, even
    where the first run (the tokens the row saves) is; until session 40 only the first run was compared."""
    import json

    bench = _bench()
    real, calls = bench.run_ours, []

    def second_run_differs(*a, **k):
        toks, secs, rounds, stats = real(*a, **k)
        calls.append(len(toks))
        if len(calls) % 2 == 1 and len(calls) > 1:  # (the first call is the warm-up) every second timed run
            toks = toks[:-1] + [toks[-1] + 1]
        return toks, secs, rounds, stats

    monkeypatch.setattr(bench, "run_ours", second_run_differs)
    out = tmp_path / "v.json"
    bench.main(["--model", str(embedded_model_path()), "--methods", "plain,ours-plain", "--sets", "gsm8k",
                "--prompts", "1", "--max-tokens", "4", "--verify-widths", "0", "--dtype", "float32", "--dequantize",
                "--repeats", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    plain, ours = saved["rows"]
    assert ours["tokens_out"] == plain["tokens_out"] and ours["repeats_agree"] is False
    assert ours["identical"] is False and plain["identical"] is True and plain["repeats_agree"] is True
    assert next(r for r in saved["summary"] if r["method"] == "ours-plain")["identical"] == 0


def test_merge_says_which_runs_compared_only_their_first_repeat(tmp_path, capsys):
    """A ``--repeats 2`` run saved before session 40 (no row has ``repeats_agree``: its ``identical`` compared each
    method's first run only) merged with a new one: the merged ``meta.merged`` marks it and ``--merge`` says so on
    stderr, instead of a joined "identical" column that silently claims every run was compared; runs of one
    repeat, and new runs, are not marked."""
    import json

    bench = _bench()

    def run(prompt, repeats, new):
        r = _saved_run([prompt])
        r["meta"].update(repeats=repeats, rounds=bench.ROUNDS)
        if new:
            for x in r["rows"]:
                x["repeats_agree"] = True
        return r

    m = bench.merge_runs([run("HumanEval/0", 2, False), run("HumanEval/1", 2, True)])
    assert [e.get("identical_first_run_only", False) for e in m["meta"]["merged"]] == [True, False]
    m = bench.merge_runs([run("HumanEval/0", 1, False), run("HumanEval/1", 1, False)])
    assert not any("identical_first_run_only" in e for e in m["meta"]["merged"])
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    a.write_text(json.dumps(run("HumanEval/0", 2, False)))
    b.write_text(json.dumps(run("HumanEval/1", 2, True)))
    bench.main(["--merge", str(a), str(b), "--out", str(out)])
    err = capsys.readouterr().err
    assert str(a) in err and "first" in err and str(b) not in err
