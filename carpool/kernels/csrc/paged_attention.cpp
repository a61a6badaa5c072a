// Decode attention read in place from the paged KV pool. The torch path gathers every sequence's blocks into
// a padded copy and runs a masked SDPA: at one token a sequence that copy costs more than the attention.
// Here each (sequence, KV head) walks its block table directly, with the query heads that share the KV head
// together (grouped-query attention), in fp32 whatever the cache dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "row_kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace carpool::kernels {

namespace {

#ifdef CARPOOL_SIMD
namespace simd = carpool::simd;

constexpr int kLanes = simd::kLanes;

// Register tiles. The query heads that share a KV head (grouped-query attention) are processed together, so
// each key and value vector is loaded (and widened from bf16) once per tile of heads rather than once per head
// (measured on AVX-512, bf16, batch 32, context 512, one thread: -15% for SmolLM2's 9/3 heads, -23% for
// Qwen2.5-1.5B's 12/2, -35% for Gemma 3's 4/1).
// Scoring: kScoreHeads heads x 4 keys of accumulators (16 of AVX-512's 32 registers, 8 of AVX2's 16).
// Weighted values: heads x chunks of accumulators up to kValueAccs, in column blocks of kValueChunks vectors.
#if defined(CARPOOL_AVX512)
constexpr int kScoreHeads = 4, kValueAccs = 24, kValueChunks = 8;
#else
constexpr int kScoreHeads = 2, kValueAccs = 12, kValueChunks = 4;
#endif

// Calls fn(std::integral_constant<int, n>) for a runtime n in [1, MAX]: register tiles need compile-time sizes.
template <int MAX, typename Fn>
void with_tile(int n, Fn&& fn) {
  if constexpr (MAX > 1) {
    if (n < MAX) return with_tile<MAX - 1>(n, fn);
  }
  fn(std::integral_constant<int, MAX>{});
}

// scores[h * context + t] = q_h . key_t for HEADS heads; keys four at a time so the horizontal sums of four
// share one reduction.
template <typename T, int CHUNKS, int HEADS>
void score_heads(const float* query, int64_t head_dim, const T* k_cache, const int64_t* offsets, int64_t context,
                 float* scores) {
  int64_t t = 0;
  for (; t + 4 <= context; t += 4) {
    simd::Vec acc[HEADS][4];
    for (int h = 0; h < HEADS; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = simd::zero();
    for (int c = 0; c < CHUNKS; ++c) {
      simd::Vec key[4];
      for (int j = 0; j < 4; ++j) key[j] = simd::load(k_cache + offsets[t + j] + c * kLanes);
      for (int h = 0; h < HEADS; ++h) {
        const simd::Vec q = simd::load(query + h * head_dim + c * kLanes);
        for (int j = 0; j < 4; ++j) acc[h][j] = simd::fmadd(q, key[j], acc[h][j]);
      }
    }
    for (int h = 0; h < HEADS; ++h)
      simd::store4(scores + h * context + t, simd::reduce4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
  }
  for (; t < context; ++t)
    for (int h = 0; h < HEADS; ++h) {
      simd::Vec acc = simd::zero();
      for (int c = 0; c < CHUNKS; ++c)
        acc = simd::fmadd(simd::load(query + h * head_dim + c * kLanes), simd::load(k_cache + offsets[t] + c * kLanes),
                          acc);
      scores[h * context + t] = simd::reduce_add(acc);
    }
}

// One row of scores -> softmax weights (unnormalized: exp(score - max)); returns their sum. torch's vector exp.
// The maximum in vectors too: a scalar max is one dependent compare per key, and took half of SmolLM2's time
// above (924 -> 414 us with the grouping).
inline float exponentiate(float* scores, int64_t context) {
  simd::Vec tops = simd::set1(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kLanes <= context; t += kLanes) tops = simd::max(tops, simd::load(scores + t));
  float top = simd::reduce_max(tops);
  for (; t < context; ++t) top = std::max(top, scores[t]);
  simd::Vec sums = simd::zero();
  const simd::Vec top_v = simd::set1(top);
  t = 0;
  for (; t + kLanes <= context; t += kLanes) {
    const simd::Vec e = simd::exp(simd::sub(simd::load(scores + t), top_v));
    simd::store(scores + t, e);
    sums = simd::add(sums, e);
  }
  float total = simd::reduce_add(sums);
  for (; t < context; ++t) total += (scores[t] = std::exp(scores[t] - top));
  return total;
}

// out_h[first chunk ..] = sum_t weight_h[t] * value_t / total_h for HEADS heads and BLOCK chunks of the head.
template <typename T, int HEADS, int BLOCK>
void weigh_values(const T* v_cache, const int64_t* offsets, int64_t context, const float* weights,
                  const float* totals, int64_t head_dim, T* out) {
  simd::Vec acc[HEADS][BLOCK];
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < BLOCK; ++c) acc[h][c] = simd::zero();
  for (int64_t t = 0; t < context; ++t) {
    simd::Vec value[BLOCK];
    for (int c = 0; c < BLOCK; ++c) value[c] = simd::load(v_cache + offsets[t] + c * kLanes);
    for (int h = 0; h < HEADS; ++h) {
      const simd::Vec p = simd::set1(weights[h * context + t]);
      for (int c = 0; c < BLOCK; ++c) acc[h][c] = simd::fmadd(p, value[c], acc[h][c]);
    }
  }
  for (int h = 0; h < HEADS; ++h) {
    const simd::Vec inv = simd::set1(1.0f / totals[h]);
    for (int c = 0; c < BLOCK; ++c) simd::store(out + h * head_dim + c * kLanes, simd::mul(acc[h][c], inv));
  }
}

// The `group` query heads of one KV head against its context (CHUNKS = head_dim / lanes). `offsets` are the
// context's rows in the pool, shared by K and V; `scores` is scratch of group x context floats.
template <typename T, int CHUNKS>
void attend_group(const float* query, const T* k_cache, const T* v_cache, const int64_t* offsets, int64_t context,
                  int group, float* scores, T* out) {
  constexpr int64_t kHeadDim = CHUNKS * kLanes;
  for (int g = 0; g < group; g += kScoreHeads)
    with_tile<kScoreHeads>(std::min(kScoreHeads, group - g), [&](auto heads) {
      score_heads<T, CHUNKS, decltype(heads)::value>(query + g * kHeadDim, kHeadDim, k_cache, offsets, context,
                                                     scores + g * context);
    });
  float totals[64];
  for (int g = 0; g < group; ++g) totals[g] = exponentiate(scores + g * context, context);
  constexpr int kBlock = std::min(CHUNKS, kValueChunks), kHeads = kValueAccs / kBlock;
  for (int first = 0; first < CHUNKS; first += kBlock)
    for (int g = 0; g < group; g += kHeads)
      with_tile<kHeads>(std::min(kHeads, group - g), [&](auto heads) {
        weigh_values<T, decltype(heads)::value, kBlock>(v_cache + first * kLanes, offsets, context,
                                                        scores + g * context, totals + g, kHeadDim,
                                                        out + g * kHeadDim + first * kLanes);
      });
}

// The vectorized path for the common head sizes (64: Llama/SmolLM2, Qwen2.5-0.5B; 128: Qwen2.5-1.5B; 256:
// Gemma 3) and groups of up to 64 query heads per KV head; false when there is none.
template <typename T>
bool attend_vectorized(const float* query, const T* k_cache, const T* v_cache, const int64_t* offsets, int64_t context,
                       int64_t group, int64_t head_dim, float* scores, T* out) {
  if constexpr (std::is_same_v<T, double>) {
    return false;
  } else {
    if (group > 64) return false;
    auto run = [&](auto dims) {
      constexpr int kChunks = decltype(dims)::value / kLanes;
      attend_group<T, kChunks>(query, k_cache, v_cache, offsets, context, static_cast<int>(group), scores, out);
      return true;
    };
    switch (head_dim) {
      case 64: return run(std::integral_constant<int, 64>{});
      case 128: return run(std::integral_constant<int, 128>{});
      case 256: return run(std::integral_constant<int, 256>{});
      default: return false;
    }
  }
}
#endif

template <typename T>
void store_heads(const float* acc, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = T(acc[i]);
}

}  // namespace

template <typename T>
void decode_attention_items(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                            const int64_t* block_tables, const int64_t* context_lens, T* out, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                            float scale, int64_t window, int64_t first, int64_t last) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots of the pool
  std::vector<float> query(group * head_dim), acc(group * head_dim), scores;
  std::vector<int64_t> offsets;
  for (int64_t item = first; item < last; ++item) {
    const int64_t b = item / num_kv_heads, kv_head = item % num_kv_heads;
    // A sliding window keeps the last `window` keys, the query's own included: positions from first_key on.
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, context_lens[b] - window) : 0;
    const int64_t context = context_lens[b] - first_key;
    const int64_t* table = block_tables + b * max_blocks;
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < head_dim; ++d)
        query[g * head_dim + d] = static_cast<float>(q[b * q_stride + (kv_head * group + g) * head_dim + d]) * scale;
    scores.resize(group * context);
    auto slot = [&](int64_t t) {
      const int64_t position = first_key + t;
      return (table[position / block_size] * block_size + position % block_size) * token_stride + kv_head * head_dim;
    };
