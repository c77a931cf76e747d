"""Shared fixtures: the real embedded model (quantized and float32), loaded once; a tiny padded-vocabulary target."""

from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# the adaptive schedule's calibration cache (mlx_dflash2.calibrate): one per test session, never the user's
# (CLI subprocesses inherit it, so a session measures each target/drafter/machine once)
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

_calibration_dir = tempfile.mkdtemp(prefix="mlx_dflash2-tests-")
atexit.register(shutil.rmtree, _calibration_dir, ignore_errors=True)
os.environ["MLX_DFLASH2_CALIBRATION_CACHE"] = os.path.join(_calibration_dir, "calibration.json")
# and the CUDA kernel sources the NVRTC compile checks write (mlx_dflash2.kernels.registry.cuda_header)
os.environ["MLX_DFLASH2_CUDA_SRC_DIR"] = os.path.join(_calibration_dir, "cuda-src")

import mlx_dflash2  # noqa: F401,E402  (before MLX: loads the optimized OpenBLAS, mlx_dflash2/_blas.py)
import mlx.core as mx
import pytest

from mlx_dflash2.loading import load_target

CHAT = "What is the capital of France? Describe the city in a few sentences."
CODE = "Write a Python function that checks whether a number is prime, with a docstring."
MATH = "A train travels 60 km in 45 minutes. What is its average speed in km/h? Explain step by step."
STORY = "Write a long story about a robot who learns to paint."
PROMPTS = {"chat": CHAT, "code": CODE, "math": MATH}


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


@pytest.fixture(autouse=True)
def _keep_mlx_cuda_graphs_variable():
    """The server's ``main`` writes ``MLX_USE_CUDA_GRAPHS`` (``--cuda-graphs``) for its process: a test calling it
    in process gets the variable back as it was (on a GPU, MLX reads it at its first GPU work)."""
    before = os.environ.get("MLX_USE_CUDA_GRAPHS")
    yield
    if before is None:
        os.environ.pop("MLX_USE_CUDA_GRAPHS", None)
    else:
        os.environ["MLX_USE_CUDA_GRAPHS"] = before


@pytest.fixture(scope="session")
def smol_q():
    """The embedded SmolLM2-135M-Instruct, natively quantized (Q4_1/Q8_0), float32 scales."""
    target, tokenizer, _ = load_target(None, dtype=mx.float32)
    _memo_targets.append(target)
    return target, tokenizer


@pytest.fixture(scope="session")
def smol_f32():
    """The same weights dequantized to a dense float32 target (exact losslessness tests)."""
    target, tokenizer, _ = load_target(None, dtype=mx.float32, dequantize=True)
    _memo_targets.append(target)
    return target, tokenizer


@pytest.fixture
def quick_calibration(tmp_path, monkeypatch):
    """A test's own calibration cache and a short measurement (contexts of 8 and 16 tokens, one pass), for
    tests of what uses a calibration of the real model rather than of the measurement (which
    tests/test_calibrate.py tests). Returns the list of the widths of each measurement made."""
    from mlx_dflash2 import calibrate as C

    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "calibration.json"))
    real, calls = C.measure_verify_costs, []

    def quick(target, widths, **kw):
        calls.append(list(widths))
        return real(target, widths, **{**kw, "context": 8, "long_context": 16, "repeats": 1, "max_repeats": 1})

    monkeypatch.setattr(C, "measure_verify_costs", quick)
    return calls


@pytest.fixture
def shared_embedded_load(monkeypatch, request):
    """``load_target`` of the embedded model (``None`` or its name) in float32, dense (what ``load()`` does by
    default on the CPU) or packed (``dequantize=False``), answered with the session's ``smol_f32`` / ``smol_q``
    (the identical loads, never mutated), for tests of what ``load()``, the CLI and the drafter converter's
    ``--target`` build around the target rather than of loading it (test_cli_api.py::test_load_default, the CLI's
    subprocess tests and test_convert_drafter.py::test_drafter_mask_is_eos_refused_with_target load it). Any other
    request loads for real."""
    from mlx_dflash2 import assets, loading

    real = loading.load_target

    def load_target(path_or_hf_repo=None, *, dtype="auto", dequantize=False, kernels=None):
        want = loading._default_dtype() if dtype == "auto" else getattr(mx, dtype) if isinstance(dtype, str) else dtype
        dense = dequantize is True or (dequantize is None and mx.default_device() == mx.cpu)
        embedded = path_or_hf_repo is None or (isinstance(path_or_hf_repo, str)
                                               and assets.is_embedded_name(path_or_hf_repo))
        if embedded and want == mx.float32:
            target, tok = request.getfixturevalue("smol_f32" if dense else "smol_q")
            if kernels in (None, "auto", target.kernels):
                return target, tok, assets.DEFAULT_MODEL
        return real(path_or_hf_repo, dtype=dtype, dequantize=dequantize, kernels=kernels)

    monkeypatch.setattr(loading, "load_target", load_target)


PADDED_ROWS = 49152 + 256  # embedding / LM-head rows of the padded target: 256 past the SmolLM2 tokenizer


@pytest.fixture(scope="session")
def padded_dir(tmp_path_factory, smol_f32):
    """A tiny random Qwen2-class mlx-lm directory (2 layers, untied head) with the SmolLM2 tokenizer and an
    embedding / LM head padded to :data:`PADDED_ROWS` rows, past ``len(tokenizer)``, as every Qwen checkpoint
    is. Its padding rows are large, so an unmasked head picks them (greedy: every token)."""
    from tiny_models import tiny_mlx_lm_dir

    root = tmp_path_factory.mktemp("padded")
    return tiny_mlx_lm_dir(root / "qwen2-padded", "qwen2", smol_f32[1], num_layers=2, vocab_rows=PADDED_ROWS)


REF_TOKENS = 64  # length of the session's references of the standard prompts (CHAT, CODE, MATH, STORY)
LONG_REF = 140  # the code prompt's: test_lossless's long asks of it (the adaptive-schedule test, scripted B = 16)

# The session targets (smol_q, smol_f32: never mutated, alive for the whole session) and their greedy references,
# {(id(target), prompt ids): (tokens, logprobs)}: the longest run made so far per prompt.
_memo_targets: list = []
_reference_memo: dict = {}


def plain_reference(target, prompt_ids: list[int], n: int, at_least: int = 0) -> tuple[list[int], list[mx.array]]:
    """mlx-lm's own greedy generation on the same weights: the independent reference (its first ``n`` tokens).

    Greedy decoding is prefix-stable (the first ``n`` tokens of a longer run are those of a run of ``n``), so
    for the session targets the longest run made so far for a prompt is kept and its prefix returned (as new
    lists; the logprob arrays are immutable): tests in different modules that decode the same prompt share one
    run. A run that has to be made is made ``at_least`` tokens long (e.g. :data:`REF_TOKENS` for the standard
    prompts, so that later, longer asks reuse it)."""
    from mlx_lm.generate import generate_step

    shared = any(target is t for t in _memo_targets)
    key = (id(target), tuple(int(i) for i in prompt_ids))
    have = _reference_memo.get(key) if shared else None
    if have is None or len(have[0]) < n:
        toks, lps = [], []
        for t, lp in generate_step(mx.array(prompt_ids), target.model, max_tokens=max(n, at_least)):
            toks.append(int(t))
            lps.append(lp)
        have = (toks, lps)
        if shared:
            _reference_memo[key] = have
    return list(have[0][:n]), list(have[1][:n])
