// Paged attention on CPU, reading K/V straight from the paged cache (no gather copy).
//
//   kv_cache      [2, Hkv, num_blocks, block_size, D]  0 = K, 1 = V; contiguous
//                 (an int8 cache, rows of D + 2 bytes, goes to paged_attention_int8.cpp's ops)
//   q             [B, Hq, D]  rows may be strided (a view of the fused qkv); heads D apart
//   block_tables  [B, W] int64, context_lens [B] int64 (>= 1)
//   window        0, or a sliding window: row b sees positions [len - window, len) only
//   sinks         none, or float32 [Hq]: a learned logit per query head that joins every
//                 softmax's denominator (gpt-oss's attention sinks) and adds no value:
//                 p_t = exp(s_t) / (sum_t exp(s_t) + exp(sink))
//
// A windowed row's key loop starts at its window's first position (mid-block if need
// be): blocks before it are neither read nor checked, so the block manager may have
// released them (their table entries are placeholders), and a step costs O(window).
//
// One work item is (sequence, kv head, partition): all G = Hq / Hkv query heads of a kv
// head are done together, so each K/V row comes from memory once per group. A block at a
// time: scores for the whole block, one online-softmax update (running max and sum), then
// the V accumulation. Contexts longer than kPartitionTokens are split into partitions of
// that length, combined at the end, so that a small batch still keeps every core busy.
//
// Batch invariance: the arithmetic for one sequence depends only on its own length, the
// block size and the head shapes (partitions are fixed by length, never by batch size or
// thread count), so its result is bitwise the same alone or in any batch.
//
// Arithmetic: bf16 caches on builds with AVX512-BF16 take both products on VDPBF16PS (exact
// bf16 products summed in fp32; namespace dot); float32 caches, and bf16 elsewhere, AVX2
// float arithmetic on widened values. Either way each block's K/V rows are prefetched into L2
// two blocks ahead and into L1 one ahead.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "bf16_tiles.h"  // VDPBF16PS's pair broadcast, where the build has it

// bf16 caches on AVX512-BF16: both products in VDPBF16PS (namespace dot below).
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGED_BF16_DOT 1
#endif

namespace {

constexpr int64_t kPartitionTokens = 512;
// Below this many K+V elements in a call, waking threads costs more than it saves.
constexpr int64_t kSerialElements = 1 << 15;

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax(__m256 a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Four sums of four vectors' lanes.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp).
// Far below zero it returns 0, as softmax wants. exp8 (AVX2) and exp16 (AVX-512) run these
// same constants in the same order.
namespace expf_poly {
constexpr float kLow = -87.3f;  // below it, exp rounds to 0
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kPoly[] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f, 4.1665795894E-2f,
                           1.6666665459E-1f, 5.0000001201E-1f};  // Horner's order
}  // namespace expf_poly

inline __m256 exp8(__m256 x) {
  using namespace expf_poly;
  const __m256 lo = _mm256_set1_ps(kLow);
  __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// Register tiles: 3 query heads x 4 rows (or 4 chunks of D) make 12 accumulators, plus 3
// operands: the 16 ymm registers, with each K/V load feeding 3 FMAs.
constexpr int kHeadTile = 3;

// s[h, t] = q[h] . k[t] for HT heads and the block's n valid rows, four rows at a time.
// Blocks are scattered (a page or so each) and hardware prefetchers stop at page
// boundaries, so this also prefetches the next block's K and V rows (next_k/next_v, or
// null), spread over the loop: a burst of prefetches would stall on the miss buffers.
template <int HT, typename T>
void scores_tile(const float* q, const T* k, int64_t n, int64_t D, float* s, int64_t pad, const T* next_k,
                 const T* next_v) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    __m256 a[HT][4];
    for (int h = 0; h < HT; ++h)
      for (int j = 0; j < 4; ++j) a[h][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      if (next_k && c % kLine == 0) {
        for (int j = 0; j < 4; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(next_k + (t + j) * D + c), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next_v + (t + j) * D + c), _MM_HINT_T0);
        }
      }
      __m256 qv[HT];
      for (int h = 0; h < HT; ++h) qv[h] = _mm256_loadu_ps(q + h * D + c);
      for (int j = 0; j < 4; ++j) {
        __m256 kv = load8(k + (t + j) * D + c);
        for (int h = 0; h < HT; ++h) a[h][j] = _mm256_fmadd_ps(kv, qv[h], a[h][j]);
      }
    }
    for (int h = 0; h < HT; ++h) _mm_storeu_ps(s + h * pad + t, hsum4(a[h][0], a[h][1], a[h][2], a[h][3]));
  }
  for (; t < n; ++t) {
    __m256 a[HT];
    for (int h = 0; h < HT; ++h) a[h] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      __m256 kv = load8(k + t * D + c);
      for (int h = 0; h < HT; ++h) a[h] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q + h * D + c), a[h]);
    }
    for (int h = 0; h < HT; ++h) s[h * pad + t] = hsum(a[h]);
  }
}

