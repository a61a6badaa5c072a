// Decode attention read in place from the paged KV pool. The torch path gathers every sequence's blocks into
// a padded copy and runs a masked SDPA: at one token a sequence that copy costs more than the attention.
// Here each (sequence, KV head) walks its block table directly, with the query heads that share the KV head
// together (grouped-query attention), in fp32 whatever the cache dtype. A verifying sequence's rows (its last token
// and its drafts, each seeing one key more) walk it together too: one read of the K/V for all of them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <omp.h>

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

// Keys a score or value pass reads while they stay in L1 (kKeyBlockBytes of K or V rows of one KV head).
template <typename T, int CHUNKS>
constexpr int64_t key_block() {
  return std::max<int64_t>(4, kKeyBlockBytes / static_cast<int64_t>(CHUNKS * kLanes * sizeof(T)) / 4 * 4);
}

// Vectors of a value row in one cache line: SplitDecodeAttention's column slice, so no line goes to two threads.
template <typename T>
constexpr int slice_chunks() {
  return std::max<int>(1, 64 / sizeof(T) / kLanes);
}

#if defined(CARPOOL_AVX512)
// A prompt chunk's run has rows x group query vectors (48 for SmolLM2's 16 rows of 3 heads): score_keys gives each
// query vector's four keys reduce4's 11 shuffles and adds beside its 16 fmadds (head size 64). Transposed, 16 keys to a
// vector (a key per lane), a query's score of 16 keys is 16 vertical sums and no shuffle; the keys' transposition is
// paid once per item for all its query vectors. The sums are reduce4's to the bit: lane l of score_keys' accumulator is
// the chain of fmadds over the chunks of q[c * 16 + l] * key[c * 16 + l] from zero, and reduce4 adds the 16 lanes in
// one fixed tree (unpack, unpack, halves): in each 128-bit quarter L, (x[4L] + x[4L+2]) + (x[4L+1] + x[4L+3]); then
// (quarter 0 + quarter 2) + (quarter 1 + quarter 3). So a row's scores do not depend on which way they were summed, and
// a decoding row (a few query vectors, score_keys) gets the bits its prompt chunk's row got.
constexpr int kTransposedQueries = 2, kTransposedGroups = 2;  // a tile: query vectors x groups of 16 keys
// Below this many query vectors the transposition (its shuffles, ~380 uops per 16 keys) costs about what the
// reductions it saves (~44 uops per query vector and 16 keys) cost. Verifying SmolLM2 sequences (8 at 1,500 keys,
// bf16, one thread) were no slower at 6 rows (18 vectors, 2.3-2.6 -> 2.2-2.3 ms) and faster at 16 (5.9-6.3 -> 5.0).
constexpr int kTransposedMinQueries = 16;

// In place: r[j] = row j of a 16 x 16 matrix -> r[j] = its column j.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit quarter: [a0 b0 a1 b1], [a2 b2 a3 b3] of rows a, b
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // per quarter k: u[4i + m] = rows 4i..4i+3 of column 4k + m
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int m = 0; m < 4; ++m) {  // column 4k + m: quarter k of u[m], u[4 + m], u[8 + m], u[12 + m]
    const __m512 p = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88), q = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xDD);
    const __m512 v = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88);
    const __m512 w = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_shuffle_f32x4(p, v, 0x88);
    r[4 + m] = _mm512_shuffle_f32x4(q, w, 0x88);
    r[8 + m] = _mm512_shuffle_f32x4(p, v, 0xDD);
    r[12 + m] = _mm512_shuffle_f32x4(q, w, 0xDD);
  }
}

// kt[d * 16 + j] = element d of key first + j, in fp32, for 16 keys.
template <typename T, int CHUNKS>
void transpose_keys(const T* k_cache, const int64_t* offsets, int64_t first, int64_t stride, float* kt) {
  constexpr int64_t kHeadDim = CHUNKS * kLanes;
  if (first + kPrefetchKeys + kLanes <= stride)
    for (int j = 0; j < kLanes; ++j) simd::prefetch(k_cache + offsets[first + kPrefetchKeys + j], kHeadDim * sizeof(T));
  for (int c = 0; c < CHUNKS; ++c) {
    __m512 rows[kLanes];
    for (int j = 0; j < kLanes; ++j) rows[j] = simd::load(k_cache + offsets[first + j] + c * kLanes);
    transpose16(rows);
    for (int l = 0; l < kLanes; ++l) _mm512_store_ps(kt + (c * kLanes + l) * kLanes, rows[l]);
  }
}

