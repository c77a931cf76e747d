"""Drafter training in MLX: data (prompts, on-policy regeneration), the trainer, and evaluation.

Python API: :class:`TrainConfig`, :class:`Trainer`, :func:`regenerate`,
:func:`build_prompts`, :func:`evaluate_sets`. Command line: ``mlx_dflash2.train``.
"""

from .data import build_prompts, load_eval_set, read_prompt_file
from .evaluate import evaluate_sets, replay
from .regen import read_responses, regenerate
from .trainer import TrainConfig, Trainer

__all__ = [
    "TrainConfig",
    "Trainer",
    "regenerate",
    "read_responses",
    "build_prompts",
    "read_prompt_file",
    "load_eval_set",
    "evaluate_sets",
    "replay",
]
