// Weight-only quantized linear layers for bfloat16 activations on CPUs with AVX512-BF16:
// y = x @ W^T, x bf16 [M, K], y bf16 [M, N], W in the int4/int8 blocks of 32 that GGUF's
// Q4_0/Q4_1/Q8_0 use, repacked at load by cpu_kernels/packing.py. Columns go in groups of
// 16 (G = ceil(N / 16)); one 32-byte vector of weights holds 16 columns x 2 consecutive k,
// the operand order of VDPBF16PS, so lanes are output columns and no horizontal sum is needed:
//
//   int4 quad t of block b (32 bytes): byte i: low nibble  = q[16g + i/2, 32b + 4t + i%2]
//                                              high nibble = q[16g + i/2, 32b + 4t + 2 + i%2]
//   int8 pair p of block b (32 bytes): byte i = q[16g + i/2, 32b + 2p + i%2]
//
// Groups go in super-groups of 8 (the last may be narrower, width w), interleaved at the
// grain the decode tile reads them, so that it reads one sequential stream:
//
//   super-group, block b:  int4: quad 0 of its w groups, quad 1, ..., quad 7,
//                                then w x 16 fp16 scales, then w x 16 fp16 zeros
//                          int8: pair 0 of its w groups, ..., pair 15, then w x 16 fp32 scales
//
//   w = scale * q (+ zero)       y[m, n] = sum_b scale[n,b] * dot_b(x[m], q[n]) + zero[n,b] * xsum[m,b]
//
// fp4 (MXFP4's e2m1, gpt-oss's experts): the int4 layout whose nibbles index the e2m1 values
// (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) instead of 0..15, with zeros 0 and the
// block's power-of-two scale: every product stays exact, the same sums as for int4.
//
// An int4 layer's zeros are either fp16 values (GGUF) or, for checkpoints whose zero is
// -scale * z with an integer z (GPTQ, AWQ; `zero_units`), the fp16 integers -z, multiplied
// by the scale in fp32 (exact) where they are read: see zeros_of.
//
// Quantized values 0..15 and -127..127 are exact in bf16 and bf16 x bf16 products are exact
// in fp32, so every term is exact and only the fp32 accumulation rounds: this is the product
// of the bf16 activations with the effective weights, computed in fp32 (up to one rounding
// of scale * q + zero, which the factored form does not perform).
//
// Batch invariance: element (m, n) is always the same sequence of operations. Per block b:
// t = 0; t = dpbf16(t, x pair p, w pair p) for p = 0..15; acc = fma(t, scale, acc);
// int4: acc = fma(zero, xsum[m, b], acc). The in-register path (few rows: decoding) and the
// panel path (many rows: prefill, big batches) run that same sequence, whatever M, the
// tiling or the threads.
//
// AMX arithmetic (CPUs with AMX-BF16; chosen per machine by cpu_kernels/dispatch.py, never
// per call). The factored form above needs each block's dot product apart, which on the tiles
// means a store and reload of every 16 x 16 block product: the vector units, not the tiles,
// then set the pace (about 600 GFLOPS on two Sapphire Rapids cores, a third of oneDNN's dense
// bf16). So in AMX arithmetic the weights are first dequantized, w = q * scale + zero in fp32
// as QuantizedTensor.dequantize() computes it, then rounded to bf16 (what a dense bf16 model
// of the dequantized weights holds), and the tiles accumulate x . w over all of K:
//
//   y[m, n] = acc after the blocks b = 0, 1, ...:  acc = acc + (t_even + t_odd)
//
// where t_even and t_odd are block b's even-k and odd-k products, each summed in k order:
// how TDPBF16PS forms one block (measured on Sapphire Rapids-class Xeons; the SDM's
// pseudocode says the same). Many rows: tiles over dequantized panels; one row: VDPBF16PS
// over x pairs with one element zeroed, so that each sum takes one product at a time, bitwise
// the same. A row's result depends only on the machine's choice, never on M.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_BF16_DOT 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDSERVE_AMX 1
#endif
#include "bf16_tiles.h"
#endif

namespace {

#ifdef PAGEDSERVE_BF16_DOT

constexpr int64_t kBlock = 32;
constexpr int64_t kPanelRows = 16;   // from this many rows on, unpack weights once into a panel
// AMX arithmetic: from this many rows on, tiles (a partial tile pads its rows); one row runs
// the split register path (at 2 rows the tiles were already faster: 57 against 70-100 us
// for 960 x 576 on two Sapphire Rapids cores).
constexpr int64_t kAmxTileFromRows = 2;
constexpr int64_t kMChunk = 128;     // rows of x kept in L2 while a thread sweeps its columns
constexpr int kPanelGroups = 2;      // column groups per panel strip (32 columns)
constexpr int kPanelTileRows = 5;    // a panel tile: 5 rows x 2 groups, 20 registers accumulating (6 rows spill)
constexpr int64_t kPrefetchBlocks = 4;  // how far ahead the few-rows path asks for weights

using bh = __m512bh;

constexpr int64_t kSuperGroup = 8;  // groups interleaved vector by vector

// Where one group's block lives: its weight vectors (quads or pairs) `stride` bytes apart,
// then its scales and (int4) zeros.
struct Slice {
  const uint8_t* values;
  int64_t stride;
  const uint8_t* scales;
  const uint8_t* zeros;
};

// Bytes of one group's block: int4 8 quads + 32 bytes of fp16 scales + 32 of fp16 zeros;
// int8 16 pairs + 64 bytes of fp32 scales.
inline int64_t bytes_per_group_block(bool int4) { return int4 ? 320 : 576; }

struct Problem {
  const uint16_t* x;   // [M, K] bf16 bits
  const uint8_t* w;    // packed weights
  const float* xsum;   // [M, blocks] (int4)
  uint16_t* out;       // [M, N] bf16 bits
  int64_t M, N, K, G, blocks;
  bool int4;
  bool amx = false;  // AMX arithmetic (see the top of the file)
  bool zero_units = false;  // int4 zeros stored in units of the scale (see zeros_of)
  bool fp4 = false;  // int4 nibbles are e2m1 codes (see the top of the file)