// scores[i * stride + g * 16 + j] = q_i . key j of group g, for QUERIES query vectors and GROUPS groups of 16 keys
// (kt: each group's transpose_keys in turn), summed as reduce4 sums them. Two query vectors by two groups: each
// broadcast query element and each loaded key vector serves two multiplies, and 16 chains in flight hide the fmadd
// latency. Three query vectors by one group left two loads a multiply: SmolLM2's 512-row bf16 chunk behind 1,536
// keys, one thread, took 24.3 ms that way, 22.5 two by two (26.4 by score_keys); the fp32 scores now run at about
// two fmadds a cycle.
template <int CHUNKS, int QUERIES, int GROUPS>
void score_transposed(const float* query, const float* kt, int64_t stride, float* scores) {
  constexpr int64_t kHeadDim = CHUNKS * kLanes;
  __m512 even[QUERIES][GROUPS], sum[QUERIES][GROUPS];  // quarters 0 + 2, then (0 + 2) + (1 + 3)
  for (int L : {0, 2, 1, 3}) {
    __m512 x[QUERIES][GROUPS][4];
    for (int h = 0; h < QUERIES; ++h)
      for (int g = 0; g < GROUPS; ++g)
        for (int i = 0; i < 4; ++i) x[h][g][i] = _mm512_setzero_ps();
    for (int c = 0; c < CHUNKS; ++c)
      for (int i = 0; i < 4; ++i) {
        const int64_t d = c * kLanes + 4 * L + i;
        __m512 keys[GROUPS];
        for (int g = 0; g < GROUPS; ++g) keys[g] = _mm512_load_ps(kt + (g * kHeadDim + d) * kLanes);
        for (int h = 0; h < QUERIES; ++h) {
          const __m512 q = _mm512_set1_ps(query[h * kHeadDim + d]);
          for (int g = 0; g < GROUPS; ++g) x[h][g][i] = _mm512_fmadd_ps(q, keys[g], x[h][g][i]);
        }
      }
    for (int h = 0; h < QUERIES; ++h)
      for (int g = 0; g < GROUPS; ++g) {
        const __m512 quarter =
            _mm512_add_ps(_mm512_add_ps(x[h][g][0], x[h][g][2]), _mm512_add_ps(x[h][g][1], x[h][g][3]));
        if (L == 0) even[h][g] = quarter;
        if (L == 2) even[h][g] = _mm512_add_ps(even[h][g], quarter);
        if (L == 1) sum[h][g] = quarter;
        if (L == 3) sum[h][g] = _mm512_add_ps(even[h][g], _mm512_add_ps(sum[h][g], quarter));
      }
  }
  for (int h = 0; h < QUERIES; ++h)
    for (int g = 0; g < GROUPS; ++g) _mm512_storeu_ps(scores + h * stride + g * kLanes, sum[h][g]);
}
#endif

// Scores of keys [first, last) (whole fours) for every query vector of the item: 16 keys at a time transposed where
// the item has many query vectors (AVX-512), the rest by score_keys; the same bits either way.
template <typename T, int CHUNKS>
void score_range(const RunWork<T>& w, const T* k_cache, int64_t first, int64_t last) {
  constexpr int64_t kHeadDim = CHUNKS * kLanes;
#if defined(CARPOOL_AVX512)
  if (w.queries() >= kTransposedMinQueries) {
    alignas(64) float kt[kTransposedGroups * kHeadDim * kLanes];
    while (first + kLanes <= last) {
      const int groups = static_cast<int>(std::min<int64_t>(kTransposedGroups, (last - first) / kLanes));
      for (int g = 0; g < groups; ++g)
        transpose_keys<T, CHUNKS>(k_cache, w.offsets, first + g * kLanes, w.stride, kt + g * kHeadDim * kLanes);
      with_tile<kTransposedGroups>(groups, [&](auto groups_tile) {
        for (int i = 0; i < w.queries(); i += kTransposedQueries)
          with_tile<kTransposedQueries>(std::min(kTransposedQueries, w.queries() - i), [&](auto tile) {
            score_transposed<CHUNKS, decltype(tile)::value, decltype(groups_tile)::value>(
                w.query + i * kHeadDim, kt, w.stride, w.scores + i * w.stride + first);
          });
      });
      first += groups * kLanes;
    }
  }
#endif
  for (int i = 0; i < w.queries(); i += kScoreHeads)
    with_tile<kScoreHeads>(std::min(kScoreHeads, w.queries() - i), [&](auto tile) {
      score_keys<T, CHUNKS, decltype(tile)::value>(w.query + i * kHeadDim, k_cache, w.offsets, first, last, w.stride,
                                                   w.scores + i * w.stride);
    });
}

