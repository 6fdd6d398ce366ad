// FP8 weight-only linear layers: y = x @ W^T, x [M, K] float32 or bf16, W [N, K] kept one byte
// a weight as FP8 checkpoints store it (float8_e4m3fn's bits), w = fp8 * scale with float32
// scales per tensor, per output channel or per block (DeepSeek-V3's 128 x 128
// `weight_scale_inv`), repacked at load by cpu_kernels/fp8_format.py.
//
// Layout. Columns go in groups of 16 (G = ceil(N / 16), the last padded with zeros) and K is
// padded with zeros to a multiple of 32 (Kp). One 64-byte unit holds a group's 16 columns x 4
// consecutive k, in the order that widening turns into two VDPBF16PS operands (16 columns x 2
// k each, the k pair in one 32-bit lane) without a cross-lane shuffle:
//
//   unit u of group g, byte 16 (c / 4) + 8 (kk / 2) + 2 (c % 4) + kk % 2  =  q[16 g + c, 4 u + kk]
//
// Groups go in super-groups of 8 (128 columns; the last may be narrower, width w): unit 0 of
// its w groups, unit 1 of its w groups, ...: a tile of 8 groups reads one sequential stream.
// Scales: float32 [G, KB, 16], per column and k block of `k_block` k (128 for DeepSeek's
// blocks; all of Kp for per-tensor and per-channel scales, KB = 1).
//
// Widening. Every e4m3fn value, subnormals included, is exactly a bf16 (and a float32). 64
// bytes go through two 128-entry byte tables (VPERMT2B: each magnitude's bf16 high and low
// byte), the sign is or-ed in, and VPUNPCK{L,H}BW interleaves the bytes into words. NaN (0x7f,
// 0xff) widens to NaN. (Against bit operations with a fix-up for the subnormals: 37 against 19
// GB/s of fp8 from L1 on one Zen 4 core, each feeding VDPBF16PS.)
//
// Arithmetic, factored per k block b (its scale is constant over it):
//
//   y[m, n] = sum_b scale[n, b] * t_b(m, n)        acc = fma(t_b, scale, acc), b = 0, 1, ...
//
// bf16 activations: t_b = VDPBF16PS over the block's k pairs in order, from zero. A bf16 times
// an e4m3 value is exact in float32, so only the fp32 sums round. float32 activations: t_b =
// fma over the block's k in order, from zero. Either way the result is the float32 product of
// x with the dequantized weights (fp8 * scale) up to summation order; a per-tensor or
// per-channel layer (one block) multiplies by its scale once, at the end.
//
// Batch invariance: element (m, n) is always that sequence, whatever M, the tiling or the
// threads. The register tiles (few rows, weights widened in registers) and the panel tiles (16
// rows and more, weights widened once per 128 rows into an L1 panel) perform the same
// operations per element.
//
// AMX arithmetic (CPUs with AMX-BF16; chosen per machine by cpu_kernels/dispatch.py, never per
// call, as for the int kernels in quant_linear_bf16.cpp): the same factored form, each block's
// t_b on the tiles. Per 32 k, TDPBF16PS adds (the even-k products summed in k order + the
// odd-k ones) to the tile, zeroed at each block's start; at its end the tiles are stored and
// acc = fma(t_b, scale, acc) runs in vectors. The widened values are exact, so unlike the int
// kernels' AMX arithmetic nothing is rounded to bf16: both arithmetics compute the same sum,
// in different orders. One row: VDPBF16PS on x pairs with one element zeroed (each sum takes
// one product at a time), bitwise what the tiles give.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define PAGEDSERVE_FP8 1
#include <immintrin.h>
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define PAGEDSERVE_FP8_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDSERVE_FP8_AMX 1
#endif
#include "bf16_tiles.h"
#endif
#endif

