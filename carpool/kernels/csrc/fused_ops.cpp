// Element-wise steps of a decoder layer fused into one pass each. At decode batch sizes these tensors are a
// few KB, so the torch versions (5-10 small ops apiece: casts, pow, mean, rsqrt, cat, neg...) cost their
// dispatch overhead, not their arithmetic; one call each brings ~20 ops a layer down to 3.
// Arithmetic is fp32 whatever the storage dtype, rounding where the torch versions round.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "row_kernels.h"
#include "vec.h"

namespace carpool::kernels {

namespace {

// One row's RMSNorm, a vector of lanes at a time; false when the row does not split into whole vectors.
template <typename T>
bool rms_norm_vector(const T* row, const T* weight, T* out, int64_t size, float eps) {
#ifdef CARPOOL_SIMD
  if constexpr (!std::is_same_v<T, double>) {
    namespace simd = carpool::simd;
    if (size % simd::kLanes != 0) return false;
    simd::Vec squares = simd::zero();
    for (int64_t i = 0; i < size; i += simd::kLanes) {
      const simd::Vec v = simd::load(row + i);
      squares = simd::fmadd(v, v, squares);
    }
    const simd::Vec inv = simd::set1(1.0f / std::sqrt(simd::reduce_add(squares) / static_cast<float>(size) + eps));
    for (int64_t i = 0; i < size; i += simd::kLanes)
      simd::store(out + i, simd::mul(simd::round_to(out, simd::mul(simd::load(row + i), inv)), simd::load(weight + i)));
    return true;
  }
#endif
  return false;
}

}  // namespace

template <typename T>
void rms_norm_rows(const T* src, const T* weight, T* dst, int64_t rows, int64_t size, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = src + r * size;
    T* out = dst + r * size;
    if (rms_norm_vector(row, weight, out, size, eps)) continue;
    float squares = 0.0f;
    for (int64_t i = 0; i < size; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(size) + eps);
    for (int64_t i = 0; i < size; ++i) out[i] = T(static_cast<float>(T(static_cast<float>(row[i]) * inv)) * static_cast<float>(weight[i]));
  }
}

namespace {

// The part of a row torch's own silu computes with vector code (torch_vector_step), in this build's lanes with
// the same Sleef exp; returns how many elements it did (none in the portable build). The rest goes through the
// scalar loop, std::exp as torch's scalar path: together bit-identical to silu(gate) * up when torch runs at
// the matching CPU capability (ATen's AVX512 with the avx512 build, AVX2 with avx2, DEFAULT with portable).
template <typename T>
int64_t silu_mul_vector(const T* gate, const T* up, T* out, int64_t width) {
  int64_t i = 0;
#ifdef CARPOOL_SIMD
  namespace simd = carpool::simd;
  const simd::Vec one = simd::set1(1.0f);
  const int64_t vector_end = width - width % simd::torch_vector_step<T>();
  for (; i < vector_end; i += simd::kLanes) {
    const simd::Vec g = simd::load(gate + i);
    const simd::Vec denominator = simd::add(one, simd::exp(simd::sub(simd::zero(), g)));
    const simd::Vec silu = simd::round_to(out, simd::div(g, denominator));
    simd::store(out + i, simd::mul(silu, simd::load(up + i)));
  }
#endif
  return i;
}

}  // namespace

template <typename T>
void silu_mul_rows(const T* src, T* dst, int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = src + r * 2 * width;
    const T* up = gate + width;
    T* out = dst + r * width;
    int64_t i = 0;
    if constexpr (!std::is_same_v<T, double>) i = silu_mul_vector(gate, up, out, width);
    for (; i < width; ++i) {
      const float g = static_cast<float>(gate[i]);
      out[i] = T(static_cast<float>(T(g / (1.0f + std::exp(-g)))) * static_cast<float>(up[i]));
    }
  }
}

