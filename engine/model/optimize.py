"""The approximate modes' fast paths, swapped into the exact reference model (engine.model.gemma)
in place by `optimize(model, kernel)`:

- stacked projections: q, k (and v) as one linear (StackedAttention), gate and up as one
  (GateUpMLP), or, under bf16, the whole MLP as one module with its gelu and product inside its
  GEMMs (BFloat16GatedMLP). One larger call costs far less than three small ones at decode
  sizes; per-channel int8 quantizes each stacked row as it would alone;
- every other linear layer, and the LM head, under the chosen kernel (kernel_select);
- on a CPU with cpu_ops, float32 activations: norms (FusedRMSNorm), q/k norm and RoPE
  (CpuOpsAttention) and the residual adds with their norms (FusedDecoderLayer) through the fused
  CPU kernels. The same maths summed in another order, so never under NUMERICS=exact. Where a
  layer's GEMMs run in bfloat16 the norms before them hand over bfloat16, and the attention's
  output projection hands bfloat16 to the residual add: the GEMMs round to it anyway, so the
  values stay the same and the casts go. A layer whose GEMMs all run on cpu_ops' int8 kernel
  runs as one flat sequence of those calls (Int8DecoderLayer).

Each fast module is a subclass of the reference module it replaces, built from it with its
weights and children shared (`_adopt`), and overrides only the part it computes differently.
`python -m evals.bench_step` times a decode step with and without the fused CPU kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import cpu_ops
from engine.model.gemma import (
    MLP,
    Attention,
    DecoderLayer,
    GemmaForCausalLM,
    RMSNorm,
    TextModel,
)
from engine.model.int8_kernels import (
    DynamicInt8Linear,
    Int8GatedMLP,
    OneDNNInt8Linear,
    PackedInt8Rows,
    serves_every_row,
)
from engine.model.kernel_select import body_and_head, make_fused_mlp, make_linear, quantize_model
from engine.model.linear_kernels import BFloat16GatedMLP, BFloat16Linear
from engine.model.paged_attention import PagedAttentionStep

M = TypeVar("M", bound=nn.Module)


def _adopt(cls: type[M], module: nn.Module) -> M:
    """An instance of `cls` (a subclass of module's class) holding module's state: the same
    parameters, buffers, children and attributes, shared rather than copied."""
    new = cls.__new__(cls)
    # The registries (_parameters, _buffers, _modules, ...) are copied: new may add or drop
    # entries without touching module's.
    new.__dict__.update(
        {k: dict(v) if isinstance(v, dict) else v for k, v in module.__dict__.items()}
    )
    return new


class FusedRMSNorm(RMSNorm):
    """RMSNorm in one cpu_ops call; bfloat16 out where what reads it runs in bfloat16."""

    bf16_out = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.rms_norm(x, self.scale, self.eps, self.bf16_out)


class StackedAttention(Attention):
    """Attention with q, k and v projected by one linear over their stacked weights (q alone on
    a KV-shared layer), split by column."""

    qkv_proj: nn.Module
    qkv_sizes: list[int]

    @classmethod
    def from_attention(cls, attention: Attention, kernel: str) -> StackedAttention:
        stacked = _adopt(cls, attention)
        spec = attention.spec
        names = ["q_proj"]
        if spec.stores_kv:
            names += ["k_proj"] if spec.k_eq_v else ["k_proj", "v_proj"]
        projections = [getattr(attention, name) for name in names]
        stacked.qkv_proj = make_linear(kernel, torch.cat([p.weight for p in projections]))
        stacked.qkv_sizes = [p.out_features for p in projections]
        for name in names:
            delattr(stacked, name)
        return stacked

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(self.qkv_proj(x).split(self.qkv_sizes, dim=-1))


class CpuOpsAttention(StackedAttention):
    """StackedAttention with each of q and k normalized and rotated in one cpu_ops call,
    straight from the stacked projection's columns."""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: PagedAttentionStep
    ) -> torch.Tensor:
        spec, heads, dim = self.spec, self.num_heads, self.spec.head_dim
        projected = self.qkv_proj(x)
        eps = self.q_norm.eps
        query = cpu_ops.norm_rope(projected, 0, heads, dim, self.q_norm.scale, cos, sin, eps)
        if spec.stores_kv:
            kv_width = spec.num_kv_heads * dim
            keys = cpu_ops.norm_rope(
                projected, heads * dim, spec.num_kv_heads, dim, self.k_norm.scale, cos, sin, eps
            )
            values_from = heads * dim + (0 if spec.k_eq_v else kv_width)
            values = projected[:, values_from : values_from + kv_width].view(
                -1, spec.num_kv_heads, dim
            )
            if self.v_norm is not None:
                values = self.v_norm(values)
            step.write(spec.index, keys, values)
        # A bfloat16 output projection reads bfloat16: the attention hands it over as such.
        o_proj = self.o_proj
        bf16_in = isinstance(o_proj, BFloat16Linear) and o_proj.bf16_out
        out_dtype = torch.bfloat16 if bf16_in else None
        out = step.attend(spec.kv_source, query, self.scaling, self.softcap, out_dtype)
        return o_proj(out.reshape(x.shape[0], -1))


