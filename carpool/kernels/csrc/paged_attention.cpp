// Decode attention read in place from the paged KV pool. The torch path gathers every sequence's blocks into
// a padded copy and runs a masked SDPA: at one token a sequence that copy costs more than the attention.
// Here each (sequence, KV head) walks its block table directly, with the query heads that share the KV head
// together (grouped-query attention), in fp32 whatever the cache dtype. A verifying sequence's rows (its last token
// and its drafts, each seeing one key more) walk it together too: one read of the K/V for all of them.
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

// Register tiles. The query heads that share a KV head (grouped-query attention), of every row of a run, are
// processed together, so each key and value vector is loaded (and widened from bf16) once per tile of heads rather
// than once per head (measured on AVX-512, bf16, batch 32, context 512, one thread: -15% for SmolLM2's 9/3 heads,
// -23% for Qwen2.5-1.5B's 12/2, -35% for Gemma 3's 4/1; a verifying SmolLM2 sequence's 5 rows at 1,500 keys: -23%).
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

// Keys a pass over the query tiles covers: their K (or V) rows, 16 KiB (128 bf16 keys of 64 values), stay in L1
// while every tile of the run's rows x heads reads them.
constexpr int64_t kKeyBlockBytes = 16 * 1024;

// How many keys ahead of the one it reads the walk asks for K and V rows. A key's row of one KV head is 128-512
// bytes at a 16-token block's stride, in blocks anywhere in the pool, and the hardware prefetchers left the walk
// waiting on its loads (perf: ~75% of the kernel's samples on the K and V loads). Measured on an Intel VM (family 6
// model 167, 2 threads, bf16, 30 layers' calls, pools of random blocks): one sequence at 2,000 keys 7.0 -> 4.4 ms
// (SmolLM2's 9/3 heads), 8.5 -> 5.9 (Qwen2.5-1.5B's 12/2), 12.2 -> 8.2 (Gemma 3's 4/1); 32 sequences at 600 keys
// 73 -> 53 ms (1.5B, 28 layers), 60 -> 38 (SmolLM2). 32 and 64 keys ahead gave the same, 16 and 128 less.
constexpr int64_t kPrefetchKeys = 32;