  int64_t group_block_bytes() const { return bytes_per_group_block(int4); }

  Slice slice(int64_t g, int64_t b) const {
    const int64_t first = g / kSuperGroup * kSuperGroup, width = std::min(kSuperGroup, G - first);
    const int64_t vectors = int4 ? 8 : 16, lane = g - first;
    const uint8_t* row = w + (first * blocks + b * width) * group_block_bytes();
    const uint8_t* scales = row + vectors * width * 32 + lane * (int4 ? 32 : 64);
    return {row + lane * 32, width * 32, scales, int4 ? scales + width * 32 : nullptr};
  }
};

inline __m512 scales_of(const Slice& s, bool int4) {
  if (int4) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.scales)));
  return _mm512_loadu_ps(reinterpret_cast<const float*>(s.scales));
}

// A block's int4 zero points in fp32. Stored as fp16 values (GGUF: zero = m, or -8 d), or
// with `units` as fp16 multiples of the scale (GPTQ/AWQ: zero = scale * -z, whose 15
// significant bits fp16 cannot hold, but -z (0..-15) it can): then zero = scale * (-z),
// exact in fp32, the same float32 zero QuantizedTensor holds, so every sum below is the one
// an fp32-zero layout would give, for the same bytes as GGUF's.
inline __m512 zeros_of(const Slice& s, __m512 scale, bool units) {
  const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.zeros)));
  return units ? _mm512_mul_ps(z, scale) : z;
}