// acc[h, c:c+8CT] = acc * alpha[h] + sum_t p[h, t] v[t, c:c+8CT] for HT heads.
template <int HT, int CT, typename T>
inline void values_tile(const float* p, int64_t pad, const T* v, int64_t n, int64_t D, const float* alpha,
                        float* acc, int64_t c) {
  __m256 a[HT][CT];
  for (int h = 0; h < HT; ++h)
    for (int j = 0; j < CT; ++j)
      a[h][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + c + 8 * j), _mm256_set1_ps(alpha[h]));
  for (int64_t t = 0; t < n; ++t) {
    __m256 ph[HT];
    for (int h = 0; h < HT; ++h) ph[h] = _mm256_broadcast_ss(p + h * pad + t);
    for (int j = 0; j < CT; ++j) {
      __m256 vv = load8(v + t * D + c + 8 * j);
      for (int h = 0; h < HT; ++h) a[h][j] = _mm256_fmadd_ps(ph[h], vv, a[h][j]);
    }
  }
  for (int h = 0; h < HT; ++h)
    for (int j = 0; j < CT; ++j) _mm256_storeu_ps(acc + h * D + c + 8 * j, a[h][j]);
}
#endif  // __AVX2__

// Online-softmax update of one head with this block's n scores: turns them into
// probabilities relative to the new running max m; returns the factor for the old sums.
inline float softmax_update(float* s, int64_t n, float& m, float& l) {
  int64_t t = 0;
  float block_max = -std::numeric_limits<float>::infinity(), sum = 0.f;
#ifdef __AVX2__
  __m256 vmax = _mm256_set1_ps(block_max);
  for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
  block_max = hmax(vmax);
#endif
  for (; t < n; ++t) block_max = std::max(block_max, s[t]);
  const float m_new = std::max(m, block_max);
  const float alpha = std::exp(m - m_new);  // 0 on the first block (m = -inf)
  t = 0;
#ifdef __AVX2__
  __m256 vm = _mm256_set1_ps(m_new), vsum = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  sum = hsum(vsum);
#endif
  for (; t < n; ++t) sum += (s[t] = std::exp(s[t] - m_new));
  m = m_new;
  l = l * alpha + sum;
  return alpha;
}

#ifdef __AVX2__
// One block for HT heads: scores, softmax update, V accumulation.
template <int HT, typename T>
void heads_tile(const float* q, const T* k, const T* v, int64_t n, int64_t D, float* s, int64_t pad,
                float* m, float* l, float* alpha, float* acc, const T* next_k, const T* next_v) {
  scores_tile<HT>(q, k, n, D, s, pad, next_k, next_v);
  for (int h = 0; h < HT; ++h) alpha[h] = softmax_update(s + h * pad, n, m[h], l[h]);
  int64_t c = 0;
  for (; c + 32 <= D; c += 32) values_tile<HT, 4>(s, pad, v, n, D, alpha, acc, c);
  for (; c < D; c += 8) values_tile<HT, 1>(s, pad, v, n, D, alpha, acc, c);
}
#endif

// Per-thread state of one work item, for G heads.
struct Scratch {
  std::vector<float> q;       // [G, D] query heads, pre-scaled
  std::vector<float> scores;  // [G, pad] one block's scores, then probabilities
  std::vector<float> acc;     // [G, D] running sum of p * v
  std::vector<float> m, l;    // [G] running max and sum
  std::vector<float> alpha;   // [G] this block's rescale of the old sums
};

// One block of n rows (k, v) for all G heads of a kv head.
template <typename T>
void attend_block(Scratch& sc, const T* k, const T* v, int64_t n, int64_t G, int64_t D, int64_t pad,
                  const T* next_k, const T* next_v) {
#ifdef __AVX2__
  for (int64_t g = 0; g < G; g += kHeadTile) {
    const float* q = sc.q.data() + g * D;
    float *s = sc.scores.data() + g * pad, *acc = sc.acc.data() + g * D;
    float *m = sc.m.data() + g, *l = sc.l.data() + g, *alpha = sc.alpha.data() + g;
    const T* nk = g ? nullptr : next_k;  // the first head tile prefetches for all
    switch (std::min<int64_t>(kHeadTile, G - g)) {
      case 1: heads_tile<1>(q, k, v, n, D, s, pad, m, l, alpha, acc, nk, next_v); break;
      case 2: heads_tile<2>(q, k, v, n, D, s, pad, m, l, alpha, acc, nk, next_v); break;
      default: heads_tile<3>(q, k, v, n, D, s, pad, m, l, alpha, acc, nk, next_v); break;
    }
  }
#else
  (void)next_k, (void)next_v;  // no prefetching here
  for (int64_t g = 0; g < G; ++g) {
    const float* q = sc.q.data() + g * D;
    float *s = sc.scores.data() + g * pad, *acc = sc.acc.data() + g * D;
    for (int64_t t = 0; t < n; ++t) {
      float dot = 0.f;
      for (int64_t c = 0; c < D; ++c) dot += to_float(k[t * D + c]) * q[c];
      s[t] = dot;
    }
    const float alpha = softmax_update(s, n, sc.m[g], sc.l[g]);
    for (int64_t c = 0; c < D; ++c) acc[c] *= alpha;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < D; ++c) acc[c] += s[t] * to_float(v[t * D + c]);
  }
