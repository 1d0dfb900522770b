// Fused CPU kernels for the elementwise work between Gemma's GEMMs (engine/model/cpu_ops.py).
//
// In eager PyTorch a Gemma RMSNorm is eight small ops (cast, pow, mean, add, rsqrt, two muls,
// cast) and a decoder layer runs six of them plus two residual adds; at decode sizes each op
// costs more in dispatch and allocation than in arithmetic. Each kernel here does one pass over
// a row. Sums run in another order than torch's, so results match the eager ops to float32
// rounding, not bit for bit: NUMERICS=exact never calls these. The last kernel, gumbel_argmax, is
// the sampler's: it sums nothing, and engine/sampler.py calls it in every mode.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "vector_math.h"

namespace {

// Rows per parallel task: decode-sized batches run on the calling thread, with no fork/join.
constexpr int64_t kRowsPerTask = 32;

// Activations arrive as float32, or as bfloat16 where the layers' GEMMs run in bfloat16
// (WEIGHTS=bf16*): those GEMMs read and write bfloat16, so passing their rounding along saves a
// cast per GEMM and changes no value. A bfloat16 row is widened (exactly) into float32 first,
// so the arithmetic is the float32 path's, bit for bit; narrowing rounds to nearest even, as
// PyTorch's cast does.
// A row of a KV pool as float32 (a bfloat16 widens exactly: its bits are float32's top half).
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &widened, 4);
    dst[i] = value;
  }
}

// The row at x as float32: x itself, or widened into `buffer`.
inline const float* float_row(const float* x, int64_t, float*) { return x; }

inline const float* float_row(const c10::BFloat16* x, int64_t n, float* buffer) {
  load_row(x, buffer, n);
  return buffer;
}

template <typename out_t>
inline out_t narrow(float value) {
  return static_cast<out_t>(value);
}

// 1 / sqrt(mean(x^2) + eps) over one row.
inline float inverse_rms(const float* x, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    sum += x[i] * x[i];
  }
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// out = (x * inverse_rms(x)) * scale, or without the scale.
template <typename out_t>
inline void normalize_row(const float* x, const float* scale, out_t* out, int64_t n, float eps) {
  const float r = inverse_rms(x, n, eps);
  if (scale != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      out[i] = narrow<out_t>((x[i] * r) * scale[i]);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      out[i] = narrow<out_t>(x[i] * r);
    }
  }
}

const float* scale_data(const std::optional<at::Tensor>& scale, int64_t n) {
  if (!scale.has_value()) {
    return nullptr;
  }
  TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == n,
              "the norm scale must be a contiguous float32 vector of the row width");
  return scale->data_ptr<float>();
}

void check_float(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor");
}

void check_activation(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor");
}

// Calls body(in_t{}) with in_t the C++ type of x's dtype (float32 or bfloat16).
template <typename Body>
void with_activation_type(const at::Tensor& x, Body body) {
  if (x.scalar_type() == at::kBFloat16) {
    body(c10::BFloat16{});
  } else {
    body(float{});
  }
}

// Calls body(in_t{}, out_t{}) with the C++ types of x's and out's dtypes.
template <typename Body>
void with_activation_types(const at::Tensor& x, const at::Tensor& out, Body body) {
  with_activation_type(x, [&](auto in_type) {
    with_activation_type(out, [&](auto out_type) { body(in_type, out_type); });
  });
}

at::ScalarType output_type(bool bf16_out) { return bf16_out ? at::kBFloat16 : at::kFloat; }

// Gemma's RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * scale, in bfloat16
// with bf16_out, else float32.
at::Tensor rms_norm(const at::Tensor& input, const std::optional<at::Tensor>& scale, double eps,
                    bool bf16_out) {
  check_activation(input, "x");
  const at::Tensor x = input.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float* s = scale_data(scale, n);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(output_type(bf16_out)));
  const float e = static_cast<float>(eps);
  with_activation_types(x, out, [&](auto in_type, auto out_type) {
    using in_t = decltype(in_type);
    using out_t = decltype(out_type);
    const in_t* in = x.data_ptr<in_t>();
    out_t* o = out.data_ptr<out_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      std::vector<float> widened(n);
      for (int64_t row = begin; row < end; ++row) {
        normalize_row(float_row(in + row * n, n, widened.data()), s, o + row * n, n, e);
      }
    });
  });
  return out;
}

// The residual step of a decoder layer: residual (float32) += rms_norm(x, post_scale), in place;
// returns rms_norm(residual, pre_scale) (the next sublayer's input, bfloat16 with bf16_out), or
// an empty tensor without pre_scale.
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& input,
                         const std::optional<at::Tensor>& post_scale,
                         const std::optional<at::Tensor>& pre_scale, double eps,
                         bool bf16_out) {
  check_float(residual, "residual");
  check_activation(input, "x");
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous");
  const at::Tensor x = input.contiguous();
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual and x must have the same shape");
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float* post = scale_data(post_scale, n);
  const float* pre = scale_data(pre_scale, n);
  at::Tensor out = at::empty(pre != nullptr ? x.sizes() : at::IntArrayRef{0},
                             x.options().dtype(output_type(bf16_out)));
  float* res = residual.data_ptr<float>();
  const float e = static_cast<float>(eps);
  with_activation_types(x, out, [&](auto in_type, auto out_type) {
    using in_t = decltype(in_type);
    using out_t = decltype(out_type);
    const in_t* in = x.data_ptr<in_t>();
    out_t* o = pre != nullptr ? out.data_ptr<out_t>() : nullptr;
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      std::vector<float> widened(n);
      for (int64_t row = begin; row < end; ++row) {
        const float* xr = float_row(in + row * n, n, widened.data());
        float* rr = res + row * n;
        const float r = inverse_rms(xr, n, e);
        if (post != nullptr) {
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) {
            rr[i] += (xr[i] * r) * post[i];
          }
        } else {
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) {
            rr[i] += xr[i] * r;
          }
        }
        if (o != nullptr) {
          normalize_row(rr, pre, o + row * n, n, e);
        }
      }
    });
  });
  return out;
}

