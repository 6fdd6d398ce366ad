// The small per-layer operations of a decoder, fused: one call each instead of the 5-10
// torch ops (and their temporaries) that eager PyTorch runs for them. Each performs the
// roundings that the eager model performs, in the same order, so float32 results agree
// with eager up to the last bit of an exp or a reduction order, and bfloat16 ones round at
// the same places (R(.) below: round to the tensor's dtype, nearest even; identity for fp32).
//
//   rms_norm        out = R(w * R(x * r)),  r = 1 / sqrt(mean(x^2) + eps)   (HF LlamaRMSNorm)
//   add_rms_norm    residual = R(x + residual); x = rms_norm(residual)      (in place)
//   rotary          x = R(R(x * c) + R(rotate_half(x) * s)), c = R(cos[pos]), s = R(sin[pos]),
//                   on the first `num_heads` heads of each row, in place   (HF apply_rotary)
//   silu_and_mul    out = R(R(g / (1 + exp(-g))) * u), [g | u] = x         (F.silu(g) * u)
//   clamped_swiglu  gpt-oss's: g = min(g, L), u = clamp(u, -L, L),
//                   out = R(R(u + 1) * R(g * R(sigmoid(R(g * alpha))))), [g | u] = x
//
// And one op of the sampler's, as small: structured output's grammar bitmask.
//   apply_token_bitmask  logits[rows[r], t] = -inf where bit t of bitmask[r] is 0   (in place)
//
// Loops are plain C++ over float rows; -O3 -march=native vectorizes them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 16;  // rows per thread task; a decode step stays on one thread

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

// Round to nearest even, as torch converts float to bfloat16; NaN stays NaN.
inline uint16_t to_bf16_bits(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint32_t rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
  return std::isnan(f) ? 0x7FC0 : static_cast<uint16_t>(rounded);
}

// Element access and rounding for the two dtypes.
template <typename T> struct Dtype;
template <> struct Dtype<float> {
  static float load(float v) { return v; }
  static float store(float v) { return v; }
  static float round(float v) { return v; }
};
template <> struct Dtype<at::BFloat16> {
  static float load(at::BFloat16 v) { return bits_to_float(static_cast<uint32_t>(v.x) << 16); }
  static at::BFloat16 store(float v) { return at::BFloat16(to_bf16_bits(v), at::BFloat16::from_bits()); }
  static float round(float v) { return bits_to_float(static_cast<uint32_t>(to_bf16_bits(v)) << 16); }
};

// exp(x) to about 1 ulp (Cephes' expf: range reduction by ln 2, degree-6 polynomial).
inline float exp_approx(float x) {
  constexpr float kHi = 88.0f, kLo = -87.3f;
  const float xc = std::min(std::max(x, kLo), kHi);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + (r + 1.0f);
  const float scale = bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  const float result = y * scale;
  return x > kHi ? INFINITY : (x < kLo ? 0.f : result);
}

// 1 / sqrt(mean(x^2) + eps) over one row, summed in 16 fixed lanes.
template <typename T>
float inverse_rms(const T* x, int64_t n, double eps) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float v = Dtype<T>::load(x[i + j]);
      lanes[j] += v * v;
    }
  for (; i < n; ++i) {
    const float v = Dtype<T>::load(x[i]);
    lanes[i % 16] += v * v;
  }
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return 1.f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
}

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, double eps) {
  const float r = inverse_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i)
    out[i] = Dtype<T>::store(Dtype<T>::load(w[i]) * Dtype<T>::round(Dtype<T>::load(x[i]) * r));
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(), op, ": x must be a CPU [T, H] tensor with contiguous rows");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              op, ": weight must be a contiguous [H] tensor of x's dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 only");
}

// Calls f with a value of the element type: float or at::BFloat16.
template <typename F>
void dispatch(const at::Tensor& x, const char* op, const F& f) {
  if (x.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 only");
    f(at::BFloat16{});
  }
}

template <typename F>
void for_rows(int64_t rows, const F& f) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) f(t);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.size(1);
  dispatch(x, "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(x.size(0), [&](int64_t t) { norm_row(xp + t * x.stride(0), wp, op + t * n, n, eps); });
  });
  return out;
}

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x");
  const int64_t n = x.size(1);
  dispatch(x, "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    for_rows(x.size(0), [&](int64_t t) {
      scalar_t* xr = xp + t * x.stride(0);
      scalar_t* rr = rp + t * residual.stride(0);
      for (int64_t i = 0; i < n; ++i) rr[i] = Dtype<scalar_t>::store(Dtype<scalar_t>::load(xr[i]) + Dtype<scalar_t>::load(rr[i]));
      norm_row(rr, wp, xr, n, eps);
    });
  });
}

