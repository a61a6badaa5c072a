// A whole decode step's decoder layers in one call (`torch.classes.carpool.DecodeStack`), for batches where every
// token is a decode on the CPU. Per layer: norm -> q/k/v linear (+bias, + per-head q/k norm) -> rotary in place ->
// KV cache write -> paged decode attention -> o_proj (-> norm) -> residual -> norm -> gate/up linear ->
// activation -> down (-> norm) -> residual.
//
// The Python layers run the same ~15 ops a layer as ~40 Python-level calls, and for a small model that
// interpreter time, not arithmetic, is the step: SmolLM2-135M spent ~3 ms of an 8.7 ms decode step outside its
// matmuls (torch.profiler). Here the same kernels run in the same order from C++ (typed dispatcher calls, no
// Python, no autograd bookkeeping), so the outputs are bit-identical to the Python path, which stays the
// reference (prefill, mixed batches, other devices).
//
// When every projection runs a GEMV kernel (GGML blocks; int8-dot up to int8_gemv_max_rows, or the exact path), the
// whole step runs in one OpenMP parallel region instead: each op called on its own forks and joins the threads
// (SmolLM2: 5 parallel ops a layer, 150 a step, each a few microseconds of fork, join and imbalance around 10-70 us
// of work). In the region the threads share each projection's weight rows (work_shares.h) and split the
// attention's (run of a sequence's rows, KV head) items, one thread does the few-microsecond element-wise steps, and
// they meet at a barrier only where the next step reads what the last one wrote. The kernels are the ops' own
// (row_kernels.h, ggml_dot.h) on ranges, so every value is computed as the op-by-op step computes it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_gemm.h"
#include "ggml_dot.h"
#include "row_kernels.h"
#include "work_shares.h"

namespace {

using OptionalTensor = std::optional<at::Tensor>;

// The carpool kernels this file calls, looked up once (on first use: the other sources register them when the
// library loads, in an order the linker picks).
at::Tensor ggml_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("carpool::ggml_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(x, qweight, qtype);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("carpool::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, weight, eps);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("carpool::silu_mul", "").typed<at::Tensor(const at::Tensor&)>();
  return op.call(gate_up);
}

void rotary_embedding(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("carpool::rotary_embedding", "")
          .typed<void(const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&)>();
  op.call(positions, q, k, cos, sin);
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slots) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("carpool::write_kv_cache", "")
          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&)>();
  op.call(k, v, k_cache, v_cache, slots);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("carpool::paged_decode_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, double, int64_t)>();
  return op.call(q, k_cache, v_cache, tables, lens, scale, window);
}

// One projection as its weight parts (GGML blocks: qtype >= 0, or a dense matrix: qtype -1) filling the output
// side by side, and an optional bias; computed as carpool.models.layers.FusedLinear computes it.
struct Projection {
  std::vector<at::Tensor> weights;
  std::vector<int64_t> qtypes;
  OptionalTensor bias;

  Projection() = default;
  Projection(std::vector<at::Tensor> weights_, std::vector<int64_t> qtypes_, OptionalTensor bias_)
      : weights(std::move(weights_)), qtypes(std::move(qtypes_)), bias(std::move(bias_)) {
    TORCH_CHECK(!weights.empty() && weights.size() == qtypes.size(), "weights/qtypes: one qtype per weight part");
  }

  at::Tensor part(const at::Tensor& x, size_t i) const {
    return qtypes[i] >= 0 ? ggml_linear(x, weights[i], qtypes[i]) : at::linear(x, weights[i]);
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (weights.size() == 1 && qtypes[0] < 0) return at::linear(x, weights[0], bias);  // F.linear with its bias
    at::Tensor out;
    if (weights.size() == 1) {
      out = part(x, 0);
    } else {
      std::vector<at::Tensor> parts;
      parts.reserve(weights.size());
      for (size_t i = 0; i < weights.size(); ++i) parts.push_back(part(x, i));
      out = at::cat(parts, -1);
    }
    return bias ? out + *bias : out;
  }
};

