"""Backends that run the model for the engine: `custom` (our forward) and `hf` (transformers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.backends.base import InferenceBackend

if TYPE_CHECKING:
    from engine.backends.custom import CustomBackend
    from engine.backends.hf import HFBackend
    from engine.model.loader import LoadedModel

BACKEND_KINDS = ("custom", "hf")

__all__ = ["BACKEND_KINDS", "InferenceBackend", "create_backend"]


def create_backend(
    kind: str,
    loaded_model: LoadedModel,
    device: torch.device,
    dtype: torch.dtype,
    kernel: str = "exact",
) -> InferenceBackend:
    """The backend `kind` ("custom" or "hf") for a loaded model, on `device` in `dtype`, its
    linear layers run by `kernel` (engine.model.kernel_select)."""
    from engine.model.architecture import GemmaTextConfig

    backend_class: type[CustomBackend | HFBackend]
    if kind == "custom":
        from engine.backends.custom import CustomBackend as backend_class
    elif kind == "hf":
        from engine.backends.hf import HFBackend as backend_class
    else:
        raise ValueError(f"unknown backend {kind!r}: expected one of {', '.join(BACKEND_KINDS)}")
    config = loaded_model.config  # typed PretrainedConfig; load_model() gives a Gemma one
    if not isinstance(config, GemmaTextConfig):
        raise TypeError(
            f"expected Gemma3TextConfig or Gemma4TextConfig, got {type(config).__name__}"
        )
    return backend_class(
        config, loaded_model.state_dict, device, dtype, loaded_model.max_model_len, kernel
    )
