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
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

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
  // act(gate) * up as carpool.models.layers.GatedMLP: SwiGLU by its fused kernel, GeGLU by torch's gelu.
  at::Tensor activate(const at::Tensor& gate_up) const {
    if (!gelu_) return silu_mul(gate_up);
    const int64_t width = gate_up.size(-1) / 2;
    return at::gelu(gate_up.narrow(-1, 0, width), "tanh") * gate_up.narrow(-1, width, width);
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  bool gelu_ = false;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, std::string>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward);
}
