"""Fused kernels for drafting and verification: one registry, each op with a pure-MLX reference, a
Metal source and a CUDA twin (``metal/``), a numerics gate at first use and a one-line fallback
(:mod:`.registry`). ``mlx_dflash2.selftest`` checks them all on the machine at hand.

Ops (``OPS``): ``qmm`` (small-M quantized matmul), ``verify_attention`` (multi-row causal attention
over the KV cache), ``qk_norm_rope`` (the q/k heads' norms and RoPE and the heads' layout after the fused q/k/v
projection, one launch), and the drafter side: ``dynamic_conv`` (one side of DFlash2's grouped dynamic causal
convolution, in the drafter's per-round forward), ``selector_walk`` (the candidate selector's greedy walk,
all steps in one launch; top-K and the hidden projection stay in MLX; sampled walks stay in MLX) and
``greedy_accept`` (the greedy verifier's argmaxes and accepted length; the log-probabilities stay in MLX);
for hybrid targets (issue 20): ``gated_delta_steps`` (the GatedDeltaNet recurrence over a verify block,
every step's state kept; :func:`select_states` picks each sequence's state and convolution window after
its accepted prefix) and ``gated_delta_final`` (the same body over a prompt chunk, the last state only).
Tokens and ids from the kernels equal their references exactly; ``dynamic_conv`` is bit-identical in
float32.
"""

from .attention import KernelAttention, route_attention, verify_attention
from .dynamic_conv import dynamic_conv
from .gated_delta_steps import gated_delta_final, gated_delta_steps, select_states
from .gdn import route_gated_delta
from .greedy_accept import greedy_accept
from .qmm import KernelMLP, KernelQuantizedLinear, qmm, route_mlps, route_quantized_linears, undo_routes
from .qmm import fuse_enabled as qmm_fuse_enabled
from .rope import qk_norm_rope
from .registry import ENV, MODES, KernelError, KernelOp, backend, check_mode, default_mode
from .selector_walk import selector_walk

OPS = {op.name: op for op in (qmm, verify_attention, qk_norm_rope, dynamic_conv, selector_walk, greedy_accept,
                              gated_delta_steps, gated_delta_final)}

__all__ = ["route_gated_delta", "OPS", "qmm", "verify_attention", "qk_norm_rope", "dynamic_conv", "selector_walk", "greedy_accept", "gated_delta_steps",
           "gated_delta_final", "select_states", "KernelOp",
           "KernelError", "KernelQuantizedLinear", "KernelMLP", "KernelAttention", "route_quantized_linears", "route_mlps", "route_attention", "undo_routes",
           "backend", "check_mode", "default_mode", "MODES", "ENV"]
