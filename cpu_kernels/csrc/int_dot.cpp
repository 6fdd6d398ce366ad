// int4 or int8 weights times 8-bit activations in integer dot products (W4A8, W8A8; the
// arithmetic of --cpu-arithmetic int8): y = x @ W^T, x bf16 or float32 [M, K], y [M, N] of x's
// dtype, W in the blocks of 32 values along K every quantized weight already uses
// (cpu_kernels/quant_format.py):
//   int4: w = q * scale + zero, q in 0..15   (GGUF Q4_0/Q4_1, Q4_K re-blocked, GPTQ/AWQ)
//   int8: w = q * scale, q in -128..127      (GGUF Q8_0, --quantization int8)
// Per row m, block b, column n:
//
//   activations: d = amax / 127, a = round(x * (1 / d)) (RNE; d = 0 gives a = 0), as GGUF's
//                Q8_0 blocks (csrc/mxfp4_int8.cpp's); e = float(sum(a)) * d
//   s       = sum_k q_k a_k          u8 x s8 (VPDPBUSD), exact in int32 in any order; int8
//                                    weights are stored as q + 128 (unsigned), and
//                                    128 * sum(a) comes off the sum
//   acc     = acc + float(s) * (scale * d)
//   acc     = acc + zero * e         (int4 only)
//   y       = acc, or bf16(acc) (RNE), acc from 0 over the blocks in order
//
// Every float operation is rounded on its own (no fma; the build has -ffp-contract=off), so
// plain torch computes the same bits (int_dot_format.reference): each (m, n) is one fixed
// sequence of float operations on exact integers, whatever M, the tiling or the threads. The
// extra roundings (2^-24 each) are far below the activations' rounding to 8 bits (2^-8).
// (|s| <= 32 * 128 * 127 < 2^24 and |sum(a)| <= 32 * 127: both exact in float.)
//
// Layout (cpu_kernels/int_dot_format.py `pack`): columns in groups of 16 (G = ceil(N / 16),
// the last padded with zeros). One VPDPBUSD operand is 16 columns x 4 consecutive k (byte
// 4c + t: column c, k = 4 quad + t). One record per group and block, read as one stream:
//
//   int4 records [G][K/32][256 + 2 x 16 x (4 or 2) bytes]:
//       chunk h = 0..3, 64 bytes: byte 4c + t: low nibble = q of column c at k = 32 b + 4 h + t,
//                                 high nibble at k + 16 (GGUF's pairing of value j with j + 16,
//                                 so a chunk widens with an and and a shift)
//       | 16 scales | 16 zeros, by the weight's encoding (the same float32 values each way):
//         fp32:  float32 scale, float32 zero                           (6 bits a weight)
//         fp16:  fp16 scale, fp16 zero: exact for GGUF's blocks        (5 bits a weight)
//         units: fp16 scale, fp16 u with zero = scale * u exactly (GPTQ/AWQ's -scale * z)
//   int8 records [G][K/32][512 + 16 x (4 or 2) bytes]:
//       chunk h = 0..7, 64 bytes: byte 4c + t = q + 128 of column c at k = 32 b + 4 h + t
//       | 16 scales: float32 (fp32) or fp16 (fp16: GGUF's Q8_0, 8.5 bits a weight as stored)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int_dot.h"

// The same instructions as csrc/mxfp4_int8.cpp (whose int8_dot_supported() says whether they
// run); bf16 rounding in integer ops, so AVX512-BF16 is not needed (Ice Lake has VNNI only).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_INT_DOT 1
#include <immintrin.h>
#endif

namespace {

bool avx512_supported() {
#ifdef PAGEDSERVE_INT_DOT
  return true;
#else
  return false;
#endif
}

#ifdef PAGEDSERVE_INT_DOT

using namespace int_dot;

inline __m512i x_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// float32 -> bf16 bits, round to nearest even as torch rounds (NaN -> a quiet NaN).
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

inline void store_row(const Problem& p, int64_t m, int64_t g, __m512 acc) {
  const int64_t n = 16 * g, valid = std::min<int64_t>(16, p.N - n);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  if (p.fp32) _mm512_mask_storeu_ps(static_cast<float*>(p.out) + m * p.N + n, mask, acc);
  else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + m * p.N + n, mask, to_bf16(acc));
}

// 16 float32 values stored as float32 or fp16 (fp16 -> fp32 is exact).
inline __m512 load_values(const uint8_t* at, int64_t encoding) {
  if (encoding == kFp32) return _mm512_loadu_ps(at);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// After block b's integer sums s, the float steps of the top, each rounded.
template <typename W, int R, int G>
inline void finish_block(const Problem& p, int64_t m0, int64_t g0, int64_t b, __m512i (&s)[R][G],
                         __m512 (&acc)[R][G]) {
  const int64_t value_bytes = p.encoding == kFp32 ? 64 : 32;
  for (int j = 0; j < G; ++j) {
    const uint8_t* sz = p.record(g0 + j, b) + W::kChunks * kChunkBytes;
    const __m512 scale = load_values(sz, p.encoding);
    __m512 zero = _mm512_setzero_ps();
    if constexpr (W::kZeros) {
      zero = load_values(sz + value_bytes, p.encoding);
      if (p.encoding == kUnits) zero = _mm512_mul_ps(scale, zero);  // exact: pack checked it
    }
    for (int i = 0; i < R; ++i) {
      const int64_t at = (m0 + i) * p.blocks + b;
      const __m512 sd = _mm512_mul_ps(scale, _mm512_set1_ps(p.xd[at]));
      acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_mul_ps(_mm512_cvtepi32_ps(s[i][j]), sd));
      if constexpr (W::kZeros) acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_mul_ps(zero, _mm512_set1_ps(p.xe[at])));
    }
  }
}

