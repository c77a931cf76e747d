"""DFlash / DFlash2 block drafters: config, MLX model, checkpoint I/O."""

from .config import DrafterConfig, DrafterConfigError, default_target_layer_ids
from .io import (
    DrafterLoadError,
    DrafterNeedsConversionError,
    dequantize_drafter,
    init_drafter,
    is_quantized,
    load_drafter,
    pick_mask_token_id,
    save_drafter,
    validate_for_target,
)
from .model import (DEFAULT_CONTEXT_SLACK, DEFAULT_CONTEXT_WINDOW, CandidateSelector, DraftContext, DraftModel,
                    GroupedDynamicCausalConv)

__all__ = [
    "DrafterConfig",
    "DrafterConfigError",
    "DrafterLoadError",
    "DrafterNeedsConversionError",
    "DraftModel",
    "DraftContext",
    "CandidateSelector",
    "GroupedDynamicCausalConv",
    "default_target_layer_ids",
    "init_drafter",
    "load_drafter",
    "dequantize_drafter",
    "is_quantized",
    "save_drafter",
    "validate_for_target",
    "pick_mask_token_id",
]
