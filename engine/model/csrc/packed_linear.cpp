// Linear layers over weights packed in tiles of 64 outputs (engine/model/cpu_ops.py).
//
// At a decode step's few rows a linear layer is a matrix-vector product: its time is the time it
// takes to read the weights once. The packed layout makes that read one sequential stream: tile
// t holds outputs [64 t, 64 t + 64) input by input (float32: [I][64]; bfloat16: input pairs,
// [I / 2][64][2], the order AVX512-BF16's dot product takes; int8: fours, [I / 4][64][4], the
// order AVX512-VNNI's takes, and AVX2's vpmaddubsw and vpmaddwd where the CPU has no VNNI), so
// every load brings 64 outputs' weights for the same inputs, multiplied by those inputs
// broadcast from each row, with no horizontal sums. A tile's outputs stay in registers (AVX-512:
// up to 6 rows x 4 vectors; AVX2: 1 row x 8 vectors); more rows run over the tile again in
// blocks of that many (see tile_all_rows).
//
// Sums run in another order than oneDNN's; bfloat16 products are summed in float32 as oneDNN's
// are. Each output is rounded to the output dtype once, as oneDNN's GEMMs round theirs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "vector_math.h"

namespace {

constexpr int64_t kTile = 64;       // outputs per tile: four 16-float vectors
constexpr int64_t kMaxRows = 6;     // rows per register block: 6 x 4 accumulators
constexpr int64_t kStreamAhead = 2048;  // bytes of weights prefetched ahead (tile_all_rows)

#if defined(__AVX512F__)
constexpr bool kFloat32Kernel = true;
#else
constexpr bool kFloat32Kernel = false;
#endif
#if defined(__AVX512BF16__)
constexpr bool kBFloat16Kernel = true;
#else
constexpr bool kBFloat16Kernel = false;
#endif
// The int8 kernel: AVX512-VNNI's vpdpbusd where the CPU has it; without any VNNI, AVX2's
// vpmaddubsw and vpmaddwd, exact there because the weights are 7-bit (int8_weight_max in
// cpu_features.py). A CPU with AVX-VNNI alone gets 8-bit weights, which would saturate
// vpmaddubsw's int16 pair sums: it has no int8 kernel.
#if defined(__AVX512VNNI__)
#define GEMMA_INT8_KERNEL 1
#elif defined(__AVX2__) && !defined(__AVXVNNI__)
#define GEMMA_INT8_KERNEL 1
#define GEMMA_INT8_PAIRS 1
constexpr int kPairWeightMax = 63;  // |w| <= 63: 2 * 255 * 63 < 2^15, no int16 saturation
#endif
#if defined(GEMMA_INT8_KERNEL)
constexpr bool kInt8Kernel = true;
#else
constexpr bool kInt8Kernel = false;
#endif

// Inputs side by side per output in the packed layout: 1 (float32), 2 (bfloat16: the pairs
// vdpbf16ps takes), 4 (int8: the quadruples vpdpbusd takes).
int64_t inputs_per_unit(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? 2 : dtype == at::kChar ? 4 : 1;
}

// Packed weights are [tiles, inputs / unit, 64, unit] ([tiles, inputs, 64] for float32).
int64_t packed_inputs(const at::Tensor& packed) {
  return inputs_per_unit(packed.scalar_type()) * packed.size(1);
}

// The multiply-add of one weight type, for tile_sums: x_t is the unit of x broadcast to every
// lane (one float32 input, a pair of bfloat16 inputs or four uint8 ones in a 32-bit word), one
// unit of weights is kVectors vectors of kLanes outputs (64 in all), acc adds to each output
// lane, and kRows rows of x share each load of the weights in registers.
#if defined(__AVX512F__)
struct Float32Units {  // vfmadd: 16 float32 products per instruction
  static constexpr int kVectors = 4, kLanes = 16, kRows = kMaxRows;
  using w_t = float;
  using x_t = float;
  using acc_t = __m512;
  using sum_t = float;
  static acc_t zero() { return _mm512_setzero_ps(); }
  static acc_t load(const w_t* w) { return _mm512_loadu_ps(w); }
  static acc_t broadcast(x_t x) { return _mm512_set1_ps(x); }
  static acc_t madd(acc_t acc, acc_t x, acc_t w) {
    __asm__("vfmadd231ps %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
    return acc;
  }
  static void store(sum_t* sums, acc_t acc) { _mm512_storeu_ps(sums, acc); }
};
#endif

#if defined(__AVX512BF16__)
struct BFloat16Units {  // vdpbf16ps: 16 outputs x a pair of inputs, summed in float32
  static constexpr int kVectors = 4, kLanes = 16, kRows = kMaxRows;
  using w_t = c10::BFloat16;
  using x_t = uint32_t;
  using acc_t = __m512;
  using sum_t = float;
  static acc_t zero() { return _mm512_setzero_ps(); }
  static __m512bh load(const w_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static __m512bh broadcast(x_t x) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(x)); }
  static acc_t madd(acc_t acc, __m512bh x, __m512bh w) {
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
    return acc;
  }
  static void store(sum_t* sums, acc_t acc) { _mm512_storeu_ps(sums, acc); }
};
#endif

#if defined(__AVX512VNNI__)
struct Int8Units {  // vpdpbusd: 16 outputs x four uint8 x int8 products, summed in int32
  static constexpr int kVectors = 4, kLanes = 16, kRows = kMaxRows;
  using w_t = int8_t;
  using x_t = uint32_t;
  using acc_t = __m512i;
  using sum_t = int32_t;
  static acc_t zero() { return _mm512_setzero_si512(); }
  static acc_t load(const w_t* w) { return _mm512_loadu_si512(w); }
  static acc_t broadcast(x_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static acc_t madd(acc_t acc, acc_t x, acc_t w) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
    return acc;
  }
  static void store(sum_t* sums, acc_t acc) { _mm512_storeu_si512(sums, acc); }
};
#elif defined(GEMMA_INT8_PAIRS)
// vpmaddubsw sums two uint8 x int8 products per output into int16 (exact for 7-bit weights),
// vpmaddwd the two pairs of a unit into int32: 8 outputs x four products per two instructions.
// The 16 accumulators of a second row would take every AVX2 register: one row per block.
struct Int8Units {
  static constexpr int kVectors = 8, kLanes = 8, kRows = 1;
  using w_t = int8_t;
  using x_t = uint32_t;
  using acc_t = __m256i;
  using sum_t = int32_t;
  static acc_t zero() { return _mm256_setzero_si256(); }
  static acc_t load(const w_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
  static acc_t broadcast(x_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static acc_t madd(acc_t acc, acc_t x, acc_t w) {
    const __m256i pairs = _mm256_maddubs_epi16(x, w);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static void store(sum_t* sums, acc_t acc) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums), acc);
  }
};
#endif

#if defined(__AVX2__)
// sums[r][0..64) = x[r] . w over `count` units of x, for R rows of x (row stride x_stride):
// w = [count][64 outputs][unit], from the tile's start. Each unit of weights is loaded once and
// multiplied by every row's broadcast unit of x. Prefetches `prefetch_lines` cache lines from
// `prefetch` on per unit (see tile_all_rows).
template <int R, typename Units>
void tile_sums(const typename Units::x_t* x, int64_t x_stride, const typename Units::w_t* w,
               int64_t count, typename Units::sum_t* sums, const char* prefetch,
               int64_t prefetch_lines) {
  constexpr int V = Units::kVectors;
  constexpr int64_t vector_elements = kTile * (4 / sizeof(typename Units::w_t)) / V;
  typename Units::acc_t acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < V; ++b) {
      acc[r][b] = Units::zero();
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t line = 0; line < prefetch_lines; ++line) {
      _mm_prefetch(prefetch + (i * prefetch_lines + line) * 64, _MM_HINT_T1);
    }
    const typename Units::w_t* wi = w + i * V * vector_elements;
    decltype(Units::load(wi)) wv[V];
    for (int b = 0; b < V; ++b) {
      wv[b] = Units::load(wi + b * vector_elements);
    }
    for (int r = 0; r < R; ++r) {
      const auto xv = Units::broadcast(x[r * x_stride + i]);
      for (int b = 0; b < V; ++b) {
        acc[r][b] = Units::madd(acc[r][b], xv, wv[b]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < V; ++b) {
      Units::store(sums + r * kTile + Units::kLanes * b, acc[r][b]);
    }
  }
}

// tile_sums for `rows` rows (1 to R), instantiated for each count up to R.
template <typename Units, int R = Units::kRows>
void tile_rows(int64_t rows, const typename Units::x_t* x, int64_t x_stride,
               const typename Units::w_t* w, int64_t count, typename Units::sum_t* sums,
               const char* prefetch, int64_t prefetch_lines) {
  if constexpr (R > 1) {
    if (rows < R) {
      tile_rows<Units, R - 1>(rows, x, x_stride, w, count, sums, prefetch, prefetch_lines);
      return;
    }
  }
  tile_sums<R, Units>(x, x_stride, w, count, sums, prefetch, prefetch_lines);
}

// Every row's sums for one tile, rows in blocks of up to Units::kRows. The first block reads the
// tile's weights from memory; the others read them again from the L2 cache (a tile is at most
// a few hundred KB) and meanwhile prefetch `next`, the tile this thread runs after this one, so
// memory stays busy while they compute. With a single block (decode sizes) the weights are
// prefetched kStreamAhead bytes ahead of the loads: the hardware's prefetcher stops at every
// 4 KB page. `step` is the weights' elements per unit of x (64 floats per input, 128 bfloat16
// per pair, 256 int8 per quadruple).
template <typename Units, typename x_t = typename Units::x_t, typename w_t = typename Units::w_t>
void tile_all_rows(const x_t* x, int64_t rows, int64_t x_stride, const w_t* tile, int64_t count,
                   const w_t* next, typename Units::sum_t* sums) {
  constexpr int64_t step = kTile * (4 / static_cast<int64_t>(sizeof(w_t)));
  constexpr int64_t block_rows = Units::kRows;
  const int64_t blocks = (rows + block_rows - 1) / block_rows;
  const int64_t lines = count * step * static_cast<int64_t>(sizeof(w_t)) / 64;
  const int64_t per_block = blocks > 1 && next != nullptr ? (lines + blocks - 2) / (blocks - 1) : 0;
  const int64_t per_unit = (per_block + count - 1) / count;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r = b * block_rows;
    const x_t* xr = x + r * x_stride;
    typename Units::sum_t* s = sums + r * kTile;
    const int64_t first_line = (b - 1) * per_block;
    int64_t n = b > 0 && first_line < lines ? per_unit : 0;
    const char* prefetch = n > 0 ? reinterpret_cast<const char*>(next) + first_line * 64 : nullptr;
    if (blocks == 1) {  // prefetch() never faults, so running past the weights is harmless
      n = step * static_cast<int64_t>(sizeof(w_t)) / 64;
      prefetch = reinterpret_cast<const char*>(tile) + kStreamAhead;
    }
    tile_rows<Units>(std::min(block_rows, rows - r), xr, x_stride, tile, count, s, prefetch, n);
  }
}

