"""benchmarks/scripted_server.py: the scripted drafter behind the 8B-shape server runs of issue 22, and the server
entry point it serves through (``cli.main(make_model=)``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_dflash2.batch import SpeculativeBatch
from mlx_dflash2.loading import load
from mlx_dflash2.server import cli
from tiny_models import tiny_mlx_lm_dir

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import scripted_server

    return scripted_server


def test_the_script_errs_at_tau_minus_one(scripted):
    p = scripted.OracleProposer({(1, 2): [5, 6, 7, 8, 9]}, tau=3, block_size=16, vocab=100)
    s = p.start([1, 2])
    s.extend([1, 2], None)  # the prompt (the anchor of round 1, reference[0], is committed with the round)
    got = s.propose(5, 5).tokens.tolist()
    assert got == [6, 7, 9, 9, 0]  # 6, 7 right; the third (8) made wrong; past the reference: 0
    assert p.start([3]).propose(1, 4).n == 0 and p.misses == 1  # an unknown prompt without a reference: plain


def test_scripted_rows_keep_their_plain_output_and_accept_as_scripted(scripted, tmp_path):
    model, tok = load(str(tiny_mlx_lm_dir(tmp_path / "t", "qwen3")), "none", dtype=mx.float32)
    prompts = [[1, 5, 9, 13], [2, 7], [3, 4, 5, 6, 7, 8]]
    refs = scripted.plain_references(model.target, prompts, 24)
    oracle = scripted.OracleProposer({tuple(p): r for p, r in zip(prompts, refs)}, tau=3, block_size=8,
                                     vocab=model.target.vocab_size)
    batch = SpeculativeBatch(model.target, schedule="full")
    uids = [batch.add(p, 24, proposer=oracle, block_size=8) for p in prompts]
    out, steps = {u: [] for u in uids}, 0
    while batch.active or batch.pending:
        steps += 1
        for ev in batch.step():
            out[ev.uid] += ev.tokens
    assert [out[u] for u in uids] == refs  # lossless: the drafts change nothing but the rounds
    assert oracle.misses == 0 and steps <= 1 + 23 // 3 + 1  # the join, then 3 tokens a round (plain: 24 steps)


def test_a_reused_session_scripts_the_new_prompt(scripted):
    p = scripted.OracleProposer({(1, 2): [5, 6, 7, 8, 9], (1, 3): [10, 11, 12, 13, 14]}, tau=3, block_size=16,
                                vocab=100)
    s = p.start([1, 2])
    s.extend([1, 2], None)
    s.extend([5, 6, 7], None)  # a round: the anchor and two accepted drafts
    s2 = s.clone()
    s2.truncate(1)  # a prompt cache's reuse by prompt (1, 3): the shared prefix, then the rest of the prompt
    s2.extend([3], None)
    assert s2.propose(10, 4).tokens.tolist() == [11, 12, 14, 14]
    s.truncate(2)  # the same prompt again
    s.extend([], None)
    assert s.propose(5, 3).tokens.tolist() == [6, 7, 9] and p.misses == 0


def test_prompt_cache_hits_keep_the_scripted_acceptance(scripted, tmp_path):
    model, tok = load(str(tiny_mlx_lm_dir(tmp_path / "t", "qwen3")), "none", dtype=mx.float32)
    a, b = [1, 5, 9, 13, 40, 41], [1, 5, 9, 13, 70, 71, 72]  # a shared prefix (a chat template's)
    refs = scripted.plain_references(model.target, [a, b, a + [7, 8]], 24)
    oracle = scripted.OracleProposer({tuple(p): r for p, r in zip([a, b, a + [7, 8]], refs)}, tau=3,
                                     block_size=8, vocab=model.target.vocab_size)
    batch = SpeculativeBatch(model.target, schedule="full")

    def run(prompt, state=None):
        uid = batch.add(prompt, 24, proposer=oracle, block_size=8, state=state, keep_state=True)
        out, st = [], None
        while batch.active or batch.pending:
            for ev in batch.step():
                out += ev.tokens
                st = ev.stats
        return out, st, batch.take_state(uid)

    _, _, state = run(a)
    for prompt, ref in zip([b, a + [7, 8]], refs[1:]):
        out, st, _ = run(prompt, state.clone())
        assert st.cached_tokens > 0 and out == ref
        assert st.accept_hist[2] >= st.rounds - 1  # two drafts accepted a round (the last: cut by max_tokens)
    assert oracle.misses == 0


def test_a_make_model_error_is_one_line_and_exit_2(capsys):
    def make_model(args):
        raise ValueError("no such shape")

    assert cli.main(["--port", "0"], make_model=make_model) == 2
    assert capsys.readouterr().err.strip() == "error: no such shape"


@pytest.mark.parametrize("flags, env, want", [
    ([], None, "0"),  # the default: a drafter (auto), batches of up to 32 rows
    (["--drafter", "lookup"], None, "0"),
    (["--drafter", "none"], None, None),
    (["--block-size", "1"], None, None),
    (["--max-batch", "0"], None, None),
    (["--max-batch", "1"], None, None),
    (["--decode-concurrency", "1"], None, None),  # one request at a time, batched or not
    (["--drafter", "NONE"], None, "0"),  # (a path: the loader's keyword is "none" exactly)
    ([], "1", None),  # the user's own setting stays
    (["--cuda-graphs", "on"], "0", "1"),
    (["--cuda-graphs", "off", "--drafter", "none"], None, "0"),
])
def test_cuda_graphs_are_off_for_batched_drafting_unless_asked(flags, env, want, monkeypatch):
    """``--cuda-graphs auto`` turns MLX's CUDA graphs off for a server that batches drafting rows (session 52 on an
    H100: their changing shapes rebuilt graphs every round, 443 against 600 tok/s at 8 clients), before anything
    touches the GPU: ``main`` has set it when the model is made. A user's ``MLX_USE_CUDA_GRAPHS`` stays in auto."""
    monkeypatch.delenv(cli.CUDA_GRAPHS_VAR, raising=False)
    if env is not None:
        monkeypatch.setenv(cli.CUDA_GRAPHS_VAR, env)
    args = cli.setup_arg_parser().parse_args(flags)
    assert cli.cuda_graphs_setting(args) == want
    seen = []

    def make_model(args):
        seen.append(os.environ.get(cli.CUDA_GRAPHS_VAR))
        raise ValueError("stop here")

    assert cli.main(["--port", "0", *flags], make_model=make_model) == 2
    assert seen == [want if want is not None else env]


