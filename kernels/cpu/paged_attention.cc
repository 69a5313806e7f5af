// Paged attention of single queries on CPU, for the reference backend's bfloat16 cache (uint16 words)
// and its float32 cache (one handler each, from the same templates).
//
// XLA's CPU backend has no fused gather-and-dot: the jnp reference gathers each chunk of pages into a
// temporary and runs batched dots too small for its dot library (9 rows per sequence), ~1.6 ms per
// layer for a batch-64 decode at SmolLM2's shapes, a third of the step. This handler reads each key
// and value row once, straight from its page, in float32: one task per (query, KV head), spread over
// XLA's intra-op thread pool. Built on first use by kernels/cpu_attention.py; the jnp reference stays
// the specification and the fallback.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float ToF32(uint16_t word) {  // a bfloat16's bits
  uint32_t bits = static_cast<uint32_t>(word) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline float ToF32(float value) { return value; }

// exp(x) for x <= 0 (a score minus its row's max), written so that the compiler vectorizes a loop of
// it: glibc's expf is a scalar call (~10 ns: 0.9 ms of a batch-64 decode layer spent in it). 2^n by
// the exponent bits, e^r on |r| <= ln2/2 by its degree-6 Taylor polynomial: relative error < 2e-7.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);  // below, e^x underflows; exp(-inf) (a masked score) -> ~0
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float e = 1.0f / 720.0f;
  e = e * r + 1.0f / 120.0f;
  e = e * r + 1.0f / 24.0f;
  e = e * r + 1.0f / 6.0f;
  e = e * r + 0.5f;
  e = e * r + 1.0f;
  e = e * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}

// Each of `rows` score rows of `len` in place -> exp(s - max), its sum in total[row] (0 where nothing
// is visible: the output stays zero). With `sinks` (one logit per row, gpt-oss), each row's sink is a
// further key of value zero: it takes part in the max and adds exp(sink - max) to the sum.
inline void Softmax(float* scores, int64_t rows, int64_t len, float* total, const float* sinks) {
  for (int64_t row = 0; row < rows; ++row) {
    float* sg = scores + row * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
    total[row] = 0.0f;
    if (!std::isfinite(m)) continue;
    float l = 0.0f;
    if (sinks != nullptr) {
      m = std::max(m, sinks[row]);
      l = ExpNonPositive(sinks[row] - m);
    }
#pragma omp simd reduction(+ : l)
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = ExpNonPositive(sg[t] - m);
      l += sg[t];
    }
    total[row] = l;
  }
}

// T: a cache element, uint16_t (bfloat16 words) or float.
template <typename T>
struct Problem {
  const float* q;         // [N, H, G, D], already scaled
  const T* k;             // [num_blocks, block_size, H, D]
  const T* v;             // same
  const int32_t* tables;  // [N, max_blocks]
  const int32_t* positions;  // [N]: the query's position; it sees keys at positions <= it
  const int32_t* active;     // [N]: 0 -> output zeros
  int64_t window;            // > 0: keys at positions > position - window only
  float soft_cap;            // > 0: scores s -> cap * tanh(s / cap)
  const float* sinks;        // [H, G] sink logits, or nullptr
  int64_t num_queries, num_heads, group, head_dim, block_size, max_blocks, num_blocks;
  float* out;  // [N, H, G, D]
};

// The positions query i sees, [first, last]: its window, clipped to its table. False if none.
template <typename T>
inline bool VisibleRange(const Problem<T>& p, int64_t i, int64_t* first, int64_t* last) {
  if (!p.active[i]) return false;
  const int64_t position = p.positions[i];
  *first = p.window > 0 ? std::max<int64_t>(0, position - p.window + 1) : 0;
  *last = std::min<int64_t>(position, p.max_blocks * p.block_size - 1);
  return *last >= *first;
}