#endif

// The rows of x as bfloat16 pairs ([rows, pairs] 32-bit words), the last pair's second half zero
// when the width is odd; x is read as it is when it already has that form.
struct Pairs {
  at::Tensor storage;
  const uint32_t* data;
  int64_t stride;  // words per row
};

Pairs bfloat16_pairs(const at::Tensor& x, int64_t pairs) {
  const int64_t width = x.size(1);
  if (x.scalar_type() == at::kBFloat16 && width % 2 == 0 && x.stride(1) == 1 &&
      x.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0) {
    return {x, reinterpret_cast<const uint32_t*>(x.data_ptr()), x.stride(0) / 2};
  }
  at::Tensor padded = at::zeros({x.size(0), 2 * pairs}, x.options().dtype(at::kBFloat16));
  padded.narrow(1, 0, width).copy_(x);
  return {padded, reinterpret_cast<const uint32_t*>(padded.data_ptr()), pairs};
}

#if defined(__AVX2__)
// For each run of `group` consecutive tiles of the packed weights w ([tiles][count] units of
// x per tile), in parallel: every row's sums ([group][rows][64], float32 or int32) handed to
// finish(first tile, sums).
template <typename Units, typename Finish, typename x_t = typename Units::x_t,
          typename w_t = typename Units::w_t>
void run_tiles(const x_t* x, int64_t rows, int64_t x_stride, const w_t* w, int64_t tiles,
               int64_t count, int64_t group, Finish finish) {
  const int64_t tile_elements = count * kTile * (4 / static_cast<int64_t>(sizeof(w_t)));
  parallel_chunks(tiles / group, balanced_chunk(tiles / group), [&](int64_t begin, int64_t end) {
    std::vector<typename Units::sum_t> sums(group * rows * kTile);
    for (int64_t task = begin; task < end; ++task) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t t = task * group + g;
        const w_t* next = t + 1 < end * group ? w + (t + 1) * tile_elements : nullptr;
        tile_all_rows<Units>(x, rows, x_stride, w + t * tile_elements, count, next,
                      sums.data() + g * rows * kTile);
      }
      finish(task * group, sums.data());
    }
  });
}


// Rows per panel of run_tile_panels: 20 register blocks of 6.
constexpr int64_t kPanelRows = 120;

// Many rows (prefill) of the same sums as run_tiles, in panels of kPanelRows rows: each work
// item is one panel against a run of tiles, handed to block(t, row0, panel_rows, sums) for each
// `group` consecutive tiles ([group][panel_rows][64] sums). A panel's rows stay in the core's L2
// across its tiles and a tile's sums in L1, where run_tiles' one pass of every row per tile
// reads all the rows again from L3 for every tile and writes sums of megabytes.
template <typename Units, typename Block, typename x_t = typename Units::x_t,
          typename w_t = typename Units::w_t>
