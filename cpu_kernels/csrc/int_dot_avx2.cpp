// csrc/int_dot.cpp's two ops (int4 or int8 weights times 8-bit activations, W4A8 and W8A8)
// for CPUs without AVX512-VNNI: AVX2, or AVX-VNNI where the CPU has it (Intel's cores from
// Alder Lake on). The same packed records (int_dot_format.pack) and the same bits as
// int_dot.cpp and int_dot_format.reference, per row m, block b, column n:
//
//   activations: d = amax / 127, a = round(x * (1 / d)) (RNE; d = 0 gives a = 0),
//                e = float(sum(a)) * d        the same float32 operations as int_dot.cpp's
//   s       = sum_k q_k a_k                   exact in int32, whatever the instructions:
//     int4, AVX2:  VPMADDUBSW(q, a): q 0..15 unsigned, a -127..127 -> int16 pairs of at most
//                  2 x 15 x 127 = 3810; a block's 8 of them (4 chunks, low and high nibbles)
//                  add in int16 to at most 30480 < 2^15, then VPMADDWD by ones -> int32
//     int8, AVX2:  stored q + 128 would saturate VPMADDUBSW (2 x 255 x 127 > 2^15). q = byte
//                  xor 0x80, and VPMADDUBSW(|q|, a * sign(q)) (VPSIGNB, as llama.cpp) gives
//                  pairs of at most 2 x 128 x 127 = 32512 (|-128| is 0x80: 128 unsigned), then
//                  VPMADDWD by ones -> int32 per chunk
//     AVX-VNNI:    VPDPBUSD as int_dot.cpp: q (int4) or q + 128 (int8, less 128 * sum(a))
//   acc     = acc + float(s) * (scale * d)
//   acc     = acc + zero * e                  (int4 only)
//   y       = acc, or bf16(acc) (RNE), acc from 0 over the blocks in order
//
// The float operations are int_dot.cpp's, each rounded on its own (no fma), on 8 lanes instead
// of 16: a float32 lane's result does not depend on the vector's width, so the bits match.
//
// Layout: int_dot.cpp's records, each 64-byte chunk (16 columns x 4 k: byte 4c + t) read as
// two 32-byte halves, columns 0..7 and 8..15; the 16 scales (and zeros) likewise.
//
// No AVX-512 here: compile.py builds this family with -mno-avx512f, since a target attribute
// only adds instructions to -march=native's, so an AVX-512 machine tests the very
// instructions an AVX2-only one runs. The kernels carry target attributes, so the family
// builds on any x86-64 compiler, and the ops ask the CPU (int_dot_avx2_supported).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int_dot.h"

#define PAGEDSERVE_AVX2 __attribute__((target("avx2,f16c")))
#define PAGEDSERVE_AVXVNNI __attribute__((target("avx2,f16c,avxvnni")))