// scores[i * stride + t] = q_i . key_t for QUERIES query vectors and keys [first, last) (whole fours): the horizontal
// sums of four keys share one reduction. reduce4 sums each key's lanes alike whichever of the four it is, so a key's
// score does not depend on the keys beside it.
template <typename T, int CHUNKS, int QUERIES>
void score_keys(const float* query, const T* k_cache, const int64_t* offsets, int64_t first, int64_t last,
                int64_t stride, float* scores) {
  constexpr int64_t kHeadDim = CHUNKS * kLanes;
  for (int64_t t = first; t < last; t += 4) {
    if (t + kPrefetchKeys + 4 <= stride)
      for (int j = 0; j < 4; ++j) simd::prefetch(k_cache + offsets[t + kPrefetchKeys + j], kHeadDim * sizeof(T));
    simd::Vec acc[QUERIES][4];
    for (int h = 0; h < QUERIES; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = simd::zero();
    for (int c = 0; c < CHUNKS; ++c) {
      simd::Vec key[4];
      for (int j = 0; j < 4; ++j) key[j] = simd::load(k_cache + offsets[t + j] + c * kLanes);
      for (int h = 0; h < QUERIES; ++h) {
        const simd::Vec q = simd::load(query + h * kHeadDim + c * kLanes);
        for (int j = 0; j < 4; ++j) acc[h][j] = simd::fmadd(q, key[j], acc[h][j]);
      }
    }
    for (int h = 0; h < QUERIES; ++h)
      simd::store4(scores + h * stride + t, simd::reduce4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
  }
}

// q . key for a key past a context's last whole four (its len % 4 last keys): one horizontal sum of its own, as the
// one-row kernel has always summed them (reduce_add adds the lanes in another order than reduce4).
template <typename T, int CHUNKS>
float score_lone_key(const float* query, const T* key) {
  simd::Vec acc = simd::zero();
  for (int c = 0; c < CHUNKS; ++c) acc = simd::fmadd(simd::load(query + c * kLanes), simd::load(key + c * kLanes), acc);
  return simd::reduce_add(acc);
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

// acc_i[BLOCK chunks] += sum over keys [first, last) of weight_i[t] * value_t, for QUERIES query vectors; acc is
// fp32 scratch ([query][head_dim], at the block's first column) that carries the sums from one key block to the
// next exactly (stored and reloaded in fp32), so the sums add in key order as one pass over the context would.
template <typename T, int QUERIES, int BLOCK>
void weigh_values(const T* v_cache, const int64_t* offsets, int64_t first, int64_t last, const float* weights,
                  int64_t stride, int64_t head_dim, float* acc_out) {
  constexpr int64_t kBlockBytes = BLOCK * kLanes * sizeof(T);
  simd::Vec acc[QUERIES][BLOCK];
  for (int h = 0; h < QUERIES; ++h)
    for (int c = 0; c < BLOCK; ++c) acc[h][c] = simd::load(acc_out + h * head_dim + c * kLanes);
  for (int64_t t = first; t < last; ++t) {
    if (t + kPrefetchKeys < stride) simd::prefetch(v_cache + offsets[t + kPrefetchKeys], kBlockBytes);
    simd::Vec value[BLOCK];
    for (int c = 0; c < BLOCK; ++c) value[c] = simd::load(v_cache + offsets[t] + c * kLanes);
    for (int h = 0; h < QUERIES; ++h) {
      const simd::Vec p = simd::set1(weights[h * stride + t]);
      for (int c = 0; c < BLOCK; ++c) acc[h][c] = simd::fmadd(p, value[c], acc[h][c]);
    }
  }
  for (int h = 0; h < QUERIES; ++h)
    for (int c = 0; c < BLOCK; ++c) simd::store(acc_out + h * head_dim + c * kLanes, acc[h][c]);
}

// The query rows of one run (rows that share a sequence's block table: a verifying sequence's last token and its
// drafts) with the `group` query heads of one KV head, against the union of their contexts: keys [0, span) at
// `offsets` (the pool rows of K and V; padded to whole fours with repeats of the last). Row j sees keys
// [starts[j], starts[j] + lens[j]): the causal limit of a verify row, and a sliding window's first key. Query
// vector i = row * group + head (scaled, fp32); out: [rows * group, head_dim].
//
// The rows x heads fill the register tiles together, so each key and value vector is loaded (and widened from
// bf16) once per tile of query vectors and read from memory once per run, not once per row. Every row's weights
// equal the one-row kernel's to the bit: its scores are the same sums (its whole fours by reduce4, its last
// len % 4 keys by reduce_add), its softmax runs over its own keys, and keys outside its range get weight 0, which
// leaves its fp32 value sums exactly as they were (0 * v + acc == acc).
template <typename T, int CHUNKS>
void attend_run(const float* query, const T* k_cache, const T* v_cache, const int64_t* offsets, int64_t span,
                int rows, int group, const int64_t* starts, const int64_t* lens, std::vector<float>& scores,
                std::vector<float>& acc, T* out) {
  constexpr int64_t kHeadDim = CHUNKS * kLanes;
  const int queries = rows * group;
  const int64_t stride = (span + 3) / 4 * 4;
  const int64_t key_block = std::max<int64_t>(4, kKeyBlockBytes / static_cast<int64_t>(kHeadDim * sizeof(T)) / 4 * 4);
  scores.resize(queries * stride);
  for (int64_t first = 0; first < stride; first += key_block) {
    const int64_t last = std::min(stride, first + key_block);
    for (int i = 0; i < queries; i += kScoreHeads)
      with_tile<kScoreHeads>(std::min(kScoreHeads, queries - i), [&](auto tile) {
        score_keys<T, CHUNKS, decltype(tile)::value>(query + i * kHeadDim, k_cache, offsets, first, last, stride,
                                                     scores.data() + i * stride);
      });
  }
  std::vector<float> totals(queries);
  for (int j = 0; j < rows; ++j)
    for (int g = 0; g < group; ++g) {
      const int i = j * group + g;
      float* row = scores.data() + i * stride;
      for (int64_t t = starts[j] + lens[j] / 4 * 4; t < starts[j] + lens[j]; ++t)
        row[t] = score_lone_key<T, CHUNKS>(query + i * kHeadDim, k_cache + offsets[t]);
      totals[i] = exponentiate(row + starts[j], lens[j]);
      std::fill(row, row + starts[j], 0.0f);
      std::fill(row + starts[j] + lens[j], row + span, 0.0f);
    }
  acc.assign(queries * kHeadDim, 0.0f);
  constexpr int kBlock = std::min(CHUNKS, kValueChunks), kQueries = kValueAccs / kBlock;
  for (int64_t first = 0; first < span; first += key_block) {
    const int64_t last = std::min(span, first + key_block);
    for (int column = 0; column < CHUNKS; column += kBlock)
      for (int i = 0; i < queries; i += kQueries)
        with_tile<kQueries>(std::min(kQueries, queries - i), [&](auto tile) {
          weigh_values<T, decltype(tile)::value, kBlock>(v_cache + column * kLanes, offsets, first, last,
                                                         scores.data() + i * stride, stride, kHeadDim,
                                                         acc.data() + i * kHeadDim + column * kLanes);
        });
  }
  for (int i = 0; i < queries; ++i) {
    const simd::Vec inv = simd::set1(1.0f / totals[i]);
    for (int c = 0; c < CHUNKS; ++c)
      simd::store(out + i * kHeadDim + c * kLanes, simd::mul(simd::load(acc.data() + i * kHeadDim + c * kLanes), inv));
  }
}

// The vectorized path for the common head sizes (64: Llama/SmolLM2, Qwen2.5-0.5B; 128: Qwen2.5-1.5B; 256:
// Gemma 3) and groups of up to 64 query heads per KV head; false when there is none.
template <typename T>
bool attend_vectorized(const float* query, const T* k_cache, const T* v_cache, const int64_t* offsets, int64_t span,
                       int64_t rows, int64_t group, const int64_t* starts, const int64_t* lens, int64_t head_dim,
                       std::vector<float>& scores, std::vector<float>& acc, T* out) {
  if constexpr (std::is_same_v<T, double>) {
    return false;
  } else {
    if (group > 64) return false;
    auto run = [&](auto dims) {
      constexpr int kChunks = decltype(dims)::value / kLanes;
      attend_run<T, kChunks>(query, k_cache, v_cache, offsets, span, static_cast<int>(rows), static_cast<int>(group),
                             starts, lens, scores, acc, out);
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

// One row's group of query heads against its keys [first_key, first_key + context), scalar: the portable build,
// other head sizes, fp64. query: the group's scaled heads; out: the row's heads of this KV head.
template <typename T, typename Slot>
void attend_row_scalar(const float* query, const T* k_cache, const T* v_cache, Slot slot, int64_t first_key,
                       int64_t context, int64_t group, int64_t head_dim, std::vector<float>& scores,
                       std::vector<float>& acc, T* out) {
  scores.resize(group * context);
  for (int64_t t = 0; t < context; ++t) {
    const T* key = k_cache + slot(first_key + t);
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
  acc.assign(group * head_dim, 0.0f);
  for (int64_t t = 0; t < context; ++t) {
    const T* value = v_cache + slot(first_key + t);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * context + t];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] += p * static_cast<float>(value[d]);
    }
  }
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = T(acc[i]);
}

}  // namespace

std::vector<int64_t> shared_context_runs(const int64_t* block_tables, const int64_t* context_lens, int64_t batch,
                                         int64_t max_blocks, int64_t block_size) {
  std::vector<int64_t> runs{0};
  for (int64_t b = 1; b < batch; ++b) {
    const int64_t* previous = block_tables + (b - 1) * max_blocks;
    const int64_t blocks = (context_lens[b - 1] + block_size - 1) / block_size;
    const bool extends = context_lens[b] == context_lens[b - 1] + 1 && b - runs.back() < kMaxRunRows &&
                         std::equal(previous, previous + blocks, block_tables + b * max_blocks);
    if (!extends) runs.push_back(b);
  }
  if (batch > 0) runs.push_back(batch);
  return runs;
}

template <typename T>
void decode_attention_items(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                            const int64_t* block_tables, const int64_t* context_lens, const int64_t* runs, T* out,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t max_blocks, float scale, int64_t window, int64_t first, int64_t last) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots of the pool
  std::vector<float> query, acc, scores;
  std::vector<int64_t> offsets;
  std::vector<T> attended;
  int64_t starts[kMaxRunRows], lens[kMaxRunRows];
  for (int64_t item = first; item < last; ++item) {
    const int64_t run = item / num_kv_heads, kv_head = item % num_kv_heads;
    const int64_t row0 = runs[run], rows = runs[run + 1] - row0;
    // A sliding window keeps the last `window` keys, the query's own included: positions from its first key on.
    // The run reads the union of its rows' keys, from the first row's first key to the last row's last.
    int64_t begin = context_lens[row0], end = 0;
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t length = context_lens[row0 + j];
      starts[j] = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      lens[j] = length - starts[j];
      begin = std::min(begin, starts[j]);
      end = std::max(end, length);
    }
    // The run's rows agree on every block any of them reads (shared_context_runs), so the last row's table serves.
    const int64_t* table = block_tables + (row0 + rows - 1) * max_blocks;
    auto slot = [&](int64_t position) {
      return (table[position / block_size] * block_size + position % block_size) * token_stride + kv_head * head_dim;
    };
    query.resize(rows * group * head_dim);
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          query[(j * group + g) * head_dim + d] =
              static_cast<float>(q[(row0 + j) * q_stride + (kv_head * group + g) * head_dim + d]) * scale;
    auto out_row = [&](int64_t j) { return out + ((row0 + j) * num_heads + kv_head * group) * head_dim; };
#ifdef CARPOOL_SIMD
    const int64_t span = end - begin;
    offsets.resize((span + 3) / 4 * 4);
    for (int64_t t = 0; t < static_cast<int64_t>(offsets.size()); ++t) offsets[t] = slot(begin + std::min(t, span - 1));
    for (int64_t j = 0; j < rows; ++j) starts[j] -= begin;
    attended.resize(rows * group * head_dim);
    if (attend_vectorized(query.data(), k_cache, v_cache, offsets.data(), span, rows, group, starts, lens, head_dim,
                          scores, acc, attended.data())) {
      for (int64_t j = 0; j < rows; ++j)
        std::copy_n(attended.data() + j * group * head_dim, group * head_dim, out_row(j));
      continue;
    }
    for (int64_t j = 0; j < rows; ++j) starts[j] += begin;
#endif
    for (int64_t j = 0; j < rows; ++j)
      attend_row_scalar(query.data() + j * group * head_dim, k_cache, v_cache, slot, starts[j], lens[j], group,
                        head_dim, scores, acc, out_row(j));
  }
}

template void decode_attention_items(const float*, int64_t, const float*, const float*, const int64_t*,
                                     const int64_t*, const int64_t*, float*, int64_t, int64_t, int64_t, int64_t,
                                     int64_t, float, int64_t, int64_t, int64_t);
template void decode_attention_items(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*,
                                     const int64_t*, const int64_t*, const int64_t*, c10::BFloat16*, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, float, int64_t, int64_t, int64_t);

namespace {

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      const int64_t* context_lens, T* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  const std::vector<int64_t> runs = shared_context_runs(block_tables, context_lens, batch, max_blocks, block_size);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  at::parallel_for(0, num_runs * num_kv_heads, 1, [&](int64_t first, int64_t last) {
    decode_attention_items(q, num_heads * head_dim, k_cache, v_cache, block_tables, context_lens, runs.data(), out,
                           num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, window, first, last);
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

// Which rows paged_decode_attention reads together (shared_context_runs): the runs' first rows, then the batch size.
at::Tensor paged_attention_runs(const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && context_lens.numel() == block_tables.size(0),
              "block_tables/context_lens: expected int64, one row per query row");
  TORCH_CHECK(block_size >= 1, "block_size: expected >= 1, got ", block_size);
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  if (lens.numel() > 0)
    TORCH_CHECK(lens.min().item<int64_t>() >= 1 && lens.max().item<int64_t>() <= tables.size(1) * block_size,
                "context_lens: each between 1 and the block table's keys");
  const std::vector<int64_t> runs = shared_context_runs(tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                                        tables.size(0), tables.size(1), block_size);
  return at::tensor(runs, at::kLong);
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
  m.def("paged_attention_runs(Tensor block_tables, Tensor context_lens, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(carpool, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("paged_attention_runs", &paged_attention_runs);
}