void run_tile_panels(const x_t* x, int64_t rows, int64_t x_stride, const w_t* w, int64_t tiles,
                     int64_t count, int64_t group, Block block) {
  const int64_t tile_elements = count * kTile * (4 / static_cast<int64_t>(sizeof(w_t)));
  const int64_t panels = (rows + kPanelRows - 1) / kPanelRows;
  const int64_t groups = tiles / group;
  const int64_t run = std::max<int64_t>(1, groups / 4);  // groups of tiles per item
  const int64_t runs = (groups + run - 1) / run;         // items per panel
  parallel_chunks(panels * runs, 1, [&](int64_t begin, int64_t end) {
    std::vector<typename Units::sum_t> sums(group * kPanelRows * kTile);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row0 = item / runs * kPanelRows, n = std::min(kPanelRows, rows - row0);
      const int64_t first = item % runs * run * group;
      const int64_t last = std::min(tiles, first + run * group);
      for (int64_t t = first; t < last; t += group) {
        for (int64_t g = 0; g < group; ++g) {
          const w_t* next = t + g + 1 < last ? w + (t + g + 1) * tile_elements : nullptr;
          tile_all_rows<Units>(x + row0 * x_stride, n, x_stride, w + (t + g) * tile_elements,
                               count, next, sums.data() + g * n * kTile);
        }
        block(t, row0, n, sums.data());
      }
    }
  });
}
#endif

// run_tiles over float32 or bfloat16 packed weights, with x in the form their kernel reads.
template <typename Finish>
void for_each_tile(const at::Tensor& x, const at::Tensor& packed, int64_t group, Finish finish) {
  const int64_t rows = x.size(0), tiles = packed.size(0), count = packed.size(1);
  if (packed.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
    const Pairs pairs = bfloat16_pairs(x, count);
    run_tiles<BFloat16Units>(pairs.data, rows, pairs.stride, packed.data_ptr<c10::BFloat16>(),
                             tiles, count, group, finish);
#endif
  } else {
#if defined(__AVX512F__)
    const at::Tensor xf = x.to(at::kFloat);
    TORCH_CHECK(xf.stride(1) == 1, "x must have contiguous rows");
    run_tiles<Float32Units>(xf.data_ptr<float>(), rows, xf.stride(0), packed.data_ptr<float>(),
                            tiles, count, group, finish);
#endif
  }
}

bool packed_linear_supported(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return kFloat32Kernel;
    case at::kBFloat16: return kBFloat16Kernel;
    case at::kChar: return kInt8Kernel;
    default: return false;
  }
}

void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU matrix");
  TORCH_CHECK(packed_linear_supported(packed.scalar_type()),
              "this CPU build has no packed linear kernel for ", packed.scalar_type());
  const int64_t unit = inputs_per_unit(packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == (unit > 1 ? 4 : 3) &&
                  packed.size(-1) == (unit > 1 ? unit : kTile) && out_features > 0 &&
                  out_features <= packed.size(0) * kTile,
              "not a packed weight (pack_linear_weight) of that many outputs");
  const int64_t inputs = packed_inputs(packed);
  TORCH_CHECK(x.size(1) <= inputs && x.size(1) > inputs - unit, "x has ", x.size(1),
              " columns; the packed weight takes ", inputs);
}

// Writes a tile's sums to out[:, 64 t : 64 t + 64] (the columns that exist), rounded to out_t.
template <typename out_t>
void store_tile(const float* sums, int64_t rows, int64_t t, int64_t out_features, out_t* out) {
  const int64_t first = t * kTile, n = std::min(kTile, out_features - first);
  for (int64_t r = 0; r < rows; ++r) {
    out_t* dst = out + r * out_features + first;
    const float* src = sums + r * kTile;
    for (int64_t o = 0; o < n; ++o) {
      dst[o] = static_cast<out_t>(src[o]);
    }
  }
}

// gelu with the tanh approximation, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), with
// tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2 |u|).
inline float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float e = exp_nonpositive(-2.f * std::fabs(u));
  const float t = std::copysign((1.f - e) / (1.f + e), u);
  return 0.5f * x * (1.f + t);
}

#if defined(__AVX512F__)
// gelu_tanh above on 16 lanes, in the same steps.
inline __m512 gelu_tanh_ps(__m512 x) {
  const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x));
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_add_ps(x, cube));
  const __m512 magnitude = _mm512_abs_ps(u);
  const __m512 e = exp_nonpositive_ps(_mm512_mul_ps(_mm512_set1_ps(-2.f), magnitude));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t_abs = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 sign = _mm512_and_ps(u, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN)));
  const __m512 t = _mm512_or_ps(t_abs, sign);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, t));
}
#endif

#if defined(__AVX512BF16__)
// 16 floats rounded to bfloat16 (to nearest even), and those back to float32.
inline __m256i to_bfloat16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
inline __m512 from_bfloat16(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// The float32 sums of a 64-output tile, rows [0, block_rows) ([64] floats per row), into out
// (row stride out_stride) at columns [first, first + n), rounded to bfloat16.
void store_bfloat16(const float* sums, int64_t block_rows, c10::BFloat16* out, int64_t out_stride,
                    int64_t first, int64_t n) {
  for (int64_t r = 0; r < block_rows; ++r) {
    const float* src = sums + r * kTile;
    c10::BFloat16* dst = out + r * out_stride + first;
    if (n == kTile) {
      for (int64_t j = 0; j < kTile; j += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                            to_bfloat16(_mm512_loadu_ps(src + j)));
      }
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      dst[j] = static_cast<c10::BFloat16>(src[j]);
    }
  }
}
#endif

// ---- AMX: many rows of the int8 and bfloat16 kernels ----
//
// From a few rows on, the products are AMX tile work: tdpbusd multiplies a 16 x 64 tile of
// uint8 inputs by a 16 x (16 x 4) tile of int8 weights into 16 x 16 int32 sums, and tdpbf16ps
// a 16 x 32 tile of bfloat16 inputs by a 16 x (16 x 2) tile of bfloat16 weights into 16 x 16
// float32 sums. The packed layout already holds such weight tiles: 16 outputs' units of one
// unit index are 64 contiguous bytes, and the next unit's sit 256 bytes on, so a tile loads in
// place with a 256-byte stride. A unit of x (four uint8 or two bfloat16) is 4 bytes either way.
// The int8 sums are exact, so AMX and VNNI give the same int32 sums and, through the same
// rescale, the same float32 outputs at any row count; the bfloat16 sums are float32 sums of the
// same products as the VNNI kernel's, in tdpbf16ps's order.

constexpr int64_t kAmxRows = 16;                // rows per A / C tile
constexpr int64_t kAmxUnits = 16;               // units of x (64 bytes) per K step
constexpr int64_t kAmxRowBlock = 4 * kAmxRows;  // rows per pass: four row tiles
constexpr int64_t kUnitBytes = kTile * 4;       // one unit of a 64-output tile

