"""What the forward pass needs to know about each layer, read from transformers' config objects.

Gemma 3 (`Gemma3TextConfig`) and Gemma 4 (`Gemma4TextConfig`) share one decoder shape; Gemma 4
adds per-layer head sizes, KV sharing across its last layers, k=v attention, per-layer
embeddings and layer scalars. This module turns either config into plain per-layer facts, and
rejects what the text forward does not implement, naming the feature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Gemma3TextConfig, Gemma4TextConfig

# Cache group names (the engine's vocabulary) for transformers' layer types.
GROUP_OF_LAYER_TYPE = {"full_attention": "full", "sliding_attention": "sliding"}

GemmaTextConfig = Gemma3TextConfig | Gemma4TextConfig


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer type: inverse frequencies over the head dim."""

    rope_type: str  # "default", "linear" or "proportional"
    theta: float
    head_dim: int
    factor: float = 1.0
    partial_rotary_factor: float = 1.0

    def inv_freq(self) -> torch.Tensor:
        """[head_dim // 2] float32, computed exactly as transformers computes it."""
        if self.rope_type == "default":
            dim = self.head_dim
            return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        if self.rope_type == "linear":
            dim = int(self.head_dim * self.partial_rotary_factor)
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
            return (1.0 / (self.theta**exponents)) / self.factor
        # "proportional": rotate the first fraction of the dims, leave the rest (frequency 0).
        rope_angles = int(self.partial_rotary_factor * self.head_dim // 2)
        exponents = (
            torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).to(dtype=torch.float)
            / self.head_dim
        )
        rotated = 1.0 / (self.theta**exponents)
        unrotated = self.head_dim // 2 - rope_angles
        if unrotated > 0:
            rotated = torch.cat((rotated, torch.zeros(unrotated, dtype=torch.float32)))
        return rotated / self.factor


@dataclass(frozen=True)
class LayerSpec:
    index: int
    layer_type: str  # transformers' name: "full_attention" / "sliding_attention"
    group: str  # cache group: "full" / "sliding"
    head_dim: int
    num_kv_heads: int
    kv_source: int  # the layer whose cache this layer attends over (itself unless KV-shared)
    stores_kv: bool  # False for KV-shared layers: they compute no K/V and store nothing
    k_eq_v: bool  # values are the key projection (Gemma 4 full layers with attention_k_eq_v)
    intermediate_size: int


@dataclass(frozen=True)
class GemmaArchitecture:
    family: str  # "gemma3" or "gemma4"
    config: GemmaTextConfig
    layers: tuple[LayerSpec, ...]
    rope: dict[str, RopeSpec]  # by layer type
    sliding_window: int | None
    attention_scaling: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    per_layer_input_size: int  # Gemma 4 per-layer embeddings (PLE) width; 0 when absent

    @property
    def is_gemma4(self) -> bool:
        return self.family == "gemma4"

    def window_of_group(self, group: str) -> int | None:
        return self.sliding_window if group == "sliding" else None


def architecture_from_config(config: GemmaTextConfig) -> GemmaArchitecture:
    """Per-layer facts of a Gemma 3 or Gemma 4 text config; raises NotImplementedError for
    features the text forward does not implement."""
    if isinstance(config, Gemma4TextConfig):
        return _gemma4(config)
    if isinstance(config, Gemma3TextConfig):
        return _gemma3(config)
    raise TypeError(f"expected Gemma3TextConfig or Gemma4TextConfig, got {type(config).__name__}")