// Query vector i's softmax weights over its row's keys, unnormalized (exp(score - max)), and 0 for the run's other
// keys; their total.
template <typename T, int CHUNKS>
void softmax_query(const RunWork<T>& w, const T* k_cache, int i) {
  constexpr int64_t kHeadDim = CHUNKS * kLanes;
  const int64_t start = w.starts[i / w.group], len = w.lens[i / w.group];
  float* row = w.scores + i * w.stride;
  for (int64_t t = start + len / 4 * 4; t < start + len; ++t)
    row[t] = score_lone_key<T, CHUNKS>(w.query + i * kHeadDim, k_cache + w.offsets[t]);
  w.totals[i] = exponentiate(row + start, len);
  std::fill(row, row + start, 0.0f);
  std::fill(row + start + len, row + w.span, 0.0f);
}

// Columns [column, column + BLOCK) (in vectors) of every query vector's weighted values over keys [first, last),
// added to its fp32 sums.
template <typename T, int CHUNKS, int BLOCK>
void weigh_range(const RunWork<T>& w, const T* v_cache, int column, int64_t first, int64_t last) {
  constexpr int64_t kHeadDim = CHUNKS * kLanes;
  constexpr int kQueries = kValueAccs / BLOCK;
  for (int i = 0; i < w.queries(); i += kQueries)
    with_tile<kQueries>(std::min(kQueries, w.queries() - i), [&](auto tile) {
      weigh_values<T, decltype(tile)::value, BLOCK>(v_cache + column * kLanes, w.offsets, first, last,
                                                    w.scores + i * w.stride, w.stride, kHeadDim,
                                                    w.acc + i * kHeadDim + column * kLanes);
    });
}

// Columns [column, column + BLOCK) of every query vector's output: its value sums over its weights' total.
template <typename T, int CHUNKS, int BLOCK>
void write_columns(const RunWork<T>& w, int column) {
  constexpr int64_t kHeadDim = CHUNKS * kLanes;
  for (int i = 0; i < w.queries(); ++i) {
    const simd::Vec inv = simd::set1(1.0f / w.totals[i]);
    T* out = w.out + (i / w.group) * w.out_row_stride + (i % w.group) * kHeadDim;
    for (int c = column; c < column + BLOCK; ++c)
      simd::store(out + c * kLanes, simd::mul(simd::load(w.acc + i * kHeadDim + c * kLanes), inv));
  }
}

// The query rows of one run (rows that share a sequence's block table: a verifying sequence's last token and its
// drafts, or up to kMaxRunRows of a prompt chunk's rows) with the `group` query heads of one KV head, against the union
// of their contexts (RunWork), on one thread: scores, softmax, weighted values, each pass over key blocks that stay in
// L1.
//
// The rows x heads fill the register tiles together, so each key and value vector is loaded (and widened from
// bf16) once per tile of query vectors and read from memory once per run, not once per row. Every row's weights equal
// the one-row kernel's to the bit: its scores are the same sums (its whole fours by reduce4 or, in a run of many query
// vectors, score_transposed's same tree; its last len % 4 keys by reduce_add), its softmax runs over its own keys, and
// keys outside its range get weight 0, which leaves its fp32 value sums exactly as they were (0 * v + acc == acc). Each
// output column's sum is its own, in key order, so cutting the columns otherwise (SplitDecodeAttention) leaves every
// bit as it is.
template <typename T, int CHUNKS>
void attend_run(const RunWork<T>& w, const T* k_cache, const T* v_cache) {
  constexpr int64_t kKeys = key_block<T, CHUNKS>();
  constexpr int kBlock = std::min(CHUNKS, kValueChunks);
  for (int64_t first = 0; first < w.stride; first += kKeys)
    score_range<T, CHUNKS>(w, k_cache, first, std::min(w.stride, first + kKeys));
  for (int i = 0; i < w.queries(); ++i) softmax_query<T, CHUNKS>(w, k_cache, i);
  for (int64_t first = 0; first < w.span; first += kKeys)
    for (int column = 0; column < CHUNKS; column += kBlock)
      weigh_range<T, CHUNKS, kBlock>(w, v_cache, column, first, std::min(w.span, first + kKeys));
  for (int column = 0; column < CHUNKS; column += kBlock) write_columns<T, CHUNKS, kBlock>(w, column);
}