namespace {

constexpr int64_t kStep = 32;         // K is padded to a multiple of this (one AMX tile's k)
constexpr int64_t kSuperGroup = 8;    // groups interleaved unit by unit
constexpr int64_t kUnitBytes = 64;    // 16 columns x 4 k
constexpr int64_t kPanelRows = 16;    // bf16: from this many rows on, widen the weights once into a panel
constexpr int64_t kAmxTileFromRows = 2;
constexpr int64_t kMChunk = 128;      // rows of x kept in L2 while a thread sweeps its columns
constexpr int kPanelGroups = 4;       // column groups per panel strip (64 columns)
constexpr int kAmxStripGroups = 2;    // column groups per AMX strip (two B tiles)
constexpr int64_t kPrefetchUnits = 16;  // how far ahead the register tiles ask for weights (8 KB)

// The bf16 bits of the e4m3fn magnitude m (7 bits: exponent e, mantissa f): 2^(e-7) (1 + f/8),
// subnormals (e = 0) f 2^-9, and 0x7f NaN.
constexpr uint16_t e4m3_to_bf16(int m) {
  const int e = m >> 3, f = m & 7;
  if (m == 0x7f) return 0x7fc0;
  if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (f << 4));
  if (f == 0) return 0;
  const int shift = f >= 4 ? 2 : f >= 2 ? 1 : 0;  // f = 2^shift (1 + fraction)
  return static_cast<uint16_t>(((118 + shift) << 7) | ((f << (7 - shift)) & 0x7f));
}

enum class Arith { kFloat32, kBf16, kAmx };

struct Problem {
  const void* x;         // [M, Kp] float32 or bf16 bits
  const uint8_t* w;      // packed weights
  const float* scales;   // [G, KB, 16]
  void* out;             // [M, N] float32 or bf16 bits
  int64_t M, N, Kp, G, k_block, KB;
  Arith arith;
  bool out_bf16;

  const float* xf(int64_t m) const { return static_cast<const float*>(x) + m * Kp; }
  const uint16_t* xb(int64_t m) const { return static_cast<const uint16_t*>(x) + m * Kp; }

  // Group g's unit u; the next unit of the same group is unit_stride(g) bytes on.
  const uint8_t* unit(int64_t g, int64_t u) const {
    const int64_t first = g / kSuperGroup * kSuperGroup;
    return w + first * Kp * 16 + (u * width(g) + g - first) * kUnitBytes;
  }
  int64_t unit_stride(int64_t g) const { return width(g) * kUnitBytes; }
  int64_t width(int64_t g) const { return std::min(kSuperGroup, G - g / kSuperGroup * kSuperGroup); }

  // k block b's units [units_begin, units_end) (4 k each).
  int64_t units_begin(int64_t b) const { return b * k_block / 4; }
  int64_t units_end(int64_t b) const { return std::min(Kp, (b + 1) * k_block) / 4; }
};

#ifdef PAGEDSERVE_FP8

using bh = __m512bh;

struct Tables {
  __m512i hi0, hi1, lo0, lo1;  // bf16 high bytes of magnitudes 0..63, 64..127; low bytes
};

inline Tables tables() {
  alignas(64) static const std::array<uint8_t, 256> bytes = [] {
    std::array<uint8_t, 256> t{};
    for (int m = 0; m < 128; ++m) {
      t[m] = static_cast<uint8_t>(e4m3_to_bf16(m) >> 8);
      t[128 + m] = static_cast<uint8_t>(e4m3_to_bf16(m) & 0xff);
    }
    return t;
  }();
  const auto* p = bytes.data();
  return {_mm512_load_si512(p), _mm512_load_si512(p + 64), _mm512_load_si512(p + 128),
          _mm512_load_si512(p + 192)};
}

// One unit (64 bytes) -> its two pair vectors as bf16 bits: k 4u, 4u+1 and k 4u+2, 4u+3.
inline void widen(const uint8_t* src, const Tables& t, __m512i& pair0, __m512i& pair1) {
  const __m512i b = _mm512_loadu_si512(src);
  __m512i hi = _mm512_permutex2var_epi8(t.hi0, b, t.hi1);  // index bits 0..6: the sign is ignored
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, b, t.lo1);
  hi = _mm512_ternarylogic_epi32(hi, b, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (b & 0x80)
  pair0 = _mm512_unpacklo_epi8(lo, hi);
  pair1 = _mm512_unpackhi_epi8(lo, hi);
}

