// MXFP4 weights times 8-bit activations in integer dot products (--cpu-arithmetic int8):
// y = x @ W^T, x bf16 [M, K], y bf16 [M, N], W in MXFP4 (e2m1 codes, an e8m0 scale per 32
// values along K), 4.25 bits a weight as stored. This is llama.cpp's arithmetic for MXFP4:
//
//   activations: per row and block of 32, d = amax / 127, q = round(x * (1 / d)) (RNE; d = 0
//                gives q = 0), as GGUF's Q8_0 blocks; c = 12 * sum(q)
//   weights:     twice the e2m1 value is an integer, 0, +-1, 2, 3, 4, 6, 8, 12, read as the
//                unsigned byte u = 2 e2m1 + 12 (VPDPBUSD multiplies unsigned by signed bytes)
//   per block:   s = sum_k u_k q_k - c = 2 sum_k e2m1_k q_k, exact in int32 in any order
//   per output:  acc = fma(float(s), 2^(e - 127) * (d / 2), acc) over the blocks in order
//
// So every (m, n) is computed by one fixed sequence of float operations on exact integers:
// the same bits whatever M, the tiling or the threads (a row alone or in any batch). The
// activations' rounding to 8 bits changes the numbers against bf16 (docs/cpu.md measures it).
// (|s| <= 32 * 12 * 127 < 2^24, so float(s) is exact; an e8m0 byte of 0 reads as a scale of
// 0 instead of 2^-127.)
//
// Layout (cpu_kernels/packing.py `pack_mxfp4_int8`): columns in groups of 16 (G =
// ceil(N / 16), the last padded with zero codes); one VPDPBUSD operand is 16 columns x 4
// consecutive k (byte 4c + t: column c, k = 4 quad + t), and one 64-byte chunk of nibbles
// holds two of them, so it widens with two shuffles:
//
//   nibbles [G][K/32][4][64]: chunk h of block b: byte j's low nibble = the code of column
//                            j / 4, k = 32 b + 8 h + j % 4; its high nibble the same at k + 4
//   scales  [G][K/32][16]:   the e8m0 byte of each column of the group's block

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// (AVX512-BF16 too: the output's rounding to bf16 is VCVTNEPS2BF16. A CPU with VNNI and no
// BF16, Ice Lake, builds the stub and reports no integer kernel.)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define PAGEDSERVE_INT8_DOT 1
#include <immintrin.h>
#endif

namespace {

bool int8_supported() {
#ifdef PAGEDSERVE_INT8_DOT
  return true;
#else
  return false;
#endif
}

#ifdef PAGEDSERVE_INT8_DOT

constexpr int64_t kBlock = 32;
constexpr int64_t kChunkBytes = 64, kChunks = 4;                  // nibble chunks per group block
constexpr int64_t kNibbleBytes = kChunkBytes * kChunks;           // 256 per group block
constexpr int64_t kPrefetchBlocks = 4;

// u = 2 e2m1 + 12 for codes 0..15, in each 128-bit lane (VPSHUFB looks up within lanes).
inline __m512i code_table() {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
}

struct Problem {
  const int8_t* xq;     // [M, K] activations' 8-bit values
  const float* xd;      // [M, blocks] each block's d / 2
  const int32_t* xc;    // [M, blocks] each block's 12 * sum(q)
  const uint8_t* w;     // nibbles, then scales
  uint16_t* out;        // [M, N] bf16 bits
  int64_t M, N, K, G, blocks;

  const uint8_t* nibbles(int64_t g, int64_t b) const { return w + (g * blocks + b) * kNibbleBytes; }
  const uint8_t* scales(int64_t g, int64_t b) const { return w + G * blocks * kNibbleBytes + (g * blocks + b) * 16; }
};

// Two operands (quads 2h and 2h + 1) of a group's block from one chunk of nibbles.
inline void widen(const uint8_t* chunk, __m512i table, __m512i& even, __m512i& odd) {
  const __m512i v = _mm512_loadu_si512(chunk);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  even = _mm512_shuffle_epi8(table, _mm512_and_si512(v, mask));
  odd = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
}

inline __m512i x_quad(const int8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }

// A group's block scales 2^(e - 127) as fp32 (the e8m0 byte shifted into the exponent field).
inline __m512 block_scales(const uint8_t* e) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bytes, 23));
}

inline void store_row(const Problem& p, int64_t m, int64_t g, __m512 acc) {
  const __m256i y = (__m256i)_mm512_cvtneps_pbh(acc);
  const int64_t n = 16 * g, valid = std::min<int64_t>(16, p.N - n);
  _mm256_mask_storeu_epi16(p.out + m * p.N + n, static_cast<__mmask16>((1u << valid) - 1), y);
}