// bf16 bit patterns of 0..15, or (fp4) of the e2m1 values (the rest of the 32-entry table is unused).
constexpr uint16_t kE2M1Bits[16] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
inline __m512i nibble_table(bool fp4) {
  alignas(64) static const uint16_t ints[32] = {
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  alignas(64) static const uint16_t e2m1[32] = {
      kE2M1Bits[0], kE2M1Bits[1], kE2M1Bits[2], kE2M1Bits[3], kE2M1Bits[4], kE2M1Bits[5], kE2M1Bits[6],
      kE2M1Bits[7], kE2M1Bits[8], kE2M1Bits[9], kE2M1Bits[10], kE2M1Bits[11], kE2M1Bits[12], kE2M1Bits[13],
      kE2M1Bits[14], kE2M1Bits[15]};
  return _mm512_load_si512(fp4 ? e2m1 : ints);
}

// 32 packed bytes -> two vectors of 16 columns x 2 k, as bf16: pairs 2t and 2t+1 of a quad.
inline void unpack_int4_quad(const uint8_t* src, __m512i table, bh& lo, bh& hi) {
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i mask = _mm512_set1_epi16(0x0F);
  lo = (bh)_mm512_permutexvar_epi16(_mm512_and_si512(words, mask), table);
  hi = (bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
}

// 32 int8 -> one vector of 16 columns x 2 k, as bf16 (exact: |q| <= 127).
inline bh unpack_int8_pair(const uint8_t* src) {
  const __m128i* p = reinterpret_cast<const __m128i*>(src);
  const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
  const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
  return _mm512_cvtne2ps_pbh(b, a);  // a -> elements 0..15, b -> 16..31
}

// AMX arithmetic: quantized values q (16 columns x 2 k) -> w = q * scale + zero (int4) or
// q * scale (int8) in fp32, per column, rounded to bf16 (RNE, as torch's .bfloat16()).
inline bh dequantize(bh q, __m512 scale, __m512 zero, bool int4) {
  const __m512i v = (__m512i)q;
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  const __m512 we = int4 ? _mm512_fmadd_ps(even, scale, zero) : _mm512_mul_ps(even, scale);
  const __m512 wo = int4 ? _mm512_fmadd_ps(odd, scale, zero) : _mm512_mul_ps(odd, scale);
  // cvtne2ps puts we in elements 0..15 and wo in 16..31; interleave them back into pairs.
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return (bh)_mm512_permutexvar_epi16(_mm512_load_si512(interleave), (__m512i)_mm512_cvtne2ps_pbh(wo, we));
}

// Keeps a loaded vector in its register: left alone, GCC reloads the weights for every row
// of a panel tile (10 loads per 10 dot products instead of 2), and the loads become the
// bottleneck (about 200 against 320 GFLOPS at 2,048 rows).
inline void pin(bh& v) { asm("" : "+v"(v)); }

using pagedserve_bf16::x_pair;

inline void store_row(const Problem& p, int64_t m, int64_t g, __m512 acc) {
  const __m256i y = (__m256i)_mm512_cvtneps_pbh(acc);
  const int64_t n = 16 * g, valid = std::min<int64_t>(16, p.N - n);
  _mm256_mask_storeu_epi16(p.out + m * p.N + n, static_cast<__mmask16>((1u << valid) - 1), y);
}

// After block b's dot products t: the block's scale and (int4) zero-point terms. (The
// groups' slices are found here, not held across the dot products: that would take
// registers the inner loop needs.)
template <int R, int G>
inline void finish_block(const Problem& p, int64_t m0, int64_t g0, int64_t b, __m512 (&t)[R][G],
                         __m512 (&acc)[R][G]) {
  for (int j = 0; j < G; ++j) {
    const Slice r = p.slice(g0 + j, b);
    const __m512 s = scales_of(r, p.int4);
    for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(t[i][j], s, acc[i][j]);
    if (p.int4) {
      const __m512 z = zeros_of(r, s, p.zero_units);
      for (int i = 0; i < R; ++i)
        acc[i][j] = _mm512_fmadd_ps(z, _mm512_set1_ps(p.xsum[(m0 + i) * p.blocks + b]), acc[i][j]);
    }
  }
}

// Ask for block b of the tile's groups ahead of use: the few-rows path streams the weights
// from memory, and each call's stream is too short for the hardware prefetcher to ramp up.
// A tile may straddle two super-groups: each has its own row of the block.
template <int G>
inline void prefetch_block(const Problem& p, int64_t g0, int64_t b) {
  if (b >= p.blocks) return;
  for (int64_t g = g0; g < g0 + G; g = (g / kSuperGroup + 1) * kSuperGroup) {
    const int64_t first = g / kSuperGroup * kSuperGroup, width = std::min(kSuperGroup, p.G - first);
    const char* row = reinterpret_cast<const char*>(p.w + (first * p.blocks + b * width) * p.group_block_bytes());
    for (int64_t off = 0; off < width * p.group_block_bytes(); off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
  }
}

// R rows x G groups, weights unpacked in registers: for few rows, where each unpacked
// weight serves R products. G groups give R*G independent dot-product chains.
template <int R, int G>
void tile_registers(const Problem& p, int64_t m0, int64_t g0) {
  __m512 acc[R][G];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const __m512i table = nibble_table(p.fp4);
  for (int64_t b = 0; b < p.blocks; ++b) {
    prefetch_block<G>(p, g0, b + kPrefetchBlocks);
    const uint8_t* v[G];  // each group's first weight vector of the block
    int64_t stride[G];
    for (int j = 0; j < G; ++j) {
      const Slice r = p.slice(g0 + j, b);
      v[j] = r.values, stride[j] = r.stride;
    }
    __m512 t[R][G];
    for (auto& row : t)
      for (auto& a : row) a = _mm512_setzero_ps();
    const uint16_t* xb = p.x + m0 * p.K + b * kBlock;
    if (p.int4) {
      for (int quad = 0; quad < 8; ++quad) {
        for (int j = 0; j < G; ++j) {
          bh lo, hi;
          unpack_int4_quad(v[j] + quad * stride[j], table, lo, hi);
          for (int i = 0; i < R; ++i) {
            t[i][j] = _mm512_dpbf16_ps(t[i][j], x_pair(xb + i * p.K + 4 * quad), lo);
            t[i][j] = _mm512_dpbf16_ps(t[i][j], x_pair(xb + i * p.K + 4 * quad + 2), hi);
          }
        }
      }
    } else {
      for (int pair = 0; pair < 16; ++pair) {
        for (int j = 0; j < G; ++j) {
          const bh w = unpack_int8_pair(v[j] + pair * stride[j]);
          for (int i = 0; i < R; ++i) t[i][j] = _mm512_dpbf16_ps(t[i][j], x_pair(xb + i * p.K + 2 * pair), w);
        }
      }
    }
    finish_block<R, G>(p, m0, g0, b, t, acc);
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < G; ++j) store_row(p, m0 + i, g0 + j, acc[i][j]);
}

// AMX arithmetic, one row x G groups: the weights dequantized in registers, each block's
// even-k and odd-k products in separate sums (VDPBF16PS with one element of each x pair
// zeroed adds one product: xe[pair] holds x[2 pair] alone, xo[pair] x[2 pair + 1] alone),
// then acc = acc + (t_even + t_odd), as the tiles form it.
template <int G>
void row_amx_arithmetic(const Problem& p, int64_t m, int64_t g0, const int32_t* xe, const int32_t* xo) {
  __m512 acc[G];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512i table = nibble_table(p.fp4);
  for (int64_t b = 0; b < p.blocks; ++b) {
    prefetch_block<G>(p, g0, b + kPrefetchBlocks);
    const int32_t* e = xe + 16 * b;
    const int32_t* o = xo + 16 * b;
    for (int j = 0; j < G; ++j) {
      const Slice r = p.slice(g0 + j, b);
      const __m512 s = scales_of(r, p.int4), z = p.int4 ? zeros_of(r, s, p.zero_units) : _mm512_setzero_ps();
      __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
      auto dot = [&](int pair, bh q) {
        const bh w = dequantize(q, s, z, p.int4);
        even = _mm512_dpbf16_ps(even, (bh)_mm512_set1_epi32(e[pair]), w);
        odd = _mm512_dpbf16_ps(odd, (bh)_mm512_set1_epi32(o[pair]), w);
      };
      if (p.int4) {
        for (int quad = 0; quad < 8; ++quad) {
          bh lo, hi;
          unpack_int4_quad(r.values + quad * r.stride, table, lo, hi);
          dot(2 * quad, lo);
          dot(2 * quad + 1, hi);
        }
      } else {
        for (int pair = 0; pair < 16; ++pair) dot(pair, unpack_int8_pair(r.values + pair * r.stride));
      }
      acc[j] = _mm512_add_ps(acc[j], _mm512_add_ps(even, odd));
    }
  }
  for (int j = 0; j < G; ++j) store_row(p, m, g0 + j, acc[j]);
}

// A group's weights as bf16 vectors, pair after pair: [K/2][32] words: the quantized values,
// or in AMX arithmetic (p.amx) the dequantized weights rounded to bf16.
void unpack_group(const Problem& p, int64_t g, uint16_t* dst) {
  const __m512i table = nibble_table(p.fp4);
  for (int64_t b = 0; b < p.blocks; ++b) {
    const Slice r = p.slice(g, b);
    const __m512 s = scales_of(r, p.int4), z = p.int4 ? zeros_of(r, s, p.zero_units) : _mm512_setzero_ps();
    auto put = [&](uint16_t* out, bh q) {
      _mm512_storeu_si512(out, (__m512i)(p.amx ? dequantize(q, s, z, p.int4) : q));
    };
    for (int i = 0; i < (p.int4 ? 8 : 16); ++i) {
      uint16_t* out = dst + (b * 16 + (p.int4 ? 2 * i : i)) * 32;
      if (p.int4) {
        bh lo, hi;
        unpack_int4_quad(r.values + i * r.stride, table, lo, hi);
        put(out, lo);
        put(out + 32, hi);
      } else {
        put(out, unpack_int8_pair(r.values + i * r.stride));
      }
    }
  }
}

// R rows x G groups from unpacked weights: each weight load serves R products.
template <int R, int G>
void tile_panel(const Problem& p, int64_t m0, int64_t g0, const uint16_t* panel) {
  __m512 acc[R][G];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const int64_t pairs = p.K / 2;
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m512 t[R][G];
    for (auto& row : t)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t pair = 16 * b; pair < 16 * (b + 1); ++pair) {
      bh w[G];
      for (int j = 0; j < G; ++j) {
        w[j] = (bh)_mm512_loadu_si512(panel + (j * pairs + pair) * 32);
        pin(w[j]);
      }
      for (int i = 0; i < R; ++i) {
        const bh xv = x_pair(p.x + (m0 + i) * p.K + 2 * pair);
        for (int j = 0; j < G; ++j) t[i][j] = _mm512_dpbf16_ps(t[i][j], xv, w[j]);
      }
    }
    finish_block<R, G>(p, m0, g0, b, t, acc);
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < G; ++j) store_row(p, m0 + i, g0 + j, acc[i][j]);
}

template <int G>
void panel_rows(const Problem& p, int64_t m0, int64_t m1, int64_t g0, const uint16_t* panel) {
  int64_t m = m0;
  for (; m + kPanelTileRows <= m1; m += kPanelTileRows) tile_panel<kPanelTileRows, G>(p, m, g0, panel);
  switch (m1 - m) {
    case 4: tile_panel<4, G>(p, m, g0, panel); break;
    case 3: tile_panel<3, G>(p, m, g0, panel); break;
    case 2: tile_panel<2, G>(p, m, g0, panel); break;
    case 1: tile_panel<1, G>(p, m, g0, panel); break;
    default: break;
  }
}

// Rows [m0, m1) x groups [g0, g1) for many rows: strips of kPanelGroups groups unpacked once.
void many_rows(const Problem& p, int64_t m0, int64_t m1, int64_t g0, int64_t g1, uint16_t* panel) {
  const int64_t group_words = p.K / 2 * 32;
  for (int64_t g = g0; g < g1; g += kPanelGroups) {
    const int64_t count = std::min<int64_t>(kPanelGroups, g1 - g);
    for (int64_t j = 0; j < count; ++j) unpack_group(p, g + j, panel + j * group_words);
    if (count == 2) panel_rows<2>(p, m0, m1, g, panel);
    else panel_rows<1>(p, m0, m1, g, panel);
  }
}

#ifdef PAGEDSERVE_AMX
// --- AMX tiles: dequantized bf16 panels, products accumulated over all of K ------------------
// Tiles 0 and 3: 16 rows of x each, one block (16 x 64 bytes). Tiles 1, 2: one block of the
// strip's two groups (16 pairs x 16 columns x 2: the panel's layout as it is). Tiles 4-7: the
// 16 x 16 fp32 sums of (row tile, group), kept in the tiles until the last block.

using pagedserve_bf16::configure_tiles;
using pagedserve_bf16::kTileRows;

// One or two 16-row tiles of x (a0, a1: x itself, or a zero-padded copy of its last rows;
// stride K) x a strip of Count groups at g0 ([Count][K/2][32] words of dequantized weights).
// Stores rows0 rows from m, then rows1 from m + 16 (rows1 = 0: one row tile).
template <int Count>
void amx_tile(const Problem& p, int64_t m, const uint16_t* a0, int64_t rows0, const uint16_t* a1, int64_t rows1,
              const uint16_t* strip, int64_t g0) {
  const int64_t stride = p.K * 2, pairs = p.K / 2;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t b = 0; b < p.blocks; ++b) {
    const uint16_t* w = strip + 16 * b * 32;
    _tile_loadd(0, a0 + b * kBlock, stride);
    _tile_loadd(1, w, 64);
    if constexpr (Count == 2) _tile_loadd(2, w + pairs * 32, 64);
    _tile_dpbf16ps(4, 0, 1);
    if constexpr (Count == 2) _tile_dpbf16ps(5, 0, 2);
    if (rows1 > 0) {
      _tile_loadd(3, a1 + b * kBlock, stride);
      _tile_dpbf16ps(6, 3, 1);
      if constexpr (Count == 2) _tile_dpbf16ps(7, 3, 2);
    }
  }
  alignas(64) float c[4][256];
  _tile_stored(4, c[0], 64);
  _tile_stored(5, c[1], 64);
  _tile_stored(6, c[2], 64);
  _tile_stored(7, c[3], 64);
  for (int j = 0; j < Count; ++j) {
    for (int64_t i = 0; i < rows0; ++i) store_row(p, m + i, g0 + j, _mm512_load_ps(c[j] + i * 16));
    for (int64_t i = 0; i < rows1; ++i) store_row(p, m + 16 + i, g0 + j, _mm512_load_ps(c[2 + j] + i * 16));
  }
}

