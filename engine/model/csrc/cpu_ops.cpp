// Fused CPU kernels for the elementwise work between Gemma's GEMMs (engine/model/cpu_ops.py).
//
// In eager PyTorch a Gemma RMSNorm is eight small ops (cast, pow, mean, add, rsqrt, two muls,
// cast) and a decoder layer runs six of them plus two residual adds; at decode sizes each op
// costs more in dispatch and allocation than in arithmetic. Each kernel here does one pass over
// a row. Sums run in another order than torch's, so results match the eager ops to float32
// rounding, not bit for bit: NUMERICS=exact never calls these.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

namespace {

// Rows per parallel task: decode-sized batches run on the calling thread, with no fork/join.
constexpr int64_t kRowsPerTask = 32;

// 1 / sqrt(mean(x^2) + eps) over one row.
inline float inverse_rms(const float* x, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    sum += x[i] * x[i];
  }
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// out = (x * inverse_rms(x)) * scale, or without the scale; out may alias x.
inline void normalize_row(const float* x, const float* scale, float* out, int64_t n, float eps) {
  const float r = inverse_rms(x, n, eps);
  if (scale != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      out[i] = (x[i] * r) * scale[i];
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      out[i] = x[i] * r;
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

// Gemma's RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * scale.
at::Tensor rms_norm(const at::Tensor& input, const std::optional<at::Tensor>& scale,
                    double eps) {
  check_float(input, "x");
  const at::Tensor x = input.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float* s = scale_data(scale, n);
  at::Tensor out = at::empty_like(x);
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      normalize_row(in + row * n, s, o + row * n, n, static_cast<float>(eps));
    }
  });
  return out;
}

// The residual step of a decoder layer: residual += rms_norm(x, post_scale), in place; returns
// rms_norm(residual, pre_scale) (the next sublayer's input), or an empty tensor without one.
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& input,
                         const std::optional<at::Tensor>& post_scale,
                         const std::optional<at::Tensor>& pre_scale,
                         double eps) {
  check_float(residual, "residual");
  check_float(input, "x");
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous");
  const at::Tensor x = input.contiguous();
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual and x must have the same shape");
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float* post = scale_data(post_scale, n);
  const float* pre = scale_data(pre_scale, n);
  at::Tensor out = pre != nullptr ? at::empty_like(x) : at::empty({0}, x.options());
  const float* in = x.data_ptr<float>();
  float* res = residual.data_ptr<float>();
  float* o = pre != nullptr ? out.data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = in + row * n;
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
  return out;
}

// Query or key heads of a projection, normalized and rotated: for rows t of x ([T, W], rows may
// be strided, columns contiguous), heads h at columns offset + h * D: n = rms_norm(head, scale),
// then n * cos[t] + roll(n, D / 2) * signed_sin[t] (rotate-half RoPE with the first half of the
// sine negated, as gemma.py's tables hold it). Returns [T, heads, D].
at::Tensor norm_rope(const at::Tensor& x, int64_t offset, int64_t heads, int64_t head_dim,
                     const std::optional<at::Tensor>& scale, const at::Tensor& cos_table,
                     const at::Tensor& signed_sin_table, double eps) {
  check_float(x, "x");
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
  at::Tensor out = at::empty({tokens, heads, head_dim}, x.options());
  const float* in = x.data_ptr<float>();
  const int64_t row_stride = x.stride(0);
  const float* cos_data = cos_c.data_ptr<float>();
  const float* sin_data = sin_c.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t half = head_dim / 2;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, tokens * heads, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(head_dim);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t t = index / heads;
      const int64_t h = index % heads;
      normalize_row(in + t * row_stride + offset + h * head_dim, s, normed.data(), head_dim, e);
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
  return out;
}

}  // namespace

TORCH_LIBRARY(gemma_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? scale, float eps) -> Tensor");
  m.def(
      "add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor? post_scale, Tensor? pre_scale, "
      "float eps) -> Tensor");
  m.def(
      "norm_rope(Tensor x, int offset, int heads, int head_dim, Tensor? scale, Tensor cos, "
      "Tensor signed_sin, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(gemma_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("norm_rope", &norm_rope);
}