#endif
}

struct Shape {
  int64_t G, D, Hkv, num_blocks, block_size, width, part_blocks;
};

// A block's K and V rows into L2 (PREFETCHT1), two blocks before their use; the block before
// brings them on to L1 (scores_tile's prefetches). One block ahead alone keeps too few misses
// in flight to cover DRAM's latency: 1.3x to 1.7x slower out of cache (Zen 4, 2 KB blocks).
template <typename T>
inline void prefetch_l2(const T* k, const T* v, int64_t numel) {
  for (int64_t e = 0; e < numel; e += 64 / static_cast<int64_t>(sizeof(T))) {
    __builtin_prefetch(k + e, 0, 2);
    __builtin_prefetch(v + e, 0, 2);
  }
}

// Attention of one kv head's G query heads (sc.q) over the context blocks
// [first_block, end_block) of a sequence of length len, from position `start` on;
// leaves acc, m, l in `sc`.
template <typename T>
void attend_range(const Shape& sh, const T* cache, const int64_t* table, int64_t head, int64_t len,
                  int64_t start, int64_t first_block, int64_t end_block, Scratch& sc) {
  const int64_t bs = sh.block_size, block_numel = bs * sh.D, pad = (bs + 7) / 8 * 8;
  const T* k_head = cache + head * sh.num_blocks * block_numel;
  const T* v_head = cache + (sh.Hkv + head) * sh.num_blocks * block_numel;
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.end(), 0.f);
  for (int64_t i = first_block; i < end_block; ++i) {
    const int64_t skip = std::max<int64_t>(0, start - i * bs);  // rows before the window
    const int64_t n = std::min(bs, len - i * bs) - skip;
    const int64_t offset = table[i] * block_numel + skip * sh.D;
    const int64_t next = i + 1 < end_block ? table[i + 1] * block_numel : -1;
    if (i + 2 < end_block) {
      prefetch_l2(k_head + table[i + 2] * block_numel, v_head + table[i + 2] * block_numel, block_numel);
    }
    attend_block(sc, k_head + offset, v_head + offset, n, sh.G, sh.D, pad,
                 next < 0 ? nullptr : k_head + next, next < 0 ? nullptr : v_head + next);
  }
}

#ifdef PAGED_BF16_DOT
// bf16 caches on AVX512-BF16: VDPBF16PS for both products, in one fixed order per sequence.
// - Scores: q[h] . k[t] in exact products summed in fp32, then times the scale. A vector holds
//   two keys' 16-element halves (a 256-bit half each) against q's half twice; four such
//   vectors per 8 keys are summed across lanes in a fixed tree.
// - Values: two V rows interleaved into pairs, acc[h, d] += p[h, t] v[t, d] + p[h, t+1] v[t+1, d],
//   with each probability split into two bf16 parts (p = hi + lo to 2^-16, each part's product
//   exact). Rounding p to bf16 alone, as flash-attention's kernels do, was 20-30% faster in
//   cache but added up to a third to the output's error, and the tiny random gpt-oss of
//   tests/engine/test_gpt_oss.py then drifted 4x further between two bf16 runs (worst logprob
//   gap 0.19 -> 0.76). The softmax's sum adds hi + lo, the weights the values get.
// - A block whose scores all lie at or below the running max skips the max's reduction and
//   the rescale, whose factor would be exactly 1: the same bits, less work.
namespace dot {

using bh = __m512bh;
constexpr int kMaxHeads = 4;  // heads per tile: 4 x 4 accumulators + 8 key vectors in registers

// The first n of 16 or 32 lanes.
inline __mmask16 first16(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : __mmask16((1u << n) - 1); }
inline __mmask32 first32(int64_t n) { return n >= 32 ? ~0u : n <= 0 ? 0 : __mmask32((1u << n) - 1); }

// Lane sums of a and b, two by two, interleaved (per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3).
inline __m512 merge32(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }
inline __m512 merge64(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// exp8's arithmetic on 16 lanes, 2^n by VSCALEFPS; exp16(0) = 1 exactly.
inline __m512 exp16(__m512 x) {
  using namespace expf_poly;
  const __m512 lo = _mm512_set1_ps(kLow);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), y, fx);
}