struct Layer {
  at::Tensor input_norm;
  OptionalTensor attention_out_norm;  // Gemma 3's post-attention norm (on the attention output, before the residual)
  at::Tensor mlp_in_norm;             // Llama's post_attention_layernorm, Gemma 3's pre_feedforward_layernorm
  OptionalTensor mlp_out_norm;        // Gemma 3's post-feedforward norm
  OptionalTensor q_norm, k_norm;      // Gemma 3's per-head norms
  Projection qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;
  int64_t rotary = 0;  // which of forward()'s cos/sin tables
  int64_t window = 0;  // sliding-window keys; 0 = full attention
};

at::Tensor maybe_norm(const at::Tensor& x, const OptionalTensor& weight, double eps) {
  return weight ? rms_norm(x, *weight, eps) : x;
}

int64_t total_rows(const Projection& projection) {
  int64_t rows = 0;
  for (const at::Tensor& weight : projection.weights) rows += weight.size(0);
  return rows;
}

// One attention cache group's metadata for a step, checked once: slot per token, block table and keys per sequence.
struct GroupMeta {
  const int64_t* slots;
  const int64_t* tables;
  const int64_t* lens;
  int64_t max_blocks;
  std::vector<int64_t> runs;  // the rows that attend together (shared_context_runs): a verifying sequence's rows
};

// A projection's input, prepared by one thread for all of them: in float where a kernel needs it, quantized to
// int8 per 32 and per 256 values where int8-dot parts need it, and the exact kernel's input (X: float or bf16).
struct PreparedInput {
  std::vector<float> wide;
  carpool::ggml::Int8Rows int8[2];  // blocks of 32, of 256
  const void* exact = nullptr;

  const carpool::ggml::Int8Rows& rows_for(int64_t qtype) const {
    return int8[carpool::ggml::block_weights(qtype) == 32 ? 0 : 1];
  }
};

// Exact-path activations: bf16 runs the bf16 kernel where the build has one, float elsewhere (widened, exact).
template <typename T>
using ExactInput = std::conditional_t<std::is_same_v<T, float> || carpool::kernels::kExactBf16Dot, T, float>;

template <typename T>
void prepare(const Projection& projection, const uint8_t* int8, const T* in, int64_t M, int64_t K,
             PreparedInput& out) {
  bool any_exact = false, blocks[2] = {false, false};
  for (size_t i = 0; i < projection.qtypes.size(); ++i) {
    if (int8[i])
      blocks[carpool::ggml::block_weights(projection.qtypes[i]) == 32 ? 0 : 1] = true;
    else
      any_exact = true;
  }
  const float* wide = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    wide = in;
  } else if (blocks[0] || blocks[1] || (any_exact && !std::is_same_v<ExactInput<T>, T>)) {
    out.wide.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) out.wide[i] = static_cast<float>(in[i]);
    wide = out.wide.data();
  }
  for (int b = 0; b < 2; ++b)
    if (blocks[b]) carpool::ggml::quantize_rows(wide, M, K, b == 0 ? 32 : 256, out.int8[b]);
  if constexpr (std::is_same_v<ExactInput<T>, T>)
    out.exact = in;
  else
    out.exact = wide;
}

// A projection's weight rows shared out over the threads (WorkShares) in units of whole exact-path panels, and so
// of whole row groups.
void reset_shares(carpool::kernels::WorkShares& shares, const Projection& projection, int threads) {
  constexpr int64_t unit = carpool::kernels::kExactPanelRows;
  int64_t bytes = 0;
  for (const at::Tensor& weight : projection.weights) bytes += weight.numel();
  const int64_t units = std::max<int64_t>(1, (total_rows(projection) + unit - 1) / unit);
  shares.reset(units, threads, bytes / units);
}