// Query or key heads of a projection, normalized and rotated: for rows t of x ([T, W], float32
// or bfloat16; rows may be strided, columns contiguous), heads h at columns offset + h * D:
// n = rms_norm(head, scale), then n * cos[t] + roll(n, D / 2) * signed_sin[t] (rotate-half RoPE
// with the first half of the sine negated, as gemma.py's tables hold it). Returns [T, heads, D]
// float32.
at::Tensor norm_rope(const at::Tensor& x, int64_t offset, int64_t heads, int64_t head_dim,
                     const std::optional<at::Tensor>& scale, const at::Tensor& cos_table,
                     const at::Tensor& signed_sin_table, double eps) {
  check_activation(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, W] with contiguous rows");
  TORCH_CHECK(head_dim % 2 == 0 && offset >= 0 && offset + heads * head_dim <= x.size(1),
              "heads out of the projection's columns");
  const int64_t tokens = x.size(0);
  const at::Tensor cos_c = cos_table.contiguous();
  const at::Tensor sin_c = signed_sin_table.contiguous();
  check_float(cos_c, "cos");
  check_float(sin_c, "sin");
  TORCH_CHECK(cos_c.numel() == tokens * head_dim && sin_c.numel() == tokens * head_dim,
              "the RoPE tables must hold [T, head_dim] values");
  const float* s = scale_data(scale, head_dim);
  at::Tensor out = at::empty({tokens, heads, head_dim}, x.options().dtype(at::kFloat));
  const int64_t row_stride = x.stride(0);
  const float* cos_data = cos_c.data_ptr<float>();
  const float* sin_data = sin_c.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t half = head_dim / 2;
  const float e = static_cast<float>(eps);
  with_activation_type(x, [&](auto in_type) {
    using in_t = decltype(in_type);
    const in_t* in = x.data_ptr<in_t>();
    at::parallel_for(0, tokens * heads, kRowsPerTask, [&](int64_t begin, int64_t end) {
      std::vector<float> normed(head_dim), widened(head_dim);
      for (int64_t index = begin; index < end; ++index) {
        const int64_t t = index / heads;
        const int64_t h = index % heads;
        const in_t* head = in + t * row_stride + offset + h * head_dim;
        normalize_row(float_row(head, head_dim, widened.data()), s, normed.data(), head_dim, e);
        const float* c = cos_data + t * head_dim;
        const float* sn = sin_data + t * head_dim;
        float* dst = o + index * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          dst[i] = normed[i] * c[i] + normed[i + half] * sn[i];
        }
#pragma omp simd
        for (int64_t i = half; i < head_dim; ++i) {
          dst[i] = normed[i] * c[i] + normed[i - half] * sn[i];
        }
      }
    });
  });
  return out;
}

#if defined(__AVX512F__)
// 16 floats of a pool row from `src`, widened from bfloat16 where the pool holds it.
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }

inline __m512 load16(const c10::BFloat16* src) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 floats of a pool row from `src`, as load16.
inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }

inline __m256 load8(const c10::BFloat16* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#define GEMMA_AVX2_ATTENTION 1
#endif

// A mask entry at or below this marks a key the query must not see (masks hold the dtype's
// minimum there): it is skipped, never read.
constexpr float kMasked = -1e30f;

// Keys ahead of the one being scored whose rows decode attention prefetches.
constexpr int64_t kPrefetchAhead = 4;

// One (sequence, KV head) of decode attention: its `group` query heads q ([group, D]), keys and
// values at `slots` in the pools (row stride `pool_stride`), additive `mask` over its `keys`
// keys; `scores` ([group, keys]) and `inverse_total` ([group]) are its scratch, out
// ([group, D]) its result. The three passes below each take a part of it, so that one task's
// work can be shared between threads (decode_attention_kernel).
template <typename kv_t>
struct DecodeTask {
  const float* q;
  const kv_t* keys_at;
  const kv_t* values_at;
  int64_t pool_stride;
  const int64_t* slots;
  const float* mask;
  int64_t keys, group, head_dim;
  float scale;
  float* scores;
  float* inverse_total;
  float* out;
};

#if defined(GEMMA_AVX2_ATTENTION)
// With AVX2: the scores of H query heads (q [H, d]) for one key, sharing each load of the key,
// two accumulators per head (one dependent chain per dot product would leave the FMA units
// waiting). scores[h * stride] gets head h's.
template <int H, typename kv_t>
inline void score_heads(const float* q, const kv_t* key, int64_t d, float scale, float mask,
                        float* scores, int64_t stride) {
  __m256 acc[H][2];
  for (auto& head : acc) {
    head[0] = head[1] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < d; i += 16) {
    const __m256 k0 = load8(key + i), k1 = load8(key + i + 8);
    for (int h = 0; h < H; ++h) {
      acc[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), k0, acc[h][0]);
      acc[h][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i + 8), k1, acc[h][1]);
    }
  }
  for (int h = 0; h < H; ++h) {
    scores[h * stride] = reduce_add_ps(_mm256_add_ps(acc[h][0], acc[h][1])) * scale + mask;
  }
}
#endif

// The scores of keys [begin, end) for every query head of the task. `row` ([D]) is scratch.
template <typename kv_t>
void score_keys(const DecodeTask<kv_t>& t, int64_t begin, int64_t end, float* row) {
  const int64_t d = t.head_dim, keys = t.keys, group = t.group;
  const float* q = t.q;
  const float* mask = t.mask;
  float* scores = t.scores;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(kv_t));
  // With AVX-512, four query heads share each load of a key, in four independent
  // accumulators (one dependent chain per dot product would leave the FMA units waiting).
  for (int64_t k = begin; k < end; ++k) {
    // Keys and values sit at scattered slots, which the hardware does not prefetch: ask for
    // the key a few rows ahead, and for its value (read after the softmax) into L2.
    if (k + kPrefetchAhead < keys && mask[k + kPrefetchAhead] > kMasked) {
      const int64_t ahead = t.slots[k + kPrefetchAhead] * t.pool_stride;
      const char* key_row = reinterpret_cast<const char*>(t.keys_at + ahead);
      const char* value_row = reinterpret_cast<const char*>(t.values_at + ahead);
      for (int64_t line = 0; line < row_bytes; line += 64) {
        __builtin_prefetch(key_row + line, 0, 3);
        __builtin_prefetch(value_row + line, 0, 2);
      }
    }
    if (mask[k] <= kMasked) {
      continue;
    }
    const kv_t* key = t.keys_at + t.slots[k] * t.pool_stride;
    int64_t g = 0;
#if defined(__AVX512F__)
    for (; g + 4 <= group && d % 16 == 0; g += 4) {
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        const __m512 kv = load16(key + i);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + i), kv, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + (g + 1) * d + i), kv, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q + (g + 2) * d + i), kv, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q + (g + 3) * d + i), kv, a3);
      }
      scores[g * keys + k] = _mm512_reduce_add_ps(a0) * t.scale + mask[k];
      scores[(g + 1) * keys + k] = _mm512_reduce_add_ps(a1) * t.scale + mask[k];
      scores[(g + 2) * keys + k] = _mm512_reduce_add_ps(a2) * t.scale + mask[k];
      scores[(g + 3) * keys + k] = _mm512_reduce_add_ps(a3) * t.scale + mask[k];
    }