// Rows padded to whole AMX tiles, and the row stride in bytes of the inputs the AMX kernels
// read: one cache line past each row's units, since a stride of a multiple of 2 KB would put
// a tile's rows in one or two L1 sets.
int64_t amx_padded_rows(int64_t rows) { return (rows + kAmxRows - 1) / kAmxRows * kAmxRows; }
int64_t amx_row_bytes(int64_t units) { return 4 * units + 64; }

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
struct TileConfig {  // the LDTILECFG operand, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux lets a process use AMX tile data once it asked for it (oneDNN asks too).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// sums[r][0..64) for the 16 * row_tiles rows of x from `a` (row stride a_stride bytes) against
// one 64-output tile of packed weights (`units` units, a multiple of 16): int32 sums of uint8
// inputs and int8 weights, or float32 sums of bfloat16 ones (kBFloat16). `next` (the tile run
// after this one) is prefetched into L2 meanwhile. The outputs go two 16-output weight tiles at
// a time against two 16-row input tiles: tiles 0-3 hold the four blocks of sums, 4 and 5 the
// inputs, 6 and 7 the weights; the caller has loaded the configuration.
template <bool kBFloat16>
void amx_tile_sums(const char* a, int64_t a_stride, int64_t row_tiles, const char* tile,
                   int64_t units, const char* next, void* sums) {
#define GEMMA_AMX_DP(c, x, w) \
  if constexpr (kBFloat16) {  \
    _tile_dpbf16ps(c, x, w);  \
  } else {                    \
    _tile_dpbusd(c, x, w);    \
  }
  constexpr int64_t kSumStride = kTile * 4;  // bytes per row of sums
  const int64_t steps = units / kAmxUnits;
  // `next` is prefetched a share at a time over the K steps of this tile: all of it over one
  // pair of row tiles; over two pairs, 8 lines a step (half a tile), which timed faster than
  // the whole tile there (the int8 LM head at 64 rows, `python -m evals.bench_step`).
  const int64_t lines = units * kUnitBytes / 64;
  const int64_t per_step = row_tiles > 2 ? 8 : (lines + 2 * steps - 1) / (2 * steps);
  int64_t fetched = 0;  // lines of `next` prefetched so far
  for (int64_t pair = 0; pair < 2; ++pair) {  // outputs [32 pair, 32 pair + 32)
    for (int64_t r = 0; r < row_tiles; r += 2) {  // rows [16 r, 16 r + 32)
      const bool two = r + 1 < row_tiles;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t step = 0; step < steps; ++step) {
        const int64_t unit = step * kAmxUnits;
        const char* w = tile + unit * kUnitBytes + pair * 128;
        if (next != nullptr && fetched < lines) {
          for (int64_t line = 0; line < per_step && fetched < lines; ++line, ++fetched) {
            _mm_prefetch(next + fetched * 64, _MM_HINT_T1);
          }
        }
        _tile_loadd(6, w, kUnitBytes);
        _tile_loadd(7, w + 64, kUnitBytes);
        const char* x = a + r * kAmxRows * a_stride + unit * 4;
        _tile_loadd(4, x, a_stride);
        GEMMA_AMX_DP(0, 4, 6);
        GEMMA_AMX_DP(1, 4, 7);
        if (two) {
          _tile_loadd(5, x + kAmxRows * a_stride, a_stride);
          GEMMA_AMX_DP(2, 5, 6);
          GEMMA_AMX_DP(3, 5, 7);
        }
      }
      char* at = static_cast<char*>(sums) + r * kAmxRows * kSumStride + pair * 128;
      _tile_stored(0, at, kSumStride);
      _tile_stored(1, at + 64, kSumStride);
      if (two) {
        _tile_stored(2, at + kAmxRows * kSumStride, kSumStride);
        _tile_stored(3, at + kAmxRows * kSumStride + 64, kSumStride);
      }
    }
  }
#undef GEMMA_AMX_DP
}

// For each run of `group` consecutive tiles of the packed weights, in parallel, and each block
// of 64 rows of x (padded_rows of them, from `a`, row stride a_stride bytes):
// epilogue(first tile, row0, sums) gets rows [row0, row0 + 64) of those tiles' sums ([group][64
// rows][64], row-major; int32 or float32 as amx_tile_sums makes them).
template <bool kBFloat16, typename Epilogue>
void amx_tiles(const char* a, int64_t a_stride, int64_t padded_rows, const char* packed,
               int64_t tiles, int64_t units, int64_t group, Epilogue epilogue) {
  const int64_t tile_bytes = units * kUnitBytes;
  parallel_chunks(tiles / group, balanced_chunk(tiles / group), [&](int64_t begin, int64_t end) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = kAmxRows;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
    std::vector<int32_t> sums(group * kAmxRowBlock * kTile);  // 4-byte sums of either kind
    for (int64_t task = begin; task < end; ++task) {
      for (int64_t row0 = 0; row0 < padded_rows; row0 += kAmxRowBlock) {
        const int64_t row_tiles = std::min<int64_t>(4, (padded_rows - row0) / kAmxRows);
        const bool last = row0 + kAmxRowBlock >= padded_rows;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t t = task * group + g;
          const char* tile = packed + t * tile_bytes;
          const char* next = last && t + 1 < end * group ? tile + tile_bytes : nullptr;
          amx_tile_sums<kBFloat16>(a + row0 * a_stride, a_stride, row_tiles, tile, units, next,
                                   sums.data() + g * kAmxRowBlock * kTile);
        }
        epilogue(task * group, row0, static_cast<const void*>(sums.data()));
      }
    }
    _tile_release();
    _mm_sfence();  // the streaming stores are visible before the caller reads the outputs
  });
}

constexpr bool kAmxKernels = true;
#else
constexpr bool kAmxKernels = false;
bool amx_permitted() { return false; }
#endif

// Whether the int8 (4-byte units of four inputs) or bfloat16 (units of two) kernels run many
// rows on AMX tiles for weights of `inputs` inputs: built with AMX, allowed to use it, and
// `inputs` whole K steps of 16 units.
bool packed_amx(at::ScalarType dtype, int64_t inputs) {
  const int64_t unit = inputs_per_unit(dtype);
  return kAmxKernels && unit > 1 && inputs % (unit * kAmxUnits) == 0 && amx_permitted();
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
// x [rows, I] as the bfloat16 AMX kernel reads it: rows padded with zeros to whole tiles, each
// amx_row_bytes(units) long, zeros past the inputs.
at::Tensor amx_bfloat16_rows(const at::Tensor& x, int64_t units) {
  const int64_t rows = x.size(0);
  at::Tensor a = at::zeros({amx_padded_rows(rows), amx_row_bytes(units) / 2},
                           x.options().dtype(at::kBFloat16));
  a.narrow(0, 0, rows).narrow(1, 0, x.size(1)).copy_(x);
  return a;
}

// The AMX tiles' rows: padded_rows of them from `a` (bfloat16, as amx_bfloat16_rows lays out).
const char* amx_rows_data(const at::Tensor& a) { return static_cast<const char*>(a.data_ptr()); }
int64_t amx_rows_stride(const at::Tensor& a) { return a.stride(0) * a.element_size(); }
#endif

// ---- The ops ----

// weight [O, I] float32, bfloat16 or int8 -> tiles of 64 outputs ([ceil(O / 64), I, 64]
// float32, [ceil(O / 64), ceil(I / 2), 64, 2] bfloat16, [ceil(O / 64), ceil(I / 4), 64, 4]
// int8), zero-padded past the last output and input.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16 ||
                   weight.scalar_type() == at::kChar),
              "weight must be a float32, bfloat16 or int8 CPU matrix");
  const at::Tensor w = weight.contiguous();