// s[h, 0..8) = scale q[h] . k[t] for HT heads and the m <= 8 rows of k (kAll: m = 8; later
// rows score 0 and are never read). q: per head, each 16 elements twice (a 512-bit vector),
// `pieces` vectors apart. Prefetches the next block's rows (next_k/next_v, or null; next_rows
// of them) on the way: blocks are scattered and hardware prefetchers stop at page boundaries.
template <int HT, bool kAll>
inline void scores8(const uint16_t* q, int64_t pieces, int64_t D, const uint16_t* k, int64_t m, float scale,
                    float* s, int64_t pad, const uint16_t* next_k, const uint16_t* next_v, int64_t next_rows) {
  __m512 acc[HT][4];
  for (int h = 0; h < HT; ++h)
    for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 32) {
    const __mmask32 cols = first32(D - c);
    __m512i r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm512_maskz_loadu_epi16(kAll || i < m ? cols : 0, k + i * D + c);
    for (int64_t i = 0; next_k && i < next_rows; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(next_k + i * D + c), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next_v + i * D + c), _MM_HINT_T0);
    }
    for (int j = 0; j < 4; ++j) {  // keys j and j + 4: first halves, then second halves
      const bh lo = (bh)_mm512_shuffle_i64x2(r[j], r[j + 4], 0x44), hi = (bh)_mm512_shuffle_i64x2(r[j], r[j + 4], 0xee);
      for (int h = 0; h < HT; ++h) {
        const uint16_t* qh = q + (h * pieces + c / 16) * 32;
        acc[h][j] = _mm512_dpbf16_ps(acc[h][j], lo, (bh)_mm512_loadu_si512(qh));
        acc[h][j] = _mm512_dpbf16_ps(acc[h][j], hi, (bh)_mm512_loadu_si512(qh + 32));
      }
    }
  }
  for (int h = 0; h < HT; ++h) {
    // w, 128-bit lane L: keys 0..3 (L = 0, 1) or 4..7 (L = 2, 3), each summed over 4 lanes
    const __m512 w = merge64(merge32(acc[h][0], acc[h][1]), merge32(acc[h][2], acc[h][3]));
    const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(w, w, 0x88), _mm512_shuffle_f32x4(w, w, 0xdd));
    _mm256_storeu_ps(s + h * pad, _mm512_castps512_ps256(_mm512_mul_ps(sum, _mm512_set1_ps(scale))));
  }
}

// acc[h] = acc[h] alpha[h] + sum_t p[h, t] v[t] for HT heads over the block's n rows, p as two
// bf16 parts (hi at p, lo at p + lo_offset; rows pad apart), each multiplied exactly: p to 2^-16.
// acc (stride apart) holds each 32 columns c.. in VPUNPCK[LH]WD's order: acc[c + 4L + j] is
// column c + 8L + j, acc[c + 16 + 4L + j] column c + 8L + 4 + j (128-bit lane L, j < 4).
template <int HT>
void values(const uint16_t* p, int64_t pad, int64_t lo_offset, const uint16_t* v, int64_t n, int64_t D,
            const float* alpha, float* acc, int64_t stride) {
  for (int64_t c = 0; c < D; c += 32) {
    const __mmask32 cols = first32(D - c);
    __m512 a[HT][2], b[HT][2];  // the hi and lo parts' sums
    for (int h = 0; h < HT; ++h)
      for (int j = 0; j < 2; ++j) {
        a[h][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * stride + c + 16 * j), _mm512_set1_ps(alpha[h]));
        b[h][j] = _mm512_setzero_ps();
      }
    for (int64_t t = 0; t < n; t += 2) {
      const __m512i x = _mm512_maskz_loadu_epi16(cols, v + t * D + c);
      const __m512i y = _mm512_maskz_loadu_epi16(t + 1 < n ? cols : 0, v + (t + 1) * D + c);
      const bh lo = (bh)_mm512_unpacklo_epi16(x, y), hi = (bh)_mm512_unpackhi_epi16(x, y);
      for (int h = 0; h < HT; ++h) {
        const bh big = pagedserve_bf16::x_pair(p + h * pad + t);
        const bh small = pagedserve_bf16::x_pair(p + lo_offset + h * pad + t);
        a[h][0] = _mm512_dpbf16_ps(a[h][0], lo, big);
        a[h][1] = _mm512_dpbf16_ps(a[h][1], hi, big);
        b[h][0] = _mm512_dpbf16_ps(b[h][0], lo, small);
        b[h][1] = _mm512_dpbf16_ps(b[h][1], hi, small);
      }
    }
    for (int h = 0; h < HT; ++h)
      for (int j = 0; j < 2; ++j) _mm512_storeu_ps(acc + h * stride + c + 16 * j, _mm512_add_ps(a[h][j], b[h][j]));
  }
}

