"""The `custom` backend: our own Gemma 3 / Gemma 4 forward (engine.model.gemma) over the paged
KV cache."""

from __future__ import annotations

import torch

from engine.backends.base import ForwardOutput
from engine.backends.paged import PagedCacheBackend
from engine.model.architecture import GemmaTextConfig
from engine.model.batch import ForwardBatch
from engine.model.gemma import GemmaForCausalLM


class CustomBackend(PagedCacheBackend):
    def __init__(
        self,
        config: GemmaTextConfig,
        state_dict: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        kernel: str = "exact",
    ) -> None:
        self.model = GemmaForCausalLM.from_state_dict(config, state_dict, device, dtype, kernel)
        super().__init__(self.model.arch, device, dtype, max_model_len)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        step = self._attention_step(batch)
        logits = self.model(
            batch.input_ids.to(self.device),
            batch.positions.to(self.device),
            step,
            batch.logits_indices.to(self.device, torch.long),
        )
        return ForwardOutput(logits=logits, attention_mass=step.attention_mass())