// Rows [m0, m1) x groups [g0, g1) on the tiles: strips of kPanelGroups groups dequantized once
// per chunk of rows (or read from an int8 layer's dequantized copy, `unpacked`), row tiles in
// pairs. `tail`: x's rows from the last multiple of 16 on, zero-padded to 16 rows (each row's
// sums depend on that row alone).
void amx_strips(const Problem& p, int64_t m0, int64_t m1, int64_t g0, int64_t g1, const uint16_t* unpacked,
                uint16_t* panel, const uint16_t* tail) {
  const int64_t group_words = p.K / 2 * 32, full = p.M / kTileRows * kTileRows;
  auto rows_at = [&](int64_t m) { return m < full ? p.x + m * p.K : tail; };
  for (int64_t g = g0; g < g1; g += kPanelGroups) {
    const int64_t count = std::min<int64_t>(kPanelGroups, g1 - g);
    const uint16_t* strip = unpacked ? unpacked + g * group_words : panel;
    if (!unpacked)
      for (int64_t j = 0; j < count; ++j) unpack_group(p, g + j, panel + j * group_words);
    for (int64_t m = m0; m < m1; m += 2 * kTileRows) {
      const int64_t rows0 = std::min(kTileRows, m1 - m), rows1 = std::clamp<int64_t>(m1 - m - kTileRows, 0, kTileRows);
      const uint16_t* a1 = rows1 > 0 ? rows_at(m + kTileRows) : nullptr;
      if (count == 2) amx_tile<2>(p, m, rows_at(m), rows0, a1, rows1, strip, g);
      else amx_tile<1>(p, m, rows_at(m), rows0, a1, rows1, strip, g);
    }
  }
}