// Per-thread buffers of one work item, for G heads.
struct Buffers {
  int64_t pad, stride, pieces;  // a head's scores (bs up to 16s), acc (D up to 32s), q (16-element pieces)
  std::vector<uint16_t> q;      // [G, pieces, 2, 16] each piece of q twice, unscaled; zeros past D
  std::vector<float> scores;    // [G, pad]
  std::vector<uint16_t> probs;  // [2, G, pad] bf16: hi, lo parts
  std::vector<float> acc;       // [G, stride] in values()' column order
  std::vector<float> sums;      // [G, 16] the softmax's running sums, by lane
  Buffers(int64_t G, int64_t D, int64_t bs)
      : pad((bs + 15) / 16 * 16), stride((D + 31) / 32 * 32), pieces(stride / 16), q(G * pieces * 32),
        scores(G * pad), probs(2 * G * pad), acc(G * stride), sums(G * 16) {}

  void start(const at::BFloat16* qh, int64_t G, int64_t D) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(qh);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < pieces; ++i) {
        const __m256i piece = _mm256_maskz_loadu_epi16(first16(D - 16 * i), src + g * D + 16 * i);
        _mm512_storeu_si512(q.data() + (g * pieces + i) * 32, _mm512_broadcast_i64x4(piece));
      }
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(sums.begin(), sums.end(), 0.f);
  }

  // acc in column order: out [G, D].
  void columns(int64_t G, int64_t D, float* out) const {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < D; c += 32) {
        const float* lanes = acc.data() + g * stride + c;
        const __m512 a = _mm512_loadu_ps(lanes), b = _mm512_loadu_ps(lanes + 16);
        const __m512 x = _mm512_shuffle_f32x4(a, b, 0x44), y = _mm512_shuffle_f32x4(a, b, 0xee);
        _mm512_mask_storeu_ps(out + g * D + c, first16(D - c), _mm512_shuffle_f32x4(x, x, 0xd8));
        _mm512_mask_storeu_ps(out + g * D + c + 16, first16(D - c - 16), _mm512_shuffle_f32x4(y, y, 0xd8));
      }
  }
};

// One block of n rows (k, v) for HT heads from g on: scores, the online-softmax update with
// the probabilities in two bf16 parts, the V accumulation.
template <int HT>
void attend_heads(Buffers& bf, int64_t g, const uint16_t* k, const uint16_t* v, int64_t n, int64_t D, int64_t bs,
             float scale, float* m, const uint16_t* next_k, const uint16_t* next_v) {
  const int64_t pad = bf.pad;
  float* s = bf.scores.data() + g * pad;
  uint16_t* p = bf.probs.data() + g * pad;
  const int64_t lo_offset = static_cast<int64_t>(bf.probs.size() / 2);
  const uint16_t* q = bf.q.data() + g * bf.pieces * 32;
  for (int64_t t = 0; t < n; t += 8) {
    const uint16_t *nk = next_k ? next_k + t * D : nullptr, *nv = next_v ? next_v + t * D : nullptr;
    const int64_t next_rows = std::min<int64_t>(8, bs - t);
    if (n - t >= 8) {
      scores8<HT, true>(q, bf.pieces, D, k + t * D, 8, scale, s + t, pad, nk, nv, next_rows);
    } else {
      scores8<HT, false>(q, bf.pieces, D, k + t * D, n - t, scale, s + t, pad, nk, nv, next_rows);
    }
  }
  float alpha[HT];
  __m512 block_max[HT];
  for (int h = 0; h < HT; ++h) {
    block_max[h] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n; t += 16)
      block_max[h] = _mm512_mask_max_ps(block_max[h], first16(n - t), block_max[h], _mm512_loadu_ps(s + h * pad + t));
  }
  for (int h = 0; h < HT; ++h) {
    alpha[h] = 1.f;
    if (_mm512_cmp_ps_mask(block_max[h], _mm512_set1_ps(m[h]), _CMP_GT_OQ)) {  // a new running max
      const float m_new = _mm512_reduce_max_ps(block_max[h]);
      alpha[h] = std::exp(m[h] - m_new);  // 0 on the first block (m = -inf)
      m[h] = m_new;
    }
  }
  for (int h = 0; h < HT; ++h) {
    const __m512 vm = _mm512_set1_ps(m[h]);
    float* sums = bf.sums.data() + (g + h) * 16;
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(sums), _mm512_set1_ps(alpha[h]));
    for (int64_t t = 0; t < n; t += 16) {
      const __m512 e = _mm512_maskz_mov_ps(first16(n - t), exp16(_mm512_sub_ps(_mm512_loadu_ps(s + h * pad + t), vm)));
      const __m256i hi = (__m256i)_mm512_cvtneps_pbh(e);
      const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, hi_f));
      const __m512 lo_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(lo), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + h * pad + t), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + lo_offset + h * pad + t), lo);
      sum = _mm512_add_ps(sum, _mm512_add_ps(hi_f, lo_f));
    }
    _mm512_storeu_ps(sums, sum);
  }
  values<HT>(p, pad, lo_offset, v, n, D, alpha, bf.acc.data() + g * bf.stride, bf.stride);
}

}  // namespace dot

