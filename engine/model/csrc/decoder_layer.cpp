// A decode step of a Gemma 3 decoder layer whose GEMMs all run on the packed int8 kernel, in one
// call (engine/model/optimize.py's Int8DecoderLayer, when the step's attention is one paged
// decode chunk), and of a whole stack of them (Int8TextModel). It calls the registered ops of
// cpu_ops.cpp and packed_linear.cpp in the order the layer's Python forward calls them, on the
// same tensors, so its values are theirs bit for bit. What it saves is the per-op cost around
// them: at one decode row a layer's eleven ops each paid a Python call, a dispatch from Python
// and an argument parse, about as long as the layer's small ops' arithmetic, and the engine
// thread held the GIL for each, which the server's event loop waits on.
// `python -m evals.bench_step` times a decode step with and without it.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> registered(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using OptionalTensor = std::optional<at::Tensor>;
using OptionalTensors = c10::List<OptionalTensor>;

// Indices into the layer's argument lists (Int8LayerTensors.layer_call_args builds them).
enum Norm { kInput, kQuery, kKey, kPostAttention, kPreFeedforward, kPostFeedforward, kNorms };
enum Linear { kQkv, kOutput, kGateUp, kDown, kLinears };  // each as (packed, scales, compensation)
enum Size { kHeads, kKvHeads, kHeadDim, kQkvOut, kOutputOut, kHidden, kDownOut, kSizes };
enum Constant { kEps, kHeadEps, kScaling, kConstants };

// x (float32 [rows, hidden], the residual stream) advanced through the layer in place:
// input norm, the fused QKV projection, query and key norms with RoPE, the new keys and values
// stored at write_slots, attention over key_slots (mask: additive [rows, keys]), the output
// projection, the post-attention residual step, the gated MLP and its residual step. The
// layer's norms are norms[first_norm, first_norm + kNorms); linears, sizes and constants are
// its own.
void decoder_layer(at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin,
                   at::Tensor& key_pool, at::Tensor& value_pool, const at::Tensor& write_slots,
                   const at::Tensor& key_slots, const at::Tensor& mask,
                   const OptionalTensors& norms, int64_t first_norm, at::TensorList linears,
                   at::IntArrayRef sizes, at::ArrayRef<double> constants) {
  static const auto rms_norm =
      registered<at::Tensor(const at::Tensor&, const OptionalTensor&, double, bool)>(
          "gemma_cpu::rms_norm");
  static const auto add_rms_norm_ =
      registered<at::Tensor(at::Tensor&, const at::Tensor&, const OptionalTensor&,
                            const OptionalTensor&, double, bool)>("gemma_cpu::add_rms_norm_");
  static const auto norm_rope =
      registered<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t, const OptionalTensor&,
                            const at::Tensor&, const at::Tensor&, double)>("gemma_cpu::norm_rope");
  static const auto store_kv =
      registered<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&)>("gemma_cpu::store_kv");
  static const auto attention =
      registered<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double)>(
          "gemma_cpu::paged_decode_attention");
  static const auto linear =
      registered<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, int64_t, const OptionalTensor&)>(
          "gemma_cpu::packed_int8_linear");
  static const auto gated =
      registered<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, int64_t)>("gemma_cpu::packed_int8_gated");

  auto run_linear = [&](const at::Tensor& input, Linear which, int64_t out_features) {
    const int64_t i = 3 * which;
    return linear.call(input, linears[i], linears[i + 1], linears[i + 2], out_features,
                       std::nullopt);
  };
  auto norm = [&](Norm which) { return norms.get(first_norm + which); };
  const int64_t heads = sizes[kHeads], kv_heads = sizes[kKvHeads], dim = sizes[kHeadDim];
  const double eps = constants[kEps], head_eps = constants[kHeadEps];

  const at::Tensor projected =
      run_linear(rms_norm.call(x, norm(kInput), eps, false), kQkv, sizes[kQkvOut]);
  const at::Tensor query =
      norm_rope.call(projected, 0, heads, dim, norm(kQuery), cos, signed_sin, head_eps);
  const at::Tensor keys =
      norm_rope.call(projected, heads * dim, kv_heads, dim, norm(kKey), cos, signed_sin, head_eps);
  const at::Tensor values =
      projected.narrow(1, (heads + kv_heads) * dim, kv_heads * dim).view({-1, kv_heads, dim});
  store_kv.call(key_pool, value_pool, write_slots, keys, values);
  const at::Tensor attended =
      attention.call(query, key_pool, value_pool, key_slots, mask, constants[kScaling]);
  const at::Tensor output =
      run_linear(attended.reshape({x.size(0), -1}), kOutput, sizes[kOutputOut]);
  const at::Tensor hidden = add_rms_norm_.call(x, output, norm(kPostAttention),
                                               norm(kPreFeedforward), eps, false);
  const int64_t g = 3 * kGateUp;
  const at::Tensor product =
      gated.call(hidden, linears[g], linears[g + 1], linears[g + 2], sizes[kHidden]);
  add_rms_norm_.call(x, run_linear(product, kDown, sizes[kDownOut]), norm(kPostFeedforward),
                     std::nullopt, eps, false);
}