def test_the_start_up_line_reads_the_variable_as_mlx_does():
    """MLX reads ``MLX_USE_CUDA_GRAPHS`` with C's ``atoi``: ``true`` is 0, graphs off (a review's find: the start-up
    line said "on" for ``true``, ``false`` and ``""``)."""
    for value, on in ((None, True), ("1", True), (" 2x", True), ("0", False), ("false", False), ("true", False),
                      ("", False), ("-1", True)):
        assert cli.cuda_graphs_on({} if value is None else {cli.CUDA_GRAPHS_VAR: value}) is on, value


def test_make_writes_a_directory_both_loaders_read(scripted, tmp_path):
    src = tiny_mlx_lm_dir(tmp_path / "src", "qwen3")
    assert scripted.main(["make", str(tmp_path / "m"), "--tokenizer", str(src), "--shape", "tiny"]) == 0
    model, tok = load(str(tmp_path / "m"), "none")
    assert model.config["num_hidden_layers"] == 6 and model.target.vocab_size == len(tok._tokenizer)
    import mlx_lm

    mlx_lm.load(str(tmp_path / "m"))  # mlx_lm.server's loader


def test_make_refuses_a_tokenizer_that_is_not_a_model_directory(scripted, tmp_path):
    with pytest.raises(SystemExit, match="not an MLX model directory"):
        scripted.main(["make", str(tmp_path / "m"), "--tokenizer", str(tmp_path)])
    assert not (tmp_path / "m").exists()