// attend_range for bf16 on VDPBF16PS: qh [G, D] unscaled; leaves acc ([G, D], columns in
// order), m and l in sc. Heads go in tiles of up to 4; each head's arithmetic is its own.
void attend_range_bf16(const Shape& sh, const at::BFloat16* cache, const int64_t* table, int64_t head, int64_t len,
                       int64_t start, int64_t first_block, int64_t end_block, const at::BFloat16* qh, float scale,
                       dot::Buffers& bf, Scratch& sc) {
  const int64_t G = sh.G, D = sh.D, bs = sh.block_size, block_numel = bs * D;
  const uint16_t* k_head = reinterpret_cast<const uint16_t*>(cache) + head * sh.num_blocks * block_numel;
  const uint16_t* v_head = reinterpret_cast<const uint16_t*>(cache) + (sh.Hkv + head) * sh.num_blocks * block_numel;
  bf.start(qh, G, D);
  std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<float>::infinity());
  for (int64_t i = first_block; i < end_block; ++i) {
    const int64_t skip = std::max<int64_t>(0, start - i * bs);  // rows before the window
    const int64_t n = std::min(bs, len - i * bs) - skip;
    const int64_t offset = table[i] * block_numel + skip * D;
    const uint16_t *k = k_head + offset, *v = v_head + offset;
    const uint16_t* nk = i + 1 < end_block ? k_head + table[i + 1] * block_numel : nullptr;
    const uint16_t* nv = nk ? v_head + table[i + 1] * block_numel : nullptr;
    if (i + 2 < end_block) {
      prefetch_l2(k_head + table[i + 2] * block_numel, v_head + table[i + 2] * block_numel, block_numel);
    }
    for (int64_t g = 0, tile; g < G; g += tile, nk = nv = nullptr) {  // the first tile prefetches for all
      tile = std::min<int64_t>(dot::kMaxHeads, G - g);
      float* m = sc.m.data() + g;
      switch (tile) {
        case 1: dot::attend_heads<1>(bf, g, k, v, n, D, bs, scale, m, nk, nv); break;
        case 2: dot::attend_heads<2>(bf, g, k, v, n, D, bs, scale, m, nk, nv); break;
        case 3: dot::attend_heads<3>(bf, g, k, v, n, D, bs, scale, m, nk, nv); break;
        default: dot::attend_heads<4>(bf, g, k, v, n, D, bs, scale, m, nk, nv); break;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) sc.l[g] = _mm512_reduce_add_ps(_mm512_loadu_ps(bf.sums.data() + g * 16));
  bf.columns(G, D, sc.acc.data());
}
#endif  // PAGED_BF16_DOT

// The softmax's denominator given the keys' running max m and sum l (relative to m), and the
// factor the values' sums (relative to m) take: (l, 1) alone; with a sink, relative to
// m' = max(m, sink): (l e^(m - m') + e^(sink - m'), e^(m - m')). A sink of -inf gives (l, 1)
// exactly, so the output keeps its bits: acc * 1 / l.
struct Denominator {
  float sum, rescale;
};
inline Denominator denominator(float m, float l, const float* sink) {
  if (sink == nullptr) return {l, 1.f};
  const float m2 = std::max(m, *sink), rescale = std::exp(m - m2);
  return {l * rescale + std::exp(*sink - m2), rescale};
}

template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                 const at::Tensor& context_lens, double scale, int64_t window, const float* sinks, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  Shape sh{Hq / kv_cache.size(1), D, kv_cache.size(1), kv_cache.size(2), kv_cache.size(3),
           block_tables.size(1), 0};
  sh.part_blocks = std::max<int64_t>(1, kPartitionTokens / sh.block_size);
  const int64_t G = sh.G, bs = sh.block_size;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();

  // Work items (sequence, kv head, partition); split sequences' partials go to `partials`
  // at `slot`, as [G, D] weighted sums, then [G] maxima, then [G] sums.
  struct Item { int64_t b, head, part, slot; };
  std::vector<Item> items;
  std::vector<int64_t> num_parts(B), part_base(B), starts(B);
  int64_t num_partials = 0, total = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b], nblk = (len + bs - 1) / bs;
    TORCH_CHECK(len >= 1 && nblk <= sh.width, "paged_decode: context_lens[", b, "] = ", len,
                " must lie in [1, ", sh.width * bs, "] (block table width x block size)");
    starts[b] = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t first_block = starts[b] / bs;
    for (int64_t i = first_block; i < nblk; ++i) {
      const int64_t blk = tables[b * sh.width + i];
      TORCH_CHECK(blk >= 0 && blk < sh.num_blocks, "paged_decode: block_tables[", b, ", ", i, "] = ", blk,
                  " is out of range [0, ", sh.num_blocks, ")");
    }
    num_parts[b] = (nblk - first_block + sh.part_blocks - 1) / sh.part_blocks;
    part_base[b] = num_partials;
    if (num_parts[b] > 1) num_partials += num_parts[b] * sh.Hkv;
    for (int64_t h = 0; h < sh.Hkv; ++h)
      for (int64_t p = 0; p < num_parts[b]; ++p)
        items.push_back({b, h, p, num_parts[b] > 1 ? part_base[b] + h * num_parts[b] + p : -1});
    total += len - starts[b];
  }
  const int64_t partial_size = G * (D + 2);
  std::vector<float> partials(num_partials * partial_size);

  const T* cache = kv_cache.data_ptr<T>();
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next_item{0};

  auto worker = [&](int64_t, int64_t) {
    Scratch sc;
    sc.q.resize(G * D);
    sc.scores.resize(G * ((bs + 7) / 8 * 8));
    sc.acc.resize(G * D);
    sc.m.resize(G);
    sc.l.resize(G);
    sc.alpha.resize(G);
#ifdef PAGED_BF16_DOT
    std::optional<dot::Buffers> buffers;
    if constexpr (std::is_same_v<T, at::BFloat16>) buffers.emplace(G, D, bs);
#endif
    // Threads take items as they free up: contexts differ, a static split would not balance.
    for (int64_t i; (i = next_item.fetch_add(1)) < num_items;) {
      const Item& it = items[i];
      const T* qh = qp + it.b * q.stride(0) + it.head * G * D;
      const int64_t nblk = (lens[it.b] + bs - 1) / bs;
      const int64_t first = starts[it.b] / bs + it.part * sh.part_blocks;
      const int64_t end = std::min(nblk, first + sh.part_blocks);
      const int64_t* table = tables + it.b * sh.width;
#ifdef PAGED_BF16_DOT
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        attend_range_bf16(sh, cache, table, it.head, lens[it.b], starts[it.b], first, end, qh,
                          static_cast<float>(scale), *buffers, sc);
      } else
#endif
      {
        for (int64_t j = 0; j < G * D; ++j) sc.q[j] = to_float(qh[j]) * static_cast<float>(scale);
        attend_range(sh, cache, table, it.head, lens[it.b], starts[it.b], first, end, sc);
      }
      if (it.slot < 0) {  // the whole context in one item: finish here
        T* o = op + (it.b * sh.Hkv + it.head) * G * D;
        for (int64_t g = 0; g < G; ++g) {
          const Denominator d = denominator(sc.m[g], sc.l[g], sinks ? sinks + it.head * G + g : nullptr);
          const float inv = d.rescale / d.sum;
          for (int64_t c = 0; c < D; ++c) o[g * D + c] = static_cast<T>(sc.acc[g * D + c] * inv);
        }
      } else {
        float* dst = partials.data() + it.slot * partial_size;
        std::copy(sc.acc.begin(), sc.acc.end(), dst);
        std::copy(sc.m.begin(), sc.m.end(), dst + G * D);
        std::copy(sc.l.begin(), sc.l.end(), dst + G * D + G);
      }
    }
  };
  const bool serial = total * sh.Hkv * D * 2 < kSerialElements;
  const int64_t num_threads = serial ? 1 : std::min<int64_t>(at::get_num_threads(), num_items);
  if (num_threads <= 1) {
    worker(0, 1);
  } else {
    at::parallel_for(0, num_threads, 1, worker);  // one call per thread
  }

  // Combine the partitions of split sequences, in partition order.
  std::vector<float> acc(D);
  for (int64_t b = 0; b < B; ++b) {
    if (num_parts[b] <= 1) continue;
    for (int64_t h = 0; h < sh.Hkv; ++h) {
      const float* first = partials.data() + (part_base[b] + h * num_parts[b]) * partial_size;
      T* o = op + (b * sh.Hkv + h) * G * D;
      for (int64_t g = 0; g < G; ++g) {
        float m = -std::numeric_limits<float>::infinity(), l = 0.f;
        for (int64_t p = 0; p < num_parts[b]; ++p) m = std::max(m, first[p * partial_size + G * D + g]);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = 0; p < num_parts[b]; ++p) {
          const float* part = first + p * partial_size;
          const float w = std::exp(part[G * D + g] - m);
          l += part[G * D + G + g] * w;
          for (int64_t c = 0; c < D; ++c) acc[c] += part[g * D + c] * w;
        }
        const Denominator d = denominator(m, l, sinks ? sinks + h * G + g : nullptr);
        for (int64_t c = 0; c < D; ++c) o[g * D + c] = static_cast<T>(acc[c] * d.rescale / d.sum);
      }
    }
  }
}

