"""The `custom` backend: our own Gemma 3 / Gemma 4 forward (engine.model.gemma)."""

from __future__ import annotations

import torch

from engine.backends.base import InferenceBackend
from engine.model import huge_pages
from engine.model.architecture import GemmaTextConfig
from engine.model.gemma import GemmaForCausalLM
from engine.model.kernel_select import warm_up
from engine.model.optimize import optimize
from engine.model.paged_attention import PagedAttentionStep


class CustomBackend(InferenceBackend):
    def __init__(
        self,
        config: GemmaTextConfig,
        state_dict: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        kernel: str = "exact",
        fuse_ops: bool | None = None,
        flat_layers: bool = True,
    ) -> None:
        """The reference model (engine.model.gemma) with `kernel`'s fast modules swapped in
        (engine.model.optimize; `fuse_ops` and `flat_layers` as there)."""
        self.model = GemmaForCausalLM.from_state_dict(config, state_dict, device, dtype)
        optimize(self.model, kernel, fuse_ops, flat_layers)
        huge_pages.place_module(self.model)  # decode streams the weights: 2 MB pages
        super().__init__(self.model.arch, device, dtype, max_model_len, exact=kernel == "exact")

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: PagedAttentionStep,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        return self.model.hidden_states(input_ids, positions, step, rows)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.logits(hidden, out)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.model.greedy_tokens(hidden)

    def warm_up(self, max_tokens: int, max_seqs: int) -> int:
        calls = warm_up(self.model.model, max_tokens, self.dtype)
        if self.model.fast_head is not None:
            calls += warm_up(self.model.fast_head, max_seqs, self.dtype)
        return calls