def test_bench_server_knows_scripted_servers(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_server

    monkeypatch.setattr(sys, "argv", ["bench_server.py", "--server", "scripted:0"])
    with pytest.raises(SystemExit):
        bench_server.main()
    assert "scripted:TAU" in capsys.readouterr().err


def _launch_command(monkeypatch, server: str, **over) -> list[str]:
    """The command ``bench_server.start_server(server, args)`` would launch (nothing is started)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_server

    class Launched(Exception):
        pass

    def popen(cmd, **kw):
        raise Launched(cmd)

    monkeypatch.setattr(bench_server.subprocess, "Popen", popen)
    args = argparse.Namespace(**{**dict(levels=[1, 4], handoffs=None, max_batch=None, model=None, dequantize=False,
                                        block_size=None, server_arg=[], dtype="float32", start_timeout=1, pool=40,
                                        max_tokens=300), **over})
    with pytest.raises(Launched) as e:
        bench_server.start_server(server, args)
    return e.value.args[0]


def test_bench_server_precomputes_its_own_pool_and_length(monkeypatch):
    cmd = _launch_command(monkeypatch, "scripted:3")
    # every prompt of the pool (40, not serve's default 24) precomputed, each for the whole answer (300 > 256)
    assert cmd[cmd.index("--pool") + 1] == "40" and int(cmd[cmd.index("--horizon") + 1]) >= 300


def test_bench_server_gives_a_server_its_own_arguments(monkeypatch, capsys):
    """``ours:DRAFTER@--flag=value``: two of our servers that differ in a flag (``--cuda-graphs``) in one run, each
    started with its own arguments after the shared ones; a malformed one is refused before any server starts."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_server

    for server, drafter, own in (("ours:lookup@--cuda-graphs=on@--max-batch=8", "lookup",
                                  ["--cuda-graphs=on", "--max-batch=8"]), ("ours:none", "none", []),
                                 ("scripted:3@--cuda-graphs=off", "none", ["--cuda-graphs=off"])):
        cmd = _launch_command(monkeypatch, server, server_arg=["--log-level", "INFO"], pool=4, max_tokens=8)
        assert cmd[cmd.index("--drafter") + 1] == drafter, server
        assert cmd[-len(own) - 2:] == ["--log-level", "INFO"] + own, server
    monkeypatch.setattr(bench_server, "start_server", lambda *a: pytest.fail("a server was started"))
    for bad in ("ours:lookup@cuda-graphs=on", "ours:@--x", "scripted:3@", "ours:lookup@--max-batch 8"):
        with pytest.raises(SystemExit):
            bench_server.main(["--server", bad])
        assert "@--flag=value" in capsys.readouterr().err, bad


def test_the_references_are_keyed_by_the_prompts_the_server_tokenizes(scripted, tmp_path):
    model, tok = load(str(tiny_mlx_lm_dir(tmp_path / "t", "qwen3")), "none", dtype=mx.float32)
    template = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}|{{ mood }}]{% endfor %}"
    args = scripted.serve_parser().parse_args(["--tau", "3", "--pool", "3", "--chat-template", template,
                                               "--chat-template-args", '{"mood": "calm"}', "--port", "0"])
    ids = scripted.pool_ids(tok, args)
    _, engine = cli.build_app(args, model, tok)
    from bench_server import prompts
    from mlx_dflash2.server.engine import Job

    assert ids == [engine._tokenize(Job(kind="chat", max_tokens=1, messages=[{"role": "user", "content": p}]))
                   for p in prompts(3)]
    assert "calm" in tok.decode(ids[0])