// fn(std::integral_constant<int, CHUNKS>) for the head sizes the vectorized kernel has (64: Llama/SmolLM2,
// Qwen2.5-0.5B; 128: Qwen2.5-1.5B; 256: Gemma 3), in fp32 or bf16, with up to 64 query heads per KV head; false
// where there is none (the scalar kernel runs).
template <typename T, typename Fn>
bool with_head_chunks(int64_t head_dim, int64_t group, Fn&& fn) {
  if constexpr (std::is_same_v<T, double>) {
    return false;
  } else {
    if (group > 64) return false;
    switch (head_dim) {
      case 64: fn(std::integral_constant<int, 64 / kLanes>{}); return true;
      case 128: fn(std::integral_constant<int, 128 / kLanes>{}); return true;
      case 256: fn(std::integral_constant<int, 256 / kLanes>{}); return true;
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

namespace {

// What item `item` of a call reads: its run's rows, each row's keys [starts[j], starts[j] + lens[j]) (absolute
// positions), their union [begin, end), and its KV head.
struct ItemKeys {
  int64_t row0 = 0, rows = 0, kv_head = 0, begin = 0, end = 0;
  int64_t starts[kMaxRunRows] = {}, lens[kMaxRunRows] = {};
  const int64_t* table = nullptr;  // the run's block table
};

ItemKeys item_keys(const int64_t* block_tables, const int64_t* context_lens, const int64_t* runs, int64_t num_kv_heads,
                   int64_t max_blocks, int64_t window, int64_t item) {
  ItemKeys keys;
  const int64_t run = item / num_kv_heads;
  keys.kv_head = item % num_kv_heads;
  keys.row0 = runs[run];
  keys.rows = runs[run + 1] - keys.row0;
  // A sliding window keeps the last `window` keys, the query's own included: positions from its first key on.
  // The run reads the union of its rows' keys, from the first row's first key to the last row's last.
  keys.begin = context_lens[keys.row0];
  for (int64_t j = 0; j < keys.rows; ++j) {
    const int64_t length = context_lens[keys.row0 + j];
    keys.starts[j] = window > 0 ? std::max<int64_t>(0, length - window) : 0;
    keys.lens[j] = length - keys.starts[j];
    keys.begin = std::min(keys.begin, keys.starts[j]);
    keys.end = std::max(keys.end, length);
  }
  // The run's rows agree on every block any of them reads (shared_context_runs), so the last row's table serves.
  keys.table = block_tables + (keys.row0 + keys.rows - 1) * max_blocks;
  return keys;
}

// The item's query heads, scaled, in fp32: [rows * group, head_dim].
template <typename T>
void scaled_queries(const T* q, int64_t q_stride, const ItemKeys& keys, int64_t group, int64_t head_dim, float scale,
                    float* query) {
  for (int64_t j = 0; j < keys.rows; ++j)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < head_dim; ++d)
        query[(j * group + g) * head_dim + d] =
            static_cast<float>(q[(keys.row0 + j) * q_stride + (keys.kv_head * group + g) * head_dim + d]) * scale;
}

// Pool offset of key `position`'s row of the item's KV head.
int64_t key_offset(const ItemKeys& keys, int64_t position, int64_t block_size, int64_t num_kv_heads,
                   int64_t head_dim) {
  return ((keys.table[position / block_size] * block_size + position % block_size) * num_kv_heads + keys.kv_head) *
         head_dim;
}

// An item's sizes in the vectorized kernel: its keys, those padded to whole fours, its query vectors.
struct WorkSizes {
  int64_t span, stride, queries;
};
WorkSizes work_sizes(const ItemKeys& keys, int64_t group) {
  const int64_t span = keys.end - keys.begin;
  return {span, (span + 3) / 4 * 4, keys.rows * group};
}

// The vectorized kernel's view of an item, on buffers the caller sized with work_sizes (query filled, the rest
// filled here).
template <typename T>
RunWork<T> run_work(const ItemKeys& keys, int64_t group, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, T* out, const float* query, int64_t* offsets, float* scores, float* acc,
                    float* totals) {
  const WorkSizes sizes = work_sizes(keys, group);
  RunWork<T> w;
  w.query = query;
  const int64_t step = num_kv_heads * head_dim;  // between a block's consecutive keys
  for (int64_t t = 0; t < sizes.span;) {  // a block at a time: one division a block, not one a key
    const int64_t position = keys.begin + t, run = std::min(block_size - position % block_size, sizes.span - t);
    const int64_t first = key_offset(keys, position, block_size, num_kv_heads, head_dim);
    for (int64_t k = 0; k < run; ++k) offsets[t + k] = first + k * step;
    t += run;
  }
  std::fill(offsets + sizes.span, offsets + sizes.stride, offsets[sizes.span - 1]);
  w.offsets = offsets;
  w.span = sizes.span;
  w.stride = sizes.stride;
  w.rows = static_cast<int>(keys.rows);
  w.group = static_cast<int>(group);
  for (int64_t j = 0; j < keys.rows; ++j) {
    w.starts[j] = keys.starts[j] - keys.begin;
    w.lens[j] = keys.lens[j];
  }
  w.scores = scores;
  std::fill(acc, acc + sizes.queries * head_dim, 0.0f);
  w.acc = acc;
  w.totals = totals;
  w.out = out + (keys.row0 * num_heads + keys.kv_head * group) * head_dim;
  w.out_row_stride = num_heads * head_dim;
  return w;
}

}  // namespace

template <typename T>
void decode_attention_items(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                            const int64_t* block_tables, const int64_t* context_lens, const int64_t* runs, T* out,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t max_blocks, float scale, int64_t window, ItemClaims& claims) {
  const int64_t group = num_heads / num_kv_heads;
  std::vector<float> query, acc, scores, totals;
  std::vector<int64_t> offsets;
  for (int64_t item = -1, end = -1; claims.next(item, end);) {
    const ItemKeys keys = item_keys(block_tables, context_lens, runs, num_kv_heads, max_blocks, window, item);
    query.resize(keys.rows * group * head_dim);
    scaled_queries(q, q_stride, keys, group, head_dim, scale, query.data());
#ifdef CARPOOL_SIMD
    const bool vectorized = with_head_chunks<T>(head_dim, group, [&](auto chunks) {
      const WorkSizes sizes = work_sizes(keys, group);
      offsets.resize(sizes.stride);
      scores.resize(sizes.queries * sizes.stride);
      acc.resize(sizes.queries * head_dim);
      totals.resize(sizes.queries);
      const RunWork<T> w = run_work(keys, group, num_heads, num_kv_heads, head_dim, block_size, out, query.data(),
                                    offsets.data(), scores.data(), acc.data(), totals.data());
      attend_run<T, decltype(chunks)::value>(w, k_cache, v_cache);
    });
    if (vectorized) continue;
#endif
    auto slot = [&](int64_t position) { return key_offset(keys, position, block_size, num_kv_heads, head_dim); };
    for (int64_t j = 0; j < keys.rows; ++j)
      attend_row_scalar(query.data() + j * group * head_dim, k_cache, v_cache, slot, keys.starts[j], keys.lens[j],
                        group, head_dim, scores, acc,
                        out + ((keys.row0 + j) * num_heads + keys.kv_head * group) * head_dim);
  }
}

template <typename T>
bool SplitDecodeAttention<T>::prepare(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                                      const int64_t* block_tables, const int64_t* context_lens, const int64_t* runs,
                                      int64_t num_runs, T* out, int64_t num_heads, int64_t num_kv_heads,
                                      int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                                      int64_t window) {
#ifdef CARPOOL_SIMD
  const int64_t group = num_heads / num_kv_heads, items = num_runs * num_kv_heads;
  std::vector<ItemKeys> keys;
  int64_t query_size = 0, offsets_size = 0, scores_size = 0;
  for (int64_t item = 0; item < items; ++item) {
    keys.push_back(item_keys(block_tables, context_lens, runs, num_kv_heads, max_blocks, window, item));
    const WorkSizes sizes = work_sizes(keys.back(), group);
    query_size += sizes.queries * head_dim;
    offsets_size += sizes.stride;
    scores_size += sizes.queries * sizes.stride;
  }
  query_.resize(query_size);
  acc_.resize(query_size);
  totals_.resize(query_size / head_dim);
  offsets_.resize(offsets_size);
  scores_.resize(scores_size);
  work_.clear();
  for (auto& units : units_) units.clear();
  return with_head_chunks<T>(head_dim, group, [&](auto chunks) {
    constexpr int kChunks = decltype(chunks)::value, kSlice = slice_chunks<T>();
    int64_t query_at = 0, offsets_at = 0, scores_at = 0;
    for (int64_t item = 0; item < items; ++item) {
      const WorkSizes sizes = work_sizes(keys[item], group);
      scaled_queries(q, q_stride, keys[item], group, head_dim, scale, query_.data() + query_at);
      work_.push_back(run_work(keys[item], group, num_heads, num_kv_heads, head_dim, block_size, out,
                               query_.data() + query_at, offsets_.data() + offsets_at, scores_.data() + scores_at,
                               acc_.data() + query_at, totals_.data() + query_at / head_dim));
      for (int64_t first = 0; first < sizes.stride; first += key_block<T, kChunks>())
        units_[0].emplace_back(item, first);
      for (int64_t i = 0; i < sizes.queries; ++i) units_[1].emplace_back(item, i);
      for (int column = 0; column < kChunks; column += kSlice) units_[2].emplace_back(item, column);
      query_at += sizes.queries * head_dim;
      offsets_at += sizes.stride;
      scores_at += sizes.queries * sizes.stride;
    }
    k_cache_ = k_cache;
    v_cache_ = v_cache;
    head_dim_ = head_dim;
    group_ = group;
  });
#else
  return false;
#endif
}

template <typename T>
void SplitDecodeAttention<T>::run_phases(int tid, int threads) const {
#ifdef CARPOOL_SIMD
  with_head_chunks<T>(head_dim_, group_, [&](auto chunks) {
    constexpr int kChunks = decltype(chunks)::value, kSlice = slice_chunks<T>();
    constexpr int64_t kKeys = key_block<T, kChunks>();
    for (int phase = 0; phase < kPhases; ++phase) {
      if (phase > 0) {
#pragma omp barrier
      }
      const int64_t units = static_cast<int64_t>(units_[phase].size());
      for (int64_t u = units * tid / threads; u < units * (tid + 1) / threads; ++u) {
        const auto [item, index] = units_[phase][u];
        const RunWork<T>& w = work_[item];
        if (phase == 0) {
          score_range<T, kChunks>(w, k_cache_, index, std::min(w.stride, index + kKeys));
        } else if (phase == 1) {
          softmax_query<T, kChunks>(w, k_cache_, static_cast<int>(index));
        } else {
          const int column = static_cast<int>(index);
          for (int64_t key = 0; key < w.span; key += kKeys)
            weigh_range<T, kChunks, kSlice>(w, v_cache_, column, key, std::min(w.span, key + kKeys));
          write_columns<T, kChunks, kSlice>(w, column);
        }
      }
    }
  });
#endif
}

template class SplitDecodeAttention<float>;
template class SplitDecodeAttention<c10::BFloat16>;

template void decode_attention_items(const float*, int64_t, const float*, const float*, const int64_t*,
                                     const int64_t*, const int64_t*, float*, int64_t, int64_t, int64_t, int64_t,
                                     int64_t, float, int64_t, ItemClaims&);
template void decode_attention_items(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*,
                                     const int64_t*, const int64_t*, const int64_t*, c10::BFloat16*, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, float, int64_t, ItemClaims&);

namespace {

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      const int64_t* context_lens, T* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  const std::vector<int64_t> runs = shared_context_runs(block_tables, context_lens, batch, max_blocks, block_size);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  if constexpr (!std::is_same_v<T, double>) {
    SplitDecodeAttention<T> split;
    if (SplitDecodeAttention<T>::pays(num_runs * num_kv_heads, at::get_num_threads()) &&
        split.prepare(q, num_heads * head_dim, k_cache, v_cache, block_tables, context_lens, runs.data(), num_runs, out,
                      num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, window)) {
#pragma omp parallel num_threads(at::get_num_threads())
      split.run_phases(omp_get_thread_num(), omp_get_num_threads());  // one fork and join, not one a phase
      return;
    }
  }
  ItemClaims claims;
  claims.reset(num_runs, num_kv_heads);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    decode_attention_items(q, num_heads * head_dim, k_cache, v_cache, block_tables, context_lens, runs.data(), out,
                           num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, window, claims);
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