// A pair vector's even-k and odd-k values as float32 (exact: bf16 is fp32's top half).
inline __m512 even_k(__m512i pair) { return _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)); }
inline __m512 odd_k(__m512i pair) {
  return _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

inline __m512 scale_of(const Problem& p, int64_t g, int64_t b) {
  return _mm512_loadu_ps(p.scales + (g * p.KB + b) * 16);
}

inline void store_row(const Problem& p, int64_t m, int64_t g, __m512 acc) {
  const int64_t n = 16 * g, valid = std::min<int64_t>(16, p.N - n);
  const auto mask = static_cast<__mmask16>((1u << valid) - 1);
#ifdef PAGEDSERVE_FP8_BF16
  if (p.out_bf16) {  // RNE, as torch's .bfloat16()
    const __m256i y = (__m256i)_mm512_cvtneps_pbh(acc);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + m * p.N + n, mask, y);
    return;
  }
#endif
  _mm512_mask_storeu_ps(static_cast<float*>(p.out) + m * p.N + n, mask, acc);
}

// Keeps a loaded vector in its register: left alone, GCC reloads a panel tile's weights for
// every row (quant_linear_bf16.cpp's pin). By value: pinning array elements by reference kept
// the 4 x 4 tile's weight array in memory, a store per vector per pair (122 against 153 GFLOPS).
inline bh pinned(bh v) {
  asm("" : "+v"(v));
  return v;
}

#ifdef PAGEDSERVE_FP8_BF16
using pagedserve_bf16::x_pair;
#endif

// t[i] += x[row i, k 4u .. 4u+3] * the unit's weights, in k order: VDPBF16PS on the two pairs,
// or (float32 x) four fmas.
template <int R, bool F32>
inline void unit_products(const Problem& p, int64_t m0, int64_t u, __m512i pair0, __m512i pair1, __m512 (&t)[R]) {
  if constexpr (F32) {
    const __m512 w0 = even_k(pair0), w1 = odd_k(pair0), w2 = even_k(pair1), w3 = odd_k(pair1);
    for (int i = 0; i < R; ++i) {
      const float* x = p.xf(m0 + i) + 4 * u;
      t[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[0]), w0, t[i]);
      t[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[1]), w1, t[i]);
      t[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[2]), w2, t[i]);
      t[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[3]), w3, t[i]);
    }
  } else {
#ifdef PAGEDSERVE_FP8_BF16
    for (int i = 0; i < R; ++i) {
      const uint16_t* x = p.xb(m0 + i) + 4 * u;
      t[i] = _mm512_dpbf16_ps(t[i], x_pair(x), (bh)pair0);
      t[i] = _mm512_dpbf16_ps(t[i], x_pair(x + 2), (bh)pair1);
    }
#endif
  }
}

// R rows x G groups (within one super-group), the weights widened in registers: for few rows,
// where each widened unit serves R rows. G groups keep R*G independent chains in flight.
template <int R, int G, bool F32>
void tile_registers(const Problem& p, int64_t m0, int64_t g0) {
  const Tables tab = tables();
  const uint8_t* base = p.unit(g0, 0);
  const int64_t stride = p.unit_stride(g0), units = p.Kp / 4;
  __m512 acc[G][R];
  for (auto& col : acc)
    for (auto& a : col) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.KB; ++b) {
    __m512 t[G][R];
    for (auto& col : t)
      for (auto& a : col) a = _mm512_setzero_ps();
    for (int64_t u = p.units_begin(b); u < p.units_end(b); ++u) {
      // Each call's stream is too short for the hardware prefetcher to ramp up.
      if (u + kPrefetchUnits < units)
        for (int j = 0; j < G; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(base + (u + kPrefetchUnits) * stride + j * kUnitBytes),
                       _MM_HINT_T0);
      for (int j = 0; j < G; ++j) {
        __m512i pair0, pair1;
        widen(base + u * stride + j * kUnitBytes, tab, pair0, pair1);
        unit_products<R, F32>(p, m0, u, pair0, pair1, t[j]);
      }
    }
    for (int j = 0; j < G; ++j) {
      const __m512 s = scale_of(p, g0 + j, b);
      for (int i = 0; i < R; ++i) acc[j][i] = _mm512_fmadd_ps(t[j][i], s, acc[j][i]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int i = 0; i < R; ++i) store_row(p, m0 + i, g0 + j, acc[j][i]);
}

// Groups [g0, g1) in tiles of G, leftovers in tiles of G/2, G/4, ...
template <int R, int G, bool F32>
void groups_by(const Problem& p, int64_t m, int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + G <= g1; g += G) tile_registers<R, G, F32>(p, m, g);
  if constexpr (G > 1) groups_by<R, G / 2, F32>(p, m, g, g1);
}