#if defined(GEMMA_INT8_PAIRS)
  TORCH_CHECK(w.scalar_type() != at::kChar || w.numel() == 0 ||
                  w.to(at::kShort).abs().max().item<int>() <= kPairWeightMax,
              "int8 weights must lie in [-", kPairWeightMax, ", ", kPairWeightMax,
              "] on a CPU without VNNI (cpu_features.int8_weight_max)");
#endif
  const int64_t outputs = w.size(0), inputs = w.size(1);
  const int64_t tiles = (outputs + kTile - 1) / kTile;
  const int64_t group = inputs_per_unit(w.scalar_type());
  const int64_t units = (inputs + group - 1) / group;
  at::Tensor packed = group > 1 ? at::zeros({tiles, units, kTile, group}, w.options())
                                : at::zeros({tiles, units, kTile}, w.options());
  const int64_t element = w.element_size();
  const auto* src = static_cast<const char*>(w.data_ptr());
  auto* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t o = 0; o < kTile && t * kTile + o < outputs; ++o) {
        for (int64_t i = 0; i < inputs; ++i) {
          const int64_t at = ((t * units + i / group) * kTile + o) * group + i % group;
          std::memcpy(dst + at * element, src + ((t * kTile + o) * inputs + i) * element,
                      element);
        }
      }
    }
  });
  return packed;
}

// x [rows, I] @ W.T for W packed by pack_linear_weight: [rows, out_features] float32, or
// bfloat16 with bf16_out.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         bool bf16_out) {
  TORCH_CHECK(packed.scalar_type() != at::kChar, "int8 weights run packed_int8_linear");
  check_packed(x, packed, out_features);
  const int64_t rows = x.size(0);
  at::Tensor out =
      at::empty({rows, out_features}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (rows == 0) {
    return out;
  }
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
  if (packed.scalar_type() == at::kBFloat16 && rows > kMaxRows &&
      packed_amx(at::kBFloat16, packed_inputs(packed))) {
    const int64_t units = packed.size(1);
    const at::Tensor a = amx_bfloat16_rows(x, units);
    amx_tiles<true>(amx_rows_data(a), amx_rows_stride(a), a.size(0),
                    static_cast<const char*>(packed.data_ptr()), packed.size(0), units, 1,
                    [&](int64_t t, int64_t row0, const void* sums) {
                      const float* f = static_cast<const float*>(sums);
                      const int64_t block = std::min(kAmxRowBlock, rows - row0);
                      if (block <= 0) {
                        return;
                      }
                      const int64_t first = t * kTile, n = std::min(kTile, out_features - first);
                      if (bf16_out) {
                        store_bfloat16(f, block, out.data_ptr<c10::BFloat16>() + row0 * out_features,
                                       out_features, first, n);
                      } else {
                        float* o = out.data_ptr<float>() + row0 * out_features + first;
                        for (int64_t r = 0; r < block; ++r) {
                          std::memcpy(o + r * out_features, f + r * kTile, n * sizeof(float));
                        }
                      }
                    });
    return out;
  }
#endif
  if (bf16_out) {
    auto* o = out.data_ptr<c10::BFloat16>();
    for_each_tile(x, packed, 1, [&](int64_t t, const float* sums) {
      store_tile(sums, rows, t, out_features, o);
    });
  } else {
    float* o = out.data_ptr<float>();
    for_each_tile(x, packed, 1, [&](int64_t t, const float* sums) {
      store_tile(sums, rows, t, out_features, o);
    });
  }
  return out;
}

// x's rows as the int8 kernels read them, quantized as OneDNNInt8Linear quantizes: each row
// scaled so its largest magnitude is 127 and rounded to int8 (to nearest even), stored as uint8
// q + 128, `stride` bytes a row; on AMX the rows are padded to whole 16-row tiles with zeros
// (uint8 128).
struct Int8Rows {
  at::Tensor quantized;
  std::vector<float> row_max;  // each row's largest magnitude (its scale is that over 127)
  int64_t stride;
  bool amx;  // the products run on AMX tiles
};

void check_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& compensation, int64_t out_features) {
  TORCH_CHECK(packed.scalar_type() == at::kChar, "the packed weight must be int8");
  check_packed(x, packed, out_features);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == out_features && compensation.scalar_type() == at::kInt &&
                  compensation.is_contiguous() && compensation.numel() == out_features,
              "scales (float32) and compensation (int32) need one value per output");
}

#if defined(GEMMA_INT8_KERNEL)
// One row of quantize_rows: its largest magnitude (at least 1e-12), and q[i] = nearbyint(x[i] *
// 127 / that) + 128 for i < width. cvtps_epi32 rounds in the current mode, as nearbyint does.
#if defined(__AVX512VNNI__)
float quantize_row(const float* x, int64_t width, uint8_t* q) {
  __m512 top = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) {  // max(|x|, top): top where |x| is NaN, as std::max
    top = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), top);
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (width - i)) - 1);
  top = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(tail, x + i)), top);
  const float row_max = std::max(_mm512_reduce_max_ps(top), 1e-12f);
  const __m512 scale = _mm512_set1_ps(127.f / row_max);
  const __m512i zero_point = _mm512_set1_epi32(128);
  for (i = 0; i + 16 <= width; i += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale));
    _mm512_mask_cvtepi32_storeu_epi8(q + i, 0xFFFF, _mm512_add_epi32(v, zero_point));
  }
  const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + i), scale));
  _mm512_mask_cvtepi32_storeu_epi8(q + i, tail, _mm512_add_epi32(v, zero_point));
  return row_max;
}
#else
// The same on 8 lanes; each int32 keeps its low byte, as the AVX-512 form's truncating store.
float quantize_row(const float* x, int64_t width, uint8_t* q) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX));
  __m256 top = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {  // max(|x|, top): top where |x| is NaN, as std::max
    top = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), top);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  float largest = 0.f;
  for (int lane = 0; lane < 8; ++lane) {
    largest = lanes[lane] > largest ? lanes[lane] : largest;
  }
  for (; i < width; ++i) {
    const float a = std::fabs(x[i]);
    largest = a > largest ? a : largest;
  }
  const float row_max = std::max(largest, 1e-12f), factor = 127.f / row_max;
  const __m256 scale = _mm256_set1_ps(factor);
  const __m256i zero_point = _mm256_set1_epi32(128);
  // Byte 0 of each int32 lane: four per 128-bit half, then the halves' words side by side.
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                             -1, -1, -1, -1);
  const __m256i words = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
  for (i = 0; i + 8 <= width; i += 8) {
    const __m256i v = _mm256_add_epi32(
        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale)), zero_point);
    const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, low_bytes), words);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm256_castsi256_si128(packed));
  }
  for (; i < width; ++i) {
    const int32_t v = _mm_cvtss_si32(_mm_set_ss(x[i] * factor));
    q[i] = static_cast<uint8_t>(v + 128);
  }
  return row_max;
}
#endif