#ifdef CARPOOL_SIMD
    offsets.resize(context);
    for (int64_t t = 0; t < context; ++t) offsets[t] = slot(t);
    if (attend_vectorized(query.data(), k_cache, v_cache, offsets.data(), context, group, head_dim, scores.data(),
                          out + (b * num_heads + kv_head * group) * head_dim))
      continue;
#endif
    for (int64_t t = 0; t < context; ++t) {
      const T* key = k_cache + slot(t);
      for (int64_t g = 0; g < group; ++g) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += query[g * head_dim + d] * static_cast<float>(key[d]);
        scores[g * context + t] = dot;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* row = scores.data() + g * context;
      const float top = *std::max_element(row, row + context);
      float total = 0.0f;
      for (int64_t t = 0; t < context; ++t) total += (row[t] = std::exp(row[t] - top));
      for (int64_t t = 0; t < context; ++t) row[t] /= total;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t t = 0; t < context; ++t) {
      const T* value = v_cache + slot(t);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * context + t];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] += p * static_cast<float>(value[d]);
      }
    }
    store_heads(acc.data(), out + (b * num_heads + kv_head * group) * head_dim, group * head_dim);
  }
}

template void decode_attention_items(const float*, int64_t, const float*, const float*, const int64_t*,
                                     const int64_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                     int64_t, int64_t, int64_t);
