"""EXL3 test tools, independent of the converter's vectorised MLX decoder:

* :func:`reference_decode`: a literal, slow numpy decoder written straight from the
  format description (formats.md §5.3-5.4): bit ring read bit by bit, codebook
  formulas evaluated per state, the tile permutation built from the lane rule,
  and an explicit 128x128 Sylvester Hadamard matrix (no fast transform).
* :func:`viterbi_ring`: OUR OWN tail-biting Viterbi search (used for the fixture files; about
  6 % relative error at K=4 on Gaussian weights, close to exllamav3's encoder without a Hessian).
* :func:`encode`: OUR OWN greedy trellis encoder (NOT exllamav3's Viterbi encoder; fast, used
  to build whole tiny models in the tests):
  random signs + a global scale, the block Hadamard rotation, then per position the
  D new ring bits minimising the error given the bits already chosen (two passes for
  the tail-biting wrap), packed MSB-first into uint32 words stored as int16 pairs
  (the layout exllamav3's pack.cu writes). It produces valid EXL3 tensors whose
  decoded values are coarser than exllamav3's; it exists because exllamav3's encoder
  needs CUDA (see fixtures/make_exl3_fixtures.py for the real-encoder path).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

LUT_RMS = {"3inst": 1.2437, "mcg": 1.2441, "mul1": 1.0003}  # measured on exllamav3's codebooks (formats.md §5.3)


def _lut_value(state: int, codebook: str) -> np.float16:
    if codebook == "mul1":
        x = (state * 0x83DCD12D) % 2**32
        b = sum((x >> s) & 0xFF for s in (0, 8, 16, 24))
        k_inv = float(np.frombuffer(np.uint16(0x1EEE).tobytes(), np.float16)[0])
        k_bias = float(np.frombuffer(np.uint16(0xC931).tobytes(), np.float16)[0])
        return np.float16((1024 + b) * k_inv + k_bias)
    x = (state * 89226354 + 64248484) % 2**32 if codebook == "3inst" else (state * 0xCBAC1FED) % 2**32
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = float(np.frombuffer(np.uint16(x & 0xFFFF).tobytes(), np.float16)[0])
    hi = float(np.frombuffer(np.uint16(x >> 16).tobytes(), np.float16)[0])
    return np.float16(lo + hi)


@lru_cache(maxsize=None)
def lut(codebook: str) -> np.ndarray:
    """The full table, computed entry by entry with Python integers (slow, ~0.5 s; cached)."""
    return np.array([_lut_value(s, codebook) for s in range(65536)], dtype=np.float16)


def _perm() -> np.ndarray:
    perm = []
    for t in range(32):
        r0, c0 = (t % 4) * 2, t // 4
        for col in (c0, c0 + 8):
            for r in (r0, r0 + 1, r0 + 8, r0 + 9):
                perm.append(r * 16 + col)
    return np.array(perm)


def _bits_per_pos(K: float) -> list[int]:
    if float(K).is_integer():
        return [int(K)] * 256
    return [int(K) + (i % 2) for i in range(256)]


def sylvester(n: int = 128) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def reference_decode(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, codebook: str, table=None) -> np.ndarray:
    """float64 ``(in_p, out_p)`` weight ``diag(suh) H W_hat H diag(svh)`` (before the padding slice)."""
    w_hat = reference_w_hat(trellis, codebook, table).astype(np.float64)
    ti, to = trellis.shape[:2]
    H = sylvester()
    Hl = np.kron(np.eye(ti * 16 // 128), H)
    Hr = np.kron(np.eye(to * 16 // 128), H)
    return suh.astype(np.float64)[:, None] * (Hl @ w_hat @ Hr) * svh.astype(np.float64)[None, :]


def reference_w_hat(trellis: np.ndarray, codebook: str, table=None) -> np.ndarray:
    """fp16 ``(in_p, out_p)`` rotated-basis values of the tiles (literal bit-by-bit decoding)."""
    table = lut(codebook) if table is None else table
    ti, to, n16 = trellis.shape
    K = n16 / 16
    R = int(256 * K)
    u16 = trellis.view(np.uint16).astype(np.uint64)
    words = u16[..., 0::2] | (u16[..., 1::2] << np.uint64(16))  # little-endian uint32 words
    # ring bit b = bit (31 - b % 32) of word b // 32
    ring = np.zeros((ti, to, R), np.uint8)
    for b in range(R):
        ring[..., b] = (words[..., b // 32] >> np.uint64(31 - b % 32)) & np.uint64(1)
    d = _bits_per_pos(K)
    perm = _perm()
    tiles = np.zeros((ti, to, 256))
    end = 0
    for i in range(256):
        end += d[i]
        state = np.zeros((ti, to), np.int64)
        for t in range(16):
            state = (state << 1) | ring[..., (end - 16 + t) % R]
        tiles[..., perm[i]] = table[state].astype(np.float64)
    return tiles.reshape(ti, to, 16, 16).transpose(0, 2, 1, 3).reshape(ti * 16, to * 16).astype(np.float16)


def prepare(W: np.ndarray, codebook: str, seed: int = 0, table=None):
    """Rotate and scale a Hugging Face weight ``(out, in)`` for trellis encoding.

    Random ±1 sign vectors, the block Hadamard on both sides, and one global scale
    that brings the rotated weight to the codebook's RMS (folded into ``suh``), so that
    ``W_in = diag(suh) H W_hat H diag(svh)`` reconstructs it when ``W_hat ~ target``.

    Returns:
        ``(seq, suh fp16, svh fp16, (ti, to))``: ``seq`` float64 ``(ti, to, 256)`` is the
        value wanted at each trellis position (tensor-core order).
    """
    table = lut(codebook) if table is None else table
    tab = table.astype(np.float64)
    rng = np.random.default_rng(seed)
    out_f, in_f = W.shape
    in_p, out_p = -(-in_f // 128) * 128, -(-out_f // 128) * 128
    Win = np.zeros((in_p, out_p))
    Win[:in_f, :out_f] = W.T
    su = rng.choice([-1.0, 1.0], in_p)
    sv = rng.choice([-1.0, 1.0], out_p)
    H = sylvester()
    Hl, Hr = np.kron(np.eye(in_p // 128), H), np.kron(np.eye(out_p // 128), H)
    rot = Hl @ (su[:, None] * Win * sv[None, :]) @ Hr
    g16 = np.float16(np.sqrt(np.mean(rot**2)) / np.sqrt(np.mean(tab**2)) or 1.0)
    target = rot / float(g16)
    ti, to = in_p // 16, out_p // 16
    tiles = target.reshape(ti, 16, to, 16).transpose(0, 2, 1, 3).reshape(ti, to, 256)
    return tiles[..., _perm()], (su * float(g16)).astype(np.float16), sv.astype(np.float16), (ti, to)


def greedy_ring(seq: np.ndarray, K: float, codebook: str, table=None) -> np.ndarray:
    """Our greedy trellis search: the ring bits ``(ti, to, 256K)`` (two passes for the wrap)."""
    tab = (lut(codebook) if table is None else table).astype(np.float64)
    ti, to, _ = seq.shape
    R = int(256 * K)
    d = _bits_per_pos(K)
    ring = np.zeros((ti, to, R), np.uint8)
    ends = np.cumsum(d)
    for _ in range(2):
        for i in range(256):
            end, di = int(ends[i]), d[i]
            prefix = np.zeros((ti, to), np.int64)
            for t in range(16 - di):
                prefix = (prefix << 1) | ring[..., (end - 16 + t) % R]
            cands = (prefix[..., None] << di) | np.arange(1 << di)
            best = np.argmin((tab[cands] - seq[..., i : i + 1]) ** 2, axis=-1)
            for t in range(di):
                ring[..., (end - di + t) % R] = (best >> (di - 1 - t)) & 1
    return ring


def pack_ring(ring: np.ndarray) -> np.ndarray:
    """Ring bits -> int16 trellis: MSB-first uint32 words stored as little-endian uint16 pairs."""
    ti, to, R = ring.shape
    words = np.zeros((ti, to, R // 32), np.uint64)
    for b in range(R):
        words[..., b // 32] |= ring[..., b].astype(np.uint64) << np.uint64(31 - b % 32)
    w32 = words.astype(np.uint32)
    return np.stack([w32 & 0xFFFF, w32 >> 16], axis=-1).reshape(ti, to, -1).astype(np.uint16).view(np.int16)


def marker(codebook: str) -> dict:
    if codebook == "mcg":
        return {"mcg": np.array(0xCBAC1FED, dtype=np.uint32).view(np.int32).reshape(())}
    if codebook == "mul1":
        return {"mul1": np.array(0x83DCD12D, dtype=np.uint32).view(np.int32).reshape(())}
    return {}


def encode(W: np.ndarray, K: float, codebook: str, seed: int = 0) -> dict:
    """Our greedy EXL3 encoding of a Hugging Face weight ``(out, in)``: ``trellis``, ``suh``,
    ``svh`` (+ the codebook marker), as an EXL3 checkpoint stores them."""
    seq, suh, svh, _ = prepare(W, codebook, seed)
    return {"trellis": pack_ring(greedy_ring(seq, K, codebook)), "suh": suh, "svh": svh, **marker(codebook)}


def viterbi_ring(seq: np.ndarray, K: float, codebook: str, table=None, return_states: bool = False):
    """Our tail-biting Viterbi trellis search (QTIP-style; NOT exllamav3's CUDA encoder).

    State after position ``i`` = the last 16 ring bits up to ``S(i)``; a step appends ``D(i)``
    bits. Pass 1 runs from a free start and takes the best final state ``s*``; pass 2 starts
    from ``s*`` only and is traced back from ``s*`` (tail-biting: the ring closes). Cost: squared
    error of the codebook value against the wanted value at each position.

    Returns:
        ring bits ``(ti, to, 256K)`` uint8 (and the chosen states ``(ti, to, 256)`` with ``return_states``).
    """
    tab = (lut(codebook) if table is None else table).astype(np.float32)
    ti, to, _ = seq.shape
    n = ti * to
    tgt = seq.reshape(n, 256).astype(np.float32)
    d = _bits_per_pos(K)
    R = int(256 * K)

    def run(init):
        cost = init
        bps = []
        for i in range(256):
            D = d[i]
            c3 = cost.reshape(n, 1 << D, 1 << (16 - D))  # [h, low]: state = h << (16-D) | low
            bps.append(np.argmin(c3, axis=1).astype(np.uint8))
            m = np.min(c3, axis=1)  # (n, 2^(16-D)) by low = s >> D
            err = (tab[None, :] - tgt[:, i : i + 1]) ** 2
            cost = (m[:, :, None] + err.reshape(n, 1 << (16 - D), 1 << D)).reshape(n, 65536)
        return cost, bps

    cost, _ = run(np.zeros((n, 65536), np.float32))
    s_star = np.argmin(cost, axis=1)
    init = np.full((n, 65536), np.inf, np.float32)
    init[np.arange(n), s_star] = 0.0
    _, bps = run(init)
    states = np.zeros((n, 256), np.int64)
    s = s_star.copy()
    for i in range(255, -1, -1):
        states[:, i] = s
        D = d[i]
        low = s >> D
        h = bps[i][np.arange(n), low].astype(np.int64)
        s = (h << (16 - D)) | low
    ring = np.zeros((n, R), np.uint8)
    end = 0
    for i in range(256):
        D = d[i]
        end += D
        for t in range(D):
            ring[:, (end - D + t) % R] = (states[:, i] >> (D - 1 - t)) & 1
    if return_states:
        return ring.reshape(ti, to, R), states.reshape(ti, to, 256)
    return ring.reshape(ti, to, R)