def test_make_refuses_bad_arguments_cleanly_and_writes_nothing(scripted, tmp_path, capsys):
    src = tiny_mlx_lm_dir(tmp_path / "src", "qwen3")
    before = {f.name: f.read_bytes() for f in src.iterdir()}
    with pytest.raises(SystemExit) as e:  # an unknown shape: argparse's usage error, not a KeyError
        scripted.main(["make", str(tmp_path / "m"), "--tokenizer", str(src), "--shape", "nope"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not an empty directory"):  # its own tokenizer's directory
        scripted.main(["make", str(src), "--tokenizer", str(src), "--shape", "tiny"])
    assert {f.name: f.read_bytes() for f in src.iterdir()} == before
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="no vocab_size"):
        scripted.main(["make", str(tmp_path / "m"), "--tokenizer", str(bad), "--shape", "tiny"])
    (bad / "config.json").write_text('{"vocab_size": 64}')  # no tokenizer files
    with pytest.raises(SystemExit, match="has no tokenizer"):
        scripted.main(["make", str(tmp_path / "m"), "--tokenizer", str(bad), "--shape", "tiny"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "src"]


def test_a_failed_make_leaves_no_directory(scripted, tmp_path, monkeypatch):
    src = tiny_mlx_lm_dir(tmp_path / "src", "qwen3")

    def copy(a, b):
        raise OSError("disk full")

    monkeypatch.setattr(scripted.shutil, "copy", copy)
    with pytest.raises(OSError, match="disk full"):
        scripted.main(["make", str(tmp_path / "m"), "--tokenizer", str(src), "--shape", "tiny"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # (a rerun of server.sh would serve a partial one)


def test_a_tau_past_the_block_is_refused_before_the_load(scripted, tmp_path, capsys):
    with pytest.raises(ValueError, match="block size"):  # a round emits B tokens at most: the runs would say 16
        scripted.OracleProposer({}, tau=17, block_size=16, vocab=100)
    assert scripted.main(["serve", "--tau", "9", "--block-size", "8", "--port", "0",
                          "--model", str(tmp_path / "absent")]) == 2
    assert "--tau" in capsys.readouterr().err


def test_bench_server_refuses_a_tau_past_the_block_before_any_server(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_server

    monkeypatch.setattr(bench_server, "start_server", lambda *a: pytest.fail("a server was started"))
    with pytest.raises(SystemExit):
        bench_server.main(["--server", "scripted:5", "--block-size", "4"])
    assert "scripted:5" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--horizon", "-1"], ["--horizon", "0"], ["--tau", "0"], ["--pool", "-2"]])
def test_serve_refuses_bad_script_flags(scripted, flag):
    with pytest.raises(SystemExit) as e:  # (--horizon -1: continuations to the context's end, 40960 tokens a prompt)
        scripted.serve_parser().parse_args(["--tau", "3", "--port", "0"] + flag)
    assert e.value.code == 2


def test_a_prompt_outside_the_pool_is_drafted_wrong_and_computes_nothing(scripted, tmp_path):
    # the server's warm-up rows (32 scratch prompts on a GPU) used to compute a continuation each on the worker,
    # seconds apiece at the 8B shape; they still draft (the warm-up meets the drafting widths' shapes)
    d = tiny_mlx_lm_dir(tmp_path / "t", "qwen3")
    args = scripted.serve_parser().parse_args(["--tau", "3", "--pool", "2", "--horizon", "8", "--model", str(d),
                                               "--dtype", "float32", "--port", "0"])
    model, tok = scripted.scripted_model(args)
    oracle = model.proposer
    known = len(oracle.references)
    s = oracle.start([7, 7, 7])
    s.extend([7, 7, 7], None)
    prop = s.propose(7, 5)
    assert prop.n == 5 and oracle.misses == 1 and len(oracle.references) == known + 1
    assert oracle.references[(7, 7, 7)] == []


def test_bench_server_divergence_margin_finds_the_departing_token():
    """The solo margin at the departure: by characters, the solo token covering the first differing one; with the
    other run's tokens, the first differing token, also where the same text was split otherwise ("\\n\\n" vs
    "\\n" + "\\n": by characters the departure would land on the next solo token, "2", with its large margin)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_server import divergence_margin

    toks = [("fab", 2.0), ("ation", 0.375), ('."', 0.25), ("\n\n", 0.625), ("2", 6.375), (".", 9.6)]
    solo = "".join(t for t, _ in toks)
    assert divergence_margin(solo, solo, toks) is None
    assert divergence_margin(solo, 'fabation" that', toks) == 0.25  # departs inside '."'
    assert divergence_margin(solo, 'fabation." This', toks) == 0.625  # departs inside "\n\n"
    resplit = 'fabation."\n\nThis process'  # "\n" + "\n" + "This": the text departs at "2" ...
    assert divergence_margin(solo, resplit, toks) == 6.375  # ... which is all the text alone can tell
    # ... while the tokens show the departure at "\n\n" (solo's near-tie there, 0.625)
    assert divergence_margin(solo, resplit, toks, ["fab", "ation", '."', "\n", "\n", "This", " process"]) == 0.625
    assert divergence_margin(solo, solo, toks, [t for t, _ in toks]) is None
    assert divergence_margin(solo, "fabation", toks, ["fab", "ation"]) == 0.25  # the other run stopped there
    assert divergence_margin(solo, solo[:-1] + "!", toks, [t for t, _ in toks[:-1]] + ["!"]) == 9.6
    # tokens that do not spell the reference (another solo answer): no margin rather than a misplaced one
    other_answer = [("fab", 2.0), ("ric", 0.1), ("ation", 0.375)]
    assert divergence_margin(solo, 'fabation" that', other_answer) is None
    assert divergence_margin(solo, 'fabation" that', other_answer, ["fab", "ation", '"']) is None
    # a character split over byte-level tokens: spelled by the tokens' bytes (their strings read U+FFFD)
    emoji = [(b"h", 1.0), ("\U0001F600".encode()[:2], 2.0), ("\U0001F600".encode()[2:], 3.0), (b"x", 4.0)]
    assert divergence_margin("h\U0001F600x", "h\U0001F600y", emoji) == 4.0
    assert divergence_margin("h\U0001F600x", "h\U0001F600y", emoji, [t for t, _ in emoji[:3]] + [b"y"]) == 4.0


def test_bench_server_keeps_token_strings_only_where_they_spell_the_text(monkeypatch):
    """``one_request(..., token_strings=True)`` asks for logprobs and keeps the streamed tokens' strings; a server
    that sends none (or tokens that do not spell its text) gives ``None``, never an empty list that
    :func:`divergence_margin` would read as a departure at the first token."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import json

    import bench_server

    def chunk(text, toks=None):
        c = {"delta": {"content": text}}
        if toks is not None:
            c["logprobs"] = {"content": [{"token": t, "logprob": -0.1} for t in toks]}
        return "data: " + json.dumps({"choices": [c]})

    usage = "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 3}})
    bodies = {
        "spelled": [chunk("Hi", ["H", "i"]), chunk(" there", [" there"]), usage, "data: [DONE]"],
        "none": [chunk("Hi"), chunk(" there"), usage, "data: [DONE]"],
        "partial": [chunk("Hi", ["H", "i"]), chunk(" there"), usage, "data: [DONE]"],
        "split": ["data: " + json.dumps({"choices": [{"delta": {"content": "\U0001F600"}, "logprobs": {"content": [
            {"token": "\ufffd", "logprob": -0.1, "bytes": list("\U0001F600".encode()[:2])},
            {"token": "\ufffd", "logprob": -0.1, "bytes": list("\U0001F600".encode()[2:])}]}}]}), usage],
    }
    sent = []

    class Response:
        status_code = 200

        def __init__(self, lines):
            self.lines = lines

        def iter_lines(self):
            return iter(self.lines)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def stream(method, url, json=None, timeout=None):
        sent.append(json)
        return Response(bodies[json["messages"][0]["content"]])

    monkeypatch.setattr(bench_server.httpx, "stream", stream)
    out = bench_server.one_request("http://x", "spelled", 8, token_strings=True)
    assert sent[-1]["logprobs"] is True
    assert out["text"] == "Hi there" and out["token_strings"] == ["H", "i", " there"] and out["tokens"] == 3
    assert bench_server.one_request("http://x", "none", 8, token_strings=True)["token_strings"] is None
    assert bench_server.one_request("http://x", "partial", 8, token_strings=True)["token_strings"] is None
    split = bench_server.one_request("http://x", "split", 8, token_strings=True)
    assert split["token_bytes"] == ["\U0001F600".encode()[:2], "\U0001F600".encode()[2:]]
    plain = bench_server.one_request("http://x", "spelled", 8)
    assert "logprobs" not in sent[-1] and "token_strings" not in plain


def test_round_graphs_reads_a_lazy_graph_and_restores_async_eval():
    """``benchmarks/round_graphs.py``'s pieces: a lazy graph's primitive sequence (equal for equal graphs at other
    shapes, different where an op is added), where two sequences first differ, and its ``mx.async_eval`` recorder
    put back on exit."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import mlx.core as mx
    import round_graphs

    def graph(n, pad):
        x = mx.ones((n, 4)) * 2.0
        if pad:
            x = mx.pad(x, [(0, 1), (0, 0)])
        return mx.exp(x).sum()

    a, b, c = (round_graphs.op_sequence([graph(n, p)]) for n, p in ((3, False), (5, False), (3, True)))
    assert a and a == b and a != c
    d = round_graphs.first_differences(a, c)
    assert d["first"] is not None and any("Pad" in x["after"] for x in d["diffs"])
    assert round_graphs.op_sequence([mx.eval(y) or y for y in [graph(2, False)]]) == []
    orig, orig_eval, sink = mx.async_eval, mx.eval, []
    with round_graphs.recording_async_eval(sink):
        mx.eval(graph(3, False))  # before the queued forward: recorded
        graph(3, True).item()  # a read before it: recorded
        y = graph(2, True)
        mx.async_eval(y)
        mx.eval(y, graph(4, False))  # after it: not recorded
        graph(2, False).tolist()
    assert mx.async_eval is orig and mx.eval is orig_eval and mx.array.item(graph(1, False)) > 0
    assert len(sink) == 3 and sink[0] == a and sink[1] == c and "Pad" in sink[2]