namespace {

using namespace int_dot;

bool avx2_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

bool avxvnni_supported() { return avx2_supported() && __builtin_cpu_supports("avxvnni"); }

PAGEDSERVE_AVX2 inline __m256i x_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

PAGEDSERVE_AVX2 inline __m256i load_bytes(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 8 float32 values stored as float32 or fp16 (fp16 -> fp32 is exact).
PAGEDSERVE_AVX2 inline __m256 load_values(const uint8_t* at, int64_t encoding) {
  if (encoding == kFp32) return _mm256_loadu_ps(reinterpret_cast<const float*>(at));
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

// float32 -> bf16 bits, round to nearest even as torch rounds (NaN -> a quiet NaN).
PAGEDSERVE_AVX2 inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// A row's 16 columns of group g; the last group's padding columns are not written.
PAGEDSERVE_AVX2 inline void store_row(const Problem& p, int64_t m, int64_t g, const __m256 (&acc)[2]) {
  const int64_t n = 16 * g, valid = std::min<int64_t>(16, p.N - n);
  if (p.fp32) {
    float values[16];
    _mm256_storeu_ps(values, acc[0]);
    _mm256_storeu_ps(values + 8, acc[1]);
    std::memcpy(static_cast<float*>(p.out) + m * p.N + n, values, valid * sizeof(float));
  } else {
    uint16_t values[16];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(values), to_bf16(acc[0]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(values + 8), to_bf16(acc[1]));
    std::memcpy(static_cast<uint16_t*>(p.out) + m * p.N + n, values, valid * sizeof(uint16_t));
  }
}

// After block b's integer sums s, the float steps of the top, each rounded (int_dot.cpp's).
template <typename W, int R>
PAGEDSERVE_AVX2 inline void finish_block(const Problem& p, int64_t m0, int64_t g, int64_t b,
                                         const __m256i (&s)[R][2], __m256 (&acc)[R][2]) {
  const int64_t value_bytes = p.encoding == kFp32 ? 4 : 2;
  const uint8_t* sz = p.record(g, b) + W::kChunks * kChunkBytes;
  for (int j = 0; j < 2; ++j) {
    const __m256 scale = load_values(sz + 8 * j * value_bytes, p.encoding);
    __m256 zero = _mm256_setzero_ps();
    if constexpr (W::kZeros) {
      zero = load_values(sz + (16 + 8 * j) * value_bytes, p.encoding);
      if (p.encoding == kUnits) zero = _mm256_mul_ps(scale, zero);  // exact: pack checked it
    }
    for (int i = 0; i < R; ++i) {
      const int64_t at = (m0 + i) * p.blocks + b;
      const __m256 sd = _mm256_mul_ps(scale, _mm256_set1_ps(p.xd[at]));
      acc[i][j] = _mm256_add_ps(acc[i][j], _mm256_mul_ps(_mm256_cvtepi32_ps(s[i][j]), sd));
      if constexpr (W::kZeros) acc[i][j] = _mm256_add_ps(acc[i][j], _mm256_mul_ps(zero, _mm256_set1_ps(p.xe[at])));
    }
  }
}

// Block b's exact integer sums for R rows x the group's two halves, in AVX2 (see the top).
template <typename W, int R>
PAGEDSERVE_AVX2 inline void block_sums_avx2(const Problem& p, int64_t m0, int64_t g, int64_t b,
                                            __m256i (&s)[R][2]) {
  const uint8_t* record = p.record(g, b);
  const int8_t* xb = p.xq + m0 * p.K + b * kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (W::kZeros) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256i pairs[R][2];  // int16, exact: at most 8 x 3810
    for (int i = 0; i < R; ++i) pairs[i][0] = pairs[i][1] = _mm256_setzero_si256();
    for (int h = 0; h < W::kChunks; ++h) {
      for (int j = 0; j < 2; ++j) {
        const __m256i v = load_bytes(record + h * kChunkBytes + 32 * j);
        const __m256i lo = _mm256_and_si256(v, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int i = 0; i < R; ++i) {
          const int8_t* xr = xb + i * p.K + 4 * h;
          const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_quad(xr)),
                                                _mm256_maddubs_epi16(hi, x_quad(xr + 16)));
          pairs[i][j] = _mm256_add_epi16(pairs[i][j], both);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < 2; ++j) s[i][j] = _mm256_madd_epi16(pairs[i][j], ones);
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = _mm256_setzero_si256();
    for (int h = 0; h < W::kChunks; ++h) {
      for (int j = 0; j < 2; ++j) {
        const __m256i q = _mm256_xor_si256(load_bytes(record + h * kChunkBytes + 32 * j), flip);
        const __m256i magnitude = _mm256_sign_epi8(q, q);
        for (int i = 0; i < R; ++i) {
          const __m256i signed_x = _mm256_sign_epi8(x_quad(xb + i * p.K + 4 * h), q);
          s[i][j] = _mm256_add_epi32(s[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
        }
      }
    }
  }
}

// The same sums in AVX-VNNI, as int_dot.cpp's VPDPBUSD: two chains each (int4: the low and
// the high nibbles; int8: even and odd chunks) hide its latency.
template <typename W, int R>
PAGEDSERVE_AVXVNNI inline void block_sums_avxvnni(const Problem& p, int64_t m0, int64_t g, int64_t b,
                                                  __m256i (&s)[R][2]) {
  __m256i s2[R][2];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 2; ++j) s[i][j] = s2[i][j] = _mm256_setzero_si256();
  const uint8_t* record = p.record(g, b);
  const int8_t* xb = p.xq + m0 * p.K + b * kBlock;
  if constexpr (W::kZeros) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < W::kChunks; ++h) {
      for (int j = 0; j < 2; ++j) {
        const __m256i v = load_bytes(record + h * kChunkBytes + 32 * j);
        const __m256i lo = _mm256_and_si256(v, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int i = 0; i < R; ++i) {
          s[i][j] = _mm256_dpbusd_avx_epi32(s[i][j], lo, x_quad(xb + i * p.K + 4 * h));
          s2[i][j] = _mm256_dpbusd_avx_epi32(s2[i][j], hi, x_quad(xb + i * p.K + 16 + 4 * h));
        }
      }
    }
  } else {
    for (int h = 0; h < W::kChunks; h += 2) {
      for (int j = 0; j < 2; ++j) {
        const __m256i v0 = load_bytes(record + h * kChunkBytes + 32 * j);
        const __m256i v1 = load_bytes(record + (h + 1) * kChunkBytes + 32 * j);
        for (int i = 0; i < R; ++i) {
          s[i][j] = _mm256_dpbusd_avx_epi32(s[i][j], v0, x_quad(xb + i * p.K + 4 * h));
          s2[i][j] = _mm256_dpbusd_avx_epi32(s2[i][j], v1, x_quad(xb + i * p.K + 4 * h + 4));
        }
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m256i offset = _mm256_set1_epi32(W::kZeros ? 0 : p.xs[(m0 + i) * p.blocks + b]);
    for (int j = 0; j < 2; ++j) s[i][j] = _mm256_sub_epi32(_mm256_add_epi32(s[i][j], s2[i][j]), offset);
  }
}

// R rows x group g over every block. One tile per instruction set: the AVX-VNNI sums inline
// only into a function compiled for AVX-VNNI.
template <typename W, int R>
PAGEDSERVE_AVX2 void tile_avx2(const Problem& p, int64_t m0, int64_t g) {
  __m256 acc[R][2];
  for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m256i s[R][2];
    block_sums_avx2<W, R>(p, m0, g, b, s);
    finish_block<W, R>(p, m0, g, b, s, acc);
  }
  for (int i = 0; i < R; ++i) store_row(p, m0 + i, g, acc[i]);
}

template <typename W, int R>
PAGEDSERVE_AVXVNNI void tile_avxvnni(const Problem& p, int64_t m0, int64_t g) {
  __m256 acc[R][2];
  for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m256i s[R][2];
    block_sums_avxvnni<W, R>(p, m0, g, b, s);
    finish_block<W, R>(p, m0, g, b, s, acc);
  }
  for (int i = 0; i < R; ++i) store_row(p, m0 + i, g, acc[i]);
}

template <typename W, bool kVnni, int R>
void tile(const Problem& p, int64_t m0, int64_t g) {
  if constexpr (kVnni) tile_avxvnni<W, R>(p, m0, g);
  else tile_avx2<W, R>(p, m0, g);
}

// Rows [0, M) of group g, four rows a tile. 4 rows x 16 columns spill some of the 16 ymm
// registers to the stack, yet measured 3-7% faster on the Zen 4 VM than tiles of 2 x 16 or
// 4 x 8 (one half of the group after the other).
template <typename W, bool kVnni>
void all_rows(const Problem& p, int64_t g) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) tile<W, kVnni, 4>(p, m, g);
  switch (p.M - m) {
    case 3: tile<W, kVnni, 3>(p, m, g); break;
    case 2: tile<W, kVnni, 2>(p, m, g); break;
    case 1: tile<W, kVnni, 1>(p, m, g); break;
    default: break;
  }
}