// Block b's exact integer sums for R rows x G groups, the values widened in registers as
// they stream in. Two chains each (int4: the low and the high nibbles; int8: even and odd
// chunks) hide VPDPBUSD's latency.
template <typename W, int R, int G>
inline void block_sums(const Problem& p, int64_t m0, int64_t g0, int64_t b, __m512i (&s)[R][G]) {
  __m512i s2[R][G];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < G; ++j) s[i][j] = s2[i][j] = _mm512_setzero_si512();
  const int8_t* xb = p.xq + m0 * p.K + b * kBlock;
  if constexpr (W::kZeros) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int h = 0; h < W::kChunks; ++h) {
      for (int j = 0; j < G; ++j) {
        const __m512i v = _mm512_loadu_si512(p.record(g0 + j, b) + h * kChunkBytes);
        const __m512i lo = _mm512_and_si512(v, mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        for (int i = 0; i < R; ++i) {
          s[i][j] = _mm512_dpbusd_epi32(s[i][j], lo, x_quad(xb + i * p.K + 4 * h));
          s2[i][j] = _mm512_dpbusd_epi32(s2[i][j], hi, x_quad(xb + i * p.K + 16 + 4 * h));
        }
      }
    }
  } else {
    for (int h = 0; h < W::kChunks; h += 2) {
      for (int j = 0; j < G; ++j) {
        const __m512i v0 = _mm512_loadu_si512(p.record(g0 + j, b) + h * kChunkBytes);
        const __m512i v1 = _mm512_loadu_si512(p.record(g0 + j, b) + (h + 1) * kChunkBytes);
        for (int i = 0; i < R; ++i) {
          s[i][j] = _mm512_dpbusd_epi32(s[i][j], v0, x_quad(xb + i * p.K + 4 * h));
          s2[i][j] = _mm512_dpbusd_epi32(s2[i][j], v1, x_quad(xb + i * p.K + 4 * h + 4));
        }
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m512i offset = W::kZeros ? _mm512_setzero_si512() : _mm512_set1_epi32(p.xs[(m0 + i) * p.blocks + b]);
    for (int j = 0; j < G; ++j) s[i][j] = _mm512_sub_epi32(_mm512_add_epi32(s[i][j], s2[i][j]), offset);
  }
}

// R rows x G groups over every block. No software prefetch: each thread reads its groups'
// records as one sequential stream, which the hardware prefetchers follow (prefetching the
// next group one pass ahead measured 10-30% slower at one row on the Zen 4 VM).
template <typename W, int R, int G>
void tile_registers(const Problem& p, int64_t m0, int64_t g0) {
  __m512 acc[R][G];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m512i s[R][G];
    block_sums<W, R, G>(p, m0, g0, b, s);
    finish_block<W, R, G>(p, m0, g0, b, s, acc);
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < G; ++j) store_row(p, m0 + i, g0 + j, acc[i][j]);
}

// Rows [0, M) of groups g.. g + G - 1, four rows a tile.
template <typename W, int G>
void all_rows(const Problem& p, int64_t g) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) tile_registers<W, 4, G>(p, m, g);
  switch (p.M - m) {
    case 3: tile_registers<W, 3, G>(p, m, g); break;
    case 2: tile_registers<W, 2, G>(p, m, g); break;
    case 1: tile_registers<W, 1, G>(p, m, g); break;
    default: break;
  }
}

inline __m512 load(const float* s) { return _mm512_loadu_ps(s); }

inline __m512 load(const uint16_t* s) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))), 16));
}

// One row's 8-bit blocks, per the top of the file.
template <typename T>
void quantize_row(const T* x, int64_t blocks, int8_t* q, float* d_out, float* e_out, int32_t* s_out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const T* src = x + b * kBlock;
    const __m512 lo = load(src), hi = load(src + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    int8_t* dst = q + b * kBlock;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    d_out[b] = d;
    e_out[b] = static_cast<float>(sum) * d;
    s_out[b] = 128 * sum;
  }
}

template <typename W>
at::Tensor int_dot_linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t encoding) {
  return linear<W>(
      x, w, N, encoding, [](const auto* row, int64_t blocks, int8_t* q, float* d, float* e,
                            int32_t* s) { quantize_row(row, blocks, q, d, e, s); },
      [](const Problem& p, int64_t g) { all_rows<W, 1>(p, g); });
}

at::Tensor int4_int8_linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t encoding) {
  return int_dot_linear<Int4>(x, w, N, encoding);
}

at::Tensor int8_int8_linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t encoding) {
  return int_dot_linear<Int8>(x, w, N, encoding);
}

#else

at::Tensor unsupported() {
  TORCH_CHECK(false, "the integer kernels need AVX512-VNNI (with AVX512BW and VL); this CPU or build lacks them");
}

at::Tensor int4_int8_linear(const at::Tensor&, const at::Tensor&, int64_t, int64_t) { return unsupported(); }
at::Tensor int8_int8_linear(const at::Tensor&, const at::Tensor&, int64_t, int64_t) { return unsupported(); }

#endif  // PAGEDSERVE_INT_DOT

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("int_dot_avx512_supported() -> bool", &avx512_supported);
  m.def("int4_int8_linear(Tensor x, Tensor w, int n, int encoding) -> Tensor", &int4_int8_linear);
  m.def("int8_int8_linear(Tensor x, Tensor w, int n, int encoding) -> Tensor", &int8_int8_linear);
}
