// A few rows (a batch-1 decode) times a quantized weight with group scales, on CPU.
//
// x [M, K] float32 times w [K, N] stored as int8 codes, or as 4-bit codes packed two to a byte
// ([K / 2, N] uint8: input 2i in the low nibble, 2i + 1 in the high one), each group of B
// consecutive inputs of a column scaled (and, for GGUF's formats with mins, shifted):
// w[k, n] = scale[k / B, n] * code[k, n] (+ zero[k / B, n]). XLA's CPU backend converts such a
// weight to a bfloat16 copy before its dot (never fused): a batch-1 GGUF step spent more time writing
// and reading those copies than the bfloat16 model spends reading its weights. Here each code is read
// once, widened in registers, and the columns are spread over XLA's intra-op thread pool.
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float Vec __attribute__((vector_size(64)));  // 16 floats

constexpr int kMaxRows = 8;
constexpr int kTaskColumns = 512;  // columns per task

// 16 codes or scales widened to floats. GCC's __builtin_convertvector from 8- and 16-bit vectors
// compiled to one scalar insert per lane (6x slower than the bfloat16 head); with AVX-512 (which
// -march=native enables where the CPU has it) each is two instructions.
#if defined(__AVX512F__)
inline Vec WidenS8(const int8_t* p) {
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void WidenU4(const uint8_t* p, Vec& low, Vec& high) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  low = (Vec)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
  high = (Vec)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
}
inline Vec WidenF16(const uint16_t* p) {
  return (Vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
inline Vec WidenS8(const int8_t* p) {
  Vec v;
  for (int l = 0; l < 16; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}
inline void WidenU4(const uint8_t* p, Vec& low, Vec& high) {
  for (int l = 0; l < 16; ++l) {
    low[l] = static_cast<float>(p[l] & 0x0F);
    high[l] = static_cast<float>(p[l] >> 4);
  }
}
inline Vec WidenF16(const uint16_t* p) {
  Vec v;
  for (int l = 0; l < 16; ++l) {
    _Float16 h;
    std::memcpy(&h, p + l, sizeof(h));
    v[l] = static_cast<float>(h);
  }
  return v;
}
#endif

inline Vec LoadScales(const void* base, bool f16, int64_t index) {
  if (f16) return WidenF16(static_cast<const uint16_t*>(base) + index);
  Vec v;
  std::memcpy(&v, static_cast<const float*>(base) + index, sizeof(v));
  return v;
}

struct Problem {
  const float* x;        // [M, K]
  const void* codes;     // int8 [K, N] or packed uint8 [K / 2, N]
  const void* scale;     // [K / B, N] float16 or float32
  const void* zero;      // same, or nullptr
  bool packed, scale_f16, zero_f16;
  int64_t rows, depth, columns, group;  // M, K, N, B
  float* out;            // [M, N]
};

// One group of inputs over columns [n0, n0 + 16 * V): the codes times x summed in registers, then
// scaled into `acc`; a zero adds zero * (sum of x over the group).
template <int V>
void GroupBlock(const Problem& p, int64_t g, int64_t n0, Vec (*acc)[kTaskColumns / 16], int64_t a0,
                const float* xsum) {
  const int64_t m_count = p.rows, n = p.columns, b = p.group;
  Vec part[kMaxRows][V] = {};
  if (p.packed) {
    const uint8_t* codes = static_cast<const uint8_t*>(p.codes);
    for (int64_t kk = g * b / 2; kk < (g + 1) * b / 2; ++kk) {
      for (int v = 0; v < V; ++v) {
        Vec low, high;
        WidenU4(codes + kk * n + n0 + 16 * v, low, high);
        for (int64_t m = 0; m < m_count; ++m) {
          part[m][v] += p.x[m * p.depth + 2 * kk] * low + p.x[m * p.depth + 2 * kk + 1] * high;
        }
      }
    }
  } else {
    const int8_t* codes = static_cast<const int8_t*>(p.codes);
    for (int64_t k = g * b; k < (g + 1) * b; ++k) {
      for (int v = 0; v < V; ++v) {
        const Vec w = WidenS8(codes + k * n + n0 + 16 * v);
        for (int64_t m = 0; m < m_count; ++m) part[m][v] += p.x[m * p.depth + k] * w;
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    const Vec s = LoadScales(p.scale, p.scale_f16, g * n + n0 + 16 * v);
    if (p.zero != nullptr) {
      const Vec z = LoadScales(p.zero, p.zero_f16, g * n + n0 + 16 * v);
      for (int64_t m = 0; m < m_count; ++m) acc[m][a0 + v] += s * part[m][v] + z * xsum[m];
    } else {
      for (int64_t m = 0; m < m_count; ++m) acc[m][a0 + v] += s * part[m][v];
    }
  }
}

// Columns [n0, n0 + width) of every row, group by group. Within a group the block's rows are walked
// 64 columns (one cache line of codes) at a time: a wide weight's rows are pages apart, and walking
// each row across the whole block keeps those pages' translations hot (64 columns per task thrashed
// the TLB on the [576, 49152] LM head: 2.3x the bfloat16 head's time).
void Block(const Problem& p, int64_t n0, int64_t width) {
  Vec acc[kMaxRows][kTaskColumns / 16];
  for (int64_t m = 0; m < p.rows; ++m) std::fill(acc[m], acc[m] + width / 16, Vec{});
  for (int64_t g = 0; g < p.depth / p.group; ++g) {
    float xsum[kMaxRows] = {};
    if (p.zero != nullptr) {
      for (int64_t m = 0; m < p.rows; ++m) {
        for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) xsum[m] += p.x[m * p.depth + k];
      }
    }
    int64_t c = 0;
    for (; c + 64 <= width; c += 64) GroupBlock<4>(p, g, n0 + c, acc, c / 16, xsum);
    for (; c < width; c += 16) GroupBlock<1>(p, g, n0 + c, acc, c / 16, xsum);  // N is a multiple of 16
  }
  for (int64_t m = 0; m < p.rows; ++m) std::memcpy(p.out + m * p.columns + n0, acc[m], width * sizeof(float));
}

bool IsF16(ffi::AnyBuffer& b) { return b.element_type() == ffi::DataType::F16; }

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                               ffi::AnyBuffer scale, ffi::AnyBuffer zero, bool packed, bool has_zero,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto cd = codes.dimensions();
  const auto sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2) {
    return ffi::Error::InvalidArgument("quantized_matmul: x [M, K], codes [K(/2), N], scale [G, N]");
  }
  const int64_t depth = xd[1], columns = cd[1], groups = sd[0];
  if (xd[0] > kMaxRows || cd[0] * (packed ? 2 : 1) != depth || sd[1] != columns || columns % 16 != 0 ||
      groups == 0 || depth % groups != 0 || (packed && (depth / groups) % 2 != 0)) {
    return ffi::Error::InvalidArgument("quantized_matmul: shapes do not match");
  }
  if (!IsF16(scale) && scale.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("quantized_matmul: scales must be float16 or float32");
  }
  const Problem problem{x.typed_data(), codes.untyped_data(), scale.untyped_data(),
                        has_zero ? zero.untyped_data() : nullptr, packed, IsF16(scale), IsF16(zero),
                        xd[0], depth, columns, depth / groups, out->typed_data()};
  xlaserve::ParallelFor(pool, (columns + kTaskColumns - 1) / kTaskColumns, [problem](int64_t task) {
    const int64_t n0 = task * kTaskColumns;
    Block(problem, n0, std::min<int64_t>(kTaskColumns, problem.columns - n0));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveQuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("packed")
                                  .Attr<bool>("has_zero")
                                  .Ret<ffi::Buffer<ffi::F32>>());