#elif defined(GEMMA_AVX2_ATTENTION)
    if (d % 16 == 0) {
      for (; g + 4 <= group; g += 4) {
        score_heads<4>(q + g * d, key, d, t.scale, mask[k], scores + g * keys + k, keys);
      }
      for (; g < group; ++g) {
        score_heads<1>(q + g * d, key, d, t.scale, mask[k], scores + g * keys + k, keys);
      }
    }
#endif
    if (g < group) {
      load_row(key, row, d);
      for (; g < group; ++g) {
        const float* qg = q + g * d;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) {
          dot += qg[i] * row[i];
        }
        scores[g * keys + k] = dot * t.scale + mask[k];
      }
    }
  }
}

// The task's scores turned into softmax numerators in place, and 1 / their sum per query head
// into inverse_total (weigh_values scales the output by it).
template <typename kv_t>
void softmax_scores(const DecodeTask<kv_t>& t) {
  const int64_t keys = t.keys;
  const float* mask = t.mask;
  for (int64_t g = 0; g < t.group; ++g) {
    float* sg = t.scores + g * keys;
    float top = kMasked;
    int64_t k = 0;
#if defined(__AVX512F__)
    // 16 keys at a time; a masked key's score is never read (it was never written).
    const __m512 masked = _mm512_set1_ps(kMasked);
    __m512 tops = masked;
    for (; k + 16 <= keys; k += 16) {
      const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_loadu_ps(mask + k), masked, _CMP_GT_OQ);
      tops = _mm512_mask_max_ps(tops, seen, tops, _mm512_loadu_ps(sg + k));
    }
    top = _mm512_reduce_max_ps(tops);
#elif defined(GEMMA_AVX2_ATTENTION)
    // 8 keys at a time; a masked lane keeps the running maximum (its score was never written).
    const __m256 masked = _mm256_set1_ps(kMasked);
    __m256 tops = masked;
    for (; k + 8 <= keys; k += 8) {
      const __m256 seen = _mm256_cmp_ps(_mm256_loadu_ps(mask + k), masked, _CMP_GT_OQ);
      tops = _mm256_blendv_ps(tops, _mm256_max_ps(tops, _mm256_loadu_ps(sg + k)), seen);
    }
    top = reduce_max_ps(tops);
#endif
    for (; k < keys; ++k) {
      top = mask[k] <= kMasked ? top : std::max(top, sg[k]);
    }
    float total = 0.f;
    k = 0;
#if defined(__AVX512F__)
    const __m512 top_lanes = _mm512_set1_ps(top);
    __m512 totals = _mm512_setzero_ps();
    for (; k + 16 <= keys; k += 16) {
      const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_loadu_ps(mask + k), masked, _CMP_GT_OQ);
      const __m512 p = _mm512_maskz_mov_ps(
          seen, exp_nonpositive_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + k), top_lanes)));
      _mm512_storeu_ps(sg + k, p);
      totals = _mm512_add_ps(totals, p);
    }
    total = _mm512_reduce_add_ps(totals);
#elif defined(GEMMA_AVX2_ATTENTION)
    const __m256 top_lanes = _mm256_set1_ps(top);
    __m256 totals = _mm256_setzero_ps();
    for (; k + 8 <= keys; k += 8) {
      const __m256 seen = _mm256_cmp_ps(_mm256_loadu_ps(mask + k), masked, _CMP_GT_OQ);
      const __m256 p = _mm256_and_ps(
          seen, exp_nonpositive_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + k), top_lanes)));
      _mm256_storeu_ps(sg + k, p);
      totals = _mm256_add_ps(totals, p);
    }
    total = reduce_add_ps(totals);
#endif
    for (; k < keys; ++k) {
      const float p = mask[k] <= kMasked ? 0.f : exp_nonpositive(sg[k] - top);
      sg[k] = p;
      total += p;
    }
    t.inverse_total[g] = 1.f / total;
  }
}