Int8Rows quantize_rows(const at::Tensor& x, int64_t count) {
  const int64_t rows = x.size(0), width = x.size(1);
  const bool amx = rows > kMaxRows && packed_amx(at::kChar, 4 * count);
  Int8Rows result{at::Tensor(), std::vector<float>(rows), amx_row_bytes(count), amx};
  const int64_t padded = amx ? amx_padded_rows(rows) : rows;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  result.quantized = at::empty({padded, result.stride}, x.options().dtype(at::kByte));
  const float* in = xf.data_ptr<float>();
  uint8_t* q = result.quantized.data_ptr<uint8_t>();
  const int64_t stride = result.stride;
  // Rows in parallel once there are enough of them to pay for waking the other threads.
  const int64_t chunk = rows * width < (1 << 16) ? rows : balanced_chunk(rows);
  parallel_chunks(rows, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      result.row_max[r] = quantize_row(in + r * width, width, q + r * stride);
      std::memset(q + r * stride + width, 128, stride - width);  // padding: uint8 zero
    }
  });
  std::memset(q + rows * stride, 128, (padded - rows) * stride);
  return result;
}

// The int32 sums of the quantized rows against every tile of `packed`, in parallel:
// block(t, row0, block_rows, sums) gets the sums of tiles [t, t + group) for rows [row0, row0 +
// block_rows) ([group][block_rows][64], row-major; rows past the real ones are padding to skip).
template <typename Block>
void int8_tile_sums(const Int8Rows& x, int64_t rows, const at::Tensor& packed, int64_t group,
                    Block block) {
  const auto* q = static_cast<const uint8_t*>(x.quantized.data_ptr());
  const int64_t count = packed.size(1);
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
  if (x.amx) {
    amx_tiles<false>(reinterpret_cast<const char*>(q), x.stride, x.quantized.size(0),
                     static_cast<const char*>(packed.data_ptr()), packed.size(0), count, group,
                     [&](int64_t t, int64_t row0, const void* sums) {
                       block(t, row0, kAmxRowBlock, static_cast<const int32_t*>(sums));
                     });
    return;
  }
#endif
  const auto* units = reinterpret_cast<const uint32_t*>(q);
  if (rows > kPanelRows) {
    run_tile_panels<Int8Units>(units, rows, x.stride / 4, packed.data_ptr<int8_t>(),
                               packed.size(0), count, group, block);
    return;
  }
  run_tiles<Int8Units>(units, rows, x.stride / 4, packed.data_ptr<int8_t>(), packed.size(0),
                       count, group,
                       [&](int64_t t, const int32_t* sums) { block(t, 0, rows, sums); });
}

#if defined(__AVX512VNNI__)
// The outputs of the `valid` lanes of 16 sums: float(sum - compensation) * scale * the row's
// largest magnitude (zero elsewhere; nothing past the valid lanes is read).
inline __m512 rescale_ps(const int32_t* sums, const int32_t* comp, const float* sc, __m512 top,
                         __mmask16 valid = 0xFFFF) {
  const __m512i exact = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(valid, sums),
                                         _mm512_maskz_loadu_epi32(valid, comp));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_maskz_loadu_ps(valid, sc)),
                       top);
}
#else
// The outputs of 8 sums, as rescale_ps computes each lane.
inline __m256 rescale_ps(const int32_t* sums, const int32_t* comp, const float* sc, __m256 top) {
  const __m256i exact =
      _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums)),
                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(exact), _mm256_loadu_ps(sc)), top);
}
#endif

// One output, as rescale_ps computes each lane.
inline float rescale(int32_t sum, int32_t comp, float sc, float top) {
  return static_cast<float>(sum - comp) * sc * top;
}
#endif

// x [rows, I] @ W.T for int8 weights W packed by pack_linear_weight, x quantized by
// quantize_rows: the products summed exactly in int32, less compensation[o] = 128 * sum_i
// W[o, i]; then float(sum) * scales[o] (the weight's scale over 127) * the row's largest
// magnitude. Rows past kMaxRows run on AMX tiles where packed_amx(int8, I). Returns [rows,
// out_features] float32: `out` where given.
at::Tensor packed_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales, const at::Tensor& compensation,
                              int64_t out_features, const std::optional<at::Tensor>& out_opt) {
  check_int8_linear(x, packed, scales, compensation, out_features);
  const int64_t rows = x.size(0);
  at::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                    out.dim() == 2 && out.size(0) == rows && out.size(1) == out_features,
                "out must be a contiguous float32 [rows, out_features] CPU tensor");
  } else {
    out = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  }
  if (rows == 0) {
    return out;
  }
#if defined(GEMMA_INT8_KERNEL)
  const Int8Rows q = quantize_rows(x, packed.size(1));
  const float* sc = scales.data_ptr<float>();
  const int32_t* comp = compensation.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  int8_tile_sums(q, rows, packed, 1, [&](int64_t t, int64_t row0, int64_t block_rows,
                                      const int32_t* sums) {
    const int64_t first = t * kTile, n = std::min(kTile, out_features - first);
    for (int64_t r = 0; r < block_rows && row0 + r < rows; ++r) {
      const float top = q.row_max[row0 + r];
      float* dst = o + (row0 + r) * out_features + first;
      const int32_t* sr = sums + r * kTile;
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
      // Many rows' outputs (the LM head's logits) outgrow the caches: streaming stores write
      // them without reading their lines in first. Only on the AMX path, whose threads fence
      // them (amx_tiles); a few rows' outputs fit the caches anyway.
      if (q.amx && n == kTile && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
        for (int64_t j = 0; j < kTile; j += 16) {
          _mm512_stream_ps(dst + j, rescale_ps(sr + j, comp + first + j, sc + first + j,
                                               _mm512_set1_ps(top)));
        }
        continue;
      }
#endif
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        dst[j] = rescale(sr[j], comp[first + j], sc[first + j], top);
      }
    }
  });
#endif
  return out;
}

