"""OpenAI-compatible local server (``mlx_dflash2.server``), in ``mlx_lm.server``'s style.

Modules:
    protocol: request/response models (validation, OpenAPI schema), OpenAI errors.
    engine:   the generation worker (one thread owns the model; batched rounds,
              or round-robin over requests), prompt (prefix) cache, metrics.
    text:     reasoning/content split, token bytes, log-probabilities.
    app:      the FastAPI app (endpoints, SSE streaming).
    cli:      the command line (``main``).
"""

from .cli import main

__all__ = ["main"]