// All rows x groups [g0, g1) on this thread's tiles, in chunks of kMChunk rows (amx_strips).
void amx_rows(const Problem& p, int64_t g0, int64_t g1, const uint16_t* unpacked, uint16_t* panel,
              const uint16_t* tail) {
  configure_tiles();
  for (int64_t m0 = 0; m0 < p.M; m0 += kMChunk)
    amx_strips(p, m0, std::min(p.M, m0 + kMChunk), g0, g1, unpacked, panel, tail);
  _tile_release();
}

// x's rows from the last multiple of 16 on, zero-padded to 16 rows (empty if M is a multiple).
std::vector<uint16_t> padded_tail(const Problem& p) {
  const int64_t full = p.M / kTileRows * kTileRows;
  if (full == p.M) return {};
  std::vector<uint16_t> tail(kTileRows * p.K, 0);
  std::memcpy(tail.data(), p.x + full * p.K, (p.M - full) * p.K * 2);
  return tail;
}
#endif

// Each row count gets as many groups as keep R*G chains in flight within 32 registers.
// Leftover groups go in tiles of G/2, G/4, ...: a lone group is one dependent chain.
template <int R, int G>
void groups_by(const Problem& p, int64_t m, int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + G <= g1; g += G) tile_registers<R, G>(p, m, g);
  if constexpr (G > 1) groups_by<R, G / 2>(p, m, g, g1);
}