#if defined(GEMMA_INT8_KERNEL)
// One row's n outputs of a tile (columns first..first + n; comp and sc from column `first`)
// into its 16 lanes (column j in lane j % 16) of the largest output met and its smallest
// column (best, column); returns whether any output was NaN.
#if defined(__AVX512VNNI__)
bool update_lanes(const int32_t* sums, const int32_t* comp, const float* sc, float row_max,
                  int64_t first, int64_t n, float* best, int32_t* column) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 top = _mm512_loadu_ps(best);
  __m512i at = _mm512_loadu_si512(column);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1;
    const __m512 v = rescale_ps(sums + j, comp + j, sc + j, _mm512_set1_ps(row_max), valid);
    const __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32(first + j));
    nan |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
    const __mmask16 larger = _mm512_mask_cmp_ps_mask(valid, v, top, _CMP_GT_OQ);
    const __mmask16 tie = _mm512_mask_cmp_ps_mask(valid, v, top, _CMP_EQ_OQ);
    at = _mm512_mask_blend_epi32(larger, at, index);
    at = _mm512_mask_min_epi32(at, tie, at, index);
    top = _mm512_mask_blend_ps(larger, top, v);
  }
  _mm512_storeu_ps(best, top);
  _mm512_storeu_si512(column, at);
  return nan != 0;
}
#else
// The same rule on two 8-lane halves; the last outputs of a partial run of 16 lane by lane.
bool update_lanes(const int32_t* sums, const int32_t* comp, const float* sc, float row_max,
                  int64_t first, int64_t n, float* best, int32_t* column) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 scale = _mm256_set1_ps(row_max);
  __m256 top[2] = {_mm256_loadu_ps(best), _mm256_loadu_ps(best + 8)};
  __m256i at[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(column)),
                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(column + 8))};
  int nan = 0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int h = 0; h < 2; ++h) {
      const int64_t k = j + 8 * h;
      const __m256 v = rescale_ps(sums + k, comp + k, sc + k, scale);
      const __m256i index = _mm256_add_epi32(lanes, _mm256_set1_epi32(first + k));
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 larger = _mm256_cmp_ps(v, top[h], _CMP_GT_OQ);
      const __m256 tie = _mm256_cmp_ps(v, top[h], _CMP_EQ_OQ);
      at[h] = _mm256_blendv_epi8(at[h], index, _mm256_castps_si256(larger));
      at[h] = _mm256_blendv_epi8(at[h], _mm256_min_epi32(at[h], index), _mm256_castps_si256(tie));
      top[h] = _mm256_blendv_ps(top[h], v, larger);
    }
  }
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_ps(best + 8 * h, top[h]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(column + 8 * h), at[h]);
  }
  for (; j < n; ++j) {
    const float v = rescale(sums[j], comp[j], sc[j], row_max);
    const int32_t index = static_cast<int32_t>(first + j);
    const int64_t lane = j % 16;
    nan |= std::isnan(v);
    if (v > best[lane]) {
      best[lane] = v;
      column[lane] = index;
    } else if (v == best[lane] && index < column[lane]) {
      column[lane] = index;
    }
  }
  return nan != 0;
}
#endif
#endif

// The first maximum of each row of packed_int8_linear(x, ...) (a NaN counts as the largest,
// the first NaN winning, as torch.max(dim).indices and row_argmax take it): int64 [rows],
// without writing the outputs. Each output is computed as packed_int8_linear computes it, so
// the index is the one row_argmax finds in its result. A greedy step's LM head: the logits of
// 64 rows of a 262,144-token vocabulary are 64 MiB that would be written and read again.
// Each thread keeps, per row and lane of 16, the largest output it met and its smallest
// column; the lanes are reduced at the end, so the order tiles are handed out in is free.
at::Tensor packed_int8_linear_argmax(const at::Tensor& x, const at::Tensor& packed,
                                     const at::Tensor& scales, const at::Tensor& compensation,
                                     int64_t out_features) {
  check_int8_linear(x, packed, scales, compensation, out_features);
  const int64_t rows = x.size(0);
  at::Tensor out = at::zeros({rows}, x.options().dtype(at::kLong));
  TORCH_CHECK(out_features < INT32_MAX, "too many outputs");
#if defined(GEMMA_INT8_KERNEL)
  if (rows == 0) {
    return out;
  }
  const Int8Rows q = quantize_rows(x, packed.size(1));
  const float* sc = scales.data_ptr<float>();
  const int32_t* comp = compensation.data_ptr<int32_t>();
  // Called inside a parallel region, parallel_chunks runs serially on the caller's thread:
  // then one slot, whatever that thread's number.
  const bool nested = omp_in_parallel();
  const int64_t threads = nested ? 1 : omp_get_max_threads();
  // Per thread and row: 16 lanes of the largest value and its column, and the first NaN.
  std::vector<float> best(threads * rows * 16, -std::numeric_limits<float>::infinity());
  std::vector<int32_t> column(threads * rows * 16, INT32_MAX);
  std::vector<int32_t> first_nan(threads * rows, INT32_MAX);
  int8_tile_sums(q, rows, packed, 1, [&](int64_t t, int64_t row0, int64_t block_rows,
                                      const int32_t* sums) {
    const int64_t first = t * kTile, n = std::min(kTile, out_features - first);
    const int64_t thread = nested ? 0 : omp_get_thread_num();
    for (int64_t r = 0; r < block_rows && row0 + r < rows && n > 0; ++r) {
      const int64_t row = row0 + r;
      const int32_t* sr = sums + r * kTile;
      const bool nan = update_lanes(sr, comp + first, sc + first, q.row_max[row], first, n,
                                    best.data() + (thread * rows + row) * 16,
                                    column.data() + (thread * rows + row) * 16);
      if (nan) {  // the tile's first NaN, if it comes before the one already met
        for (int64_t j = 0; j < n; ++j) {
          if (std::isnan(rescale(sr[j], comp[first + j], sc[first + j], q.row_max[row]))) {
            first_nan[thread * rows + row] =
                std::min<int32_t>(first_nan[thread * rows + row], first + j);
            break;
          }
        }
      }
    }
  });
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    int32_t nan_at = INT32_MAX;
    float top = -std::numeric_limits<float>::infinity();
    int32_t at = INT32_MAX;
    for (int64_t thread = 0; thread < threads; ++thread) {
      nan_at = std::min(nan_at, first_nan[thread * rows + row]);
      for (int64_t lane = 0; lane < 16; ++lane) {
        const int64_t k = (thread * rows + row) * 16 + lane;
        if (best[k] > top || (best[k] == top && column[k] < at)) {
          top = best[k];
          at = column[k];
        }
      }
    }
    // Every output -inf: the first column, as torch.max gives it.
    o[row] = nan_at != INT32_MAX ? nan_at : (at == INT32_MAX ? 0 : at);
  }
#else
  TORCH_CHECK(false, "this CPU build has no int8 packed linear kernel");
#endif
  return out;
}

// gelu_tanh(gate(x)) * up(x), the product Gemma's int8 MLP hands its down projection, over int8
// weights packed with gate's and up's rows in alternating runs of 64 (tile 2 t: gate's outputs
// 64 t.., tile 2 t + 1: up's; scales and compensation in the same order, as packed_int8_linear
// takes them), so one task has both halves of its outputs. Each pre-activation is the value
// packed_int8_linear computes, bit for bit; the gelu is gelu_tanh's formula, whose last bits
// can differ from ATen's. x [rows, I]; returns [rows, hidden] float32.
at::Tensor packed_int8_gated(const at::Tensor& x, const at::Tensor& packed,
                             const at::Tensor& scales, const at::Tensor& compensation,
                             int64_t hidden) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(0) % 2 == 0 &&
                  hidden > 0 && hidden <= packed.size(0) / 2 * kTile,
              "gate and up must be packed int8 weights in alternate tiles");
  check_int8_linear(x, packed, scales, compensation, packed.size(0) * kTile);
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, hidden}, x.options().dtype(at::kFloat));
#if defined(GEMMA_INT8_KERNEL)
  if (rows == 0) {
    return out;
  }
  const Int8Rows q = quantize_rows(x, packed.size(1));
  const float* sc = scales.data_ptr<float>();
  const int32_t* comp = compensation.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  int8_tile_sums(q, rows, packed, 2, [&](int64_t t, int64_t row0, int64_t block_rows,
                                         const int32_t* sums) {
    const int64_t first = t / 2 * kTile, n = std::min(kTile, hidden - first);
    const int64_t gate = t * kTile, up = gate + kTile;  // their outputs in packed's order
    for (int64_t r = 0; r < block_rows && row0 + r < rows; ++r) {
      const int32_t* g = sums + r * kTile;
      const int32_t* u = sums + (block_rows + r) * kTile;
      float* dst = o + (row0 + r) * hidden + first;
#if defined(__AVX512VNNI__)
      const __m512 top = _mm512_set1_ps(q.row_max[row0 + r]);
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 valid = n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1;
        const __m512 activation =
            gelu_tanh_ps(rescale_ps(g + j, comp + gate + j, sc + gate + j, top, valid));
        const __m512 product =
            _mm512_mul_ps(rescale_ps(u + j, comp + up + j, sc + up + j, top, valid), activation);
        _mm512_mask_storeu_ps(dst + j, valid, product);
      }
#else
      const float top = q.row_max[row0 + r];
      for (int64_t j = 0; j < n; ++j) {
        const float activation = gelu_tanh(rescale(g[j], comp[gate + j], sc[gate + j], top));
        dst[j] = rescale(u[j], comp[up + j], sc[up + j], top) * activation;
      }
#endif
    }
  });