class GateUpMLP(MLP):
    """The MLP with gate and up projected by one linear over their stacked weights."""

    gate_up_proj: nn.Module

    @classmethod
    def from_mlp(cls, mlp: MLP, kernel: str) -> GateUpMLP:
        stacked = _adopt(cls, mlp)
        weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        stacked.gate_up_proj = make_linear(kernel, weight)
        del stacked.gate_proj, stacked.up_proj
        return stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # The product into gelu's own output: the same values, one [rows, intermediate]
        # tensor fewer (fresh pages at prefill sizes).
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


class FusedDecoderLayer(DecoderLayer):
    """A decoder layer whose residual adds run with the norms after them in one cpu_ops call
    each, updating x in place (x is the layer's own: the previous layer's output)."""

    bf16_activations = False  # the MLP runs in bfloat16: its input norm hands over bfloat16

    def residual_blocks(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        eps = self.input_layernorm.eps
        hidden = cpu_ops.add_rms_norm_(
            x,
            attended,
            self.post_attention_layernorm.scale,
            self.pre_feedforward_layernorm.scale,
            eps,
            self.bf16_activations,
        )
        cpu_ops.add_rms_norm_(x, self.mlp(hidden), self.post_feedforward_layernorm.scale, None, eps)
        return x


@dataclass(frozen=True, slots=True)
class Int8LayerTensors:
    """What Int8DecoderLayer passes to cpu_ops, bound once: each int8 GEMM's arguments (packed
    weights, scales, compensation, output width), the norms' scales and the layer's sizes."""

    input_norm: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_attention_norm: torch.Tensor | None
    pre_feedforward_norm: torch.Tensor | None
    post_feedforward_norm: torch.Tensor | None
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
    o_proj: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    head_eps: float
    scaling: float

    def layer_call_args(
        self,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor], list[int], list[float]]:
        """cpu_ops' int8_decoder_layer's last four arguments, in the order its C++ reads them
        (csrc/decoder_layer.cpp): the norms' scales, each GEMM's packed weights, scales and
        compensation, the sizes, and the constants."""
        norms = [
            self.input_norm, self.q_norm, self.k_norm, self.post_attention_norm,
            self.pre_feedforward_norm, self.post_feedforward_norm,
        ]  # fmt: skip
        gemms = (self.qkv, self.o_proj, self.gate_up, self.down)
        linears = [tensor for gemm in gemms for tensor in gemm[:3]]
        sizes = [self.heads, self.kv_heads, self.head_dim, *(gemm[3] for gemm in gemms)]
        return norms, linears, sizes, [self.eps, self.head_eps, self.scaling]


