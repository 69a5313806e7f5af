// x [M, K] bfloat16 times a weight [K, N] bfloat16, float32 out, on CPU: one kernel for every M, each
// output element summed over K in an order fixed by K alone (never by M, the tiling or the threads),
// so a row's bits never depend on the rows beside it (batch invariance).
//
// The weight is packed once at load (kernels/cpu_ops.py `pack_for_dot`) into strips of 64 columns,
// each contiguous: strips[s, k, c, t] = w[2k + t, 64 s + c], so a strip streams from memory in order
// (a few-row dot is a read of the weight: walking a [K, N] matrix's columns reached a third of this
// CPU's read bandwidth) and its pairs of inputs are what vdpbf16ps takes. It is read in place from a
// stack of layers [L, S, K / 2, 64, 2] with the layer's index as an operand: a layer scan neither
// slices nor copies it (XLA's own dot, YNNPACK, packs the weight again in every call).
//
// With AVX512-BF16 each element's sum is one chain of vdpbf16ps over the pairs (2k, 2k + 1) in order
// of k, up to 6 rows x 64 columns in registers for the whole depth. Without it, a portable loop sums
// x[2k] w[2k] + x[2k + 1] w[2k + 1] in float32 in the same order (other bits than the AVX512-BF16
// build: invariance holds per CPU kind).
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kStrip = 64;     // columns per strip (4 float32 vectors of output)
constexpr int kRowBlock = 6;       // rows in registers at once: 6 x 4 accumulators
constexpr int64_t kRowChunk = 96;  // rows per task when there are many

struct Problem {
  const uint16_t* x;       // [M, K]
  const uint16_t* strips;  // [S, K / 2, 64, 2]: this layer's
  int64_t rows, depth, columns;
  float* out;  // [M, S * 64]
};

#if defined(__AVX512BF16__)

// Rows [m0, m0 + R) times strip s.
template <int R>
void Block(const Problem& p, int64_t s, int64_t m0) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const int64_t pairs = p.depth / 2;
  const uint16_t* w = p.strips + s * pairs * 2 * kStrip;
  const uint16_t* x = p.x + m0 * p.depth;
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + (k * 4 + v) * 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // x[2k], x[2k + 1] broadcast as one 32-bit word
      std::memcpy(&pair, x + r * p.depth + 2 * k, sizeof(pair));
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xp, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = p.out + (m0 + r) * p.columns + s * kStrip;
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + 16 * v, acc[r][v]);
  }
}

#else  // portable: float32 products summed in the same order (compiled with -ffp-contract=off)

inline float Widen(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <int R>
void Block(const Problem& p, int64_t s, int64_t m0) {
  float acc[R][kStrip] = {};
  const int64_t pairs = p.depth / 2;
  const uint16_t* w = p.strips + s * pairs * 2 * kStrip;
  for (int64_t k = 0; k < pairs; ++k) {
    const uint16_t* row = w + k * 2 * kStrip;
    for (int r = 0; r < R; ++r) {
      const uint16_t* x = p.x + (m0 + r) * p.depth + 2 * k;
      const float x0 = Widen(x[0]), x1 = Widen(x[1]);
      for (int64_t c = 0; c < kStrip; ++c) {
        acc[r][c] = acc[r][c] + (x0 * Widen(row[2 * c]) + x1 * Widen(row[2 * c + 1]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(p.out + (m0 + r) * p.columns + s * kStrip, acc[r], sizeof(acc[r]));
  }
}

#endif

// Rows [m0, m1) times strip s, kRowBlock rows at a time.
void Rows(const Problem& p, int64_t s, int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + kRowBlock <= m1; m += kRowBlock) Block<kRowBlock>(p, s, m);
  switch (m1 - m) {
    case 5: Block<5>(p, s, m); break;
    case 4: Block<4>(p, s, m); break;
    case 3: Block<3>(p, s, m); break;
    case 2: Block<2>(p, s, m); break;
    case 1: Block<1>(p, s, m); break;
    default: break;
  }
}

ffi::Error Bf16MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U16> strips,
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = strips.dimensions();
  const bool words = x.element_type() == ffi::DataType::BF16 || x.element_type() == ffi::DataType::U16;
  if (xd.size() != 2 || !words || wd.size() != 5 || wd[3] != kStrip || wd[4] != 2 ||
      layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("bf16_matmul: x [M, K] bfloat16, strips [L, S, K/2, 64, 2], a layer");
  }
  const int64_t rows = xd[0], depth = xd[1], columns = wd[1] * kStrip;
  if (wd[2] * 2 != depth) return ffi::Error::InvalidArgument("bf16_matmul: x's K is not the strips' K");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= wd[0]) {
    return ffi::Error::InvalidArgument("bf16_matmul: layer index out of range");
  }
  if (rows == 0) return ffi::Error::Success();
  const Problem problem{static_cast<const uint16_t*>(x.untyped_data()),
                        strips.typed_data() + index * depth * columns,
                        rows,
                        depth,
                        columns,
                        out->typed_data()};
  // Tasks: runs of strips (read in order: contiguous memory) times chunks of rows; about 4 per
  // thread when the rows are few, so that a busy core does not hold the others up.
  const int64_t num_strips = wd[1], chunks = (rows + kRowChunk - 1) / kRowChunk;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t run = std::max<int64_t>(1, num_strips * chunks / (4 * threads));
  const int64_t runs = (num_strips + run - 1) / run;
  xlaserve::ParallelFor(pool, runs * chunks, [problem, run, chunks, num_strips](int64_t task) {
    const int64_t s0 = (task / chunks) * run, m0 = (task % chunks) * kRowChunk;
    const int64_t m1 = std::min(problem.rows, m0 + kRowChunk);
    for (int64_t s = s0; s < std::min(num_strips, s0 + run); ++s) Rows(problem, s, m0, m1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
