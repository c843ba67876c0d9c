"""Model construction (Llama size presets) and Hugging Face checkpoint import/export."""

from tierlm.models.hf import (
    SUPPORTED_MODEL_TYPES,
    ModelLoadError,
    export_hf,
    hf_model_skeleton,
    load_hf_model,
)
from tierlm.models.presets import (
    PRESETS,
    build_model,
    count_params,
    param_count_for,
    preset_config,
)

__all__ = [
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "ModelLoadError",
    "build_model",
    "count_params",
    "export_hf",
    "hf_model_skeleton",
    "load_hf_model",
    "param_count_for",
    "preset_config",
]