#if defined(GEMMA_AVX2_ATTENTION)
// With AVX2: weigh_values' columns [begin, end) of query heads [g, g + H), 16 at a time, each
// 16 columns of H heads in registers while every key's values stream past.
template <int H, typename kv_t>
void weigh_heads(const DecodeTask<kv_t>& t, int64_t g, int64_t begin, int64_t end) {
  const int64_t keys = t.keys;
  for (int64_t col = begin; col < end; col += 16) {
    __m256 acc[H][2];
    for (auto& head : acc) {
      head[0] = head[1] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < keys; ++k) {
      if (k + kPrefetchAhead < keys && t.mask[k + kPrefetchAhead] > kMasked) {
        __builtin_prefetch(t.values_at + t.slots[k + kPrefetchAhead] * t.pool_stride + col, 0, 3);
      }
      if (t.mask[k] <= kMasked) {
        continue;
      }
      const kv_t* value = t.values_at + t.slots[k] * t.pool_stride + col;
      const __m256 v0 = load8(value), v1 = load8(value + 8);
      for (int h = 0; h < H; ++h) {
        const __m256 p = _mm256_set1_ps(t.scores[(g + h) * keys + k]);
        acc[h][0] = _mm256_fmadd_ps(p, v0, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(p, v1, acc[h][1]);
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 inverse = _mm256_set1_ps(t.inverse_total[g + h]);
      float* o = t.out + (g + h) * t.head_dim + col;
      _mm256_storeu_ps(o, _mm256_mul_ps(acc[h][0], inverse));
      _mm256_storeu_ps(o + 8, _mm256_mul_ps(acc[h][1], inverse));
    }
  }
}
#endif

// The task's output columns [begin, end): the softmax-weighted values, over inverse_total.
// Each column sums the keys in the same order whatever the range, so the bits do not depend
// on how the columns are split. `row` ([D]) is scratch.
template <typename kv_t>
void weigh_values(const DecodeTask<kv_t>& t, int64_t begin, int64_t end, float* row) {
  const int64_t d = t.head_dim, keys = t.keys, group = t.group, width = end - begin;
  const float* mask = t.mask;
  const int64_t* slots = t.slots;
  const float* scores = t.scores;
  // With AVX-512, 64 output columns of four query heads stay in 16 registers while every
  // key's values stream past, so nothing is stored until the tile is done.
  int64_t g = 0;
#if defined(__AVX512F__)
  for (; g + 4 <= group && width % 64 == 0; g += 4) {
    for (int64_t col = begin; col < end; col += 64) {
      __m512 acc[4][4];
      for (auto& head : acc) {
        for (auto& part : head) {
          part = _mm512_setzero_ps();
        }
      }
      for (int64_t k = 0; k < keys; ++k) {
        // The score pass asked for the values in L2; this tile's part of a row a few keys
        // ahead into L1 (two lines: 64 bfloat16, or the first half of 64 float32).
        if (k + kPrefetchAhead < keys && mask[k + kPrefetchAhead] > kMasked) {
          const char* ahead = reinterpret_cast<const char*>(
              t.values_at + slots[k + kPrefetchAhead] * t.pool_stride + col);
          __builtin_prefetch(ahead, 0, 3);
          __builtin_prefetch(ahead + 64, 0, 3);
        }
        if (mask[k] <= kMasked) {
          continue;
        }
        const kv_t* value = t.values_at + slots[k] * t.pool_stride + col;
        const __m512 v[4] = {load16(value), load16(value + 16), load16(value + 32),
                             load16(value + 48)};
        for (int64_t h = 0; h < 4; ++h) {
          const __m512 p = _mm512_set1_ps(scores[(g + h) * keys + k]);
          for (int64_t part = 0; part < 4; ++part) {
            acc[h][part] = _mm512_fmadd_ps(p, v[part], acc[h][part]);
          }
        }
      }
      for (int64_t h = 0; h < 4; ++h) {
        const __m512 inverse = _mm512_set1_ps(t.inverse_total[g + h]);
        for (int64_t part = 0; part < 4; ++part) {
          _mm512_storeu_ps(t.out + (g + h) * d + col + part * 16,
                           _mm512_mul_ps(acc[h][part], inverse));
        }
      }
    }
  }
#elif defined(GEMMA_AVX2_ATTENTION)
  if (width % 16 == 0) {
    for (; g + 4 <= group; g += 4) {
      weigh_heads<4>(t, g, begin, end);
    }
    for (; g < group; ++g) {
      weigh_heads<1>(t, g, begin, end);
    }
  }
#endif
  for (int64_t h = g; h < group; ++h) {
    std::fill(t.out + h * d + begin, t.out + h * d + end, 0.f);
  }
  if (g < group) {
    for (int64_t k = 0; k < keys; ++k) {
      if (mask[k] <= kMasked) {
        continue;
      }
      load_row(t.values_at + slots[k] * t.pool_stride + begin, row, width);
      for (int64_t h = g; h < group; ++h) {
        const float p = scores[h * keys + k];
        float* o = t.out + h * d + begin;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
          o[i] += p * row[i];
        }
      }
    }
    for (int64_t h = g; h < group; ++h) {
      float* o = t.out + h * d + begin;
      const float inverse = t.inverse_total[h];
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        o[i] *= inverse;
      }
    }
  }
}

// Keys below which one decode task is never shared between threads: the barriers between the
// shared passes cost more than the work they would split.
constexpr int64_t kShareMinKeys = 64;

template <typename kv_t>
void decode_attention_kernel(const float* query, const kv_t* key_pool, const kv_t* value_pool,
                             const int64_t* slots, const float* mask, float* out, int64_t seqs,
                             int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t keys,
                             float scale) {
  const int64_t group = heads / kv_heads, tasks = seqs * kv_heads;
  // Task `task`'s pointers into the batch, with its scratch.
  auto task_at = [&](int64_t task, float* scores, float* inverse_total) {
    const int64_t seq = task / kv_heads, kv_head = task % kv_heads;
    // The query heads sharing this KV head are consecutive: kv_head * group + g.
    const int64_t first = (seq * heads + kv_head * group) * head_dim;
    DecodeTask<kv_t> t;
    t.q = query + first;
    t.keys_at = key_pool + kv_head * head_dim;
    t.values_at = value_pool + kv_head * head_dim;
    t.pool_stride = kv_heads * head_dim;
    t.slots = slots + seq * keys;
    t.mask = mask + seq * keys;
    t.keys = keys;
    t.group = group;
    t.head_dim = head_dim;
    t.scale = scale;
    t.scores = scores;
    t.inverse_total = inverse_total;
    t.out = out + first;
    return t;
  };
  const int64_t threads = omp_get_max_threads();
  if (tasks >= threads || keys < kShareMinKeys || omp_in_parallel()) {
    // A task per thread at a time, each whole.
    parallel_chunks(tasks, balanced_chunk(tasks), [&](int64_t begin, int64_t end) {
      std::vector<float> scores(group * keys), inverse_total(group), row(head_dim);
      for (int64_t task = begin; task < end; ++task) {
        const DecodeTask<kv_t> t = task_at(task, scores.data(), inverse_total.data());
        score_keys(t, 0, keys, row.data());
        softmax_scores(t);
        weigh_values(t, 0, head_dim, row.data());
      }
    });
    return;
  }
  // Fewer tasks than threads (a decode step of one sequence): every thread scores a share of
  // each task's keys, then weighs a share of its output columns, each block and tile handed to
  // whichever thread comes free (as parallel_chunks hands out runs, for a thread the event loop
  // displaces). Each score and each column is computed as the whole-task path computes it, so
  // the result is the same bit for bit whoever takes which.
  std::vector<float> scores(tasks * group * keys), inverse_total(tasks * group);
  const int64_t block = std::max<int64_t>(16, (keys + 4 * threads - 1) / (4 * threads));
  const int64_t blocks = (keys + block - 1) / block;
  const int64_t tile = head_dim % 64 == 0 ? 64 : head_dim;
  const int64_t tiles = head_dim / tile;
  auto shared = [&](int64_t task) {
    return task_at(task, scores.data() + task * group * keys, inverse_total.data() + task * group);
  };
#pragma omp parallel
  {
    std::vector<float> row(head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks * blocks; ++i) {
      const int64_t first = (i % blocks) * block;
      score_keys(shared(i / blocks), first, std::min(keys, first + block), row.data());
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      softmax_scores(shared(task));
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks * tiles; ++i) {
      const int64_t first = (i % tiles) * tile;
      weigh_values(shared(i / tiles), first, first + tile, row.data());
    }
  }
}