// Rows [m0, m1) x groups [g0, g1): a super-group's part at a time (its weights stay in L2),
// every row over it, as quant_linear_bf16.cpp's few-rows path.
template <bool F32>
void few_rows(const Problem& p, int64_t m0, int64_t m1, int64_t g0, int64_t g1) {
  for (int64_t c0 = g0, c1; c0 < g1; c0 = c1) {
    c1 = std::min(g1, (c0 / kSuperGroup + 1) * kSuperGroup);
    int64_t m = m0;
    if ((m1 - m0) % 4 == 1 && m1 - m0 >= 5) {  // 5 rows in one tile rather than 4 + 1
      groups_by<5, 2, F32>(p, m, c0, c1);
      m += 5;
    }
    for (; m + 4 <= m1; m += 4) groups_by<4, 2, F32>(p, m, c0, c1);
    switch (m1 - m) {
      case 3: groups_by<3, 2, F32>(p, m, c0, c1); break;
      case 2: groups_by<2, 4, F32>(p, m, c0, c1); break;
      case 1: groups_by<1, 8, F32>(p, m, c0, c1); break;
      default: break;
    }
  }
}

#ifdef PAGEDSERVE_FP8_BF16
// Groups [g, g + count) widened, each pair vector after pair vector: [count][Kp/2][32] bf16
// words (the panel tiles' and the AMX tiles' B operand as it is). Unit by unit across the
// groups, prefetching ahead: the weights come from memory, and one group alone would read
// every w-th line of its super-group's stream.
void widen_groups(const Problem& p, int64_t g, int64_t count, uint16_t* dst) {
  const Tables tab = tables();
  const int64_t units = p.Kp / 4, group_words = p.Kp / 2 * 32;
  for (int64_t u = 0; u < units; ++u) {
    for (int64_t j = 0; j < count; ++j) {
      if (u + kPrefetchUnits < units)
        _mm_prefetch(reinterpret_cast<const char*>(p.unit(g + j, u + kPrefetchUnits)), _MM_HINT_T0);
      __m512i pair0, pair1;
      widen(p.unit(g + j, u), tab, pair0, pair1);
      _mm512_storeu_si512(dst + j * group_words + 64 * u, pair0);
      _mm512_storeu_si512(dst + j * group_words + 64 * u + 32, pair1);
    }
  }
}