def _gemma3(config: Gemma3TextConfig) -> GemmaArchitecture:
    if config.use_bidirectional_attention:
        raise NotImplementedError(
            "Gemma 3 bidirectional attention (use_bidirectional_attention) is not supported"
        )
    # transformers' __post_init__ fills these in when a checkpoint's config leaves them out.
    assert config.layer_types is not None and config.rope_parameters is not None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = tuple(
        LayerSpec(
            index=i,
            layer_type=layer_type,
            group=_group(layer_type),
            head_dim=head_dim,
            num_kv_heads=config.num_key_value_heads,
            kv_source=i,
            stores_kv=True,
            k_eq_v=False,
            intermediate_size=config.intermediate_size,
        )
        for i, layer_type in enumerate(config.layer_types[: config.num_hidden_layers])
    )
    return GemmaArchitecture(
        family="gemma3",
        config=config,
        layers=layers,
        rope={t: _rope_spec(config.rope_parameters[t], head_dim) for t in set(config.layer_types)},
        sliding_window=config.sliding_window,
        attention_scaling=config.query_pre_attn_scalar**-0.5,
        # Applied as configured. transformers' Gemma 3 reads this field but never applies it;
        # no released Gemma 3 checkpoint sets it.
        attn_logit_softcapping=config.attn_logit_softcapping,
        final_logit_softcapping=config.final_logit_softcapping,
        per_layer_input_size=0,
    )


def _gemma4(config: Gemma4TextConfig) -> GemmaArchitecture:
    if config.enable_moe_block:
        raise NotImplementedError(
            "Gemma 4 mixture-of-experts blocks (enable_moe_block) are not supported"
        )
    if config.use_bidirectional_attention == "all":
        raise NotImplementedError(
            "Gemma 4 bidirectional attention (use_bidirectional_attention='all') is not supported"
        )
    # transformers' __post_init__ fills these in when a checkpoint's config leaves them out.
    assert config.layer_types is not None and config.rope_parameters is not None
    layer_types = config.layer_types[: config.num_hidden_layers]
    sharing = config.kv_sharing_modes
    # A KV-shared ("reuse") layer attends over the cache of the last earlier layer of its type
    # that computes K/V (transformers marks that producer "store").
    producer_of_type = {layer_types[i]: i for i, mode in enumerate(sharing) if mode == "store"}
    layers = []
    for i, layer_type in enumerate(layer_types):
        per_layer = config.per_layer_config[i]
        shared = sharing[i] == "reuse"
        if shared and layer_type not in producer_of_type:
            raise NotImplementedError(
                f"layer {i} shares K/V but no earlier {layer_type} layer computes them"
            )
        is_full = layer_type == "full_attention"
        double_wide = config.use_double_wide_mlp and shared
        layers.append(
            LayerSpec(
                index=i,
                layer_type=layer_type,
                group=_group(layer_type),
                head_dim=per_layer.head_dim,
                num_kv_heads=per_layer.num_key_value_heads,
                kv_source=producer_of_type[layer_type] if shared else i,
                stores_kv=not shared,
                k_eq_v=config.attention_k_eq_v and is_full,
                intermediate_size=config.intermediate_size * (2 if double_wide else 1),
            )
        )
    # per_layer_config is typed as a Sequence, but it also takes a layer type (and checks that
    # every layer of that type has the same config).
    rope = {
        t: _rope_spec(
            config.rope_parameters[t],
            config.per_layer_config[t].head_dim,  # type: ignore[call-overload]
        )
        for t in set(layer_types)
    }
    return GemmaArchitecture(
        family="gemma4",
        config=config,
        layers=tuple(layers),
        rope=rope,
        sliding_window=config.sliding_window,
        attention_scaling=1.0,  # Gemma 4 relies on the q/k norms instead of a query scale
        attn_logit_softcapping=None,  # Gemma 4 configs have no attention softcap
        final_logit_softcapping=config.final_logit_softcapping,
        per_layer_input_size=config.hidden_size_per_layer_input or 0,
    )


def _group(layer_type: str) -> str:
    try:
        return GROUP_OF_LAYER_TYPE[layer_type]
    except KeyError:
        raise NotImplementedError(f"layer type {layer_type!r} is not supported") from None


def _rope_spec(params: dict, head_dim: int) -> RopeSpec:
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "linear", "proportional"):
        raise NotImplementedError(
            f"RoPE type {rope_type!r} is not supported (default, linear, proportional are)"
        )
    return RopeSpec(
        rope_type=rope_type,
        theta=params["rope_theta"],
        head_dim=head_dim,
        factor=params.get("factor", 1.0),
        partial_rotary_factor=params.get("partial_rotary_factor", 1.0),
    )