// Weight rows [first, last) of a projection (its parts side by side): out[m * ldo + n].
template <typename T>
void project_rows(const Projection& projection, const uint8_t* int8, const PreparedInput& in, int64_t M, int64_t K,
                  T* out, int64_t ldo, ExactInput<T>* panel, int64_t first, int64_t last) {
  int64_t offset = 0;
  for (size_t i = 0; i < projection.weights.size(); ++i) {
    const int64_t rows = projection.weights[i].size(0);
    const int64_t lo = std::max(first, offset) - offset, hi = std::min(last, offset + rows) - offset;
    const uint8_t* weight = projection.weights[i].data_ptr<uint8_t>();
    if (lo < hi && int8[i])
      carpool::ggml::int8_gemv_rows(in.rows_for(projection.qtypes[i]), weight, projection.qtypes[i], lo, hi,
                                    out + offset, ldo);
    else if (lo < hi)
      carpool::kernels::exact_gemv_rows(static_cast<const ExactInput<T>*>(in.exact), M, weight, projection.qtypes[i],
                                        K, lo, hi, out + offset, ldo, panel);
    offset += rows;
  }
}

// This thread's part of a projection's rows, as `shares` (reset_shares) hands them out.
template <typename T>
void project_share(const Projection& projection, const uint8_t* int8, const PreparedInput& in, int64_t M, int64_t K,
                   T* out, int64_t ldo, ExactInput<T>* panel, carpool::kernels::WorkShares& shares, int tid) {
  constexpr int64_t unit = carpool::kernels::kExactPanelRows;
  const int64_t rows = total_rows(projection);
  shares.run(tid, [&](int64_t first, int64_t last) {
    project_rows(projection, int8, in, M, K, out, ldo, panel, first * unit, std::min(rows, last * unit));
  });
}