// Visits the rows of positions [first, last] of `cache` through `table` as (position - first,
// pointer to the row's word `offset`), page by page (no division per key); a page id outside the
// cache is skipped, never read. Pages are scattered: the hardware prefetcher stops at each one's end,
// so with `prefetch` the next page is asked for while this one is used.
template <typename T, typename Visit>
void ForEachRow(const Problem<T>& p, const int32_t* table, int64_t first, int64_t last, const T* cache,
                int64_t offset, bool prefetch, Visit&& visit) {
  const int64_t bs = p.block_size, row_stride = p.num_heads * p.head_dim, last_page = last / bs;
  for (int64_t page_index = first / bs; page_index <= last_page; ++page_index) {
    const int64_t page = table[page_index];
    if (prefetch && page_index < last_page) {
      const int64_t next = table[page_index + 1];
      if (next >= 0 && next < p.num_blocks) {
        const char* bytes = reinterpret_cast<const char*>(cache + next * bs * row_stride);
        for (int64_t b = 0; b < bs * row_stride * int64_t(sizeof(T)); b += 64) __builtin_prefetch(bytes + b);
      }
    }
    if (page < 0 || page >= p.num_blocks) continue;
    const int64_t lo = std::max(first, page_index * bs), hi = std::min(last, page_index * bs + bs - 1);
    const T* base = cache + page * bs * row_stride + offset;
    for (int64_t t = lo; t <= hi; ++t) visit(t - first, base + (t - page_index * bs) * row_stride);
  }
}

// One query's G heads sharing KV head h: scores for every visible key, softmax, weighted values.
// Keys are walked page by page (no division per key); a row is widened to float32 once for all G.
template <typename T>
void AttendOne(const Problem<T>& p, int64_t task, std::vector<float>& scores, std::vector<float>& row) {
  const int64_t i = task / p.num_heads, h = task % p.num_heads;
  const int64_t g_count = p.group, d = p.head_dim;
  float* out = p.out + (i * p.num_heads + h) * g_count * d;
  std::fill(out, out + g_count * d, 0.0f);
  int64_t first, last;
  if (!VisibleRange(p, i, &first, &last)) return;
  const int64_t len = last - first + 1;
  const float* q = p.q + (i * p.num_heads + h) * g_count * d;
  const int32_t* table = p.tables + i * p.max_blocks;
  scores.assign(g_count * len, -std::numeric_limits<float>::infinity());
  row.resize(d);
  float* r = row.data();
  auto for_each_row = [&](const T* cache, auto&& visit) {
    ForEachRow(p, table, first, last, cache, h * d, false, visit);
  };
  for_each_row(p.k, [&](int64_t t, const T* key) {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) r[j] = ToF32(key[j]);
    for (int64_t g = 0; g < g_count; ++g) {
      const float* qg = q + g * d;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < d; ++j) s += qg[j] * r[j];
      if (p.soft_cap > 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
      scores[g * len + t] = s;
    }
  });
  float total[64];  // group sizes are small (query heads per KV head)
  Softmax(scores.data(), g_count, len, total, p.sinks == nullptr ? nullptr : p.sinks + h * g_count);
  for_each_row(p.v, [&](int64_t t, const T* value) {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) r[j] = ToF32(value[j]);
    for (int64_t g = 0; g < g_count; ++g) {
      const float w = scores[g * len + t];
      float* og = out + g * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) og[j] += w * r[j];
    }
  });
  for (int64_t g = 0; g < g_count; ++g) {
    if (total[g] <= 0.0f) continue;
    const float inv = 1.0f / total[g];
    for (int64_t j = 0; j < d; ++j) out[g * d + j] *= inv;
  }
}

// The same for head_dim D and group G known at compile time (the common shapes): a row is loaded as
// D / 16 vectors of 16 floats and used by all G heads while in registers, and the G x D output
// accumulates in registers across the keys. GCC vector extensions: AVX-512 where -march=native has
// it, pairs of AVX2 vectors elsewhere.
typedef float Vec __attribute__((vector_size(64)));
typedef uint16_t Words __attribute__((vector_size(32)));
typedef uint32_t Wide __attribute__((vector_size(64)));