// Decode attention read in place from the paged pools, with no gathered copy of anyone's K/V:
// for each sequence b and query head h, softmax_k(q[b, h] . K[slots[b, k]] * scale + mask[b, k])
// times V at the same slots. query [B, H, D] float32; pools [S, Hkv, D] float32 or bfloat16;
// slots [B, K] int64; mask [B, K] additive, its masked keys skipped.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_pool,
                                  const at::Tensor& value_pool, const at::Tensor& slots,
                                  const at::Tensor& mask, double scale) {
  check_float(query, "query");
  TORCH_CHECK(query.dim() == 3 && key_pool.dim() == 3, "query [B, H, D] and pools [S, Hkv, D]");
  TORCH_CHECK(key_pool.sizes() == value_pool.sizes() &&
                  key_pool.scalar_type() == value_pool.scalar_type() &&
                  key_pool.is_contiguous() && value_pool.is_contiguous(),
              "the key and value pools must be contiguous and alike");
  const int64_t seqs = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = key_pool.size(1);
  TORCH_CHECK(key_pool.size(2) == head_dim && kv_heads > 0 && heads % kv_heads == 0,
              "the query and pool head sizes do not match");
  TORCH_CHECK(slots.scalar_type() == at::kLong && seqs > 0 && slots.numel() % seqs == 0,
              "slots must be int64 [B, K]");
  const int64_t keys = slots.numel() / seqs;
  TORCH_CHECK(mask.numel() == seqs * keys, "mask must be [B, K]");
  const at::Tensor q = query.contiguous();
  const at::Tensor s = slots.contiguous();
  const at::Tensor m = mask.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({seqs, heads, head_dim}, query.options());
  const float sc = static_cast<float>(scale);
  if (key_pool.scalar_type() == at::kFloat) {
    decode_attention_kernel(q.data_ptr<float>(), key_pool.data_ptr<float>(),
                            value_pool.data_ptr<float>(), s.data_ptr<int64_t>(),
                            m.data_ptr<float>(), out.data_ptr<float>(), seqs, heads, kv_heads,
                            head_dim, keys, sc);
  } else {
    TORCH_CHECK(key_pool.scalar_type() == at::kBFloat16, "pools must be float32 or bfloat16");
    decode_attention_kernel(q.data_ptr<float>(), key_pool.data_ptr<c10::BFloat16>(),
                            value_pool.data_ptr<c10::BFloat16>(), s.data_ptr<int64_t>(),
                            m.data_ptr<float>(), out.data_ptr<float>(), seqs, heads, kv_heads,
                            head_dim, keys, sc);
  }
  return out;
}

#if defined(__AVX512F__)
// 16 floats rounded to bfloat16 as c10::BFloat16(float) rounds them: to nearest even, NaN to
// 0x7FC0 (AVX512-BF16's conversion would flush denormals to zero).
inline __m256i round_to_bfloat16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

// A float32 row of `width` (a multiple of 32) written to `to` (64-byte aligned) as bfloat16 with
// streaming stores: a whole line at a time straight to memory, without first reading the line
// for ownership as a cached store must. A new token's row lands in a line nothing has cached,
// and a step's rows are scattered over the pools, so cached stores waited on those reads.
inline void stream_bfloat16_row(const float* from, c10::BFloat16* to, int64_t width) {
  for (int64_t i = 0; i < width; i += 32) {
    const __m256i low = round_to_bfloat16(_mm512_loadu_ps(from + i));
    const __m256i high = round_to_bfloat16(_mm512_loadu_ps(from + i + 16));
    _mm512_stream_si512(reinterpret_cast<__m512i*>(to + i),
                        _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1));
  }
}
#endif

