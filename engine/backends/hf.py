"""The `hf` backend: transformers' own Gemma3ForCausalLM / Gemma4ForCausalLM under the engine
contract, as a reference for our forward.

The model is built from the same config and state dict as `custom`, with an attention function
of ours registered in transformers' AttentionInterface: transformers computes projections,
norms, RoPE, MLPs and logits; our function writes each layer's new K/V into the same paged pools
and attends over them with the same masks. Batching, chunked prefill and prefix caching
therefore work exactly as in `custom`. The whole batch runs as one row of T tokens with each
token's own position; transformers' own mask construction is skipped (masks come from the
ForwardBatch).

Gemma 4 KV sharing works: transformers hands shared layers the producer layer's K/V of this
step only; our function ignores them and reads the producer's full paged cache instead.
No known feature of the Gemma 3 / Gemma 4 text models is unsupported here beyond what `custom`
rejects (MoE blocks, bidirectional attention, RoPE types other than default/linear/
proportional); those are rejected up front with the same errors.
"""

from __future__ import annotations

import copy

import torch
from transformers import AttentionInterface, Gemma3ForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig
from transformers.initialization import no_init_weights
from transformers.masking_utils import AttentionMaskInterface

from engine.backends.base import InferenceBackend
from engine.model.architecture import GemmaTextConfig, architecture_from_config
from engine.model.kernel_select import head_argmax, quantize_model, run_head, warm_up
from engine.model.paged_attention import PagedAttentionStep

ATTENTION_NAME = "gemma_serve_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    paged_step: PagedAttentionStep | None = None,
    kv_sources: tuple[int, ...] = (),
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature; query [1, H, T, D], key/value [1, Hkv, T, D]."""
    if paged_step is None:
        raise RuntimeError(f"the {ATTENTION_NAME!r} attention needs the engine's paged_step")
    layer = module.layer_idx
    assert isinstance(layer, int)  # transformers' attention modules know their layer
    assert scaling is not None  # and pass their scaling
    source = kv_sources[layer]
    if source == layer:  # a layer with its own K/V (KV-shared layers get the producer's; ignore)
        paged_step.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
    softcap = getattr(module, "attn_logit_softcapping", None)
    out = paged_step.attend(source, query[0].transpose(0, 1), scaling, softcap)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """Masks come from the ForwardBatch's positions, not from transformers."""
    return


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


class HFBackend(InferenceBackend):
    def __init__(
        self,
        config: GemmaTextConfig,
        state_dict: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        kernel: str = "exact",
    ) -> None:
        arch = architecture_from_config(config)  # rejects what neither backend supports
        super().__init__(arch, device, dtype, max_model_len, exact=kernel == "exact")
        model_class = (
            Gemma4ForCausalLM if isinstance(config, Gemma4TextConfig) else Gemma3ForCausalLM
        )
        config = copy.deepcopy(config)  # transformers records dtype and attention on the config
        with no_init_weights():
            model = model_class._from_config(
                config, dtype=dtype, attn_implementation=ATTENTION_NAME
            )
        model.tie_weights()  # an LM head tied to the embeddings (skipped along with the init)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        # A tied head is the embedding; absent layer scalars keep transformers' value of 1.
        missing = [key for key in missing if not key.endswith("layer_scalar")]
        missing = [
            key for key in missing if not (key == "lm_head.weight" and config.tie_word_embeddings)
        ]
        unexpected = [key for key in unexpected if not self._is_shared_layer_kv_weight(key)]
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the config: missing {missing}, unexpected {unexpected}"
            )
        model = model.to(device).eval().requires_grad_(False)
        quantize_model(model, kernel, head=model.get_output_embeddings())  # as in `custom`
        self.model = model
        self.kv_sources = tuple(spec.kv_source for spec in arch.layers)

    def _is_shared_layer_kv_weight(self, key: str) -> bool:
        return any(
            key.startswith(f"model.layers.{spec.index}.self_attn.")
            for spec in self.arch.layers
            if not spec.stores_kv
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: PagedAttentionStep,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        out = self.model.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            paged_step=step,
            kv_sources=self.kv_sources,
        )
        return out.last_hidden_state[0].index_select(0, rows)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """As Gemma3ForCausalLM / Gemma4ForCausalLM compute them from the hidden states."""
        logits = run_head(self.model.lm_head, hidden, out)
        cap = self.model.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """As the custom backend's: the head's own argmax, where it has one and no softcap."""
        if self.model.config.final_logit_softcapping is not None:
            return None
        return head_argmax(self.model.lm_head, hidden)

    def warm_up(self, max_tokens: int, max_seqs: int) -> int:
        head = self.model.get_output_embeddings()
        return warm_up(self.model.model, max_tokens, self.dtype) + warm_up(
            head, max_seqs, self.dtype
        )