// The same for one row from a layer's dequantized copy ([G][K/2][32] words): no dequantizing
// per call, so a decoding row costs about what the VDPBF16PS arithmetic costs.
template <int G>
void row_amx_from_panel(const Problem& p, int64_t m, int64_t g0, const uint16_t* unpacked, const int32_t* xe,
                        const int32_t* xo) {
  __m512 acc[G];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const int64_t group_words = p.K / 2 * 32;
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m512 even[G], odd[G];
    for (int j = 0; j < G; ++j) even[j] = odd[j] = _mm512_setzero_ps();
    for (int pair = 0; pair < 16; ++pair) {
      const __m512i e = _mm512_set1_epi32(xe[16 * b + pair]), o = _mm512_set1_epi32(xo[16 * b + pair]);
      for (int j = 0; j < G; ++j) {
        const bh w = (bh)_mm512_loadu_si512(unpacked + (g0 + j) * group_words + (16 * b + pair) * 32);
        even[j] = _mm512_dpbf16_ps(even[j], (bh)e, w);
        odd[j] = _mm512_dpbf16_ps(odd[j], (bh)o, w);
      }
    }
    for (int j = 0; j < G; ++j) acc[j] = _mm512_add_ps(acc[j], _mm512_add_ps(even[j], odd[j]));
  }
  for (int j = 0; j < G; ++j) store_row(p, m, g0 + j, acc[j]);
}

// x's row m as its even and odd elements alone, one per 32-bit word (the other half zero).
void split_row(const Problem& p, int64_t m, int32_t* xe, int32_t* xo) {
  for (int64_t pair = 0; pair < p.K / 2; ++pair) {
    xe[pair] = p.x[m * p.K + 2 * pair];
    xo[pair] = static_cast<int32_t>(static_cast<uint32_t>(p.x[m * p.K + 2 * pair + 1]) << 16);
  }
}

template <int G>
void row_amx(const Problem& p, int64_t m, int64_t g0, const uint16_t* unpacked, const int32_t* xe, const int32_t* xo) {
  if (unpacked) row_amx_from_panel<G>(p, m, g0, unpacked, xe, xo);
  else row_amx_arithmetic<G>(p, m, g0, xe, xo);
}

// AMX arithmetic below the tiles' row count: each row on its own, 4 groups of sums at once,
// the weights dequantized in registers or read from a layer's dequantized copy (`unpacked`).
void rows_amx_arithmetic(const Problem& p, int64_t m0, int64_t m1, int64_t g0, int64_t g1,
                         const uint16_t* unpacked = nullptr) {
  std::vector<int32_t> xe(p.K / 2), xo(p.K / 2);
  for (int64_t m = m0; m < m1; ++m) {
    split_row(p, m, xe.data(), xo.data());
    int64_t g = g0;
    for (; g + 4 <= g1; g += 4) row_amx<4>(p, m, g, unpacked, xe.data(), xo.data());
    for (; g < g1; ++g) row_amx<1>(p, m, g, unpacked, xe.data(), xo.data());
  }
}

// Few rows: a chunk of groups at a time (while its weights stay in L2), every row over it.
void few_rows(const Problem& p, int64_t m0, int64_t m1, int64_t g0, int64_t g1) {
  if (p.amx) return rows_amx_arithmetic(p, m0, m1, g0, g1);
  for (int64_t c0 = g0; c0 < g1; c0 += kSuperGroup) {
    const int64_t c1 = std::min(g1, c0 + kSuperGroup);
    int64_t m = m0;
    // 5 rows in one tile rather than 4 + 1: the 1-row tile would unpack every weight again
    // for a single product. Speculative decoding verifies a token and 4 drafts: 5 rows.
    if ((m1 - m0) % 4 == 1 && m1 - m0 >= 5) {
      groups_by<5, 2>(p, m, c0, c1);
      m += 5;
    }
    for (; m + 4 <= m1; m += 4) groups_by<4, 2>(p, m, c0, c1);
    switch (m1 - m) {
      case 3: groups_by<3, 2>(p, m, c0, c1); break;
      case 2: groups_by<2, 4>(p, m, c0, c1); break;
      case 1: groups_by<1, 8>(p, m, c0, c1); break;
      default: break;
    }
  }
}

// xsum[m, b]: each block's sum of x in fp32, in one fixed order.
void block_sums(const Problem& p, float* xsum) {
  at::parallel_for(0, p.M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < p.blocks; ++b) {
        const uint16_t* xb = p.x + m * p.K + b * kBlock;
        auto widen = [](const uint16_t* src) {
          return _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
        };
        xsum[m * p.blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(widen(xb), widen(xb + 16)));
      }
    }
  });
}

bool amx_ready();