// R rows x G groups from a widened panel: each weight load serves R rows. Per element the
// register tiles' sequence: per block, VDPBF16PS over its pairs in order, then the scale.
template <int R, int G>
void tile_panel(const Problem& p, int64_t m0, int64_t g0, const uint16_t* panel) {
  const int64_t pairs = p.Kp / 2, block_pairs = p.k_block / 2, row = p.Kp;
  const uint16_t* x = p.xb(m0);
  // The sums of the finished blocks wait in memory: the registers hold the R x G running
  // dot products (16 at 4 x 4), the G weight vectors and x.
  alignas(64) float acc[R][G][16] = {};
  for (int64_t b = 0, pair = 0; pair < pairs; ++b) {
    __m512 t[R][G];
    for (auto& r : t)
      for (auto& a : r) a = _mm512_setzero_ps();
    for (const int64_t end = std::min(pairs, pair + block_pairs); pair < end; ++pair) {
      bh w[G];
      for (int j = 0; j < G; ++j) w[j] = pinned((bh)_mm512_loadu_si512(panel + (j * pairs + pair) * 32));
      for (int i = 0; i < R; ++i) {
        const bh xv = x_pair(x + i * row + 2 * pair);
        for (int j = 0; j < G; ++j) t[i][j] = _mm512_dpbf16_ps(t[i][j], xv, w[j]);
      }
    }
    for (int j = 0; j < G; ++j) {
      const __m512 s = scale_of(p, g0 + j, b);
      for (int i = 0; i < R; ++i) _mm512_store_ps(acc[i][j], _mm512_fmadd_ps(t[i][j], s, _mm512_load_ps(acc[i][j])));
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < G; ++j) store_row(p, m0 + i, g0 + j, _mm512_load_ps(acc[i][j]));
}

// Rows [m0, m1) over a panel of G groups: tiles of 4 rows (one of 5 for 4n + 1 rows, rather
// than a lone row at the end), then the rest.
template <int G>
void panel_rows(const Problem& p, int64_t m0, int64_t m1, int64_t g0, const uint16_t* panel) {
  int64_t m = m0;
  if ((m1 - m0) % 4 == 1 && m1 - m0 >= 5) {
    tile_panel<5, G>(p, m, g0, panel);
    m += 5;
  }
  for (; m + 4 <= m1; m += 4) tile_panel<4, G>(p, m, g0, panel);
  switch (m1 - m) {
    case 3: tile_panel<3, G>(p, m, g0, panel); break;
    case 2: tile_panel<2, G>(p, m, g0, panel); break;
    case 1: tile_panel<1, G>(p, m, g0, panel); break;
    default: break;
  }
}

// Rows [m0, m1) x groups [g0, g1) for many rows: strips of kPanelGroups groups widened once.
void many_rows(const Problem& p, int64_t m0, int64_t m1, int64_t g0, int64_t g1, uint16_t* panel) {
  for (int64_t g = g0; g < g1; g += kPanelGroups) {
    const int64_t count = std::min<int64_t>(kPanelGroups, g1 - g);
    widen_groups(p, g, count, panel);
    switch (count) {
      case 4: panel_rows<4>(p, m0, m1, g, panel); break;
      case 3: panel_rows<3>(p, m0, m1, g, panel); break;
      case 2: panel_rows<2>(p, m0, m1, g, panel); break;
      default: panel_rows<1>(p, m0, m1, g, panel); break;
    }
  }
}

// AMX arithmetic, one row x G groups (within a super-group), weights widened in registers:
// per 32 k, the even-k and the odd-k products in separate sums (xe[pair] holds x[2 pair]
// alone, xo[pair] x[2 pair + 1] alone), then c = c + (even + odd); per block, c from zero,
// then acc = fma(c, scale, acc): what the tiles compute.
template <int G>
void row_amx(const Problem& p, int64_t m, int64_t g0, const int32_t* xe, const int32_t* xo) {
  const Tables tab = tables();
  const uint8_t* base = p.unit(g0, 0);
  const int64_t stride = p.unit_stride(g0);
  __m512 acc[G];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.KB; ++b) {
    __m512 c[G];
    for (auto& a : c) a = _mm512_setzero_ps();
    for (int64_t u0 = p.units_begin(b); u0 < p.units_end(b); u0 += kStep / 4) {
      __m512 even[G], odd[G];
      for (int j = 0; j < G; ++j) even[j] = odd[j] = _mm512_setzero_ps();
      for (int64_t u = u0; u < u0 + kStep / 4; ++u) {
        for (int j = 0; j < G; ++j) {
          __m512i pair[2];
          widen(base + u * stride + j * kUnitBytes, tab, pair[0], pair[1]);
          for (int h = 0; h < 2; ++h) {
            even[j] = _mm512_dpbf16_ps(even[j], (bh)_mm512_set1_epi32(xe[2 * u + h]), (bh)pair[h]);
            odd[j] = _mm512_dpbf16_ps(odd[j], (bh)_mm512_set1_epi32(xo[2 * u + h]), (bh)pair[h]);
          }
        }
      }
      for (int j = 0; j < G; ++j) c[j] = _mm512_add_ps(c[j], _mm512_add_ps(even[j], odd[j]));
    }
    for (int j = 0; j < G; ++j) acc[j] = _mm512_fmadd_ps(c[j], scale_of(p, g0 + j, b), acc[j]);
  }
  for (int j = 0; j < G; ++j) store_row(p, m, g0 + j, acc[j]);
}