// After block b's integer sums s: acc = fma(float(s - c), scale * d / 2, acc), per the top.
template <int R, int G>
inline void finish_block(const Problem& p, int64_t m0, int64_t g0, int64_t b, __m512i (&s)[R][G],
                         __m512 (&acc)[R][G]) {
  for (int j = 0; j < G; ++j) {
    const __m512 scale = block_scales(p.scales(g0 + j, b));
    for (int i = 0; i < R; ++i) {
      const int64_t at = (m0 + i) * p.blocks + b;
      const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[i][j], _mm512_set1_epi32(p.xc[at])));
      acc[i][j] = _mm512_fmadd_ps(f, _mm512_mul_ps(scale, _mm512_set1_ps(p.xd[at])), acc[i][j]);
    }
  }
}

// R rows x G groups, the weights widened in registers as they stream in.
template <int R, int G>
void tile_registers(const Problem& p, int64_t m0, int64_t g0) {
  __m512 acc[R][G];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const __m512i table = code_table();
  for (int64_t b = 0; b < p.blocks; ++b) {
    if (b + kPrefetchBlocks < p.blocks)
      for (int j = 0; j < G; ++j)
        for (int64_t off = 0; off < kNibbleBytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(p.nibbles(g0 + j, b + kPrefetchBlocks)) + off, _MM_HINT_T0);
    __m512i s[R][G];
    for (auto& row : s)
      for (auto& a : row) a = _mm512_setzero_si512();
    const int8_t* xb = p.xq + m0 * p.K + b * kBlock;
    for (int h = 0; h < kChunks; ++h) {
      for (int j = 0; j < G; ++j) {
        __m512i even, odd;
        widen(p.nibbles(g0 + j, b) + h * kChunkBytes, table, even, odd);
        for (int i = 0; i < R; ++i) {
          s[i][j] = _mm512_dpbusd_epi32(s[i][j], even, x_quad(xb + i * p.K + 8 * h));
          s[i][j] = _mm512_dpbusd_epi32(s[i][j], odd, x_quad(xb + i * p.K + 8 * h + 4));
        }
      }
    }
    finish_block<R, G>(p, m0, g0, b, s, acc);
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < G; ++j) store_row(p, m0 + i, g0 + j, acc[i][j]);
}

// Rows [0, M) of groups g (and g + 1 if G = 2), four rows a tile.
template <int G>
void all_rows(const Problem& p, int64_t g) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) tile_registers<4, G>(p, m, g);
  switch (p.M - m) {
    case 3: tile_registers<3, G>(p, m, g); break;
    case 2: tile_registers<2, G>(p, m, g); break;
    case 1: tile_registers<1, G>(p, m, g); break;
    default: break;
  }
}

// The activations' 8-bit blocks, per the top of the file: one row per task.
void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int8_t* q, float* d_half, int32_t* c) {
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* src = x + m * K + b * kBlock;
        auto load = [](const uint16_t* s) {
          return _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))), 16));
        };
        const __m512 lo = load(src), hi = load(src + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
        int8_t* dst = q + m * K + b * kBlock;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
        d_half[m * blocks + b] = d * 0.5f;
        c[m * blocks + b] = 12 * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      }
    }
  });
}

at::Tensor mxfp4_int8_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous 2-D bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1), G = (N + 15) / 16, blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && K > 0 && N > 0, "K must be a positive multiple of 32, N positive");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == G * blocks * (kNibbleBytes + 16),
              "packed MXFP4 weights: want ", G * blocks * (kNibbleBytes + 16), " bytes for N=", N, ", K=", K,
              ", got ", w.numel());
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * blocks);
  std::vector<int32_t> xc(M * blocks);
  quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, xq.data(), xd.data(), xc.data());
  const Problem p{xq.data(), xd.data(), xc.data(), w.data_ptr<uint8_t>(),
                  reinterpret_cast<uint16_t*>(out.data_ptr()), M, N, K, G, blocks};
  // Threads split the column groups, two at a time: each streams its share of the weights
  // once, every row tile rereading the pair's blocks from L2. (Widening a pair once into a
  // panel of bytes for many rows measured no faster at 512 rows.)
  at::parallel_for(0, (G + 1) / 2, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      if (G - 2 * s >= 2) all_rows<2>(p, 2 * s);
      else all_rows<1>(p, 2 * s);
    }
  });
  return out;
}

#else

at::Tensor mxfp4_int8_linear(const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "mxfp4_int8_linear needs AVX512-VNNI (with AVX512BW and VL); this CPU or build lacks it");
}

#endif  // PAGEDSERVE_INT8_DOT

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("int8_dot_supported() -> bool", &int8_supported);
  m.def("mxfp4_int8_linear(Tensor x, Tensor w, int n) -> Tensor", &mxfp4_int8_linear);
}
