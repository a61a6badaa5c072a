// Decode attention read in place from the paged KV pool. The torch path gathers every sequence's blocks into
// a padded copy and runs a masked SDPA: at one token a sequence that copy costs more than the attention.
// Here each (sequence, KV head) walks its block table directly, with the query heads that share the KV head
// together (grouped-query attention), in fp32 whatever the cache dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#ifdef CARPOOL_AVX512
// One (sequence, KV head): scores for the group's query heads, softmax, weighted values; head_dim % 16 == 0.
// Each key and value row is loaded (and widened from bf16) once for all the heads that share it.
template <typename T>
void attend_vectorized(const float* query, const T* k_cache, const T* v_cache, const int64_t* table, int64_t context,
                       int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride, int64_t kv_offset,
                       float* scores, float* acc) {
  const int64_t chunks = head_dim / 16;
  for (int64_t t = 0; t < context; ++t) {
    const T* key = k_cache + (table[t / block_size] * block_size + t % block_size) * token_stride + kv_offset;
    for (int64_t g = 0; g < group; ++g) {
      __m512 dot = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * head_dim + c * 16), carpool::load16(key + c * 16), dot);
      scores[g * context + t] = _mm512_reduce_add_ps(dot);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * context;
    const float top = *std::max_element(row, row + context);
    float total = 0.0f;
    for (int64_t t = 0; t < context; ++t) total += (row[t] = std::exp(row[t] - top));
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < context; ++t) row[t] *= inv;
  }
  std::fill(acc, acc + group * head_dim, 0.0f);
  for (int64_t t = 0; t < context; ++t) {
    const T* value = v_cache + (table[t / block_size] * block_size + t % block_size) * token_stride + kv_offset;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 v = carpool::load16(value + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        float* out = acc + g * head_dim + c * 16;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * context + t]), v, _mm512_loadu_ps(out)));
      }
    }
  }
}
#endif

template <typename T>
void store_heads(const float* acc, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = T(acc[i]);
}

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      const int64_t* context_lens, T* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots of the pool
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t context = context_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          query[g * head_dim + d] = static_cast<float>(q[(b * num_heads + kv_head * group + g) * head_dim + d]) * scale;
      scores.resize(group * context);
#ifdef CARPOOL_AVX512
      if constexpr (!std::is_same_v<T, double>) {
        if (head_dim % 16 == 0) {
          attend_vectorized(query.data(), k_cache, v_cache, table, context, group, head_dim, block_size, token_stride,
                            kv_head * head_dim, scores.data(), acc.data());
          store_heads(acc.data(), out + (b * num_heads + kv_head * group) * head_dim, group * head_dim);
          continue;
        }
      }
#endif
      auto slot = [&](int64_t t) { return (table[t / block_size] * block_size + t % block_size) * token_stride + kv_head * head_dim; };
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
  });
}

// q: [batch, heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim]; block_tables: [batch, max
// blocks] (int64); context_lens: [batch], keys each sequence attends to (its new token's already written).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
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
  at::Tensor out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                               tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch,
                               num_heads, num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(carpool, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