class Int8DecoderLayer(FusedDecoderLayer):
    """A FusedDecoderLayer whose GEMMs all run on cpu_ops' int8 kernel (CPUs without AMX,
    where the MLP is an Int8GatedMLP), run as one flat sequence of cpu_ops calls on tensors
    bound once instead of through its modules: the same kernels on the same tensors in the
    same order, so the same values bit for bit, without a dozen module calls and attribute
    lookups per layer, which at one decode row cost about as much as the layer's GEMMs.
    A step whose attention is one paged decode chunk (every decode step) runs the whole layer
    as one cpu_ops call, int8_decoder_layer, which calls the same kernels in the same order;
    any other step runs them one by one here, with the attention through PagedAttentionStep's
    write and attend, as CpuOpsAttention does. `python -m evals.bench_step` times a decode
    step both ways."""

    bound: Int8LayerTensors
    call_args: tuple[list[torch.Tensor | None], list[torch.Tensor], list[int], list[float]]

    @staticmethod
    def supports(layer: FusedDecoderLayer) -> bool:
        """Whether `layer` has only the parts this class runs: Gemma 3's attention (its own
        K and V, no value norm or logit softcap) over int8 projections that cpu_ops' kernel
        runs at every row count, an Int8GatedMLP, and no per-layer input or layer scalar."""
        attention, mlp = layer.self_attn, layer.mlp
        if not isinstance(attention, CpuOpsAttention) or not isinstance(mlp, Int8GatedMLP):
            return False
        spec = attention.spec
        projections = (attention.qkv_proj, attention.o_proj)
        return (
            spec.stores_kv
            and not spec.k_eq_v
            and attention.v_norm is None
            and attention.softcap is None
            and all(_every_row_int8(p) is not None for p in projections)
            and not layer.has_per_layer_input
            and layer.layer_scalar is None
            and not layer.bf16_activations
        )

    @classmethod
    def from_layer(cls, layer: FusedDecoderLayer) -> Int8DecoderLayer:
        flat = _adopt(cls, layer)
        attention, mlp = layer.self_attn, layer.mlp
        assert isinstance(attention, CpuOpsAttention) and isinstance(mlp, Int8GatedMLP)
        qkv, o_proj = _every_row_int8(attention.qkv_proj), _every_row_int8(attention.o_proj)
        assert qkv is not None and o_proj is not None
        flat.bound = Int8LayerTensors(
            input_norm=layer.input_layernorm.scale,
            q_norm=attention.q_norm.scale,
            k_norm=attention.k_norm.scale,
            post_attention_norm=layer.post_attention_layernorm.scale,
            pre_feedforward_norm=layer.pre_feedforward_layernorm.scale,
            post_feedforward_norm=layer.post_feedforward_layernorm.scale,
            qkv=(qkv.tiles, qkv.scales, qkv.compensation, qkv.out_features),
            o_proj=(o_proj.tiles, o_proj.scales, o_proj.compensation, o_proj.out_features),
            gate_up=(mlp.gate_up.tiles, mlp.gate_up.scales, mlp.gate_up.compensation, mlp.hidden),
            down=(mlp.down.tiles, mlp.down.scales, mlp.down.compensation, mlp.down.out_features),
            heads=attention.num_heads,
            kv_heads=attention.spec.num_kv_heads,
            head_dim=attention.spec.head_dim,
            eps=layer.input_layernorm.eps,
            head_eps=attention.q_norm.eps,
            scaling=attention.scaling,
        )
        flat.call_args = flat.bound.layer_call_args()
        return flat

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: PagedAttentionStep,
        per_layer_input: torch.Tensor | None,
    ) -> torch.Tensor:
        ops, index = torch.ops.gemma_cpu, self.self_attn.spec.index
        addressing = step.decode_addressing(index)
        if addressing is not None:
            return ops.int8_decoder_layer(x, cos, sin, *addressing, *self.call_args)
        t = self.bound
        heads, kv_heads, dim = t.heads, t.kv_heads, t.head_dim
        projected = ops.packed_int8_linear(
            ops.rms_norm(x, t.input_norm, t.eps, False), *t.qkv, None
        )
        query = ops.norm_rope(projected, 0, heads, dim, t.q_norm, cos, sin, t.head_eps)
        keys = ops.norm_rope(projected, heads * dim, kv_heads, dim, t.k_norm, cos, sin, t.head_eps)
        start = (heads + kv_heads) * dim
        values = projected[:, start : start + kv_heads * dim].view(-1, kv_heads, dim)
        step.write(index, keys, values)
        out = step.attend(index, query, t.scaling)
        attended = ops.packed_int8_linear(out.reshape(x.shape[0], -1), *t.o_proj, None)
        hidden = ops.add_rms_norm_(
            x, attended, t.post_attention_norm, t.pre_feedforward_norm, t.eps, False
        )
        mlp_out = ops.packed_int8_linear(ops.packed_int8_gated(hidden, *t.gate_up), *t.down, None)
        ops.add_rms_norm_(x, mlp_out, t.post_feedforward_norm, None, t.eps, False)
        return x