// One layer (Int8DecoderLayer's paged decode step).
at::Tensor int8_decoder_layer(at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin,
                              at::Tensor& key_pool, at::Tensor& value_pool,
                              const at::Tensor& write_slots, const at::Tensor& key_slots,
                              const at::Tensor& mask, const OptionalTensors& norms,
                              at::TensorList linears, at::IntArrayRef sizes,
                              at::ArrayRef<double> constants) {
  TORCH_CHECK(norms.size() == kNorms && linears.size() == 3 * kLinears && sizes.size() == kSizes &&
                  constants.size() == kConstants,
              "int8_decoder_layer takes 6 norms, 4 packed linears, 7 sizes and 3 constants");
  decoder_layer(x, cos, signed_sin, key_pool, value_pool, write_slots, key_slots, mask, norms, 0,
                linears, sizes, constants);
  return x;
}

// Every layer of the model in turn (Int8TextModel's paged decode step): the lists hold layer
// i's arguments at i (its norms, linears, sizes and constants as int8_decoder_layer's, one
// layer's after another). One call instead of one per layer: between layers the engine
// thread neither takes the GIL nor pays a dispatch from Python.
at::Tensor int8_decoder_stack(at::Tensor& x, at::TensorList cos, at::TensorList signed_sin,
                              at::TensorList key_pools, at::TensorList value_pools,
                              at::TensorList write_slots, at::TensorList key_slots,
                              at::TensorList masks, const OptionalTensors& norms,
                              at::TensorList linears, at::IntArrayRef sizes,
                              at::ArrayRef<double> constants) {
  const int64_t layers = static_cast<int64_t>(cos.size());
  for (const size_t n : {signed_sin.size(), key_pools.size(), value_pools.size(),
                         write_slots.size(), key_slots.size(), masks.size()}) {
    TORCH_CHECK(static_cast<int64_t>(n) == layers, "int8_decoder_stack takes a tensor per layer");
  }
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == kNorms * layers &&
                  static_cast<int64_t>(linears.size()) == 3 * kLinears * layers &&
                  static_cast<int64_t>(sizes.size()) == kSizes * layers &&
                  static_cast<int64_t>(constants.size()) == kConstants * layers,
              "int8_decoder_stack takes 6 norms, 4 packed linears, 7 sizes and 3 constants a layer");
  for (int64_t i = 0; i < layers; ++i) {
    at::Tensor key_pool = key_pools[i], value_pool = value_pools[i];
    decoder_layer(x, cos[i], signed_sin[i], key_pool, value_pool, write_slots[i], key_slots[i],
                  masks[i], norms, kNorms * i, linears.slice(3 * kLinears * i, 3 * kLinears),
                  sizes.slice(kSizes * i, kSizes), constants.slice(kConstants * i, kConstants));
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemma_cpu, m) {
  m.def(
      "int8_decoder_layer(Tensor(a!) x, Tensor cos, Tensor signed_sin, Tensor(b!) key_pool, "
      "Tensor(c!) value_pool, Tensor write_slots, Tensor key_slots, Tensor mask, Tensor?[] norms, "
      "Tensor[] linears, int[] sizes, float[] constants) -> Tensor(a!)");
  m.def(
      "int8_decoder_stack(Tensor(a!) x, Tensor[] cos, Tensor[] signed_sin, "
      "Tensor(b!)[] key_pools, Tensor(c!)[] value_pools, Tensor[] write_slots, "
      "Tensor[] key_slots, Tensor[] masks, Tensor?[] norms, Tensor[] linears, int[] sizes, "
      "float[] constants) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(gemma_cpu, CPU, m) {
  m.impl("int8_decoder_layer", &int8_decoder_layer);
  m.impl("int8_decoder_stack", &int8_decoder_stack);
}