// y = a + b (+= in place), rounded to T once, as torch adds two tensors of T.
template <typename T>
void add_into(T* y, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = T(static_cast<float>(y[i]) + static_cast<float>(b[i]));
}

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              std::string activation)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "activation: expected silu or gelu_tanh, got ",
                activation);
    gelu_ = activation == "gelu_tanh";
  }

  // Norm weights, then each projection as (weight parts, qtypes[, bias]), the layer's KV cache views, rotary
  // table index and window.
  void add_layer(at::Tensor input_norm, OptionalTensor attention_out_norm, at::Tensor mlp_in_norm,
                 OptionalTensor mlp_out_norm, OptionalTensor q_norm, OptionalTensor k_norm,
                 std::vector<at::Tensor> qkv, std::vector<int64_t> qkv_qtypes, OptionalTensor qkv_bias,
                 std::vector<at::Tensor> o, std::vector<int64_t> o_qtypes, std::vector<at::Tensor> gate_up,
                 std::vector<int64_t> gate_up_qtypes, std::vector<at::Tensor> down, std::vector<int64_t> down_qtypes,
                 at::Tensor k_cache, at::Tensor v_cache, int64_t rotary, int64_t window) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm/k_norm: both or neither");
    Layer layer;
    layer.input_norm = std::move(input_norm);
    layer.attention_out_norm = std::move(attention_out_norm);
    layer.mlp_in_norm = std::move(mlp_in_norm);
    layer.mlp_out_norm = std::move(mlp_out_norm);
    layer.q_norm = std::move(q_norm);
    layer.k_norm = std::move(k_norm);
    layer.qkv = Projection(std::move(qkv), std::move(qkv_qtypes), std::move(qkv_bias));
    layer.o = Projection(std::move(o), std::move(o_qtypes), std::nullopt);
    layer.gate_up = Projection(std::move(gate_up), std::move(gate_up_qtypes), std::nullopt);
    layer.down = Projection(std::move(down), std::move(down_qtypes), std::nullopt);
    layer.k_cache = std::move(k_cache);
    layer.v_cache = std::move(v_cache);
    layer.rotary = rotary;
    layer.window = window;
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // False runs every step op by op, as before the one-region step: for benchmarks that compare the two.
  void set_one_region(bool enabled) { one_region_ = enabled; }

  // x: [batch, hidden] the embedded decode tokens -> the last layer's output (before the final norm).
  // positions [batch]; cos/sin: the rotary tables; slots/tables/lens: the attention metadata of the full-attention
  // cache group, sliding_*: the sliding-window group's (absent: the sliding layers read the full group's).
  at::Tensor forward(at::Tensor x, at::Tensor positions, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                     at::Tensor slots, at::Tensor tables, at::Tensor lens, OptionalTensor sliding_slots,
                     OptionalTensor sliding_tables, OptionalTensor sliding_lens) const {
    TORCH_CHECK(x.dim() == 2 && positions.numel() == x.size(0), "x/positions: expected [batch, hidden] and [batch]");
    TORCH_CHECK(cos.size() == sin.size(), "cos/sin: one table of each per rotary");
    TORCH_CHECK(sliding_slots.has_value() == sliding_tables.has_value() &&
                    sliding_tables.has_value() == sliding_lens.has_value(),
                "sliding_slots/sliding_tables/sliding_lens: all or none");
    std::vector<uint8_t> int8;
    if (one_region_ && gemv_plan(x, int8)) {
      if (x.scalar_type() == at::kFloat)
        return forward_in_one_region<float>(x, positions, cos, sin, slots, tables, lens, sliding_slots,
                                            sliding_tables, sliding_lens, int8);
      return forward_in_one_region<c10::BFloat16>(x, positions, cos, sin, slots, tables, lens, sliding_slots,
                                                  sliding_tables, sliding_lens, int8);
    }
    const int64_t batch = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    for (const Layer& layer : layers_) {
      TORCH_CHECK(layer.rotary < static_cast<int64_t>(cos.size()), "cos: no table for rotary ", layer.rotary);
      const bool own_group = layer.window > 0 && sliding_slots.has_value();
      const at::Tensor& layer_slots = own_group ? *sliding_slots : slots;
      const at::Tensor& layer_tables = own_group ? *sliding_tables : tables;
      const at::Tensor& layer_lens = own_group ? *sliding_lens : lens;

      const at::Tensor qkv = layer.qkv(rms_norm(x, layer.input_norm, eps_));
      at::Tensor q = qkv.narrow(-1, 0, q_size).view({batch, num_heads_, head_dim_});
      at::Tensor k = qkv.narrow(-1, q_size, kv_size).view({batch, num_kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(-1, q_size + kv_size, kv_size).view({batch, num_kv_heads_, head_dim_});
      if (layer.q_norm) {
        q = rms_norm(q, *layer.q_norm, eps_);
        k = rms_norm(k, *layer.k_norm, eps_);
      }
      rotary_embedding(positions, q, k, cos[layer.rotary], sin[layer.rotary]);
      write_kv_cache(k, v, layer.k_cache, layer.v_cache, layer_slots);
      const at::Tensor attended =
          paged_decode_attention(q, layer.k_cache, layer.v_cache, layer_tables, layer_lens, scale_, layer.window);
      x = x + maybe_norm(layer.o(attended.view({batch, q_size})), layer.attention_out_norm, eps_);

      const at::Tensor gate_up = layer.gate_up(rms_norm(x, layer.mlp_in_norm, eps_));
      x = x + maybe_norm(layer.down(activate(gate_up)), layer.mlp_out_norm, eps_);
    }
    return x;
  }

 private:
  // Whether this step's projections all run GEMV kernels (see the top of this file), and per weight part (layer by
  // layer: qkv, o, gate_up, down) whether int8-dot: decided on the calling thread, whose matmul mode applies.
  bool gemv_plan(const at::Tensor& x, std::vector<uint8_t>& int8) const {
    const at::ScalarType dtype = x.scalar_type();
    if (dtype != at::kFloat && dtype != at::kBFloat16) return false;
    const int64_t M = x.size(0);
    for (const Layer& layer : layers_) {
      if (layer.qkv.bias && (layer.qkv.bias->scalar_type() != dtype || !layer.qkv.bias->is_contiguous())) return false;
      for (const Projection* projection : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
        for (const int64_t qtype : projection->qtypes) {
          if (qtype < 0) return false;  // a dense matrix: at::linear
          const bool part_int8 = carpool::ggml::int8_dot_applies(qtype, M);
          if (part_int8 && M > carpool::ggml::int8_gemv_max_rows(qtype)) return false;  // the batched int8 kernel
          if (!part_int8 && dtype == at::kBFloat16 && carpool::ggml::amx_exact_applies(M)) return false;  // tiles
          if (!part_int8 && dtype == at::kFloat && M > carpool::kernels::kFp32FusedMaxRows) return false;  // MKL
          int8.push_back(part_int8);
        }
    }
    return true;
  }

  // The checks the ops make per call, once per step, so that nothing in the parallel region can throw; returns each
  // layer's cache group.
  template <typename T>
  std::vector<GroupMeta> checked_groups(const at::Tensor& positions, const std::vector<at::Tensor>& cos,
                                        const std::vector<at::Tensor>& sin, const at::Tensor& slots,
                                        const at::Tensor& tables, const at::Tensor& lens,
                                        const OptionalTensor& sliding_slots, const OptionalTensor& sliding_tables,
                                        const OptionalTensor& sliding_lens, int64_t batch) const {
    const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
    for (size_t r = 0; r < cos.size(); ++r)
      TORCH_CHECK(cos[r].scalar_type() == dtype && sin[r].scalar_type() == dtype && cos[r].is_contiguous() &&
                      sin[r].is_contiguous() && cos[r].size(-1) == head_dim_ && sin[r].sizes() == cos[r].sizes(),
                  "cos/sin: expected contiguous tables in x's dtype");
    const int64_t* position = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < batch; ++t)
      for (const at::Tensor& table : cos)
        TORCH_CHECK(position[t] >= 0 && position[t] < table.size(0), "positions: ", position[t],
                    " outside the rotary table");
    auto group = [&](const at::Tensor& s, const at::Tensor& t, const at::Tensor& l) {
      TORCH_CHECK(s.scalar_type() == at::kLong && t.scalar_type() == at::kLong && l.scalar_type() == at::kLong &&
                      s.is_contiguous() && t.is_contiguous() && l.is_contiguous(),
                  "slots/tables/lens: expected contiguous int64");
      TORCH_CHECK(s.numel() == batch && t.dim() == 2 && t.size(0) == batch && l.numel() == batch,
                  "slots/tables/lens: one row per token");
      return GroupMeta{s.data_ptr<int64_t>(), t.data_ptr<int64_t>(), l.data_ptr<int64_t>(), t.size(1)};
    };
    GroupMeta full = group(slots, tables, lens);
    std::optional<GroupMeta> sliding =
        sliding_slots ? std::optional(group(*sliding_slots, *sliding_tables, *sliding_lens)) : std::nullopt;
    std::vector<GroupMeta> groups;
    for (const Layer& layer : layers_) {
      TORCH_CHECK(layer.rotary < static_cast<int64_t>(cos.size()), "cos: no table for rotary ", layer.rotary);
      GroupMeta& meta = layer.window > 0 && sliding ? *sliding : full;
      const at::Tensor& cache = layer.k_cache;
      TORCH_CHECK(cache.scalar_type() == dtype && layer.v_cache.scalar_type() == dtype && cache.is_contiguous() &&
                      layer.v_cache.is_contiguous() && cache.dim() == 4 && layer.v_cache.sizes() == cache.sizes() &&
                      cache.size(2) == num_kv_heads_ && cache.size(3) == head_dim_,
                  "k_cache/v_cache: expected contiguous [blocks, block_size, kv_heads, head_dim] in x's dtype");
      const int64_t block_size = cache.size(1), num_slots = cache.size(0) * block_size;
      for (int64_t t = 0; t < batch; ++t) {
        TORCH_CHECK(meta.slots[t] >= 0 && meta.slots[t] < num_slots, "slot_mapping: slot ", meta.slots[t],
                    " outside the pool");
        TORCH_CHECK(meta.lens[t] >= 1 && meta.lens[t] <= meta.max_blocks * block_size,
                    "context_lens: each between 1 and the block table's keys, got ", meta.lens[t]);
        // The blocks the attention reads: a sliding window's from its first key on (earlier ones may be gone).
        const int64_t first_key = layer.window > 0 ? std::max<int64_t>(0, meta.lens[t] - layer.window) : 0;
        for (int64_t b = first_key / block_size; b < (meta.lens[t] + block_size - 1) / block_size; ++b)
          TORCH_CHECK(meta.tables[t * meta.max_blocks + b] >= 0 && meta.tables[t * meta.max_blocks + b] < cache.size(0),
                      "block_tables: block outside the pool");
      }
      if (meta.runs.empty())  // once per cache group, after its lengths are checked against its table
        meta.runs = carpool::kernels::shared_context_runs(meta.tables, meta.lens, batch, meta.max_blocks, block_size);
      groups.push_back(meta);
    }
    return groups;
  }

  template <typename T>
  at::Tensor forward_in_one_region(const at::Tensor& x, const at::Tensor& positions_in,
                                   const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                                   const at::Tensor& slots_in, const at::Tensor& tables_in, const at::Tensor& lens_in,
                                   const OptionalTensor& sliding_slots_in, const OptionalTensor& sliding_tables_in,
                                   const OptionalTensor& sliding_lens_in, const std::vector<uint8_t>& int8) const {
    using X = ExactInput<T>;
    auto longs = [](const at::Tensor& t) { return t.to(at::kLong).contiguous(); };
    auto maybe_longs = [&](const OptionalTensor& t) { return t ? OptionalTensor(longs(*t)) : std::nullopt; };
    const at::Tensor positions = longs(positions_in), slots = longs(slots_in), tables = longs(tables_in),
                     lens = longs(lens_in);
    const OptionalTensor sliding_slots = maybe_longs(sliding_slots_in), sliding_tables = maybe_longs(sliding_tables_in),
                         sliding_lens = maybe_longs(sliding_lens_in);
    const int64_t M = x.size(0), H = x.size(1), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t qkv_width = q_size + 2 * kv_size;
    const std::vector<GroupMeta> groups = checked_groups<T>(positions, cos, sin, slots, tables, lens, sliding_slots,
                                                            sliding_tables, sliding_lens, M);
    int64_t inter = 0;
    for (const Layer& layer : layers_) inter = std::max(inter, checked_width<T>(layer, H));
    const int64_t max_k = std::max({H, q_size, inter});
    const bool any_exact = std::find(int8.begin(), int8.end(), uint8_t{0}) != int8.end();

    const at::Tensor hidden = x.contiguous().clone();
    const at::TensorOptions options = hidden.options();
    const at::Tensor normed_t = at::empty({M, H}, options), qkv_t = at::empty({M, qkv_width}, options),
                     attended_t = at::empty({M, q_size}, options), projected_t = at::empty({M, H}, options),
                     gate_up_t = at::empty({M, 2 * inter}, options), act_t = at::empty({M, inter}, options);
    T *h = hidden.data_ptr<T>(), *normed = normed_t.data_ptr<T>(), *qkv = qkv_t.data_ptr<T>(),
      *attended = attended_t.data_ptr<T>(), *projected = projected_t.data_ptr<T>(),
      *gate_up = gate_up_t.data_ptr<T>(), *act = act_t.data_ptr<T>();
    const int64_t* position = positions.data_ptr<int64_t>();
    const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
    PreparedInput prepared;
    // Steps with fewer attention items than threads, or too few to share evenly (one sequence of few KV heads), share
    // each item finer (SplitDecodeAttention::pays).
    using Split = carpool::kernels::SplitDecodeAttention<T>;
    Split split;
    bool split_now = false;
    carpool::kernels::ItemClaims claims;
    carpool::kernels::WorkShares shares(at::get_num_threads());

#pragma omp parallel num_threads(at::get_num_threads())
    {
      const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
      std::vector<X> panel(any_exact ? carpool::kernels::kExactPanelRows * max_k : 0);
      const uint8_t* part_int8 = int8.data();
      for (size_t l = 0; l < layers_.size(); ++l) {
        const Layer& layer = layers_[l];
        const Layer* previous = l > 0 ? &layers_[l - 1] : nullptr;
        const GroupMeta& group = groups[l];
#pragma omp single
        {
          if (previous) finish_mlp(*previous, h, projected, M, H, eps);
          carpool::kernels::rms_norm_rows(h, layer.input_norm.data_ptr<T>(), normed, M, H, eps);
          prepare(layer.qkv, part_int8, normed, M, H, prepared);
          reset_shares(shares, layer.qkv, threads);
        }
        project_share(layer.qkv, part_int8, prepared, M, H, qkv, qkv_width, panel.data(), shares, tid);
        part_int8 += layer.qkv.qtypes.size();
#pragma omp barrier
        const int64_t runs = static_cast<int64_t>(group.runs.size()) - 1;
#pragma omp single
        {
          for (int64_t t = 0; t < M; ++t)
            position_token(layer, group, qkv + t * qkv_width, t, position[t], cos, sin, eps);
          claims.reset(runs, num_kv_heads_);
          split_now = Split::pays(runs * num_kv_heads_, threads, /*in_region=*/true) &&
                      split.prepare(qkv, qkv_width, layer.k_cache.data_ptr<T>(), layer.v_cache.data_ptr<T>(),
                                    group.tables, group.lens, group.runs.data(), runs, attended, num_heads_,
                                    num_kv_heads_, head_dim_, layer.k_cache.size(1), group.max_blocks, scale,
                                    layer.window);
        }
        if (split_now) {
          split.run_phases(tid, threads);
        } else {
          carpool::kernels::decode_attention_items(qkv, qkv_width, layer.k_cache.data_ptr<T>(),
                                                   layer.v_cache.data_ptr<T>(), group.tables, group.lens,
                                                   group.runs.data(), attended,
                                                   num_heads_, num_kv_heads_, head_dim_, layer.k_cache.size(1),
                                                   group.max_blocks, scale, layer.window, claims);
        }
#pragma omp barrier
#pragma omp single
        {
          prepare(layer.o, part_int8, attended, M, q_size, prepared);
          reset_shares(shares, layer.o, threads);
        }
        project_share(layer.o, part_int8, prepared, M, q_size, projected, H, panel.data(), shares, tid);
        part_int8 += layer.o.qtypes.size();
#pragma omp barrier
#pragma omp single
        {
          if (layer.attention_out_norm)
            carpool::kernels::rms_norm_rows(projected, layer.attention_out_norm->data_ptr<T>(), projected, M, H, eps);
          add_into(h, projected, M * H);
          carpool::kernels::rms_norm_rows(h, layer.mlp_in_norm.data_ptr<T>(), normed, M, H, eps);
          prepare(layer.gate_up, part_int8, normed, M, H, prepared);
          reset_shares(shares, layer.gate_up, threads);
        }
        const int64_t width = total_rows(layer.gate_up) / 2;
        project_share(layer.gate_up, part_int8, prepared, M, H, gate_up, 2 * width, panel.data(), shares, tid);
        part_int8 += layer.gate_up.qtypes.size();
#pragma omp barrier
#pragma omp single
        {
          activate_into(gate_up, act, M, width, options);
          prepare(layer.down, part_int8, act, M, width, prepared);
          reset_shares(shares, layer.down, threads);
        }
        project_share(layer.down, part_int8, prepared, M, width, projected, H, panel.data(), shares, tid);
        part_int8 += layer.down.qtypes.size();
#pragma omp barrier
      }
#pragma omp single
      if (!layers_.empty()) finish_mlp(layers_.back(), h, projected, M, H, eps);
    }
    return hidden;
  }

  // What the ops check per call about a layer's weights, for x of width H; returns the MLP's width.
  template <typename T>
  int64_t checked_width(const Layer& layer, int64_t H) const {
    const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
    auto norm = [&](const OptionalTensor& weight, int64_t size) {
      TORCH_CHECK(!weight || (weight->scalar_type() == dtype && weight->is_contiguous() && weight->numel() == size),
                  "norm weights: expected ", size, " contiguous values of x's dtype");
    };
    norm(layer.input_norm, H);
    norm(layer.mlp_in_norm, H);
    norm(layer.attention_out_norm, H);
    norm(layer.mlp_out_norm, H);
    norm(layer.q_norm, head_dim_);
    norm(layer.k_norm, head_dim_);
    const int64_t q_size = num_heads_ * head_dim_, width = total_rows(layer.gate_up) / 2;
    auto chains = [](const Projection& projection, int64_t in, int64_t out) {
      for (size_t i = 0; i < projection.weights.size(); ++i)
        TORCH_CHECK(carpool::kernels::checked_in_features(projection.weights[i], projection.qtypes[i]) == in,
                    "weights: a projection's input is not the width before it");
      TORCH_CHECK(total_rows(projection) == out, "weights: a projection's output is not the width after it");
    };
    chains(layer.qkv, H, q_size + 2 * num_kv_heads_ * head_dim_);
    chains(layer.o, q_size, H);
    chains(layer.gate_up, H, 2 * width);
    chains(layer.down, width, H);
    TORCH_CHECK(!layer.qkv.bias || layer.qkv.bias->numel() == q_size + 2 * num_kv_heads_ * head_dim_,
                "qkv_bias: one value per q/k/v output");
    return width;
  }

  // A token's q/k/v after the projection: + bias, per-head q/k norms, rotary, then k and v into its cache slot.
  template <typename T>
  void position_token(const Layer& layer, const GroupMeta& group, T* qkv, int64_t t, int64_t position,
                      const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin, float eps) const {
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    if (layer.qkv.bias) add_into(qkv, layer.qkv.bias->data_ptr<T>(), q_size + 2 * kv_size);
    T *q = qkv, *k = qkv + q_size, *v = k + kv_size;
    if (layer.q_norm) {
      carpool::kernels::rms_norm_rows(q, layer.q_norm->data_ptr<T>(), q, num_heads_, head_dim_, eps);
      carpool::kernels::rms_norm_rows(k, layer.k_norm->data_ptr<T>(), k, num_kv_heads_, head_dim_, eps);
    }
    const at::Tensor &c = cos[layer.rotary], &s = sin[layer.rotary];
    carpool::kernels::rotate_token(q, num_heads_, k, num_kv_heads_, head_dim_, c.data_ptr<T>() + position * head_dim_,
                                   s.data_ptr<T>() + position * head_dim_);
    const int64_t slot = group.slots[t];
    std::memcpy(layer.k_cache.data_ptr<T>() + slot * kv_size, k, kv_size * sizeof(T));
    std::memcpy(layer.v_cache.data_ptr<T>() + slot * kv_size, v, kv_size * sizeof(T));
  }

  // The MLP's output (-> norm) added to the residual stream.
  template <typename T>
  void finish_mlp(const Layer& layer, T* h, T* projected, int64_t M, int64_t H, float eps) const {
    if (layer.mlp_out_norm)
      carpool::kernels::rms_norm_rows(projected, layer.mlp_out_norm->data_ptr<T>(), projected, M, H, eps);
    add_into(h, projected, M * H);
  }

  // act(gate) * up into act [M, width]: SwiGLU's kernel on the rows, GeGLU through torch's gelu (run here by one
  // thread: inside the parallel region its own parallel_for stays on the calling thread).
  template <typename T>
  void activate_into(const T* gate_up, T* act, int64_t M, int64_t width, const at::TensorOptions& options) const {
    if (!gelu_) return carpool::kernels::silu_mul_rows(gate_up, act, M, width);
    c10::InferenceMode inference;
    const at::Tensor out = activate(at::from_blob(const_cast<T*>(gate_up), {M, 2 * width}, options));
    std::memcpy(act, out.contiguous().data_ptr<T>(), M * width * sizeof(T));
  }

  // act(gate) * up as carpool.models.layers.GatedMLP: SwiGLU by its fused kernel, GeGLU by torch's gelu.
  at::Tensor activate(const at::Tensor& gate_up) const {
    if (!gelu_) return silu_mul(gate_up);
    const int64_t width = gate_up.size(-1) / 2;
    return at::gelu(gate_up.narrow(-1, 0, width), "tanh") * gate_up.narrow(-1, width, width);
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  bool gelu_ = false;
  bool one_region_ = true;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, std::string>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_one_region", &DecodeStack::set_one_region)
      .def("forward", &DecodeStack::forward);
}
