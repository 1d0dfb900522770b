"""Our Gemma 3 / Gemma 4 text forward pass over the paged KV cache: the exact reference.

Built from transformers' `Gemma3TextConfig` / `Gemma4TextConfig` and loaded from a state dict
in transformers' CausalLM naming (`model.layers.0.self_attn.q_proj.weight`, ...). Every
operation follows transformers' reference in the same order and dtype, so a single-sequence
prefill reproduces its logits bit for bit. The batch is flat: T tokens of many sequences in
rows, with no padding; only attention looks across rows, through `PagedAttentionStep`.

Gemma 3 vs Gemma 4, as the reference defines them:
- RMSNorm scales by (1 + w) with rsqrt in Gemma 3, by w with pow(-0.5) in Gemma 4, which also
  has a weightless norm on values;
- Gemma 3 scales queries by query_pre_attn_scalar**-0.5, Gemma 4 not at all;
- Gemma 4 adds per-layer head sizes, k=v attention on full layers, KV sharing (the last layers
  read an earlier layer's cache and store nothing), per-layer embeddings (PLE) with a gate and
  projection, a double-wide MLP on KV-shared layers, and a scalar per layer.

This module is only that reference, one forward per module, readable beside transformers'
modeling_gemma3.py / modeling_gemma4.py. The approximate modes' faster modules (stacked
projections, quantized linears, fused CPU ops) replace these in place: engine.model.optimize.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.architecture import (
    GemmaArchitecture,
    GemmaTextConfig,
    LayerSpec,
    architecture_from_config,
)
from engine.model.kernel_select import head_argmax, run_head
from engine.model.paged_attention import PagedAttentionStep


class RMSNorm(nn.Module):
    """Gemma RMSNorm; `unit_offset` selects Gemma 3's (1 + w) form, `with_scale=False` Gemma 4's
    weightless value norm."""

    scale: torch.Tensor | None  # a buffer set by init_buffers() when there is a weight

    def __init__(self, dim: int, eps: float, unit_offset: bool, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False) if with_scale else None
        self.register_buffer("scale", None, persistent=False)

    def init_buffers(self) -> None:
        """The float32 multiplier, (1 + w) or w, computed once instead of every call."""
        if self.weight is not None:
            scale = 1.0 + self.weight.float() if self.unit_offset else self.weight.float()
            self.register_buffer("scale", scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.unit_offset:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.scale is not None:
            h = h * self.scale
        return h.type_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D] in the rotate-half convention: x * cos +
    [-x2, x1] * sin, written as [x2, x1] * [-sin1, sin2] (the same products, fewer ops)."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)


def linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False).requires_grad_(False)


class Attention(nn.Module):
    def __init__(self, arch: GemmaArchitecture, spec: LayerSpec) -> None:
        super().__init__()
        config = arch.config
        if config.attention_bias:
            raise NotImplementedError(
                "attention projections with bias (attention_bias) are not supported"
            )
        eps, unit_offset = config.rms_norm_eps, not arch.is_gemma4
        self.spec = spec
        self.num_heads = config.num_attention_heads
        self.scaling = arch.attention_scaling
        self.softcap = arch.attn_logit_softcapping
        self.q_proj = linear(config.hidden_size, self.num_heads * spec.head_dim)
        self.q_norm = RMSNorm(spec.head_dim, eps, unit_offset)
        if spec.stores_kv:
            self.k_proj = linear(config.hidden_size, spec.num_kv_heads * spec.head_dim)
            if not spec.k_eq_v:
                self.v_proj = linear(config.hidden_size, spec.num_kv_heads * spec.head_dim)
            self.k_norm = RMSNorm(spec.head_dim, eps, unit_offset)
            self.v_norm = (
                RMSNorm(spec.head_dim, eps, unit_offset=False, with_scale=False)
                if arch.is_gemma4
                else None
            )
        self.o_proj = linear(self.num_heads * spec.head_dim, config.hidden_size)

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[queries, keys, values] (values absent when k=v; only queries on KV-shared layers)."""
        if not self.spec.stores_kv:
            return [self.q_proj(x)]
        if self.spec.k_eq_v:
            return [self.q_proj(x), self.k_proj(x)]
        return [self.q_proj(x), self.k_proj(x), self.v_proj(x)]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: PagedAttentionStep
    ) -> torch.Tensor:
        spec = self.spec
        tokens = x.shape[0]
        projected = self.project(x)
        query = rotate(
            self.q_norm(projected[0].view(tokens, self.num_heads, spec.head_dim)), cos, sin
        )
        if spec.stores_kv:
            raw_keys = projected[1].view(tokens, spec.num_kv_heads, spec.head_dim)
            values = (
                raw_keys
                if spec.k_eq_v
                else projected[2].view(tokens, spec.num_kv_heads, spec.head_dim)
            )
            keys = rotate(self.k_norm(raw_keys), cos, sin)
            if self.v_norm is not None:
                values = self.v_norm(values)
            step.write(spec.index, keys, values)
        out = step.attend(spec.kv_source, query, self.scaling, self.softcap)
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    """GeGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, config: GemmaTextConfig, intermediate_size: int) -> None:
        super().__init__()
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise NotImplementedError(
                f"hidden activation {config.hidden_activation!r} is not supported"
            )
        self.gate_proj = linear(config.hidden_size, intermediate_size)
        self.up_proj = linear(config.hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: GemmaArchitecture, spec: LayerSpec) -> None:
        super().__init__()
        config = arch.config
        hidden, eps, unit_offset = config.hidden_size, config.rms_norm_eps, not arch.is_gemma4
        self.self_attn = Attention(arch, spec)
        # nn.Module: the approximate modes may swap in another MLP (engine.model.optimize).
        self.mlp: nn.Module = MLP(config, spec.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset)
        self.has_per_layer_input = arch.per_layer_input_size > 0
        if self.has_per_layer_input:
            self.per_layer_input_gate = linear(hidden, arch.per_layer_input_size)
            self.per_layer_projection = linear(arch.per_layer_input_size, hidden)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps, unit_offset)
        if arch.is_gemma4:
            self.register_buffer("layer_scalar", torch.ones(1))
        else:
            self.layer_scalar = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: PagedAttentionStep,
        per_layer_input: torch.Tensor | None,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, step)
        x = self.residual_blocks(x, attended)
        return self.per_layer_and_scalar(x, per_layer_input)

    def residual_blocks(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """x + post(attended), then that plus post_ff(mlp(pre_ff(it)))."""
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def per_layer_and_scalar(
        self, x: torch.Tensor, per_layer_input: torch.Tensor | None
    ) -> torch.Tensor:
        """Gemma 4's per-layer input (PLE) and layer scalar, where the layer has them."""
        if self.has_per_layer_input:
            assert per_layer_input is not None  # TextModel passes one to every layer then
            gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        if self.layer_scalar is not None:
            x = x * self.layer_scalar
        return x