PAGEDSERVE_AVX2 inline __m256 load8(const float* s) { return _mm256_loadu_ps(s); }

PAGEDSERVE_AVX2 inline __m256 load8(const uint16_t* s) {
  const __m128i bf16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16));
}

PAGEDSERVE_AVX2 inline float max_lane(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

PAGEDSERVE_AVX2 inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// One row's 8-bit blocks, per the top of the file (int_dot.cpp's quantize_row).
template <typename T>
PAGEDSERVE_AVX2 void quantize_row(const T* x, int64_t blocks, int8_t* q, float* d_out, float* e_out,
                                  int32_t* s_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    for (int t = 0; t < 4; ++t) v[t] = load8(x + b * kBlock + 8 * t);
    const __m256 max01 = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
    const __m256 max23 = _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]));
    const float amax = max_lane(_mm256_max_ps(max01, max23));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    __m256i a[4];
    for (int t = 0; t < 4; ++t) a[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], _mm256_set1_ps(id)));
    // int32 -> int8, saturating as int_dot.cpp's VPMOVSDB; the packs interleave the 128-bit
    // lanes (dwords a0 a1 a2 a3 of lane 0, then of lane 1), the permute restores k's order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), ordered);
    const int32_t sum = sum_lanes(_mm256_add_epi32(_mm256_add_epi32(a[0], a[1]), _mm256_add_epi32(a[2], a[3])));
    d_out[b] = d;
    e_out[b] = static_cast<float>(sum) * d;
    s_out[b] = 128 * sum;
  }
}