inline Vec Load(const uint16_t* words) {
  Words w;
  std::memcpy(&w, words, sizeof(w));
  Wide bits = __builtin_convertvector(w, Wide) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline Vec Load(const float* values) {
  Vec v;
  std::memcpy(&v, values, sizeof(v));
  return v;
}

// The 16 lanes summed as a tree (4 shuffles and adds; a lane-by-lane loop is 15 dependent adds, and
// it ran once per key and query head: most of a decode's time).
inline float Sum(Vec v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// One task per query: its pages are walked once, each row of all KV heads (H x D contiguous words)
// read in one go, so a page streams through the cache in order.
constexpr int kMaxKvHeads = 16;

template <typename T, int D, int G>
void AttendQueryFixed(const Problem<T>& p, int64_t i, std::vector<float>& scores) {
  constexpr int C = D / 16;
  const int64_t heads = p.num_heads;
  float* out = p.out + i * heads * G * D;
  std::fill(out, out + heads * G * D, 0.0f);
  int64_t first, last;
  if (!VisibleRange(p, i, &first, &last)) return;
  const int64_t len = last - first + 1;
  const int32_t* table = p.tables + i * p.max_blocks;
  const float* q = p.q + i * heads * G * D;
  scores.assign(heads * G * len, -std::numeric_limits<float>::infinity());  // [H, G, len]
  auto for_each_row = [&](const T* cache, bool prefetch, auto&& visit) {
    ForEachRow(p, table, first, last, cache, 0, prefetch, visit);
  };
  // Head by head, so that its G x D query stays in registers over the rows (the rows of the first head
  // bring the pages into the cache for the others).
  for (int64_t h = 0; h < heads; ++h) {
    Vec qv[G][C];
    std::memcpy(qv, q + h * G * D, sizeof(qv));
    float* sh = scores.data() + h * G * len;
    for_each_row(p.k, h == 0, [&](int64_t t, const T* keys) {
      Vec k[C];
      for (int c = 0; c < C; ++c) k[c] = Load(keys + h * D + 16 * c);
      for (int g = 0; g < G; ++g) {
        Vec acc = qv[g][0] * k[0];
        for (int c = 1; c < C; ++c) acc += qv[g][c] * k[c];
        float s = Sum(acc);
        if (p.soft_cap > 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
        sh[g * len + t] = s;
      }
    });
  }
  float total[kMaxKvHeads * G];
  Softmax(scores.data(), heads * G, len, total, p.sinks);
  Vec acc[kMaxKvHeads][G][C] = {};
  for (int64_t h = 0; h < heads; ++h) {
    Vec ah[G][C] = {};  // in registers over the rows
    const float* sh = scores.data() + h * G * len;
    for_each_row(p.v, h == 0, [&](int64_t t, const T* values) {
      Vec v[C];
      for (int c = 0; c < C; ++c) v[c] = Load(values + h * D + 16 * c);
      for (int g = 0; g < G; ++g) {
        const float w = sh[g * len + t];
        for (int c = 0; c < C; ++c) ah[g][c] += w * v[c];
      }
    });
    std::memcpy(acc[h], ah, sizeof(ah));
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int g = 0; g < G; ++g) {
      const float inv = total[h * G + g] > 0.0f ? 1.0f / total[h * G + g] : 0.0f;
      for (int c = 0; c < C; ++c) {
        const Vec o = acc[h][g][c] * inv;
        std::memcpy(out + (h * G + g) * D + 16 * c, &o, sizeof(o));
      }
    }
  }
}

template <typename T>
using AttendFn = void (*)(const Problem<T>&, int64_t, std::vector<float>&);

template <typename T, int D>
AttendFn<T> FixedFor(int64_t group) {
  switch (group) {
    case 1: return AttendQueryFixed<T, D, 1>;
    case 2: return AttendQueryFixed<T, D, 2>;
    case 3: return AttendQueryFixed<T, D, 3>;
    case 4: return AttendQueryFixed<T, D, 4>;
    case 6: return AttendQueryFixed<T, D, 6>;
    case 8: return AttendQueryFixed<T, D, 8>;
    default: return nullptr;
  }
}

template <typename T>
AttendFn<T> FixedFor(int64_t head_dim, int64_t group, int64_t num_heads) {
  if (num_heads > kMaxKvHeads) return nullptr;
  switch (head_dim) {
    case 64: return FixedFor<T, 64>(group);
    case 128: return FixedFor<T, 128>(group);
    default: return nullptr;
  }
}

// T: the cache's element; DT: its FFI type.
template <typename T, ffi::DataType DT>
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<DT> k_cache,
                              ffi::Buffer<DT> v_cache, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> active,
                              ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> sinks, float soft_cap,
                              bool has_sinks, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_attention: q [N, H, G, D], cache [B, S, H, D], tables [N, P]");
  }
  const auto vd = v_cache.dimensions();
  const bool same_v = vd.size() == 4 && std::equal(vd.begin(), vd.end(), kd.begin());
  if (kd[2] != qd[1] || kd[3] != qd[3] || td[0] != qd[0] || !same_v) {
    return ffi::Error::InvalidArgument("paged_attention: mismatched q, cache and table shapes");
  }
  if (qd[2] > 64) return ffi::Error::InvalidArgument("paged_attention: more than 64 query heads per KV head");
  if (has_sinks && sinks.element_count() != static_cast<size_t>(qd[1] * qd[2])) {
    return ffi::Error::InvalidArgument("paged_attention: sinks must hold one logit per query head");
  }
  const Problem<T> problem{q.typed_data(),   k_cache.typed_data(), v_cache.typed_data(),
                        tables.typed_data(), positions.typed_data(), active.typed_data(),
                        window.typed_data()[0], soft_cap,
                        has_sinks ? sinks.typed_data() : nullptr,
                        qd[0], qd[1], qd[2], qd[3], kd[1], td[1], kd[0], out->typed_data()};
  const AttendFn<T> fixed = FixedFor<T>(qd[3], qd[2], qd[1]);
  const int64_t num_tasks = fixed != nullptr ? qd[0] : qd[0] * qd[1];  // per query, or per (query, head)
  xlaserve::ParallelFor(pool, num_tasks, [problem, fixed](int64_t task) {
    thread_local std::vector<float> scores, row;
    if (fixed != nullptr) {
      fixed(problem, task, scores);
    } else {
      AttendOne(problem, task, scores, row);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// The bfloat16 cache's handler or the float32 cache's (kernels/cpu_ops.py: TARGET, F32_TARGET).
#define XLASERVE_PAGED_ATTENTION_BINDING(DT)       \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::ThreadPool>()                      \
      .Arg<ffi::Buffer<ffi::F32>>()                \
      .Arg<ffi::Buffer<DT>>()                      \
      .Arg<ffi::Buffer<DT>>()                      \
      .Arg<ffi::Buffer<ffi::S32>>()                \
      .Arg<ffi::Buffer<ffi::S32>>()                \
      .Arg<ffi::Buffer<ffi::S32>>()                \
      .Arg<ffi::Buffer<ffi::S32>>()                \
      .Arg<ffi::Buffer<ffi::F32>>()                \
      .Attr<float>("soft_cap")                     \
      .Attr<bool>("has_sinks")                     \
      .Ret<ffi::Buffer<ffi::F32>>()

// One handler a build (kernels/cpu_ops.py passes the define): each library compiles only its own
// templates' instances, half the compiler's time of both.
#ifdef XLASERVE_F32_CACHE
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePagedAttentionF32, (PagedAttentionImpl<float, ffi::F32>),
                              XLASERVE_PAGED_ATTENTION_BINDING(ffi::F32));
#else
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePagedAttention, (PagedAttentionImpl<uint16_t, ffi::U16>),
                              XLASERVE_PAGED_ATTENTION_BINDING(ffi::U16));
#endif