// Checks x and the packed weights, allocates `out` [M, N] and, for int4, fills `xsum`: what
// both entry points need before their tiles run.
Problem linear_problem(const at::Tensor& x, const at::Tensor& w, int64_t N, bool int4, bool amx, bool zero_units,
                       bool fp4, at::Tensor& out, std::vector<float>& xsum) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous 2-D bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1), G = (N + 15) / 16, blocks = K / kBlock,
                rec = bytes_per_group_block(int4);
  TORCH_CHECK(K % kBlock == 0 && K > 0 && N > 0, "K must be a positive multiple of 32, N positive");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == G * blocks * rec,
              "packed weights: want ", G * blocks * rec, " bytes for N=", N, ", K=", K, ", got ", w.numel());
  out = at::empty({M, N}, x.options());
  TORCH_CHECK(!amx || amx_ready(), "AMX arithmetic asked for, but this CPU or build cannot run AMX tiles");
  const bool sums = int4 && !amx;  // AMX arithmetic folds the zero point into the weights
  xsum.assign(sums ? M * blocks : 0, 0.f);
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr()), w.data_ptr<uint8_t>(), xsum.data(),
                  reinterpret_cast<uint16_t*>(out.data_ptr()), M, N, K, G, blocks, int4, amx, zero_units, fp4};
  if (sums && M > 0) block_sums(p, xsum.data());
  return p;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, int64_t N, bool int4, bool amx, bool zero_units,
                       bool fp4) {
  at::Tensor out;
  std::vector<float> xsum;
  const Problem p = linear_problem(x, w, N, int4, amx, zero_units, fp4, out, xsum);
  const int64_t M = p.M, K = p.K, G = p.G;
  if (M == 0) return out;
#ifdef PAGEDSERVE_AMX
  const std::vector<uint16_t> tail = amx ? padded_tail(p) : std::vector<uint16_t>{};
#endif
  // Threads split the column groups: each streams its share of the weights once per chunk of rows.
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    if (M < (amx ? kAmxTileFromRows : kPanelRows)) {
      few_rows(p, 0, M, g0, g1);
      return;
    }
    std::unique_ptr<uint16_t[]> panel(new uint16_t[kPanelGroups * K / 2 * 32]);  // filled before read
#ifdef PAGEDSERVE_AMX
    if (amx) {
      amx_rows(p, g0, g1, nullptr, panel.get(), tail.data());
      return;
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += kMChunk) many_rows(p, m0, std::min(M, m0 + kMChunk), g0, g1, panel.get());
  });
  return out;
}

// An int8 weight unpacked once, for good: each group's bf16 pairs as `unpack_group` writes
// them, [G][K/2][32] words. Unpacking int8 costs more than the dot products it feeds, so for
// a few rows (speculative decoding's verification, 2-15 rows) a layer that keeps this copy
// (twice its int8 bytes) runs the panel tiles straight from it. Same op sequence per element.
at::Tensor bf16_unpack(const at::Tensor& w, int64_t N, int64_t K, bool int4, bool amx, bool zero_units, bool fp4) {
  const int64_t G = (N + 15) / 16, blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && K > 0 && w.scalar_type() == at::kByte && w.is_contiguous() &&
              w.numel() == G * blocks * bytes_per_group_block(int4), "packed weights: wrong size for N, K");
  at::Tensor out = at::empty({G * K / 2 * 32}, at::TensorOptions().dtype(at::kBFloat16));
  const Problem p{nullptr, w.data_ptr<uint8_t>(), nullptr, nullptr, 0, N, K, G, blocks, int4, amx, zero_units, fp4};
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) unpack_group(p, g, dst + g * (K / 2 * 32));
  });
  return out;
}

at::Tensor bf16_linear_unpacked(const at::Tensor& x, const at::Tensor& w, const at::Tensor& unpacked,
                                int64_t N, bool int4, bool amx, bool zero_units, bool fp4) {
  at::Tensor out;
  std::vector<float> xsum;
  const Problem p = linear_problem(x, w, N, int4, amx, zero_units, fp4, out, xsum);
  const int64_t M = p.M, K = p.K, G = p.G;
  TORCH_CHECK(unpacked.scalar_type() == at::kBFloat16 && unpacked.is_contiguous() &&
              unpacked.numel() == G * K / 2 * 32, "unpacked weights: wrong size for N, K");
  if (M == 0) return out;
  const auto* panel = reinterpret_cast<const uint16_t*>(unpacked.data_ptr());
#ifdef PAGEDSERVE_AMX
  const std::vector<uint16_t> tail = amx ? padded_tail(p) : std::vector<uint16_t>{};
#endif
  const int64_t group_words = K / 2 * 32;
  // Strips of kPanelGroups groups, as many_rows takes them; threads split the strips.
  const int64_t strips = (G + kPanelGroups - 1) / kPanelGroups;
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
#ifdef PAGEDSERVE_AMX
    if (amx) {
      const int64_t g0 = s0 * kPanelGroups, g1 = std::min(G, s1 * kPanelGroups);
      if (M < kAmxTileFromRows) rows_amx_arithmetic(p, 0, M, g0, g1, panel);
      else amx_rows(p, g0, g1, panel, nullptr, tail.data());  // a partial tile pads its rows
      return;
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += kMChunk) {
      const int64_t m1 = std::min(M, m0 + kMChunk);
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t g = s * kPanelGroups;
        if (G - g >= 2) panel_rows<2>(p, m0, m1, g, panel + g * group_words);
        else panel_rows<1>(p, m0, m1, g, panel + g * group_words);
      }
    }
  });
  return out;
}

