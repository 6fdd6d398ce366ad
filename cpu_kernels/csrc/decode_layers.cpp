// A Llama-family decoder's layers for a step of decodes, in one call from Python
// (engine/models/cpu_decode.py). Each layer is the sequence the model's Python runs:
//
//   x, residual = add_rms_norm(x, residual)        (the first layer: rms_norm(x), residual = x)
//   qkv   = linear(x) [+ bias]; [q, k = rms_norm of each head (Qwen3)]; rotary on q and k, in place
//   reshape_and_cache(k, v); out = paged_decode(q)
//   x     = linear(out) [+ bias]; x, residual = add_rms_norm(x, residual)
//   x     = linear(silu_and_mul(linear(x) [+ bias])) [+ bias]
//
// through the same ops (csrc/layer_ops.cpp, csrc/paged_attention.cpp and the linear kernels:
// the integer ones or the exact bf16 ones), called through torch's dispatcher instead of
// Python: the same inputs in the same order, so the same bits, without the ~80 us of Python
// and argument parsing a layer costs at one row (docs/cpu.md, "A decode step's layers in one
// call"). The weights and each layer's constants are given once, to DecodeLayers'
// constructor; a step passes only what changes.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using RmsNormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNormFn = void(at::Tensor&, at::Tensor&, const at::Tensor&, double);
using RotaryFn = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using CacheFn = void(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&);
using DecodeFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                            int64_t, const std::optional<at::Tensor>&);
using GatedFn = at::Tensor(const at::Tensor&);

// The op registered as `name` ("pagedserve_cpu::rms_norm"); its family must be loaded.
template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Fn>();
}

// An empty tensor stands for "none" in the constructor's lists (a bias, a sink).
std::optional<at::Tensor> given(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

using Bf16Int4Fn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool, bool, bool);
using Bf16Int8Fn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool);
using UnpackedFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool, bool, bool,
                              bool);

// One linear layer as QuantLinear.forward runs it, on one of three kernels:
//   kIntDot   the integer kernels (csrc/int_dot*.cpp), `int_dot` the machine's variant
//   kBf16Int4 / kBf16Int8   the exact bf16 kernels (csrc/quant_linear_bf16.cpp), from
//             `unpacked_from_rows` rows on reading the `unpacked` bf16 copy where there is one
enum Kind : int64_t { kIntDot = 0, kBf16Int4 = 1, kBf16Int8 = 2 };

struct Kernels {
  Kernels()
      : bf16_int4(op<Bf16Int4Fn>("pagedserve_cpu::bf16_int4_linear")),
        bf16_int8(op<Bf16Int8Fn>("pagedserve_cpu::bf16_int8_linear")),
        unpacked(op<UnpackedFn>("pagedserve_cpu::bf16_linear_unpacked")) {}
  c10::TypedOperatorHandle<Bf16Int4Fn> bf16_int4;
  c10::TypedOperatorHandle<Bf16Int8Fn> bf16_int8;
  c10::TypedOperatorHandle<UnpackedFn> unpacked;
};

struct Linear {
  Kind kind;
  std::optional<c10::TypedOperatorHandle<LinearFn>> int_dot;
  at::Tensor weight;
  std::optional<at::Tensor> unpacked, bias;
  int64_t n, encoding, unpacked_from_rows;
  bool amx, zero_units, fp4;