namespace {

// (x1, x2) -> (x1 c1 - x2 s1, x2 c2 + x1 s2) on each head, in fp32 with every product rounded (no FMA), as
// torch computes x * cos + rotate_half(x) * sin.
template <typename T>
void rotate_heads(T* base, int64_t heads, int64_t head_stride, int64_t half, const T* c, const T* s) {
  for (int64_t h = 0; h < heads; ++h) {
    T* v = base + h * head_stride;
    int64_t i = 0;
#ifdef CARPOOL_SIMD
    if constexpr (!std::is_same_v<T, double>) {
      namespace simd = carpool::simd;
      for (; i + simd::kLanes <= half; i += simd::kLanes) {
        const simd::Vec x1 = simd::load(v + i), x2 = simd::load(v + i + half);
        const simd::Vec c1 = simd::load(c + i), c2 = simd::load(c + i + half);
        const simd::Vec s1 = simd::load(s + i), s2 = simd::load(s + i + half);
        simd::store(v + i, simd::sub(simd::mul(x1, c1), simd::mul(x2, s1)));
        simd::store(v + i + half, simd::add(simd::mul(x2, c2), simd::mul(x1, s2)));
      }
    }
#endif
    for (; i < half; ++i) {
      const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
      const float c1 = static_cast<float>(c[i]), c2 = static_cast<float>(c[i + half]);
      const float s1 = static_cast<float>(s[i]), s2 = static_cast<float>(s[i + half]);
      v[i] = T(x1 * c1 - x2 * s1);
      v[i + half] = T(x2 * c2 + x1 * s2);
    }
  }
}

}  // namespace

template <typename T>
void rotate_token(T* q, int64_t q_heads, T* k, int64_t k_heads, int64_t head_dim, const T* cos, const T* sin) {
  rotate_heads(q, q_heads, head_dim, head_dim / 2, cos, sin);
  rotate_heads(k, k_heads, head_dim, head_dim / 2, cos, sin);
}

namespace {

template <typename T>
void rotary_tokens(const int64_t* positions, at::Tensor& q, at::Tensor& k, const T* cos, const T* sin) {
  const int64_t head_dim = q.size(2), half = head_dim / 2;
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  at::parallel_for(0, q.size(0), 16, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const T* c = cos + positions[t] * head_dim;
      const T* s = sin + positions[t] * head_dim;
      rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), half, c, s);
      rotate_heads(kp + t * k.stride(0), k.size(1), k.stride(1), half, c, s);
    }
  });
}

// RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * weight, the statistics in fp32.
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  const int64_t size = input.size(-1);
  TORCH_CHECK(weight.numel() == size && weight.scalar_type() == input.scalar_type(), "weight: expected ", size,
              " values of the input's dtype");
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *src = x.data_ptr<scalar_t>(), *weights = w.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel() / size, 64, [&](int64_t first, int64_t last) {
      rms_norm_rows(src + first * size, weights, dst + first * size, last - first, size, static_cast<float>(eps));
    });
  });
  return out;
}

// [..., 2 * n] gate|up -> [..., n] silu(gate) * up: the SwiGLU activation.
at::Tensor silu_mul(const at::Tensor& input) {
  TORCH_CHECK(input.size(-1) % 2 == 0, "input: last dimension must be even (gate and up halves)");
  const int64_t width = input.size(-1) / 2;
  const at::Tensor x = input.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_mul", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel() / (2 * width), 16, [&](int64_t first, int64_t last) {
      silu_mul_rows(src + first * 2 * width, dst + first * width, last - first, width);
    });
  });
  return out;
}

// Rotary embedding in place on q [T, heads, head_dim] and k [T, kv_heads, head_dim] (views into the qkv
// projection), half-split layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); cos/sin: [max_pos, head_dim]
// in q's dtype.
void rotary_embedding(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(2) == k.size(2) && q.size(0) == k.size(0), "q/k: bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.scalar_type() == k.scalar_type(), "q/k: bad layout");
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type() && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(-1) == q.size(2), "cos/sin: expected contiguous tables in q's dtype");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == q.size(0), "positions: one per token");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rotary_embedding", [&] {
    rotary_tokens<scalar_t>(pos.data_ptr<int64_t>(), q, k, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
  });
}

}  // namespace

template void rms_norm_rows(const float*, const float*, float*, int64_t, int64_t, float);
template void rms_norm_rows(const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t, int64_t, float);
template void silu_mul_rows(const float*, float*, int64_t, int64_t);
template void silu_mul_rows(const c10::BFloat16*, c10::BFloat16*, int64_t, int64_t);
template void rotate_token(float*, int64_t, float*, int64_t, int64_t, const float*, const float*);
template void rotate_token(c10::BFloat16*, int64_t, c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*,
                           const c10::BFloat16*);

}  // namespace carpool::kernels

using namespace carpool::kernels;

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor input) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(carpool, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
