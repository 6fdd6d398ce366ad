// Weight-only quantized linear layers, y = x @ W^T, with W kept in blocks of 32 along K
// exactly as GGUF stores Q4_0/Q4_1/Q8_0 (scales widened to fp32), and x in float32:
//
//   int4: qweight [N, K/2] uint8. Byte j of a block holds value j (low nibble) and j+16
//         (high nibble); w = q * scale + zero, q in 0..15 (Q4_1: zero = m; Q4_0: -8 * d).
//   int8: qweight [N, K] int8; w = q * scale (Q8_0).
//   scales, zeros: [N, K/32] float32.
//
// Each block is unpacked in registers to its effective float32 weights, computed as the
// reference computes them (q * scale, then + zero), so the result is the float32 product
// with exactly the dequantized weights, up to summation order. That order is fixed per
// output element: eight lanes, lane l accumulating x[k] * w[k] for k = l, l+8, l+16, ...
// with fma, then a horizontal sum in a fixed order. Every path below (one row at a time,
// tiles of rows sharing unpacked weights) performs exactly that sequence, so a row's result
// never depends on M, the tiling or the threads: the engine relies on it (a request's
// tokens must not change with what it is batched with).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kMChunk = 64;  // rows of x kept hot in cache while a thread sweeps its columns

// --- 8-lane vectors: AVX2, or a portable emulation with the same rounding --------------------

#ifdef __AVX2__

using Vec = __m256;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }

// Keeps a loaded value in its register: left alone, GCC folds a reload into every fma that
// uses it, and the 4x2 tile then waits on loads (12 per 8 fmas instead of 6).
inline void pin(Vec& v) { asm("" : "+x"(v)); }

inline float hsum(Vec v) {  // (0+4, 1+5, 2+6, 3+7), then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block's 32 weights as 4 x 8 floats, in value order.
inline void unpack(const uint8_t* q, bool int4, Vec out[4]) {
  if (int4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);                     // values 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);  // values 16..31
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  }
}

#else

struct Vec { float v[8]; };
inline Vec load(const float* p) { Vec r; for (int i = 0; i < 8; ++i) r.v[i] = p[i]; return r; }
inline Vec zero() { return Vec{}; }
inline Vec splat(float x) { Vec r; for (float& v : r.v) v = x; return r; }
inline Vec mul(Vec a, Vec b) { for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i]; return a; }
inline Vec add(Vec a, Vec b) { for (int i = 0; i < 8; ++i) a.v[i] += b.v[i]; return a; }
inline Vec fma(Vec a, Vec b, Vec c) { for (int i = 0; i < 8; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }
inline void pin(Vec&) {}

inline float hsum(Vec v) {
  float a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = v.v[i] + v.v[i + 4];
  for (int i = 0; i < 2; ++i) b[i] = a[i] + a[i + 2];
  return b[0] + b[1];
}

inline void unpack(const uint8_t* q, bool int4, Vec out[4]) {
  for (int j = 0; j < kBlock; ++j) {
    const float w = int4 ? static_cast<float>(j < 16 ? (q[j] & 15) : (q[j - 16] >> 4))
                         : static_cast<float>(static_cast<int8_t>(q[j]));
    out[j / 8].v[j % 8] = w;
  }
}

#endif

// One block's effective weights as 4 x 8 floats: q * scale (+ zero), two roundings, as
// QuantizedTensor.dequantize() does.
inline void dequant_block(const uint8_t* q, bool int4, float scale, float zero, Vec w[4]) {
  unpack(q, int4, w);
  for (int c = 0; c < 4; ++c) w[c] = int4 ? add(mul(w[c], splat(scale)), splat(zero)) : mul(w[c], splat(scale));
}

// Values 8c..8c+7 of one block's effective weights (c in 0..3), the same numbers as
// dequant_block's w[c]: for one row computing many columns, where each column needs its own
// accumulator and a whole block per column would not fit in registers.
inline Vec dequant_vector(const uint8_t* q, bool int4, int c, float scale, float zero) {
#ifdef __AVX2__
  __m256i v;
  if (int4) {
    v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (c & 1) * 8)));
    v = c < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
  } else {
    v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + c * 8)));
  }
  const Vec w = mul(_mm256_cvtepi32_ps(v), splat(scale));
#else
  Vec all[4];
  unpack(q, int4, all);
  const Vec w = mul(all[c], splat(scale));
#endif
  return int4 ? add(w, splat(zero)) : w;
}

// --- the kernels ---------------------------------------------------------------------------

struct Problem {
  const float* x;       // [M, K]
  const uint8_t* q;     // [N, row_bytes]
  const float* scales;  // [N, blocks]
  const float* zeros;   // [N, blocks] (int4 only)
  float* out;           // [M, N]
  int64_t M, N, K, blocks, row_bytes;
  bool int4;

  const uint8_t* block(int64_t n, int64_t b) const { return q + n * row_bytes + b * (int4 ? kBlock / 2 : kBlock); }
  float zero(int64_t n, int64_t b) const { return int4 ? zeros[n * blocks + b] : 0.f; }

  void dequant(int64_t n, int64_t b, Vec w[4]) const {
    dequant_block(block(n, b), int4, scales[n * blocks + b], zero(n, b), w);
  }
};