  at::Tensor operator()(const Kernels& k, const at::Tensor& x) const {
    at::Tensor y;
    if (kind == kIntDot) {
      y = int_dot->call(x, weight, n, encoding);
    } else if (unpacked && x.size(0) >= unpacked_from_rows) {
      y = k.unpacked.call(x, weight, *unpacked, n, kind == kBf16Int4, amx, zero_units, fp4);
    } else if (kind == kBf16Int4) {
      y = k.bf16_int4.call(x, weight, n, amx, zero_units, fp4);
    } else {
      y = k.bf16_int8.call(x, weight, n, amx);
    }
    return bias ? y + *bias : y;  // as the model adds it: a new tensor
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  std::optional<at::Tensor> q_norm, k_norm;  // Qwen3's RMSNorm of each q and k head
  std::vector<Linear> linears;  // qkv, o, gate_up, down
  int64_t window;               // 0: full attention
  std::optional<at::Tensor> sinks;
};

class DecodeLayers : public torch::CustomClassHolder {
 public:
  // Per layer l and linear j = 4l + i (i = qkv, o, gate_up, down): weights[j], unpacked[j],
  // biases[j], int_dot[j] (the integer op's qualified name; "" for the bf16 kernels) and
  // params[7j..7j+6] = (kind, N, encoding, amx, zero_units, fp4, unpacked_from_rows).
  // norms[4l..4l+3] = input, post-attention, q and k head norms (empty: none); windows[l];
  // sinks[l] (float32 [Hq]).
  // heads = (Hq, Hkv, D).
  DecodeLayers(std::vector<at::Tensor> weights, std::vector<at::Tensor> unpacked, std::vector<at::Tensor> biases,
               std::vector<std::string> int_dot, std::vector<int64_t> params, std::vector<at::Tensor> norms,
               std::vector<int64_t> windows, std::vector<at::Tensor> sinks, std::vector<int64_t> heads, double eps)
      : rms_norm_(op<RmsNormFn>("pagedserve_cpu::rms_norm")),
        add_rms_norm_(op<AddRmsNormFn>("pagedserve_cpu::add_rms_norm")),
        rotary_(op<RotaryFn>("pagedserve_cpu::rotary")),
        cache_(op<CacheFn>("pagedserve_cpu::reshape_and_cache")),
        decode_(op<DecodeFn>("pagedserve_cpu::paged_decode")),
        silu_and_mul_(op<GatedFn>("pagedserve_cpu::silu_and_mul")),
        eps_(eps) {
    const size_t count = windows.size();
    TORCH_CHECK(count > 0 && weights.size() == 4 * count && unpacked.size() == 4 * count &&
                    biases.size() == 4 * count && int_dot.size() == 4 * count && params.size() == 28 * count &&
                    norms.size() == 4 * count && sinks.size() == count && heads.size() == 3,
                "DecodeLayers: want 4 linears, 4 norms, a window and a sink entry per layer, and (Hq, Hkv, D)");
    num_heads_ = heads[0], num_kv_heads_ = heads[1], head_dim_ = heads[2];
    for (size_t l = 0; l < count; ++l) {
      Layer layer{norms[4 * l], norms[4 * l + 1], given(norms[4 * l + 2]), given(norms[4 * l + 3]), {}, windows[l],
                  given(sinks[l])};
      for (size_t j = 4 * l; j < 4 * l + 4; ++j) {
        const int64_t* p = &params[7 * j];
        TORCH_CHECK(p[0] >= kIntDot && p[0] <= kBf16Int8, "DecodeLayers: unknown linear kind ", p[0]);
        std::optional<c10::TypedOperatorHandle<LinearFn>> int_dot_op;
        if (p[0] == kIntDot) int_dot_op = op<LinearFn>(int_dot[j]);
        layer.linears.push_back(Linear{static_cast<Kind>(p[0]), int_dot_op, weights[j], given(unpacked[j]),
                                       given(biases[j]), p[1], p[2], p[6], p[3] != 0, p[4] != 0, p[5] != 0});
      }
      layers_.push_back(std::move(layer));
    }
  }

  // x [T, H]: the embeddings of T decode rows (one per sequence), T = block_tables' rows.
  // Returns (x, residual) after the last layer, as the model's loop leaves them.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
                                             const at::Tensor& sin, std::vector<at::Tensor> kv_caches,
                                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                             const at::Tensor& context_lens, double scale) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodeLayers: want a KV cache per layer, got ",
                kv_caches.size(), " for ", layers_.size());
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) == block_tables.size(0),
                "DecodeLayers: x must be contiguous [T, H] with a row per sequence");
    const int64_t rows = x.size(0), heads = num_heads_ + 2 * num_kv_heads_;
    at::Tensor residual;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      if (l == 0) {
        residual = x;
        x = rms_norm_.call(x, layer.input_norm, eps_);
      } else {
        add_rms_norm_.call(x, residual, layer.input_norm, eps_);
      }
      at::Tensor qkv = layer.linears[0](kernels_, x).view({rows, heads, head_dim_});
      at::Tensor qk = qkv.narrow(1, 0, num_heads_ + num_kv_heads_);
      if (layer.q_norm) qk = at::cat({head_norm(qk.narrow(1, 0, num_heads_), *layer.q_norm),
                                      head_norm(qk.narrow(1, num_heads_, num_kv_heads_), *layer.k_norm)}, 1);
      at::Tensor rows_qk = qk.flatten(1);
      rotary_.call(rows_qk, positions, cos, sin, num_heads_ + num_kv_heads_, head_dim_);
      at::Tensor q = qk.narrow(1, 0, num_heads_);
      cache_.call(qk.narrow(1, num_heads_, num_kv_heads_), qkv.narrow(1, num_heads_ + num_kv_heads_, num_kv_heads_),
                  kv_caches[l], slot_mapping);
      at::Tensor out = decode_.call(q, kv_caches[l], block_tables, context_lens, scale, layer.window, layer.sinks);
      x = layer.linears[1](kernels_, out.view({rows, num_heads_ * head_dim_}));
      add_rms_norm_.call(x, residual, layer.post_norm, eps_);
      x = layer.linears[3](kernels_, silu_and_mul_.call(layer.linears[2](kernels_, x)));
    }
    return {x, residual};
  }

 private:
  // RMSNorm.forward on heads [T, H, D] (a view of qkv): a new [T, H, D] tensor.
  at::Tensor head_norm(const at::Tensor& heads, const at::Tensor& weight) const {
    return rms_norm_.call(heads.reshape({-1, head_dim_}), weight, eps_).view(heads.sizes());
  }

  c10::TypedOperatorHandle<RmsNormFn> rms_norm_;
  c10::TypedOperatorHandle<AddRmsNormFn> add_rms_norm_;
  c10::TypedOperatorHandle<RotaryFn> rotary_;
  c10::TypedOperatorHandle<CacheFn> cache_;
  c10::TypedOperatorHandle<DecodeFn> decode_;
  c10::TypedOperatorHandle<GatedFn> silu_and_mul_;
  Kernels kernels_;
  double eps_;
  int64_t num_heads_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<std::string>, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>, double>())
      .def("forward", &DecodeLayers::forward);
}
