"""Run a kernel body shared by Metal and CUDA on the CPU, one ``std::thread`` per GPU thread.

``metal/dialect.h`` has a third dialect, ``DF_CPU_EMU``: barriers are ``std::barrier``s and SIMD
shuffles go through a per-warp exchange buffer, so a shared body (``verify_attention.h``, ...) runs
unchanged, with its real work split, indexing, masking and reduction order. Tests use it to check
the logic of the kernels' shared bodies (against the MLX reference, and bit-for-bit row-count
invariance) on machines without a GPU; the GPU's own gate then checks the compiled kernel.

Needs a C++20 compiler (``$CXX``, default ``g++``); float32 only (the dialect's conversions).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from .registry import source_text

__all__ = ["available", "attention", "qk_norm_rope", "dynamic_conv", "selector_walk", "greedy_accept",
           "gated_delta_steps"]

# the launchers' common part: the body's sources, one block of threads, file I/O
_PRELUDE = r"""
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>
#define DF_CPU_EMU 1
@SOURCE@
template <typename F>
void run_block(int nthreads, F f) {
  std::barrier<> block_bar(nthreads);
  int nw = nthreads / 32;
  std::vector<std::barrier<>*> wb;
  std::vector<std::vector<float>> xch(nw, std::vector<float>(32));
  for (int w = 0; w < nw; ++w) wb.push_back(new std::barrier<>(32));
  std::vector<std::thread> ts;
  for (int t = 0; t < nthreads; ++t)
    ts.emplace_back([&, t] {
      df_ctx c{t % 32, xch[t / 32].data(), wb[t / 32], &block_bar};
      df_tls = &c;
      f(t / 32, t % 32);
    });
  for (auto& th : ts) th.join();
  for (auto* b : wb) delete b;
}
template <typename V = float>
static std::vector<V> readf(const char* p, size_t n) {
  std::vector<V> v(n); FILE* f = fopen(p, "rb"); fread(v.data(), 4, n, f); fclose(f); return v;
}
template <typename V>
static void writef(const std::string& p, const std::vector<V>& v) {
  FILE* f = fopen(p.c_str(), "wb"); fwrite(v.data(), 4, v.size(), f); fclose(f);
}
"""

_ATTENTION = r"""
int main(int argc, char** argv) {
  // argv: dir H Hk Lq L S D
  std::string dir = argv[1];
  int H = atoi(argv[2]), Hk = atoi(argv[3]), Lq = atoi(argv[4]), L = atoi(argv[5]), S = atoi(argv[6]);
  constexpr int D = EMU_D, TILES = EMU_TILES, ROWS = EMU_ROWS, WARPS = EMU_WARPS, KD = EMU_KD, SCR = EMU_SCR;
  constexpr int VB = EMU_VB, PF = EMU_PF;
  constexpr int TILE = 32;
  auto q = readf((dir + "/q").c_str(), (size_t)H * Lq * D);
  auto k = readf((dir + "/k").c_str(), (size_t)Hk * S * D);
  auto v = readf((dir + "/v").c_str(), (size_t)Hk * S * D);
  float scale = readf((dir + "/scale").c_str(), 1)[0];
  int G = H / Hk, R = G * Lq, n_chunks = (L + TILE * TILES - 1) / (TILE * TILES), n_rg = (R + ROWS - 1) / ROWS;
  int params[8] = {H, Hk, Lq, n_rg, 0, 0, 0, 0};
  std::vector<float> po((size_t)Hk * R * n_chunks * D), pml((size_t)Hk * R * n_chunks * 2), out((size_t)H * Lq * D);
  for (int hk = 0; hk < Hk; ++hk)
    for (int bx = 0; bx < n_chunks * n_rg; ++bx) {
      std::vector<float> tq(ROWS * D), scr(SCR);
      run_block(WARPS * 32, [&](int warp, int lane) {
        dflash_attn::attn_partial<float, D, TILES, ROWS, WARPS, KD, SCR, VB, PF>(q.data(), k.data(), v.data(), params, &scale,
            po.data(), pml.data(), tq.data(), scr.data(), bx / n_rg, hk, bx % n_rg, warp, lane, L,
            (long)S * D, (long)S * D);
      });
    }
  int rows = Hk * R;
  for (int r0 = 0; r0 < rows; r0 += 4)
    run_block(128, [&](int warp, int lane) {
      dflash_attn::attn_combine<float, D>(po.data(), pml.data(), params, out.data(), r0 + warp, lane, n_chunks);
    });
  writef(dir + "/out", out);
  return 0;
}
"""


_DYNAMIC_CONV = r"""
int main(int argc, char** argv) {
  // argv: dir N B D K G group_size side
  std::string dir = argv[1];
  int p[7];
  for (int i = 0; i < 7; ++i) p[i] = atoi(argv[2 + i]);
  const int N = p[0], B = p[1], D = p[2], K = p[3], G = p[4], total = N * B * D;
  auto x = readf((dir + "/x").c_str(), (size_t)total);
  auto delta = readf((dir + "/delta").c_str(), (size_t)N * B * 2 * K * G);
  auto base = readf((dir + "/base").c_str(), (size_t)2 * K * D);
  std::vector<float> out((size_t)total);
  for (int b0 = 0; b0 < total; b0 += EMU_THREADS)
    run_block(EMU_THREADS, [&](int warp, int lane) {
      dflash_dconv::dynamic_conv<float, float, float, float>(x.data(), delta.data(), base.data(), p, out.data(),
                                                             b0 + warp * 32 + lane);
    });
  writef(dir + "/out", out);
  return 0;
}
"""


_SELECTOR_WALK = r"""
int main(int argc, char** argv) {
  // argv: dir M T K V
  std::string dir = argv[1];
  int p[3] = {atoi(argv[2]), atoi(argv[3]), atoi(argv[4])};
  const int M = p[0], T = p[1], K = p[2], V = atoi(argv[5]);
  constexpr int R = EMU_R, P = EMU_P;
  auto cand = readf<int>((dir + "/cand").c_str(), (size_t)M * T * K);
  auto unary = readf((dir + "/unary").c_str(), (size_t)M * T * K);
  auto hproj = readf((dir + "/hproj").c_str(), (size_t)M * T * R);
  auto pred = readf((dir + "/pred").c_str(), (size_t)V * R);
  auto succ = readf((dir + "/succ").c_str(), (size_t)V * R);
  auto anchor = readf<int>((dir + "/anchor").c_str(), (size_t)M);
  std::vector<int> tokens((size_t)M * T, -1);
  for (int m = 0; m < M; ++m) {
    std::vector<float> sc(32);
    std::vector<int> prev(1);
    run_block(K * 32, [&](int warp, int lane) {
      dflash_sel::selector_walk<float, R, P>(cand.data(), unary.data(), hproj.data(), pred.data(), succ.data(),
                                             anchor.data(), p, tokens.data(), sc.data(), prev.data(), m, warp, lane);
    });
  }
  writef(dir + "/tokens", tokens);
  return 0;
}
"""


_GREEDY_ACCEPT = r"""
int main(int argc, char** argv) {
  // argv: dir rows V
  std::string dir = argv[1];
  const int rows = atoi(argv[2]), V = atoi(argv[3]), n = rows - 1;
  constexpr int TPB = EMU_TPB;
  int p[2] = {V, n};
  auto logits = readf((dir + "/logits").c_str(), (size_t)rows * V);
  auto draft = n ? readf<int>((dir + "/draft").c_str(), (size_t)n) : std::vector<int>(1, 0);
  std::vector<int> tokens(rows, -2), num(1, -2);
  for (int row = 0; row < rows; ++row) {
    std::vector<float> wv(32);
    std::vector<int> wi(32);
    run_block(TPB, [&](int warp, int lane) {
      dflash_acc::row_argmax<float, TPB>(logits.data(), p, tokens.data(), wv.data(), wi.data(), row, warp, lane);
    });
  }
  run_block(32, [&](int warp, int lane) { dflash_acc::accept(tokens.data(), draft.data(), p, num.data(), lane); });
  writef(dir + "/tokens", tokens);
  writef(dir + "/num", num);
  return 0;
}
"""


_QK_NORM_ROPE = r"""
int main(int argc, char** argv) {
  // argv: dir H Hk L has_norm
  std::string dir = argv[1];
  const int H = atoi(argv[2]), Hk = atoi(argv[3]), L = atoi(argv[4]), has_norm = atoi(argv[5]);
  constexpr int D = EMU_D;
  const int NH = H + 2 * Hk;
  int params[8] = {H, Hk, L, has_norm, 0, 0, 0, 0};
  auto y = readf((dir + "/y").c_str(), (size_t)L * NH * D);
  auto qw = readf((dir + "/qw").c_str(), (size_t)D);
  auto kw = readf((dir + "/kw").c_str(), (size_t)D);
  auto pos = readf<int>((dir + "/pos").c_str(), (size_t)L);
  auto fp = readf((dir + "/fparams").c_str(), 2);
  std::vector<float> qo((size_t)H * L * D, -7.0f), ko((size_t)Hk * L * D, -7.0f), vo((size_t)Hk * L * D, -7.0f);
  const int warps = L * NH;
  for (int w0 = 0; w0 < warps; w0 += 4)
    run_block(128, [&](int warp, int lane) {
      dflash_qkr::qk_norm_rope<float, D>(y.data(), qw.data(), kw.data(), pos.data(), params, fp.data(), qo.data(),
                                         ko.data(), vo.data(), w0 + warp, lane);
    });
  writef(dir + "/qo", qo);
  writef(dir + "/ko", ko);
  writef(dir + "/vo", vo);
  return 0;
}
"""


_GATED_DELTA_STEPS = r"""
int main(int argc, char** argv) {
  // argv: dir B S Hk Hv Dv
  std::string dir = argv[1];
  int p[8] = {0};
  for (int i = 0; i < 5; ++i) p[i] = atoi(argv[2 + i]);
  const int B = p[0], S = p[1], Hk = p[2], Hv = p[3], Dv = p[4];
  constexpr int DK = EMU_DK, TGY = EMU_TGY;
  auto q = readf((dir + "/q").c_str(), (size_t)B * S * Hk * DK);
  auto k = readf((dir + "/k").c_str(), (size_t)B * S * Hk * DK);
  auto v = readf((dir + "/v").c_str(), (size_t)B * S * Hv * Dv);
  auto g = readf((dir + "/g").c_str(), (size_t)B * S * Hv);
  auto beta = readf((dir + "/beta").c_str(), (size_t)B * S * Hv);
  auto state = readf((dir + "/state").c_str(), (size_t)B * Hv * Dv * DK);
  std::vector<float> y((size_t)B * S * Hv * Dv, NAN), states((size_t)B * (EMU_ALL ? S : 1) * Hv * Dv * DK, NAN);
  const int rows = (Dv + TGY - 1) / TGY * TGY;  // the grid's y extent, padded to whole threadgroups
  for (int n = 0; n < B * Hv; ++n)              // grid z
    for (int y0 = 0; y0 < rows; y0 += TGY)      // one threadgroup (32, TGY, 1)
      run_block(32 * TGY, [&](int warp, int lane) {
        dflash_gdn::gated_delta_steps<float, DK, EMU_ALL>(q.data(), k.data(), v.data(), g.data(), beta.data(), state.data(), p,
                                                 y.data(), states.data(), n, y0 + warp, lane);
      });
  writef(dir + "/y", y);
  writef(dir + "/states", states);
  return 0;
}
"""


def _cxx() -> str:
    return os.environ.get("CXX", "g++")


def available() -> bool:
    """Whether a C++20 compiler with ``<barrier>`` is here."""
    try:
        r = subprocess.run([_cxx(), "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input="#include <barrier>\n",
                           capture_output=True, text=True, timeout=60)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_built: dict[str, Path] = {}


def _binary(names: list[str], main: str, defines: dict) -> Path:
    text = _PRELUDE.replace("@SOURCE@", "".join(source_text(n) for n in names)) + main
    key = hashlib.sha256((text + repr(sorted(defines.items()))).encode()).hexdigest()[:16]
    if key in _built:
        return _built[key]
    out = Path(tempfile.gettempdir()) / f"dflash_emu_{key}"
    if not out.exists():
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "emu.cpp"
            src.write_text(text)
            cmd = [_cxx(), "-std=c++20", "-O1", "-pthread", "-w", str(src), "-o", str(out)]
            cmd += [f"-D{k}={v}" for k, v in defines.items()]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"emulator build failed:\n{r.stderr[:4000]}")
    _built[key] = out
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, length: int, scale: float,
              backend: str = "cuda", vb: int | None = None, pf: int | None = None) -> np.ndarray:
    """``verify_attention.h`` emulated with ``backend``'s launch geometry for these rows (row groups, key
    sub-tiles; ``vb``, ``pf``: :func:`~.attention.geometry`'s load batching in place of its defaults):
    ``q [H, Lq, D]``, ``k, v [Hk, S, D]`` float32 -> ``[H, Lq, D]``."""
    from .attention import geometry

    H, Lq, D = q.shape
    Hk, S, _ = k.shape
    tiles, rows, warps, kd, scr, vb, pf = geometry(backend, D, (H // Hk) * Lq, vb=vb, pf=pf)
    exe = _binary(["dialect.h", "verify_attention.h"], _ATTENTION,
                  dict(EMU_D=D, EMU_TILES=tiles, EMU_ROWS=rows, EMU_WARPS=warps, EMU_KD=kd, EMU_SCR=scr,
                       EMU_VB=vb, EMU_PF=pf))
    with tempfile.TemporaryDirectory() as d:
        for name, arr in (("q", q), ("k", k), ("v", v), ("scale", np.array([scale]))):
            np.ascontiguousarray(arr, dtype=np.float32).tofile(os.path.join(d, name))
        subprocess.run([str(exe), d, str(H), str(Hk), str(Lq), str(length), str(S)], check=True, timeout=600)
        return np.fromfile(os.path.join(d, "out"), dtype=np.float32).reshape(H, Lq, D)


def _run(exe: Path, inputs: dict, args: list, outputs: dict) -> dict:
    """Write ``inputs`` (name -> array; float32 or int32) to a scratch folder, run ``exe`` on it with
    ``args`` and read ``outputs`` (name -> (dtype, shape)) back."""
    with tempfile.TemporaryDirectory() as d:
        for name, arr in inputs.items():
            arr = np.asarray(arr)
            dtype = np.int32 if arr.dtype.kind in "iu" else np.float32
            np.ascontiguousarray(arr, dtype=dtype).tofile(os.path.join(d, name))
        subprocess.run([str(exe), d, *[str(a) for a in args]], check=True, timeout=600)
        return {name: np.fromfile(os.path.join(d, name), dtype=dt).reshape(shape)
                for name, (dt, shape) in outputs.items()}


def dynamic_conv(x: np.ndarray, base: np.ndarray, delta: np.ndarray, side: int, group_size: int) -> np.ndarray:
    """``dynamic_conv.h`` emulated in float32: ``x [N, B, D]``, ``base [2, K, D]``, ``delta [N, B, 2, K, G]``
    -> ``[N, B, D]``."""
    from .dynamic_conv import THREADS

    N, B, D = x.shape
    K, G = base.shape[1], delta.shape[-1]
    exe = _binary(["dialect.h", "dynamic_conv.h"], _DYNAMIC_CONV, dict(EMU_THREADS=THREADS))
    return _run(exe, dict(x=x, delta=delta, base=base), [N, B, D, K, G, group_size, side],
                dict(out=(np.float32, (N, B, D))))["out"]


def selector_walk(cand: np.ndarray, u: np.ndarray, H: np.ndarray, pred: np.ndarray, succ: np.ndarray,
                  anchor: np.ndarray) -> np.ndarray:
    """``selector_walk.h`` emulated: ``cand`` int ``[M, T, K]``, ``u`` ``[M, T, K]``, ``H`` ``[M, T, R]``,
    codebooks ``[V, R]`` (float32), ``anchor`` int ``[M]`` -> int32 tokens ``[M, T]``."""
    from .selector_walk import _pow2

    M, T, K = cand.shape
    V, R = pred.shape
    exe = _binary(["dialect.h", "selector_walk.h"], _SELECTOR_WALK, dict(EMU_R=R, EMU_P=_pow2(R)))
    return _run(exe, dict(cand=cand, unary=u, hproj=H, pred=pred, succ=succ, anchor=anchor), [M, T, K, V],
                dict(tokens=(np.int32, (M, T))))["tokens"]


def greedy_accept(logits: np.ndarray, draft: np.ndarray, tpb: int | None = None) -> tuple[int, np.ndarray]:
    """``greedy_accept.h`` emulated: ``logits [n + 1, V]`` (float32), ``draft`` int ``[n]`` ->
    ``(num_accepted, int32 tokens [n + 1])``; ``tpb``: threads per row (default the kernel's)."""
    from .greedy_accept import TPB

    rows, V = logits.shape
    exe = _binary(["dialect.h", "greedy_accept.h"], _GREEDY_ACCEPT, dict(EMU_TPB=tpb or TPB))
    out = _run(exe, dict(logits=logits, draft=np.asarray(draft, dtype=np.int32)), [rows, V],
               dict(tokens=(np.int32, (rows,)), num=(np.int32, (1,))))
    return int(out["num"][0]), out["tokens"]


def qk_norm_rope(y: np.ndarray, qw: np.ndarray | None, kw: np.ndarray | None, H: int, Hk: int, eps: float,
                 base: float, offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``qk_norm_rope.h`` emulated in float32: ``y [L, (H + 2 Hk) * D]``, norm weights ``[D]`` or None, RoPE from
    ``offset`` -> ``(q [H, L, D], k [Hk, L, D], v [Hk, L, D])``."""
    import math

    L, W = y.shape
    D = W // (H + 2 * Hk)
    exe = _binary(["dialect.h", "qk_norm_rope.h"], _QK_NORM_ROPE, dict(EMU_D=D))
    ones = np.ones(D, np.float32)
    out = _run(exe, dict(y=y, qw=ones if qw is None else qw, kw=ones if kw is None else kw,
                         pos=np.arange(offset, offset + L, dtype=np.int32),
                         fparams=np.array([eps, math.log2(base)], np.float32)),
               [H, Hk, L, int(qw is not None)],
               dict(qo=(np.float32, (H, L, D)), ko=(np.float32, (Hk, L, D)), vo=(np.float32, (Hk, L, D))))
    return out["qo"], out["ko"], out["vo"]


def gated_delta_steps(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                      state: np.ndarray, all_steps: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``gated_delta_steps.h`` emulated in float32, threadgroup by threadgroup as the kernel's grid:
    ``q, k [B, T, Hk, Dk]``, ``v [B, T, Hv, Dv]``, ``g, beta [B, T, Hv]``, ``state [B, Hv, Dv, Dk]`` ->
    ``(y [B, T, Hv, Dv], states [B, T, Hv, Dv, Dk])`` (outputs start as NaN: an element the body
    does not write stays NaN). ``all_steps=False``: the body's ``ALL = 0`` instantiation (the prefill's
    ``gated_delta_final``), ``states [B, 1, Hv, Dv, Dk]`` = the state after the last step."""
    from .gated_delta_steps import TGY

    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    exe = _binary(["dialect.h", "gated_delta_steps.h"], _GATED_DELTA_STEPS,
                  dict(EMU_DK=Dk, EMU_TGY=TGY, EMU_ALL=int(all_steps)))
    Ts = T if all_steps else 1
    out = _run(exe, dict(q=q, k=k, v=v, g=g, beta=beta, state=state), [B, T, Hk, Hv, Dv],
               dict(y=(np.float32, (B, T, Hv, Dv)), states=(np.float32, (B, Ts, Hv, Dv, Dk))))
    return out["y"], out["states"]
