"""The contract between the engine and whatever runs the model.

The engine owns scheduling and block bookkeeping, the model runner (engine.runner) the physical
KV cache and the step's tensors; a backend owns the weights and computes one step's final
hidden states, writing and reading K/V through the PagedAttentionStep it is given, and the
logits of any of them (the runner makes a prompt's logits a slice at a time).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.model.architecture import GemmaArchitecture
    from engine.model.paged_attention import PagedAttentionStep


class InferenceBackend(ABC):
    """A loaded model on `device` in `dtype` (`custom`: ours; `hf`: transformers')."""

    def __init__(
        self,
        arch: GemmaArchitecture,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        exact: bool = True,
    ) -> None:
        self.arch = arch
        # Whether logits must follow transformers' order of operations (NUMERICS=exact): then
        # attention stays explicit too; otherwise it may use fused kernels.
        self.exact = exact
        self.device = device
        self.dtype = dtype
        self.vocab_size = int(arch.config.vocab_size)
        self.max_model_len = max_model_len

    @abstractmethod
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: PagedAttentionStep,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """The final (normed) hidden states [N, hidden] of the flattened batch's rows `rows`
        ([T] ids and positions, on the device); each layer writes and reads K/V through
        `step`."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head (and final softcap) on hidden states: [N, vocab] float32, written into
        `out` (a buffer reused between steps) where the head's kernel can."""

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The first maximum of each row of logits(hidden) (int64 [N]) where the head's kernel
        finds it without writing the logits; None where it cannot (then the caller takes the
        logits)."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: PagedAttentionStep,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [N, vocab] float32 of the flattened batch's rows `logits_indices`."""
        return self.logits(self.hidden_states(input_ids, positions, step, logits_indices))

    def warm_up(self, max_tokens: int, max_seqs: int) -> int:
        """Build whatever per-shape state the kernels keep (oneDNN's primitives) for every
        batch a step can bring: up to `max_tokens` rows through the decoder layers and
        `max_seqs` through the LM head. Returns the number of kernel calls made; 0 where the
        kernels keep no such state."""
        return 0