// The int8 cache's ops (family paged_attention_int8, which must be loaded: cpu_kernels.ops does).
template <typename Fn>
c10::TypedOperatorHandle<Fn> int8_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale, int64_t window,
                        const std::optional<at::Tensor>& sinks) {
  if (kv_cache.scalar_type() == at::kChar) {
    using Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                          const std::optional<at::Tensor>&);
    static const auto op = int8_op<Fn>("pagedserve_cpu::paged_decode_int8");
    return op.call(q, kv_cache, block_tables, context_lens, scale, window, sinks);
  }
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2 && context_lens.dim() == 1,
              "paged_decode: want q [B, Hq, D], kv_cache [2, Hkv, N, bs, D], block_tables [B, W], "
              "context_lens [B]");
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.scalar_type() == q.scalar_type(),
              "paged_decode: kv_cache must be contiguous and of q's dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_decode: q's heads must be D apart, their elements contiguous");
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == q.size(2) && q.size(2) % 8 == 0 &&
              q.size(1) % kv_cache.size(1) == 0, "paged_decode: shape mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && context_lens.is_contiguous() &&
              block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_decode: block_tables [B, W] and context_lens [B] must be contiguous int64");
  TORCH_CHECK(window >= 0, "paged_decode: window must be >= 0 (0: the whole context)");
  const float* sink = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                sinks->size(0) == q.size(1), "paged_decode: sinks must be contiguous float32 [Hq]");
    sink = sinks->data_ptr<float>();
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    decode_impl<float>(q, kv_cache, block_tables, context_lens, scale, window, sink, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_decode: float32 or bfloat16 only");
    decode_impl<at::BFloat16>(q, kv_cache, block_tables, context_lens, scale, window, sink, out);
  }
  return out;
}