// AMX arithmetic below the tiles' row count: each row on its own, 4 groups at a time.
void rows_amx(const Problem& p, int64_t m0, int64_t m1, int64_t g0, int64_t g1) {
  std::vector<int32_t> xe(p.Kp / 2), xo(p.Kp / 2);
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* x = p.xb(m);
    for (int64_t pair = 0; pair < p.Kp / 2; ++pair) {
      xe[pair] = x[2 * pair];
      xo[pair] = static_cast<int32_t>(static_cast<uint32_t>(x[2 * pair + 1]) << 16);
    }
    for (int64_t c0 = g0, c1; c0 < g1; c0 = c1) {
      c1 = std::min(g1, (c0 / kSuperGroup + 1) * kSuperGroup);
      int64_t g = c0;
      for (; g + 4 <= c1; g += 4) row_amx<4>(p, m, g, xe.data(), xo.data());
      for (; g < c1; ++g) row_amx<1>(p, m, g, xe.data(), xo.data());
    }
  }
}
#endif  // PAGEDSERVE_FP8_BF16

#ifdef PAGEDSERVE_FP8_AMX
// --- AMX tiles over widened panels --------------------------------------------------------
// Tiles 0 and 3: 16 rows of x each, 32 k (16 x 64 bytes). Tiles 1, 2: the strip's two groups,
// 16 pairs x 16 columns x 2 (the panel as it is). Tiles 4-7: the 16 x 16 fp32 sums of (row
// tile, group) over one k block; stored at its end and scaled into `acc`.

using pagedserve_bf16::configure_tiles;
using pagedserve_bf16::kTileRows;

// One or two 16-row tiles of x (a0, a1: x itself or a zero-padded copy of its last rows;
// stride Kp) x a strip of Count groups at g0 ([Count][Kp/2][32] words). Stores rows0 rows
// from m, then rows1 from m + 16 (rows1 = 0: one row tile).
template <int Count>
void amx_tile(const Problem& p, int64_t m, const uint16_t* a0, int64_t rows0, const uint16_t* a1, int64_t rows1,
              const uint16_t* strip, int64_t g0) {
  const int64_t stride = p.Kp * 2, pairs = p.Kp / 2;
  alignas(64) float c[4][256];
  alignas(64) float acc[4][256] = {};
  for (int64_t b = 0; b < p.KB; ++b) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t step = p.units_begin(b) * 4 / kStep; step < p.units_end(b) * 4 / kStep; ++step) {
      const uint16_t* w = strip + step * 16 * 32;
      _tile_loadd(0, a0 + step * kStep, stride);
      _tile_loadd(1, w, 64);
      if constexpr (Count == 2) _tile_loadd(2, w + pairs * 32, 64);
      _tile_dpbf16ps(4, 0, 1);
      if constexpr (Count == 2) _tile_dpbf16ps(5, 0, 2);
      if (rows1 > 0) {
        _tile_loadd(3, a1 + step * kStep, stride);
        _tile_dpbf16ps(6, 3, 1);
        if constexpr (Count == 2) _tile_dpbf16ps(7, 3, 2);
      }
    }
    _tile_stored(4, c[0], 64);
    _tile_stored(5, c[1], 64);
    _tile_stored(6, c[2], 64);
    _tile_stored(7, c[3], 64);
    for (int j = 0; j < Count; ++j) {
      const __m512 s = scale_of(p, g0 + j, b);
      for (int half = 0; half < 2; ++half) {
        float* a = acc[2 * half + j];
        const float* t = c[2 * half + j];
        for (int64_t i = 0; i < (half ? rows1 : rows0); ++i)
          _mm512_store_ps(a + i * 16, _mm512_fmadd_ps(_mm512_load_ps(t + i * 16), s, _mm512_load_ps(a + i * 16)));
      }
    }
  }
  for (int j = 0; j < Count; ++j) {
    for (int64_t i = 0; i < rows0; ++i) store_row(p, m + i, g0 + j, _mm512_load_ps(acc[j] + i * 16));
    for (int64_t i = 0; i < rows1; ++i) store_row(p, m + 16 + i, g0 + j, _mm512_load_ps(acc[2 + j] + i * 16));
  }
}