class Int8TextModel(TextModel):
    """A TextModel whose layers are all Int8DecoderLayer: a step whose attention is one paged
    decode chunk (every decode step) runs the whole stack as one cpu_ops call,
    int8_decoder_stack, which runs each layer as int8_decoder_layer does, so the same values
    bit for bit. Between layers the engine thread then neither pays a Python module call and
    a dispatch nor takes the GIL, which the server's event loop wants while the step runs; any
    other step runs the layers one by one."""

    stack_args: tuple[list[torch.Tensor | None], list[torch.Tensor], list[int], list[float]]

    @classmethod
    def from_model(cls, model: TextModel) -> Int8TextModel:
        flat = _adopt(cls, model)
        parts = [layer.call_args for layer in model.layers if isinstance(layer, Int8DecoderLayer)]
        assert len(parts) == len(model.layers)
        flat.stack_args = (
            [norm for part in parts for norm in part[0]],
            [tensor for part in parts for tensor in part[1]],
            [size for part in parts for size in part[2]],
            [constant for part in parts for constant in part[3]],
        )
        return flat

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedAttentionStep
    ) -> torch.Tensor:
        found = [step.decode_addressing(spec.index) for spec in self.arch.layers]
        addressing = [where for where in found if where is not None]
        if len(addressing) < len(found):
            return super().forward(input_ids, positions, step)
        x = self.embed_tokens(input_ids)
        rotary = self.rotary(positions, x.dtype)
        tables = [rotary[spec.layer_type] for spec in self.arch.layers]
        cos, sin = [table[0] for table in tables], [table[1] for table in tables]
        # Per layer (key pool, value pool, write slots, key slots, mask): a list of each.
        columns = [list(column) for column in zip(*addressing, strict=True)]
        return torch.ops.gemma_cpu.int8_decoder_stack(x, cos, sin, *columns, *self.stack_args)


def _every_row_int8(module: nn.Module) -> PackedInt8Rows | None:
    """The cpu_ops int8 kernel state of an int8 linear that runs it at every row count."""
    if not isinstance(module, (DynamicInt8Linear, OneDNNInt8Linear)):
        return None
    return module.packed_rows if serves_every_row(module.packed_rows) else None


def optimize(
    model: GemmaForCausalLM, kernel: str, fuse_ops: bool | None = None, flat_layers: bool = True
) -> None:
    """Swap `kernel`'s fast modules into `model` in place (nothing for `exact`). `fuse_ops`: run
    the fused CPU kernels (cpu_ops); None: where they run, a CPU float32 model with cpu_ops.
    `flat_layers`: fused layers that can run as Int8DecoderLayer do (False: through their
    modules, to compare)."""
    if kernel == "exact":
        return
    body, head = body_and_head(kernel)
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.self_attn = StackedAttention.from_attention(layer.self_attn, body)
        exact = layer.mlp
        assert isinstance(exact, MLP)
        fused = make_fused_mlp(
            body, exact.gate_proj.weight, exact.up_proj.weight, exact.down_proj.weight
        )
        layer.mlp = fused if fused is not None else GateUpMLP.from_mlp(exact, body)
    quantize_model(model.model, body)
    # A tied head keeps its float embedding table for lookups and gets its own copy.
    model.fast_head = make_linear(head, model.lm_head_weight)
    weights = model.lm_head_weight
    if fuse_ops is None:
        fuse_ops = (
            weights.device.type == "cpu" and weights.dtype == torch.float32 and cpu_ops.available()
        )
    if fuse_ops:
        _fuse_ops(model, flat_layers)


def _fuse_ops(model: GemmaForCausalLM, flat_layers: bool) -> None:
    """The fused CPU kernels in place of the eager ops (see the module doc)."""
    _replace(model.model, RMSNorm, lambda norm: _adopt(FusedRMSNorm, norm))
    _replace(model.model, StackedAttention, lambda attention: _adopt(CpuOpsAttention, attention))
    layers = model.model.layers
    for i, layer in enumerate(layers):
        fused = _adopt(FusedDecoderLayer, layer)
        bf16 = isinstance(fused.mlp, BFloat16GatedMLP)
        fused.bf16_activations = bf16
        norm = fused.input_layernorm
        assert isinstance(norm, FusedRMSNorm)
        norm.bf16_out = bf16
        # The residual add after the attention reads bfloat16 too.
        if isinstance(fused.self_attn.o_proj, BFloat16Linear):
            fused.self_attn.o_proj.bf16_out = bf16
        flat = flat_layers and Int8DecoderLayer.supports(fused)
        layers[i] = Int8DecoderLayer.from_layer(fused) if flat else fused
    if all(type(layer) is Int8DecoderLayer for layer in layers):
        model.model = Int8TextModel.from_model(model.model)


def _replace(root: nn.Module, kind: type[M], make: Callable[[M], nn.Module]) -> None:
    """Replace every module of exactly class `kind` under `root` by make(module)."""
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, make(child))