class ScaledEmbedding(nn.Embedding):
    """Token embedding times sqrt(width), the scale rounded to the embedding dtype first."""

    embed_scale: torch.Tensor  # a buffer set by init_buffers()

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.weight.requires_grad_(False)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale

    def init_buffers(self) -> None:
        scale = torch.tensor(self.scale).to(device=self.weight.device, dtype=self.weight.dtype)
        self.register_buffer("embed_scale", scale, persistent=False)


class TextModel(nn.Module):
    def __init__(self, arch: GemmaArchitecture) -> None:
        super().__init__()
        config = arch.config
        self.arch = arch
        self.embed_tokens = ScaledEmbedding(
            config.vocab_size, config.hidden_size, config.hidden_size**0.5
        )
        self.layers = nn.ModuleList(DecoderLayer(arch, spec) for spec in arch.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=not arch.is_gemma4)
        self.per_layer_input_size = arch.per_layer_input_size
        if self.per_layer_input_size:
            width = len(arch.layers) * self.per_layer_input_size
            self.embed_tokens_per_layer = ScaledEmbedding(
                config.vocab_size_per_layer_input, width, self.per_layer_input_size**0.5
            )
            self.per_layer_model_projection = linear(config.hidden_size, width)
            self.per_layer_projection_norm = RMSNorm(
                self.per_layer_input_size, config.rms_norm_eps, unit_offset=False
            )

    def init_buffers(self) -> None:
        """Derived constants (not weights): embedding scales and RoPE inverse frequencies."""
        self.embed_tokens.init_buffers()
        if self.per_layer_input_size:
            self.embed_tokens_per_layer.init_buffers()
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.init_buffers()
        device = self.embed_tokens.weight.device
        for layer_type, rope in self.arch.rope.items():
            self.register_buffer(
                f"{layer_type}_inv_freq", rope.inv_freq().to(device), persistent=False
            )

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """PLE: [T, layers, width], token-identity part plus a projection of the embeddings."""
        shape = (input_ids.shape[0], len(self.layers), self.per_layer_input_size)
        identity = self.embed_tokens_per_layer(input_ids).reshape(shape)
        context = self.per_layer_model_projection(embeds) * self.arch.config.hidden_size**-0.5
        context = self.per_layer_projection_norm(context.reshape(shape))
        return (context + identity) * 2.0**-0.5

    def rotary(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos and sign-folded sin ([T, 1, head_dim]) per layer type for this step's positions."""
        tables = {}
        for layer_type in self.arch.rope:
            freqs = positions[:, None].float() * getattr(self, f"{layer_type}_inv_freq")
            angles = torch.cat((freqs, freqs), dim=-1)
            sin = angles.sin().to(dtype)
            half = sin.shape[-1] // 2
            signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            tables[layer_type] = (angles.cos().to(dtype)[:, None], signed_sin[:, None])
        return tables

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedAttentionStep
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_input_size else None
        rotary = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            cos, sin = rotary[self.arch.layers[i].layer_type]
            x = layer(x, cos, sin, step, per_layer[:, i] if per_layer is not None else None)
        return x


class GemmaForCausalLM(nn.Module):
    """The text model and its (usually tied) LM head; parameter names match transformers'."""

    def __init__(self, config: GemmaTextConfig) -> None:
        super().__init__()
        self.arch = architecture_from_config(config)
        self.model = TextModel(self.arch)
        self.tied = bool(config.tie_word_embeddings)
        if not self.tied:
            self.lm_head = linear(config.hidden_size, config.vocab_size)
        # The LM head under a faster kernel (engine.model.optimize); None: F.linear on
        # lm_head_weight.
        self.fast_head: nn.Module | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    @classmethod
    def from_state_dict(
        cls,
        config: GemmaTextConfig,
        state_dict: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ) -> GemmaForCausalLM:
        """The model with transformers-named weights, on `device` in `dtype`; checks that
        nothing is missing or left over."""
        with torch.device("meta"):  # no throwaway random init: the weights replace everything
            model = cls(config)
        weights = dict(state_dict)
        if model.tied:
            weights.pop("lm_head.weight", None)
        for spec in model.arch.layers:
            # KV-shared Gemma 4 layers have no K/V weights; checkpoints may still carry them.
            if not spec.stores_kv:
                for name in ("k_proj", "v_proj", "k_norm", "v_norm"):
                    weights.pop(f"model.layers.{spec.index}.self_attn.{name}.weight", None)
            # A checkpoint without layer scalars means 1, as transformers initializes them.
            if model.arch.is_gemma4:
                weights.setdefault(f"model.layers.{spec.index}.layer_scalar", torch.ones(1))
        weights = {name: tensor.to(device=device, dtype=dtype) for name, tensor in weights.items()}
        missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the config: missing {missing}, unexpected {unexpected}"
            )
        model.model.init_buffers()
        return model.requires_grad_(False)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: PagedAttentionStep,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """The final normed hidden states [N, hidden] of the flattened batch's rows `rows`."""
        hidden = self.model(input_ids, positions, step)
        return self.model.norm(hidden.index_select(0, rows))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The first maximum of each row of logits(hidden), from the fast head's own argmax
        (kernel_select.head_argmax); None where it has none. A final softcap could round two
        logits to a tie that the raw ones do not have, so a capped model takes the logits."""
        if self.fast_head is None or self.arch.final_logit_softcapping is not None:
            return None
        return head_argmax(self.fast_head, hidden)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, vocab] float32 of final hidden states. A sliced fast head writes them into
        `out` where it is [N, vocab] float32 (a buffer the caller reuses: see slice_output)."""
        if self.fast_head is not None:
            logits = run_head(self.fast_head, hidden, out)
        else:
            logits = F.linear(hidden, self.lm_head_weight)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