// All rows x groups [g0, g1) on this thread's tiles: per chunk of kMChunk rows, strips of
// kAmxStripGroups groups widened once, row tiles in pairs. `tail`: x's rows from the last
// multiple of 16 on, zero-padded to 16 rows (each row's sums depend on that row alone).
void amx_rows(const Problem& p, int64_t g0, int64_t g1, uint16_t* panel, const uint16_t* tail) {
  configure_tiles();
  const int64_t full = p.M / kTileRows * kTileRows;
  auto rows_at = [&](int64_t m) { return m < full ? p.xb(m) : tail; };
  for (int64_t m0 = 0; m0 < p.M; m0 += kMChunk) {
    const int64_t m1 = std::min(p.M, m0 + kMChunk);
    for (int64_t g = g0; g < g1; g += kAmxStripGroups) {
      const int64_t count = std::min<int64_t>(kAmxStripGroups, g1 - g);
      widen_groups(p, g, count, panel);
      for (int64_t m = m0; m < m1; m += 2 * kTileRows) {
        const int64_t rows0 = std::min(kTileRows, m1 - m);
        const int64_t rows1 = std::clamp<int64_t>(m1 - m - kTileRows, 0, kTileRows);
        const uint16_t* a1 = rows1 > 0 ? rows_at(m + kTileRows) : nullptr;
        if (count == 2) amx_tile<2>(p, m, rows_at(m), rows0, a1, rows1, panel, g);
        else amx_tile<1>(p, m, rows_at(m), rows0, a1, rows1, panel, g);
      }
    }
  }
  _tile_release();
}

std::vector<uint16_t> padded_tail(const Problem& p) {
  const int64_t full = p.M / kTileRows * kTileRows;
  if (full == p.M) return {};
  std::vector<uint16_t> tail(kTileRows * p.Kp, 0);
  std::memcpy(tail.data(), p.xb(full), (p.M - full) * p.Kp * 2);
  return tail;
}
#endif  // PAGEDSERVE_FP8_AMX

// The rows and this thread's groups [g0, g1), by arithmetic and row count.
void run_groups(const Problem& p, int64_t g0, int64_t g1, const uint16_t* tail) {
  if (p.arith == Arith::kFloat32) {
    for (int64_t m0 = 0; m0 < p.M; m0 += kMChunk) few_rows<true>(p, m0, std::min(p.M, m0 + kMChunk), g0, g1);
    return;
  }
#ifdef PAGEDSERVE_FP8_BF16
  const bool amx = p.arith == Arith::kAmx;
  if (amx && p.M < kAmxTileFromRows) return rows_amx(p, 0, p.M, g0, g1);
  if (!amx && p.M < kPanelRows) return few_rows<false>(p, 0, p.M, g0, g1);
  std::unique_ptr<uint16_t[]> panel(new uint16_t[kPanelGroups * p.Kp / 2 * 32]);  // filled before read
#ifdef PAGEDSERVE_FP8_AMX
  if (amx) return amx_rows(p, g0, g1, panel.get(), tail);
#endif
  for (int64_t m0 = 0; m0 < p.M; m0 += kMChunk) many_rows(p, m0, std::min(p.M, m0 + kMChunk), g0, g1, panel.get());
#endif
  (void)tail;
}