// Write each new token's K and V ([T, Hkv, D] views, rows strided, as split from the fused
// qkv) into its slot of the cache; rows past slot_mapping's length are padding.
void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  if (kv_cache.scalar_type() == at::kChar) {
    using Fn = void(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&);
    static const auto op = int8_op<Fn>("pagedserve_cpu::reshape_and_cache_int8");
    return op.call(k, v, kv_cache, slot_mapping);
  }
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "reshape_and_cache: k and v must be [T, Hkv, D] with heads D apart, elements contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2 &&
              kv_cache.size(1) == k.size(1) && kv_cache.size(4) == k.size(2) &&
              kv_cache.scalar_type() == k.scalar_type() && v.scalar_type() == k.scalar_type(),
              "reshape_and_cache: kv_cache must be a contiguous [2, Hkv, N, bs, D] tensor of k's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() <= k.size(0), "reshape_and_cache: slot_mapping must be contiguous int64, one per row");
  const int64_t rows = slot_mapping.numel(), heads = k.size(1), dim = k.size(2);
  const int64_t slots = kv_cache.size(2) * kv_cache.size(3), bytes = dim * k.element_size();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "reshape_and_cache: slot ", slot[t], " is outside the cache");
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* src[2] = {static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr())};
  const int64_t row_stride[2] = {k.stride(0) * k.element_size(), v.stride(0) * v.element_size()};
  for (int64_t t = 0; t < rows; ++t)
    for (int which = 0; which < 2; ++which)
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(cache + ((which * heads + h) * slots + slot[t]) * bytes, src[which] + t * row_stride[which] + h * bytes,
                    bytes);
}

bool paged_decode_bf16_dot() {
#ifdef PAGED_BF16_DOT
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("paged_decode_bf16_dot() -> bool", &paged_decode_bf16_dot);
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()", &reshape_and_cache);
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, float scale, "
        "int window=0, Tensor? sinks=None) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