// A layer's new keys and values written into its pools at `slots`: pool[slots[n]] = rows[n],
// rounded to the pool's dtype to nearest even as a cast rounds, so the pools hold what
// index_copy_ of the cast rows would, in one op instead of four. keys and values [N, Hkv, D]
// float32 or bfloat16, each row's Hkv x D elements contiguous (rows may be strided: the values
// are columns of the fused projection); pools [S, Hkv, D] float32 or bfloat16.
void store_kv(at::Tensor& key_pool, at::Tensor& value_pool, const at::Tensor& slots,
              const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(key_pool.is_contiguous() && value_pool.is_contiguous() &&
                  key_pool.sizes() == value_pool.sizes() && key_pool.dim() == 3,
              "the pools must be contiguous [S, Hkv, D] and alike");
  const int64_t width = key_pool.size(1) * key_pool.size(2);
  const at::Tensor s = slots.contiguous();
  TORCH_CHECK(s.scalar_type() == at::kLong && s.dim() == 1, "slots must be int64 [N]");
  const int64_t rows = s.size(0);
  const int64_t* slot = s.data_ptr<int64_t>();
  for (int64_t n = 0; n < rows; ++n) {
    TORCH_CHECK(slot[n] >= 0 && slot[n] < key_pool.size(0), "slot ", slot[n], " out of range");
  }
  auto store = [&](at::Tensor& pool, const at::Tensor& input, const char* name) {
    check_activation(input, name);
    at::Tensor x = input;
    if (!(x.dim() == 3 && x.size(1) * x.size(2) == width && x.stride(2) == 1 &&
          x.stride(1) == x.size(2))) {
      x = x.reshape({-1, width}).contiguous();
    }
    TORCH_CHECK(x.size(0) == rows && x.numel() == rows * width, name, " must be [N, Hkv, D]");
    const int64_t stride = x.stride(0);
    with_activation_types(x, pool, [&](auto in_type, auto out_type) {
      using in_t = decltype(in_type);
      using out_t = decltype(out_type);
      const in_t* src = x.data_ptr<in_t>();
      out_t* dst = pool.data_ptr<out_t>();
      for (int64_t n = 0; n < rows; ++n) {
        const in_t* from = src + n * stride;
        out_t* to = dst + slot[n] * width;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<in_t, float> && std::is_same_v<out_t, c10::BFloat16>) {
          if (width % 32 == 0 && reinterpret_cast<uintptr_t>(to) % 64 == 0) {
            stream_bfloat16_row(from, to, width);
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < width; ++i) {
          to[i] = static_cast<out_t>(static_cast<float>(from[i]));
        }
      }
    });
#if defined(__AVX512F__)
    _mm_sfence();  // the streamed rows visible before any later load of them
#endif
  };
  store(key_pool, keys, "keys");
  store(value_pool, values, "values");
}

// Sampling by a Gumbel-max race (engine/random_draw.py): per row, the token v with the largest
// s_v + G(key, v), where s_v = (logit_v - the row's largest logit) * inverse temperature and
// G = -log(-log u) is Gumbel noise whose uniform u a counter-based hash computes from the row's
// key and the token id alone. That token is a draw from softmax(logits * inverse temperature),
// and it changes with the logits only where two tokens' perturbed scores nearly tie.
// engine/random_draw.py's race_torch is the same hash and race in torch ops.
//
// The hash: mix32 below, two multiply-xorshift rounds (constants from Wellons' hash prospector,
// both below 2^31 so that the torch version's int64 products never overflow). A key's low and
// high 32 bits lo and hi give a = mix32(lo ^ mix32(hi)) and
// b = mix32(hi ^ mix32(lo ^ 0x9e3779b9)); token v gets h = mix32(mix32(v + a) ^ b) (mod 2^32)
// and u = (h + 0.5) / 2^32. G is computed from t = 1 - u = (~h + 0.5) / 2^32 as
// -log(-log1p(-t)), in double.
//
// Most tokens need no logarithm. t >= 2^-33 bounds G by 33 ln 2; and G <= -log t (as
// -log(1 - t) >= t) <= (32 - e) ln 2, where 2^e <= ~h is read off the exponent of ~h as a float.
// Pass 1 finds the largest logit of each block of kRaceBlock columns; pass 2 skips a block
// whose largest logit cannot reach the best score so far even with the largest noise, in the
// others a token's bound costs the hash and a few vector instructions, and only the tokens
// whose bound reaches the best score get the logarithms. The bounds are exact (kRaceSlack
// covers the float rounding of the comparisons), so the result is the token the race over every
// token gives.

constexpr uint32_t kMixA = 0x21f0aaadu;
constexpr uint32_t kMixB = 0x735a2d97u;
constexpr uint32_t kKeyOffset = 0x9e3779b9u;
// Columns per block of the race: its largest logit decides whether the block is scanned.
constexpr int64_t kRaceBlock = 64;
constexpr float kLn2 = 0.693147180559945f;
constexpr float kRaceSlack = 1e-3f;
constexpr float kGumbelMax = 33.f * kLn2 + kRaceSlack;

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMixA;
  x ^= x >> 15;
  x *= kMixB;
  x ^= x >> 15;
  return x;
}

struct RaceKey {
  uint32_t a, b;
};

inline RaceKey race_key(int64_t key) {
  const uint64_t k = static_cast<uint64_t>(key);
  const uint32_t lo = static_cast<uint32_t>(k);
  const uint32_t hi = static_cast<uint32_t>(k >> 32);
  return {mix32(lo ^ mix32(hi)), mix32(hi ^ mix32(lo ^ kKeyOffset))};
}

inline uint32_t race_bits(RaceKey key, uint32_t token) {
  return mix32(mix32(token + key.a) ^ key.b);
}

// G for the hash bits h, in double.
inline double gumbel(uint32_t bits) {
  const double t = (static_cast<double>(~bits) + 0.5) * 0x1p-32;
  return -std::log(-std::log1p(-t));
}

// An upper bound of gumbel(bits), plus kRaceSlack: (32 - e) ln 2 with 2^e <= ~bits (for ~bits 0,
// the float 0, whose exponent field 0 gives a bound above any G).
inline float gumbel_bound(uint32_t bits) {
  const float t = static_cast<float>(~bits);  // about t * 2^32
  uint32_t raw;
  std::memcpy(&raw, &t, 4);
  const int32_t exponent = static_cast<int32_t>(raw >> 23) - 127;
  return static_cast<float>(32 - exponent) * kLn2 + kRaceSlack;
}