template <typename W, bool kVnni>
at::Tensor int_dot_linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t encoding) {
  TORCH_CHECK(kVnni ? avxvnni_supported() : avx2_supported(),
              kVnni ? "the AVX-VNNI integer kernels need AVX-VNNI, AVX2 and F16C, which this CPU lacks"
                    : "the AVX2 integer kernels need AVX2 and F16C, which this CPU lacks");
  return linear<W>(
      x, w, N, encoding, [](const auto* row, int64_t blocks, int8_t* q, float* d, float* e,
                            int32_t* s) { quantize_row(row, blocks, q, d, e, s); },
      [](const Problem& p, int64_t g) { all_rows<W, kVnni>(p, g); });
}

at::Tensor int4_int8_linear_avx2(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t encoding) {
  return int_dot_linear<Int4, false>(x, w, N, encoding);
}

at::Tensor int8_int8_linear_avx2(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t encoding) {
  return int_dot_linear<Int8, false>(x, w, N, encoding);
}

at::Tensor int4_int8_linear_avxvnni(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t encoding) {
  return int_dot_linear<Int4, true>(x, w, N, encoding);
}

at::Tensor int8_int8_linear_avxvnni(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t encoding) {
  return int_dot_linear<Int8, true>(x, w, N, encoding);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("int_dot_avx2_supported() -> bool", &avx2_supported);
  m.def("int_dot_avxvnni_supported() -> bool", &avxvnni_supported);
  m.def("int4_int8_linear_avx2(Tensor x, Tensor w, int n, int encoding) -> Tensor", &int4_int8_linear_avx2);
  m.def("int8_int8_linear_avx2(Tensor x, Tensor w, int n, int encoding) -> Tensor", &int8_int8_linear_avx2);
  m.def("int4_int8_linear_avxvnni(Tensor x, Tensor w, int n, int encoding) -> Tensor", &int4_int8_linear_avxvnni);
  m.def("int8_int8_linear_avxvnni(Tensor x, Tensor w, int n, int encoding) -> Tensor", &int8_int8_linear_avxvnni);
}