// Ask for the next columns' weights, scales and zeros while this call computes: each
// column's row is only a few cache lines, too short for the hardware prefetcher to start.
inline void prefetch_columns(const Problem& p, int64_t n, int64_t count) {
  if (n + count > p.N) return;
  auto ahead = [](const void* start, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(start) + off);
  };
  ahead(p.q + n * p.row_bytes, count * p.row_bytes);
  ahead(p.scales + n * p.blocks, count * p.blocks * 4);
  if (p.int4) ahead(p.zeros + n * p.blocks, count * p.blocks * 4);
}

// Row m for columns [n, n + NC): NC independent accumulators keep the FMA units busy (one
// column's lanes form a single dependent chain). For few rows, as in decoding.
template <int NC>
inline void row_by_columns(const Problem& p, int64_t m, int64_t n) {
  Vec acc[NC];
  for (int j = 0; j < NC; ++j) acc[j] = zero();
  const float* x = p.x + m * p.K;
  prefetch_columns(p, n + NC, NC);
  for (int64_t b = 0; b < p.blocks; ++b) {
    for (int c = 0; c < 4; ++c) {
      const Vec xv = load(x + b * kBlock + 8 * c);
      for (int j = 0; j < NC; ++j) {
        const int64_t col = n + j;
        acc[j] = fma(xv, dequant_vector(p.block(col, b), p.int4, c, p.scales[col * p.blocks + b], p.zero(col, b)),
                     acc[j]);
      }
    }
  }
  for (int j = 0; j < NC; ++j) p.out[m * p.N + n + j] = hsum(acc[j]);
}

// Four rows x two columns from weights dequantized once per chunk of rows into `panel`
// ([2][K] floats): each x load serves two products, each weight load four.
inline void tile_4x2(const Problem& p, int64_t m, int64_t n, const float* panel) {
  Vec acc[4][2];
  for (auto& row : acc) row[0] = row[1] = zero();
  const float* x = p.x + m * p.K;
  for (int64_t k = 0; k < p.K; k += 8) {
    Vec w0 = load(panel + k), w1 = load(panel + p.K + k);
    pin(w0), pin(w1);
    for (int t = 0; t < 4; ++t) {
      Vec xv = load(x + t * p.K + k);
      pin(xv);
      acc[t][0] = fma(xv, w0, acc[t][0]);
      acc[t][1] = fma(xv, w1, acc[t][1]);
    }
  }
  for (int t = 0; t < 4; ++t) {
    p.out[(m + t) * p.N + n] = hsum(acc[t][0]);
    p.out[(m + t) * p.N + n + 1] = hsum(acc[t][1]);
  }
}

inline void dequant_row(const Problem& p, int64_t n, float* dst) {
  Vec w[4];
  for (int64_t b = 0; b < p.blocks; ++b) {
    p.dequant(n, b, w);
    for (int c = 0; c < 4; ++c) {
#ifdef __AVX2__
      _mm256_storeu_ps(dst + b * kBlock + 8 * c, w[c]);
#else
      for (int i = 0; i < 8; ++i) dst[b * kBlock + 8 * c + i] = w[c].v[i];
#endif
    }
  }
}

// Columns [n_begin, n_end) for rows [m0, m1).
void columns(const Problem& p, int64_t m0, int64_t m1, int64_t n_begin, int64_t n_end, float* panel) {
  int64_t n = n_begin;
  if (m1 - m0 >= 8) {  // enough rows to repay dequantizing two columns into the panel
    for (; n + 2 <= n_end; n += 2) {
      dequant_row(p, n, panel);
      dequant_row(p, n + 1, panel + p.K);
      int64_t m = m0;
      for (; m + 4 <= m1; m += 4) tile_4x2(p, m, n, panel);
      for (; m < m1; ++m) row_by_columns<2>(p, m, n);
    }
  }
  for (int64_t m = m0; m < m1; ++m) {
    int64_t col = n;
    for (; col + 8 <= n_end; col += 8) row_by_columns<8>(p, m, col);
    for (; col < n_end; ++col) row_by_columns<1>(p, m, col);
  }
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& zeros, bool int4) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(1) == (int4 ? K / 2 : K), "qweight shape");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == N &&
              scales.size(1) == blocks, "scales: contiguous float32 [N, K/32]");
  if (int4) TORCH_CHECK(zeros && zeros->sizes() == scales.sizes() && zeros->is_contiguous(), "zeros shape");

  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Problem p{x.data_ptr<float>(), static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                  int4 ? zeros->data_ptr<float>() : nullptr, out.data_ptr<float>(), M, N, K, blocks,
                  int4 ? K / 2 : K, int4};
  // Threads split the columns (in pairs): each streams its share of the weights once per
  // chunk of rows.
  at::parallel_for(0, (N + 1) / 2, 8, [&](int64_t pair_begin, int64_t pair_end) {
    const int64_t n_begin = 2 * pair_begin, n_end = std::min(N, 2 * pair_end);
    std::vector<float> panel(2 * K);
    for (int64_t m0 = 0; m0 < M; m0 += kMChunk)
      columns(p, m0, std::min(M, m0 + kMChunk), n_begin, n_end, panel.data());
  });
  return out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& zeros) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "int4 qweight must be uint8");
  return quant_linear(x, qweight, scales, zeros, true);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "int8 qweight must be int8");
  return quant_linear(x, qweight, scales, c10::nullopt, false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros) -> Tensor", &int4_linear);
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor", &int8_linear);
}