// The largest of the kRaceBlock floats at x.
inline float block_maximum(const float* x) {
#if defined(__AVX512F__)
  __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  for (int64_t j = 32; j < kRaceBlock; j += 32) {
    a = _mm512_max_ps(a, _mm512_loadu_ps(x + j));
    b = _mm512_max_ps(b, _mm512_loadu_ps(x + j + 16));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
#elif defined(__AVX__)
  __m256 m = _mm256_loadu_ps(x);
  for (int64_t j = 8; j < kRaceBlock; j += 8) {
    m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
#else
  float m = -INFINITY;
  for (int64_t j = 0; j < kRaceBlock; ++j) {
    m = std::max(m, x[j]);
  }
  return m;
#endif
}

// The token ids of a row's columns: the column itself, or read from a list.
struct ColumnIds {
  uint32_t operator()(int64_t column) const { return static_cast<uint32_t>(column); }
};

struct ListedIds {
  const int64_t* ids;
  uint32_t operator()(int64_t column) const { return static_cast<uint32_t>(ids[column]); }
};

// The race over one row x[0, n) whose column j is token ids(j); returns the winner's column.
// block_max is scratch of one float per kRaceBlock columns.
template <typename Ids>
int64_t race_row(const float* x, int64_t n, float inverse_temperature, RaceKey key, Ids ids,
                 float* block_max) {
  const int64_t blocks = (n + kRaceBlock - 1) / kRaceBlock;
  const int64_t full = n / kRaceBlock;
  for (int64_t block = 0; block < full; ++block) {
    block_max[block] = block_maximum(x + block * kRaceBlock);
  }
  if (full < blocks) {
    float m = -INFINITY;
    for (int64_t v = full * kRaceBlock; v < n; ++v) {
      m = std::max(m, x[v]);
    }
    block_max[full] = m;
  }
  float top = -INFINITY;
  for (int64_t block = 0; block < blocks; ++block) {
    top = std::max(top, block_max[block]);
  }
  int64_t top_block = -1;
  for (int64_t block = 0; block < blocks && top > -INFINITY; ++block) {
    if (block_max[block] == top) {
      top_block = block;
      break;
    }
  }
  if (top_block < 0 || top == INFINITY) {
    // Every logit -inf (or NaN): the smallest id. Some +inf (a broken model): the smallest id
    // among them, as they tie.
    int64_t column = -1;
    for (int64_t j = 0; j < n; ++j) {
      if ((top_block < 0 || x[j] == top) && (column < 0 || ids(j) < ids(column))) {
        column = j;
      }
    }
    return column;
  }
  // The first largest logit, whose s is 0, starts the race.
  int64_t best_column = top_block * kRaceBlock;
  const int64_t top_end = std::min(n, best_column + kRaceBlock);
  for (int64_t j = best_column; j < top_end; ++j) {
    if (x[j] == top) {
      best_column = j;
      break;
    }
  }
  const float inv = inverse_temperature;
  uint32_t best_token = ids(best_column);
  double best = gumbel(race_bits(key, best_token));
  float bar = static_cast<float>(best);
  float bound[kRaceBlock];
  for (int64_t block = 0; block < blocks; ++block) {
    if ((block_max[block] - top) * inv + kGumbelMax < bar) {
      continue;
    }
    const int64_t first = block * kRaceBlock;
    const float* xb = x + first;
    const int64_t len = std::min(kRaceBlock, n - first);
    float reach = -INFINITY;
#pragma omp simd reduction(max : reach)
    for (int64_t j = 0; j < len; ++j) {
      const float b = (xb[j] - top) * inv + gumbel_bound(race_bits(key, ids(first + j)));
      bound[j] = b;
      reach = std::max(reach, b);
    }
    if (reach < bar) {
      continue;
    }
    for (int64_t j = 0; j < len; ++j) {
      if (bound[j] >= bar) {
        const uint32_t token = ids(first + j);
        const double score =
            static_cast<double>((xb[j] - top) * inv) + gumbel(race_bits(key, token));
        if (score > best || (score == best && token < best_token)) {
          best = score;
          best_token = token;
          best_column = first + j;
          bar = static_cast<float>(best);
        }
      }
    }
  }
  return best_column;
}

// The first largest value of x[0, n), as torch.max(dim).indices gives it: a NaN counts as the
// largest, the first NaN winning. One pass: each lane keeps its own largest value and the first
// column it was seen in (replaced only by a strictly larger one), then the lanes are reduced.
int64_t first_maximum(const float* x, int64_t n) {
  int64_t best = 0;
  int64_t start = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 top = _mm512_loadu_ps(x);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i column = at;
    const __m512i sixteen = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    int64_t j = 16;
    for (; j + 16 <= n && j < INT32_MAX - 16; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      column = _mm512_add_epi32(column, sixteen);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 larger = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
      top = _mm512_mask_blend_ps(larger, top, v);
      at = _mm512_mask_blend_epi32(larger, at, column);
    }
    if (nan != 0) {
      for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(x[i])) {
          return i;
        }
      }
    }
    alignas(64) float values[16];
    alignas(64) int32_t columns[16];
    _mm512_store_ps(values, top);
    _mm512_store_si512(columns, at);
    best = columns[0];
    for (int lane = 1; lane < 16; ++lane) {
      if (values[lane] > x[best] || (values[lane] == x[best] && columns[lane] < best)) {
        best = columns[lane];
      }
    }
    start = j;
  }
#endif
  for (int64_t i = start; i < n; ++i) {
    if (std::isnan(x[i])) {
      for (int64_t k = 0; k <= i; ++k) {
        if (std::isnan(x[k])) {
          return k;
        }
      }
    }
    if (x[i] > x[best]) {
      best = i;
    }
  }
  return best;
}

// The first maximum of each row of logits ([R, W] float32, rows contiguous): int64 [R], as
// torch.max(logits, dim=1).indices, in one pass over each row, rows shared out between threads.
at::Tensor row_argmax(const at::Tensor& logits) {
  check_float(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [R, W] with W > 0");
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), width = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  parallel_chunks(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      o[row] = first_maximum(data + row * stride, width);
    }
  });
  return out;
}