#endif
  return out;
}

// Gemma's MLP, down(gelu_tanh(gate(x)) * up(x)), over bfloat16 packed weights, rounded where
// BFloat16GatedMLP's oneDNN GEMMs round: the activation gelu(gate sums) to bfloat16, the product
// (up sums times it) to bfloat16, the output to bfloat16. gate_up packs gate's and up's rows in
// alternating runs of 64 (tile 2 t: gate's outputs 64 t.., tile 2 t + 1: up's), so one task has
// both halves of its outputs. x [rows, I] float32 or bfloat16; returns [rows, out_features]
// bfloat16.
at::Tensor packed_gated_mlp(const at::Tensor& x, const at::Tensor& gate_up,
                            const at::Tensor& down, int64_t hidden, int64_t out_features) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && down.scalar_type() == at::kBFloat16 &&
                  gate_up.size(0) % 2 == 0 && hidden <= gate_up.size(0) / 2 * kTile,
              "the MLP's packed weights must be bfloat16, gate and up in alternate tiles");
  check_packed(x, gate_up, 2 * hidden);
  const int64_t rows = x.size(0);
  at::Tensor product = at::zeros({rows, packed_inputs(down)}, x.options().dtype(at::kBFloat16));
  check_packed(product, down, out_features);
  at::Tensor out = at::empty({rows, out_features}, product.options());
  if (rows == 0) {
    return out;
  }
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
  if (rows > kMaxRows && packed_amx(at::kBFloat16, packed_inputs(gate_up)) &&
      packed_amx(at::kBFloat16, packed_inputs(down))) {
    const int64_t units = gate_up.size(1), down_units = down.size(1);
    const at::Tensor a = amx_bfloat16_rows(x, units);
    // The product in the layout the down projection's tiles read.
    const at::Tensor between = amx_bfloat16_rows(product, down_units);
    auto* p = static_cast<c10::BFloat16*>(between.data_ptr());
    const int64_t p_stride = between.stride(0);
    amx_tiles<true>(
        amx_rows_data(a), amx_rows_stride(a), a.size(0), static_cast<const char*>(gate_up.data_ptr()),
        gate_up.size(0), units, 2, [&](int64_t tile, int64_t row0, const void* sums) {
          const float* g = static_cast<const float*>(sums);
          const float* u = g + kAmxRowBlock * kTile;
          const int64_t first = tile / 2 * kTile, n = std::min(kTile, hidden - first);
          const int64_t block = std::min(kAmxRowBlock, rows - row0);
          for (int64_t r = 0; r < block; ++r) {
            c10::BFloat16* dst = p + (row0 + r) * p_stride + first;
            const float* gr = g + r * kTile;
            const float* ur = u + r * kTile;
            if (n == kTile) {
              for (int64_t j = 0; j < kTile; j += 16) {
                const __m512 activation = from_bfloat16(to_bfloat16(gelu_tanh_ps(_mm512_loadu_ps(gr + j))));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                                    to_bfloat16(_mm512_mul_ps(_mm512_loadu_ps(ur + j), activation)));
              }
              continue;
            }
            for (int64_t j = 0; j < n; ++j) {
              const float activation = static_cast<float>(static_cast<c10::BFloat16>(gelu_tanh(gr[j])));
              dst[j] = static_cast<c10::BFloat16>(ur[j] * activation);
            }
          }
        });
    amx_tiles<true>(amx_rows_data(between), amx_rows_stride(between), between.size(0),
                    static_cast<const char*>(down.data_ptr()), down.size(0), down_units, 1,
                    [&](int64_t t, int64_t row0, const void* sums) {
                      const int64_t block = std::min(kAmxRowBlock, rows - row0);
                      const int64_t first = t * kTile, n = std::min(kTile, out_features - first);
                      if (block > 0) {
                        store_bfloat16(static_cast<const float*>(sums), block,
                                       out.data_ptr<c10::BFloat16>() + row0 * out_features,
                                       out_features, first, n);
                      }
                    });
    return out;
  }
#endif
  auto* p = product.data_ptr<c10::BFloat16>();
  const int64_t width = product.size(1);
  for_each_tile(x, gate_up, 2, [&](int64_t tile, const float* sums) {
    const int64_t first = tile / 2 * kTile, n = std::min(kTile, hidden - first);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = sums + r * kTile;
      const float* u = sums + (rows + r) * kTile;
      c10::BFloat16* dst = p + r * width + first;
      for (int64_t o = 0; o < n; ++o) {
        const float activation = static_cast<float>(static_cast<c10::BFloat16>(gelu_tanh(g[o])));
        dst[o] = static_cast<c10::BFloat16>(u[o] * activation);
      }
    }
  });
  auto* o = out.data_ptr<c10::BFloat16>();
  for_each_tile(product, down, 1, [&](int64_t t, const float* sums) {
    store_tile(sums, rows, t, out_features, o);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemma_cpu, m) {
  m.def("packed_linear_supported(ScalarType dtype) -> bool");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, bool bf16_out) -> Tensor");
  m.def(
      "packed_int8_linear(Tensor x, Tensor packed, Tensor scales, Tensor compensation, "
      "int out_features, Tensor(a!)? out=None) -> Tensor");
  m.def(
      "packed_int8_linear_argmax(Tensor x, Tensor packed, Tensor scales, Tensor compensation, "
      "int out_features) -> Tensor");
  m.def(
      "packed_int8_gated(Tensor x, Tensor packed, Tensor scales, Tensor compensation, "
      "int hidden) -> Tensor");
  m.def("packed_amx(ScalarType dtype, int inputs) -> bool");
  m.def(
      "packed_gated_mlp(Tensor x, Tensor gate_up, Tensor down, int hidden, int out_features) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(gemma_cpu, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_int8_linear", &packed_int8_linear);
  m.impl("packed_int8_linear_argmax", &packed_int8_linear_argmax);
  m.impl("packed_int8_gated", &packed_int8_gated);
  m.impl("packed_gated_mlp", &packed_gated_mlp);
}

TORCH_LIBRARY_IMPL(gemma_cpu, CompositeExplicitAutograd, m) {
  m.impl("packed_linear_supported", &packed_linear_supported);
  m.impl("packed_amx", &packed_amx);
}