void rotary(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
            int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= num_heads * head_dim && head_dim % 2 == 0,
              "rotary: x must be [T, >= num_heads * head_dim] with contiguous rows");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() >= x.size(0),
              "rotary: positions must be contiguous int64 with a position per row");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.dim() == 2 && cos.size(1) == head_dim &&
              sin.sizes() == cos.sizes() && sin.is_contiguous() && sin.scalar_type() == at::kFloat,
              "rotary: cos and sin must be contiguous float32 [max_positions, head_dim]");
  const int64_t half = head_dim / 2, max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary: position ", pos[t], " is outside the table");
  dispatch(x, "rotary", [&](auto tag) {
    using scalar_t = decltype(tag);
    using D = Dtype<scalar_t>;
    scalar_t* xp = x.data_ptr<scalar_t>();
    for_rows(x.size(0), [&](int64_t t) {
      const float* c = cos.data_ptr<float>() + pos[t] * head_dim;
      const float* s = sin.data_ptr<float>() + pos[t] * head_dim;
      std::vector<float> cr(head_dim), sr(head_dim), v(head_dim);
      for (int64_t i = 0; i < head_dim; ++i) cr[i] = D::round(c[i]), sr[i] = D::round(s[i]);
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* head = xp + t * x.stride(0) + h * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) v[i] = D::load(head[i]);
        for (int64_t i = 0; i < half; ++i)
          head[i] = D::store(D::round(v[i] * cr[i]) + D::round(-v[i + half] * sr[i]));
        for (int64_t i = half; i < head_dim; ++i)
          head[i] = D::store(D::round(v[i] * cr[i]) + D::round(v[i - half] * sr[i]));
      }
    });
  });
}

// A gated activation: x [T, 2I] = [gate | up] -> out [T, I], out[t, i] = D::store(f(D, g, u))
// with g and u loaded as float; `f` is a generic lambda given the dtype's rounding (Dtype<T>).
template <typename F>
at::Tensor gated(const at::Tensor& x, const char* name, F f) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0 && x.device().is_cpu(),
              name, ": x must be a CPU [T, 2 * I] tensor with contiguous rows");
  const int64_t inter = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), inter}, x.options());
  dispatch(x, name, [&](auto tag) {
    using scalar_t = decltype(tag);
    using D = Dtype<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(x.size(0), [&](int64_t t) {
      const scalar_t* g = xp + t * x.stride(0);
      const scalar_t* u = g + inter;
      for (int64_t i = 0; i < inter; ++i) op[t * inter + i] = D::store(f(D{}, D::load(g[i]), D::load(u[i])));
    });
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  return gated(x, "silu_and_mul", [](auto d, float g, float u) {
    using D = decltype(d);
    return D::round(g / (1.f + exp_approx(-g))) * u;
  });
}

at::Tensor clamped_swiglu(const at::Tensor& x, double alpha, double limit) {
  // Eager torch does a bf16 tensor's arithmetic with a Python scalar in float32.
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);
  return gated(x, "clamped_swiglu", [a, lim](auto d, float g, float u) {
    using D = decltype(d);
    // std::min / std::clamp keep a NaN, as torch.clamp does; the bounds are exact in bf16.
    const float gv = D::round(std::min(g, lim));
    const float uv = D::round(std::clamp(u, -lim, lim));
    const float sig = D::round(1.f / (1.f + exp_approx(-D::round(gv * a))));
    return D::round(uv + 1.f) * D::round(gv * sig);
  });
}

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat &&
                  logits.device().is_cpu(),
              "apply_token_bitmask: logits must be a CPU float32 [B, V] tensor with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt &&
                  bitmask.size(1) * 32 >= logits.size(1),
              "apply_token_bitmask: bitmask must be a contiguous int32 [R, >= V / 32] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: rows must be int64 [R], one logits row per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.size(0); ++r)
    TORCH_CHECK(0 <= row_ids[r] && row_ids[r] < logits.size(0), "apply_token_bitmask: row out of range");
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // One thread: a row takes microseconds, less than waking a second one costs.
  for (int64_t r = 0; r < rows.size(0); ++r) {
    float* row = logits.data_ptr<float>() + row_ids[r] * logits.stride(0);
    const auto* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + r * words;
    for (int64_t w = 0; w < words && w * 32 < vocab; ++w) {
      const uint32_t bits = mask[w];
      if (bits == 0xffffffffu) continue;  // all allowed: the common word inside free text
      const int64_t base = w * 32, n = std::min<int64_t>(32, vocab - base);
      for (int64_t i = 0; i < n; ++i)
        if (!((bits >> i) & 1u)) row[base + i] = neg_inf;
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm);
  m.def("rotary(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()", &rotary);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("clamped_swiglu(Tensor x, float alpha, float limit) -> Tensor", &clamped_swiglu);
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()", &apply_token_bitmask);
}