#endif  // PAGEDSERVE_FP8

bool fp8_supported() {
#ifdef PAGEDSERVE_FP8
  return true;
#else
  return false;
#endif
}

bool fp8_bf16_supported() {
#ifdef PAGEDSERVE_FP8_BF16
  return true;
#else
  return false;
#endif
}

// Whether AMX tiles run here: built for them and the kernel granted this process the tile data
// state (bf16_tiles.h: a refusal means no AMX, never a SIGILL).
bool fp8_amx_ready() {
#ifdef PAGEDSERVE_FP8_AMX
  return pagedserve_bf16::amx_tiles_granted();
#else
  return false;
#endif
}

// y [M, N] = x [M, K] @ W^T. float32 x: the fma arithmetic, float32 out. bfloat16 x: VDPBF16PS
// (or AMX, `amx`), bfloat16 out unless out_dtype asks for float32 (the fp32 sums unrounded).
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, int64_t N, int64_t k_block,
                      bool amx, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(fp8_supported(), "FP8 linear layers need AVX-512 (F, BW, VBMI), which this build lacks");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous 2-D float32 or bfloat16 tensor");
  const bool f32 = x.scalar_type() == at::kFloat;
  const int64_t M = x.size(0), K = x.size(1), Kp = (K + kStep - 1) / kStep * kStep, G = (N + 15) / 16;
  TORCH_CHECK(K > 0 && N > 0, "K and N must be positive");
  TORCH_CHECK(k_block > 0 && k_block % kStep == 0, "k_block must be a positive multiple of 32, got ", k_block);
  const int64_t KB = (Kp + k_block - 1) / k_block;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == G * Kp * 16,
              "packed weights: want ", G * Kp * 16, " bytes for N=", N, ", K=", K, ", got ", w.numel());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == G * KB * 16,
              "scales: want float32 [", G, ", ", KB, ", 16], got ", scales.numel(), " values");
  TORCH_CHECK(!(f32 && amx), "AMX arithmetic takes bfloat16 activations");
  TORCH_CHECK(f32 || fp8_bf16_supported(), "bfloat16 activations need AVX512-BF16, which this build lacks");
  TORCH_CHECK(!amx || fp8_amx_ready(), "AMX arithmetic asked for, but this CPU or build cannot run AMX tiles");
  const at::ScalarType out_type = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(out_type == at::kFloat || (!f32 && out_type == at::kBFloat16),
              "out_dtype: float32, or bfloat16 for bfloat16 x");
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_type));
  if (M == 0) return out;
  at::Tensor xp = x;
  if (Kp != K) {  // the padded k must meet zeros, not whatever follows x's rows
    xp = at::zeros({M, Kp}, x.options());
    xp.narrow(1, 0, K).copy_(x);
  }
  const Problem p{xp.data_ptr(), w.data_ptr<uint8_t>(), scales.data_ptr<float>(), out.data_ptr(),
                  M, N, Kp, G, k_block, KB,
                  f32 ? Arith::kFloat32 : amx ? Arith::kAmx : Arith::kBf16, out_type == at::kBFloat16};
#ifdef PAGEDSERVE_FP8
  std::vector<uint16_t> tail;
#ifdef PAGEDSERVE_FP8_AMX
  if (amx) tail = padded_tail(p);
#endif
  // Threads split the column groups: each streams its share of the weights once per chunk of rows.
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) { run_groups(p, g0, g1, tail.data()); });
#else
  (void)p;
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("fp8_supported() -> bool", &fp8_supported);
  m.def("fp8_bf16_supported() -> bool", &fp8_bf16_supported);
  m.def("fp8_amx_ready() -> bool", &fp8_amx_ready);
  m.def("fp8_linear(Tensor x, Tensor w, Tensor scales, int n, int k_block, bool amx=False, "
        "ScalarType? out_dtype=None) -> Tensor", &fp8_linear);
}