template void decode_attention_items(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*,
                                     const int64_t*, const int64_t*, c10::BFloat16*, int64_t, int64_t, int64_t,
                                     int64_t, int64_t, float, int64_t, int64_t, int64_t);

namespace {

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      const int64_t* context_lens, T* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t first, int64_t last) {
    decode_attention_items(q, num_heads * head_dim, k_cache, v_cache, block_tables, context_lens, out, num_heads,
                           num_kv_heads, head_dim, block_size, max_blocks, scale, window, first, last);
  });
}

// q: [batch, heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim]; block_tables: [batch, max
// blocks] (int64); context_lens: [batch], keys each sequence attends to (its new token's already written);
// window > 0: each query sees only its last `window` keys (a sliding-window layer), 0: all of them.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "q/k_cache/v_cache: bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache/v_cache: must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q/k_cache/v_cache: dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables/context_lens: expected int64");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "q/k_cache: head layout mismatch");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch && context_lens.numel() == batch,
              "block_tables/context_lens: one row per sequence");
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous(), query = q.contiguous();
  TORCH_CHECK(lens.max().item<int64_t>() <= tables.size(1) * block_size, "context_lens: longer than the block table");
  TORCH_CHECK(lens.min().item<int64_t>() >= 1, "context_lens: every sequence attends to at least its own key");
  TORCH_CHECK(window >= 0, "window: expected 0 (full attention) or a positive number of keys, got ", window);
  at::Tensor out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                               tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch,
                               num_heads, num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(scale),
                               window);
  });
  return out;
}

// Writes each new token's key and value rows into its cache slot: k, v [T, kv_heads, head_dim] (rows may be
// strided views into the qkv projection), caches [blocks, block_size, kv_heads, head_dim], slot_mapping [T].
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == slot_mapping.numel(), "k/v/slot_mapping: shapes");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "k/v: cache dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache/v_cache: must be contiguous");
  const int64_t row = k.size(1) * k.size(2);
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == row, "k/k_cache: head layout mismatch");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k/v: each token's heads must be contiguous");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const size_t bytes = row * k.element_size();
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const auto* k_src = static_cast<const char*>(k.data_ptr());
  const auto* v_src = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < k.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot_mapping: slot ", slot[t], " outside the pool");
    std::memcpy(k_dst + slot[t] * bytes, k_src + t * k.stride(0) * k.element_size(), bytes);
    std::memcpy(v_dst + slot[t] * bytes, v_src + t * v.stride(0) * v.element_size(), bytes);
  }
}

}  // namespace

}  // namespace carpool::kernels

using namespace carpool::kernels;

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(carpool, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}