// One token id per row of logits ([R, W] float32, rows contiguous; -inf for a banned token):
// the Gumbel-max race above with each row's inverse temperature ([R] float32) and key ([R]
// int64). Column j of a row is token j, or ids[row, j] where ids ([R, W] int64, ids below
// 2^32) are given; ties go to the smaller id. A row whose logits are all -inf gets its
// smallest id.
at::Tensor gumbel_argmax(const at::Tensor& logits, const at::Tensor& inverse_temperature,
                         const at::Tensor& keys, const std::optional<at::Tensor>& ids) {
  check_float(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits must be [R, W]");
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(width > 0 && width <= static_cast<int64_t>(UINT32_MAX) + 1,
              "a row must hold 1 to 2^32 tokens");
  const at::Tensor inv = inverse_temperature.contiguous();
  check_float(inv, "inverse_temperature");
  TORCH_CHECK(inv.numel() == rows, "inverse_temperature must be [R]");
  const at::Tensor k = keys.contiguous();
  TORCH_CHECK(k.device().is_cpu() && k.scalar_type() == at::kLong && k.numel() == rows,
              "keys must be an int64 CPU tensor [R]");
  at::Tensor listed;
  if (ids.has_value()) {
    listed = ids->contiguous();
    TORCH_CHECK(listed.device().is_cpu() && listed.scalar_type() == at::kLong &&
                    listed.sizes() == x.sizes(),
                "ids must be an int64 CPU tensor shaped like logits");
  }
  at::Tensor out = at::empty({rows}, k.options());
  const float* data = x.data_ptr<float>();
  const int64_t stride = x.stride(0);
  const float* inv_data = inv.data_ptr<float>();
  const int64_t* key_data = k.data_ptr<int64_t>();
  const int64_t* id_data = listed.defined() ? listed.data_ptr<int64_t>() : nullptr;
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t blocks = (width + kRaceBlock - 1) / kRaceBlock;
  parallel_chunks(rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> block_max(blocks);
    for (int64_t row = begin; row < end; ++row) {
      const float* x_row = data + row * stride;
      const RaceKey key = race_key(key_data[row]);
      if (id_data == nullptr) {
        o[row] = race_row(x_row, width, inv_data[row], key, ColumnIds{}, block_max.data());
      } else {
        const int64_t* row_ids = id_data + row * width;
        o[row] = row_ids[race_row(x_row, width, inv_data[row], key, ListedIds{row_ids},
                                  block_max.data())];
      }
    }
  });
  return out;
}

// out[r, column + j] = part[r, j] (* row_scale[r]) for the rows of out: one slice of a sliced
// GEMM's output (float32 or bfloat16, rows contiguous) put into its columns of the whole
// float32 output while it is still in cache. One multiply per value, as torch.mul rounds.
void scatter_columns(const at::Tensor& part, const std::optional<at::Tensor>& row_scale,
                     at::Tensor& out, int64_t column) {
  TORCH_CHECK(part.dim() == 2 && out.dim() == 2 && part.stride(1) == 1 && out.stride(1) == 1,
              "part and out must be [R, W] with contiguous rows");
  check_float(out, "out");
  const int64_t rows = out.size(0), width = part.size(1);
  TORCH_CHECK(part.size(0) >= rows && column >= 0 && column + width <= out.size(1),
              "part must cover out's rows and fit its columns");
  check_activation(part, "part");
  at::Tensor scale;
  if (row_scale.has_value()) {
    scale = row_scale->contiguous();
    check_float(scale, "row_scale");
    TORCH_CHECK(scale.numel() >= rows, "row_scale must hold one value per row");
  }
  const float* scales = scale.defined() ? scale.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>() + column;
  const int64_t out_stride = out.stride(0), part_stride = part.stride(0);
  with_activation_type(part, [&](auto type) {
    const auto* source = part.data_ptr<decltype(type)>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        float* dst = o + row * out_stride;
        load_row(source + row * part_stride, dst, width);
        if (scales != nullptr) {
          const float s = scales[row];
#pragma omp simd
          for (int64_t j = 0; j < width; ++j) {
            dst[j] *= s;
          }
        }
      }
    });
  });
}

// (x / m, m) with m = max(max |x[r, :]|, 1e-12) per row of a float32 [R, K] x: an int8 kernel's
// activations scaled into [-1, 1], in one read and one write of x where the eager ops (abs,
// amax, clamp, div) take four passes and a temporary. The same IEEE division as torch.div, so
// the scaled values are those bit for bit (a row with a NaN gets NaNs from the division).
std::tuple<at::Tensor, at::Tensor> scale_rows_by_max(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [R, K] with contiguous rows");
  check_float(x, "x");
  const int64_t rows = x.size(0), width = x.size(1), stride = x.stride(0);
  at::Tensor scaled = at::empty({rows, width}, x.options());
  at::Tensor row_max = at::empty({rows, 1}, x.options());
  const float* source = x.data_ptr<float>();
  float* out = scaled.data_ptr<float>();
  float* maxima = row_max.data_ptr<float>();
  parallel_chunks(rows, balanced_chunk(rows), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* src = source + row * stride;
      float largest = 0.f;
#pragma omp simd reduction(max : largest)
      for (int64_t j = 0; j < width; ++j) {
        largest = std::max(largest, std::fabs(src[j]));
      }
      largest = std::max(largest, 1e-12f);
      maxima[row] = largest;
      float* dst = out + row * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        dst[j] = src[j] / largest;
      }
    }
  });
  return {scaled, row_max};
}

}  // namespace

TORCH_LIBRARY(gemma_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? scale, float eps, bool bf16_out=False) -> Tensor");
  m.def(
      "add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor? post_scale, Tensor? pre_scale, "
      "float eps, bool bf16_out=False) -> Tensor");
  m.def(
      "norm_rope(Tensor x, int offset, int heads, int head_dim, Tensor? scale, Tensor cos, "
      "Tensor signed_sin, float eps) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_pool, Tensor value_pool, Tensor slots, "
      "Tensor mask, float scale) -> Tensor");
  m.def(
      "store_kv(Tensor(a!) key_pool, Tensor(b!) value_pool, Tensor slots, Tensor keys, "
      "Tensor values) -> ()");
  m.def(
      "gumbel_argmax(Tensor logits, Tensor inverse_temperature, Tensor keys, Tensor? ids=None) "
      "-> Tensor");
  m.def("row_argmax(Tensor logits) -> Tensor");
  m.def(
      "scatter_columns(Tensor part, Tensor? row_scale, Tensor(a!) out, int column) -> ()");
  m.def("scale_rows_by_max(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(gemma_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("norm_rope", &norm_rope);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("store_kv", &store_kv);
  m.impl("gumbel_argmax", &gumbel_argmax);
  m.impl("scatter_columns", &scatter_columns);
  m.impl("row_argmax", &row_argmax);
  m.impl("scale_rows_by_max", &scale_rows_by_max);
}