// A nibble's value: itself, or (fp4) its e2m1 value.
inline float nibble_value(int nibble, bool fp4) {
  if (!fp4) return static_cast<float>(nibble);
  uint32_t bits = static_cast<uint32_t>(kE2M1Bits[nibble]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Rows `ids` of a packed weight as bf16: w = q * scale (+ zero) in fp32, as
// QuantizedTensor.dequantize() computes it, then rounded. A tied embedding's lookup.
at::Tensor bf16_rows(const at::Tensor& w, const at::Tensor& ids, int64_t N, int64_t K, bool int4, bool zero_units,
                     bool fp4) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids: contiguous int64 [T]");
  const int64_t G = (N + 15) / 16, blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && K > 0 && w.scalar_type() == at::kByte && w.is_contiguous() &&
              w.numel() == G * blocks * bytes_per_group_block(int4), "packed weights: wrong size for N, K");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t) TORCH_CHECK(id[t] >= 0 && id[t] < N, "id ", id[t], " out of range");
  at::Tensor out = at::empty({ids.numel(), K}, at::TensorOptions().dtype(at::kBFloat16));
  const Problem p{nullptr, w.data_ptr<uint8_t>(), nullptr, nullptr, 0, N, K, G, blocks, int4};
  auto* dst = reinterpret_cast<at::BFloat16*>(out.data_ptr());
  at::parallel_for(0, ids.numel(), 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = id[t] / 16, lane = id[t] % 16;
      at::BFloat16* row = dst + t * K;
      for (int64_t b = 0; b < blocks; ++b) {
        const Slice s = p.slice(g, b);
        float scale, zero = 0.f;
        if (int4) {
          scale = static_cast<float>(reinterpret_cast<const at::Half*>(s.scales)[lane]);
          zero = static_cast<float>(reinterpret_cast<const at::Half*>(s.zeros)[lane]);
          if (zero_units) zero *= scale;
        } else {
          scale = reinterpret_cast<const float*>(s.scales)[lane];
        }
        for (int64_t v = 0; v < (int4 ? 8 : 16); ++v) {
          const uint8_t* bytes = s.values + v * s.stride + 2 * lane;
          for (int kk = 0; kk < 2; ++kk) {
            if (int4) {
              row[b * kBlock + 4 * v + kk] = static_cast<at::BFloat16>(nibble_value(bytes[kk] & 15, fp4) * scale + zero);
              row[b * kBlock + 4 * v + 2 + kk] = static_cast<at::BFloat16>(nibble_value(bytes[kk] >> 4, fp4) * scale + zero);
            } else {
              row[b * kBlock + 2 * v + kk] = static_cast<at::BFloat16>(static_cast<int8_t>(bytes[kk]) * scale);
            }
          }
        }
      }
    }
  });
  return out;
}

#else  // no AVX512-BF16: the Python side checks `bf16_supported` and never calls these

at::Tensor bf16_unpack(const at::Tensor&, int64_t, int64_t, bool, bool, bool, bool) {
  TORCH_CHECK(false, "bf16 quantized linear layers need AVX512-BF16, which this build lacks");
}

at::Tensor bf16_linear_unpacked(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool, bool, bool,
                                bool) {
  TORCH_CHECK(false, "bf16 quantized linear layers need AVX512-BF16, which this build lacks");
}

at::Tensor bf16_linear(const at::Tensor&, const at::Tensor&, int64_t, bool, bool, bool, bool) {
  TORCH_CHECK(false, "bf16 quantized linear layers need AVX512-BF16, which this build lacks");
}

at::Tensor bf16_rows(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool, bool, bool) {
  TORCH_CHECK(false, "bf16 quantized linear layers need AVX512-BF16, which this build lacks");
}

#endif

bool bf16_supported() {
#ifdef PAGEDSERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

// Whether AMX tiles run here: built for them (-march=native on a CPU with AMX-BF16) and the
// kernel granted this process the tile data state (bf16_tiles.h).
bool amx_ready() {
#ifdef PAGEDSERVE_AMX
  return pagedserve_bf16::amx_tiles_granted();
#else
  return false;
#endif
}

at::Tensor bf16_int4_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, bool amx, bool zero_units, bool fp4) {
  return bf16_linear(x, w, n, true, amx, zero_units, fp4);
}

at::Tensor bf16_int8_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, bool amx) {
  return bf16_linear(x, w, n, false, amx, false, false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("bf16_supported() -> bool", &bf16_supported);
  m.def("bf16_amx_ready() -> bool", &amx_ready);
  m.def("bf16_int4_linear(Tensor x, Tensor w, int n, bool amx=False, bool zero_units=False, bool fp4=False) -> Tensor",
        &bf16_int4_linear);
  m.def("bf16_int8_linear(Tensor x, Tensor w, int n, bool amx=False) -> Tensor", &bf16_int8_linear);
  m.def("bf16_rows(Tensor w, Tensor ids, int n, int k, bool int4, bool zero_units=False, bool fp4=False) -> Tensor",
        &bf16_rows);
  m.def("bf16_unpack(Tensor w, int n, int k, bool int4, bool amx=False, bool zero_units=False, bool fp4=False) -> "
        "Tensor", &bf16_unpack);
  m.def("bf16_linear_unpacked(Tensor x, Tensor w, Tensor unpacked, int n, bool int4, bool amx=False, "
        "bool zero_units=False, bool fp4=False) -> Tensor", &bf16_linear_unpacked);
}
