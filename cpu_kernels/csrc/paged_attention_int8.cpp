// Paged attention over an int8 KV cache (--kv-cache-dtype int8): the cache write that
// quantizes and the decode kernel that reads it. paged_attention.cpp's reshape_and_cache and
// paged_decode hand an int8 cache to these ops, so Python and the one-call decode layers
// (decode_layers.cpp) reach them through the same two ops.
//
//   kv_cache  [2, Hkv, num_blocks, block_size, D + 2] int8, contiguous; one row per (token, head):
//             +-----------------------------+-------------+
//             | q[0] ... q[D-1]       int8  | scale  bf16 |    x[c] ~= q[c] * scale
//             +-----------------------------+-------------+
//   scale = amax(|x|) / 127 in float32 (at least kMinScale), rounded UP to bfloat16, so that
//   |x / scale| <= 127; q = round-half-to-even(x / scale), a true division: the same bits as
//   engine/attention/kv_format.py's quantize_int8.
//
// Decode follows paged_attention.cpp's float kernel (work items of (sequence, kv head,
// partition), online softmax a block at a time, fixed partitions: batch invariant), with the
// dequantization folded into the arithmetic, in registers: a key's scale multiplies its G
// scores (s = scale_k * (q . k_int8)), a value's scale its G probabilities before the V sum
// (the softmax's denominator keeps the unscaled ones). A row is 66 bytes at D = 64 where bf16
// reads 128. AVX2 (float arithmetic on widened int8, any x86-64 with AVX2, AVX-512 machines
// included); plain C++ elsewhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPartitionTokens = 512;  // as the float kernel: the same partitions
constexpr int64_t kSerialElements = 1 << 15;
constexpr int64_t kScaleBytes = 2;
constexpr float kMinScale = 0x1p-32f;  // kv_format.MIN_SCALE

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// The bfloat16 scale stored after a row's D values, as a float.
inline float row_scale(const int8_t* row, int64_t D) {
  uint16_t bits;
  std::memcpy(&bits, row + D, sizeof bits);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// amax / 127, at least kMinScale, rounded up to a bfloat16 value (positive: carry the low bits).
inline float int8_scale(float amax) {
  const float s = std::max(amax / 127.0f, kMinScale);
  uint32_t bits;
  std::memcpy(&bits, &s, sizeof bits);
  bits = (bits + 0xFFFFu) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

// One row x[0..D) (float) -> q[0..D) and its scale's two bytes.
void quantize_row(const float* x, int64_t D, int8_t* out) {
  float amax = 0.f;
  for (int64_t c = 0; c < D; ++c) amax = std::max(amax, std::fabs(x[c]));
  const float scale = int8_scale(amax);
  int64_t c = 0;
#ifdef __AVX2__
  const __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (; c + 8 <= D; c += 8) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + c), vs),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // half to even
    __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + c), _mm_packs_epi16(i16, i16));
  }
#endif
  for (; c < D; ++c) out[c] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[c] / scale))));
  uint32_t wide;
  std::memcpy(&wide, &scale, sizeof wide);
  const uint16_t bits = static_cast<uint16_t>(wide >> 16);  // exact: the scale is a bf16 value
  std::memcpy(out + D, &bits, sizeof bits);
}

template <typename T>
void write_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const int64_t* slot, int64_t rows) {
  const int64_t heads = k.size(1), D = k.size(2), R = D + kScaleBytes, slots = kv_cache.size(2) * kv_cache.size(3);
  int8_t* cache = kv_cache.data_ptr<int8_t>();
  const T* src[2] = {k.data_ptr<T>(), v.data_ptr<T>()};
  const int64_t row_stride[2] = {k.stride(0), v.stride(0)};
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / (heads * D)), [&](int64_t begin, int64_t end) {
    std::vector<float> x(D);
    for (int64_t t = begin; t < end; ++t)
      for (int which = 0; which < 2; ++which)
        for (int64_t h = 0; h < heads; ++h) {
          const T* in = src[which] + t * row_stride[which] + h * D;
          for (int64_t c = 0; c < D; ++c) x[c] = to_float(in[c]);
          quantize_row(x.data(), D, cache + ((which * heads + h) * slots + slot[t]) * R);
        }
  });
}

void reshape_and_cache_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                            const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2) && v.scalar_type() == k.scalar_type(),
              "reshape_and_cache_int8: k and v must be [T, Hkv, D] of one dtype, heads D apart, elements contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kChar &&
              kv_cache.size(0) == 2 && kv_cache.size(1) == k.size(1) && kv_cache.size(4) == k.size(2) + kScaleBytes,
              "reshape_and_cache_int8: kv_cache must be a contiguous int8 [2, Hkv, N, bs, D + 2] tensor");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() <= k.size(0), "reshape_and_cache_int8: slot_mapping must be contiguous int64, "
              "one per row");
  const int64_t rows = slot_mapping.numel(), slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "reshape_and_cache_int8: slot ", slot[t], " is outside the cache");
  if (k.scalar_type() == at::kFloat) {
    write_rows<float>(k, v, kv_cache, slot, rows);
  } else {
    TORCH_CHECK(k.scalar_type() == at::kBFloat16, "reshape_and_cache_int8: float32 or bfloat16 k and v only");
    write_rows<at::BFloat16>(k, v, kv_cache, slot, rows);
  }
}

// ---- decode ---------------------------------------------------------------------------------

#ifdef __AVX2__
inline __m256 load8(const int8_t* p) {  // 8 int8 -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

constexpr int kHeadTile = 3;  // 3 heads x 4 rows: 12 accumulators + operands in 16 ymm

// s[h, t] = scale_k[t] * (q[h] . k[t]) for HT heads and the block's n rows (R bytes apart).
// Brings the next block's K and V rows (next_k/next_v, or null) into L1 on the way, spread over
// the loop as the float kernel does: blocks are scattered and hardware prefetchers stop at page
// boundaries. A block's rows are contiguous, so 4 rows are 4R bytes: 5 lines at D = 64.
template <int HT>
void scores_tile(const float* q, const int8_t* k, int64_t n, int64_t D, int64_t R, float* s, int64_t pad,
                 const int8_t* next_k, const int8_t* next_v) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    __m256 a[HT][4];
    for (int h = 0; h < HT; ++h)
      for (int j = 0; j < 4; ++j) a[h][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      if (next_k && c < 16) {  // rows t..t+3 of the next block: 4R contiguous bytes, 3 lines now, 2 next
        for (int64_t at = c == 0 ? 0 : 192; at < (c == 0 ? 192 : 4 * R); at += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(next_k + t * R + at), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next_v + t * R + at), _MM_HINT_T0);
        }
      }
      __m256 qv[HT];
      for (int h = 0; h < HT; ++h) qv[h] = _mm256_loadu_ps(q + h * D + c);
      for (int j = 0; j < 4; ++j) {
        const __m256 kv = load8(k + (t + j) * R + c);
        for (int h = 0; h < HT; ++h) a[h][j] = _mm256_fmadd_ps(kv, qv[h], a[h][j]);
      }
    }
    const __m128 scales = _mm_setr_ps(row_scale(k + t * R, D), row_scale(k + (t + 1) * R, D),
                                      row_scale(k + (t + 2) * R, D), row_scale(k + (t + 3) * R, D));
    for (int h = 0; h < HT; ++h)
      _mm_storeu_ps(s + h * pad + t, _mm_mul_ps(hsum4(a[h][0], a[h][1], a[h][2], a[h][3]), scales));
  }
  for (; t < n; ++t) {
    __m256 a[HT];
    for (int h = 0; h < HT; ++h) a[h] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 kv = load8(k + t * R + c);
      for (int h = 0; h < HT; ++h) a[h] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q + h * D + c), a[h]);
    }
    const float scale = row_scale(k + t * R, D);
    for (int h = 0; h < HT; ++h) s[h * pad + t] = hsum(a[h]) * scale;
  }
}

// acc[h, c:c+8CT] = acc * alpha[h] + sum_t p[h, t] scale_v[t] v[t, c:c+8CT] (the scale folded
// into the probability, read from the row as it is reached).
template <int HT, int CT>
inline void values_tile(const float* w, int64_t pad, const int8_t* v, int64_t n, int64_t D, int64_t R,
                        const float* alpha, float* acc, int64_t c) {
  __m256 a[HT][CT];
  for (int h = 0; h < HT; ++h)
    for (int j = 0; j < CT; ++j)
      a[h][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + c + 8 * j), _mm256_set1_ps(alpha[h]));
  for (int64_t t = 0; t < n; ++t) {
    __m256 wh[HT];
    const float scale = row_scale(v + t * R, D);
    for (int h = 0; h < HT; ++h) wh[h] = _mm256_set1_ps(w[h * pad + t] * scale);
    for (int j = 0; j < CT; ++j) {
      const __m256 vv = load8(v + t * R + c + 8 * j);
      for (int h = 0; h < HT; ++h) a[h][j] = _mm256_fmadd_ps(wh[h], vv, a[h][j]);
    }
  }
  for (int h = 0; h < HT; ++h)
    for (int j = 0; j < CT; ++j) _mm256_storeu_ps(acc + h * D + c + 8 * j, a[h][j]);
}
#endif  // __AVX2__

#ifdef __AVX2__
inline float hmax(__m256 a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for x <= 0: paged_attention.cpp's exp8 (Cephes' expf, ~1 ulp; 0 far below zero). A
// scalar exp per key and head cost as much as the int8 dot products themselves.
inline __m256 exp8(__m256 x) {
  constexpr float kPoly[] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f, 4.1665795894E-2f,
                             1.6666665459E-1f, 5.0000001201E-1f};
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
#endif

// Online-softmax update of one head with n scores: probabilities relative to the new running
// max in s; returns the factor for the old sums.
inline float softmax_update(float* s, int64_t n, float& m, float& l) {
  float block_max = -std::numeric_limits<float>::infinity(), sum = 0.f;
  int64_t t = 0;
#ifdef __AVX2__
  __m256 vmax = _mm256_set1_ps(block_max);
  for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
  block_max = hmax(vmax);
#endif
  for (; t < n; ++t) block_max = std::max(block_max, s[t]);
  const float m_new = std::max(m, block_max), alpha = std::exp(m - m_new);  // 0 on the first block
  t = 0;
#ifdef __AVX2__
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
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

struct Scratch {
  std::vector<float> q, scores, acc, m, l, alpha;
};

// One block of n rows for all G heads of a kv head (the first head tile prefetches the next block).
void attend_block(Scratch& sc, const int8_t* k, const int8_t* v, int64_t n, int64_t G, int64_t D, int64_t pad,
                  const int8_t* next_k, const int8_t* next_v) {
  const int64_t R = D + kScaleBytes;
  for (int64_t g = 0; g < G;) {
    float *s = sc.scores.data() + g * pad, *acc = sc.acc.data() + g * D;
    const float* q = sc.q.data() + g * D;
#ifdef __AVX2__
    const int64_t tile = std::min<int64_t>(kHeadTile, G - g);
    const int8_t *nk = g ? nullptr : next_k, *nv = g ? nullptr : next_v;
    switch (tile) {
      case 1: scores_tile<1>(q, k, n, D, R, s, pad, nk, nv); break;
      case 2: scores_tile<2>(q, k, n, D, R, s, pad, nk, nv); break;
      default: scores_tile<3>(q, k, n, D, R, s, pad, nk, nv); break;
    }
#else
    const int64_t tile = 1;
    (void)next_k, (void)next_v;
    for (int64_t t = 0; t < n; ++t) {
      float dot = 0.f;
      for (int64_t c = 0; c < D; ++c) dot += static_cast<float>(k[t * R + c]) * q[c];
      s[t] = dot * row_scale(k + t * R, D);
    }
#endif
    for (int64_t h = 0; h < tile; ++h) sc.alpha[g + h] = softmax_update(s + h * pad, n, sc.m[g + h], sc.l[g + h]);
#ifdef __AVX2__
    const float* alpha = sc.alpha.data() + g;
    for (int64_t c = 0; c < D;) {
      const bool four = c + 32 <= D;
      switch (tile * 2 + four) {
        case 2: values_tile<1, 1>(s, pad, v, n, D, R, alpha, acc, c); break;
        case 3: values_tile<1, 4>(s, pad, v, n, D, R, alpha, acc, c); break;
        case 4: values_tile<2, 1>(s, pad, v, n, D, R, alpha, acc, c); break;
        case 5: values_tile<2, 4>(s, pad, v, n, D, R, alpha, acc, c); break;
        case 6: values_tile<3, 1>(s, pad, v, n, D, R, alpha, acc, c); break;
        default: values_tile<3, 4>(s, pad, v, n, D, R, alpha, acc, c); break;
      }
      c += four ? 32 : 8;
    }
#else
    for (int64_t c = 0; c < D; ++c) acc[c] *= sc.alpha[g];
    for (int64_t t = 0; t < n; ++t) {
      const float w = s[t] * row_scale(v + t * R, D);
      for (int64_t c = 0; c < D; ++c) acc[c] += w * static_cast<float>(v[t * R + c]);
    }
#endif
    g += tile;
  }
}

struct Shape {
  int64_t G, D, Hkv, num_blocks, block_size, width, part_blocks;
};

// A block's K and V rows into L2, two blocks before their use (as the float kernel does:
// blocks are scattered, and hardware prefetchers stop at page boundaries).
inline void prefetch_l2(const int8_t* k, const int8_t* v, int64_t bytes) {
  for (int64_t e = 0; e < bytes; e += 64) {
    __builtin_prefetch(k + e, 0, 2);
    __builtin_prefetch(v + e, 0, 2);
  }
}

// Attention of one kv head's G query heads (sc.q, pre-scaled) over the context blocks
// [first_block, end_block) of a sequence of length len, from position `start` on.
void attend_range(const Shape& sh, const int8_t* cache, const int64_t* table, int64_t head, int64_t len,
                  int64_t start, int64_t first_block, int64_t end_block, Scratch& sc) {
  const int64_t R = sh.D + kScaleBytes, bs = sh.block_size, block_bytes = bs * R, pad = (bs + 7) / 8 * 8;
  const int8_t* k_head = cache + head * sh.num_blocks * block_bytes;
  const int8_t* v_head = cache + (sh.Hkv + head) * sh.num_blocks * block_bytes;
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.end(), 0.f);
  for (int64_t i = first_block; i < std::min(first_block + 2, end_block); ++i)  // the loop prefetches from 2 on
    prefetch_l2(k_head + table[i] * block_bytes, v_head + table[i] * block_bytes, block_bytes);
  for (int64_t i = first_block; i < end_block; ++i) {
    const int64_t skip = std::max<int64_t>(0, start - i * bs);  // rows before the window
    const int64_t n = std::min(bs, len - i * bs) - skip;
    const int64_t offset = table[i] * block_bytes + skip * R;
    const int64_t next = i + 1 < end_block ? table[i + 1] * block_bytes : -1;
    if (i + 2 < end_block) prefetch_l2(k_head + table[i + 2] * block_bytes, v_head + table[i + 2] * block_bytes,
                                       block_bytes);
    attend_block(sc, k_head + offset, v_head + offset, n, sh.G, sh.D, pad, next < 0 ? nullptr : k_head + next,
                 next < 0 ? nullptr : v_head + next);
  }
}

// The softmax's denominator and the values' rescale with an optional sink (paged_attention.cpp's).
struct Denominator {
  float sum, rescale;
};
inline Denominator denominator(float m, float l, const float* sink) {
  if (sink == nullptr) return {l, 1.f};
  const float m2 = std::max(m, *sink), rescale = std::exp(m - m2);
  return {l * rescale + std::exp(*sink - m2), rescale};
}

struct Item {
  int64_t b, head, part, slot;
};

template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& kv_cache, const int64_t* tables, const int64_t* lens,
                 int64_t width, double scale, int64_t window, const float* sinks, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  Shape sh{Hq / kv_cache.size(1), D, kv_cache.size(1), kv_cache.size(2), kv_cache.size(3), width, 0};
  sh.part_blocks = std::max<int64_t>(1, kPartitionTokens / sh.block_size);
  const int64_t G = sh.G, bs = sh.block_size;
  std::vector<Item> items;
  std::vector<int64_t> num_parts(B), part_base(B), starts(B);
  int64_t num_partials = 0, total = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b], nblk = (len + bs - 1) / bs;
    TORCH_CHECK(len >= 1 && nblk <= width, "paged_decode: context_lens[", b, "] = ", len, " must lie in [1, ",
                width * bs, "] (block table width x block size)");
    starts[b] = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    for (int64_t i = starts[b] / bs; i < nblk; ++i) {
      const int64_t blk = tables[b * width + i];
      TORCH_CHECK(blk >= 0 && blk < sh.num_blocks, "paged_decode: block_tables[", b, ", ", i, "] = ", blk,
                  " is out of range [0, ", sh.num_blocks, ")");
    }
    num_parts[b] = (nblk - starts[b] / bs + sh.part_blocks - 1) / sh.part_blocks;
    part_base[b] = num_partials;
    if (num_parts[b] > 1) num_partials += num_parts[b] * sh.Hkv;
    for (int64_t h = 0; h < sh.Hkv; ++h)
      for (int64_t p = 0; p < num_parts[b]; ++p)
        items.push_back({b, h, p, num_parts[b] > 1 ? part_base[b] + h * num_parts[b] + p : -1});
    total += len - starts[b];
  }
  const int64_t partial_size = G * (D + 2);
  std::vector<float> partials(num_partials * partial_size);
  const int8_t* cache = kv_cache.data_ptr<int8_t>();
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next_item{0};

  auto worker = [&](int64_t, int64_t) {
    Scratch sc;
    const int64_t pad = (bs + 7) / 8 * 8;
    sc.q.resize(G * D), sc.scores.resize(G * pad), sc.acc.resize(G * D);
    sc.m.resize(G), sc.l.resize(G), sc.alpha.resize(G);
    for (int64_t i; (i = next_item.fetch_add(1)) < num_items;) {
      const Item& it = items[i];
      const T* qh = qp + it.b * q.stride(0) + it.head * G * D;
      const int64_t nblk = (lens[it.b] + bs - 1) / bs;
      const int64_t first = starts[it.b] / bs + it.part * sh.part_blocks;
      const int64_t end = std::min(nblk, first + sh.part_blocks);
      for (int64_t j = 0; j < G * D; ++j) sc.q[j] = to_float(qh[j]) * static_cast<float>(scale);
      attend_range(sh, cache, tables + it.b * width, it.head, lens[it.b], starts[it.b], first, end, sc);
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
    at::parallel_for(0, num_threads, 1, worker);
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

at::Tensor paged_decode_int8(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, double scale, int64_t window,
                             const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2 && context_lens.dim() == 1,
              "paged_decode_int8: want q [B, Hq, D], kv_cache [2, Hkv, N, bs, D + 2], block_tables [B, W], "
              "context_lens [B]");
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode_int8: CPU tensors only");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kChar,
              "paged_decode_int8: kv_cache must be contiguous int8");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_decode_int8: q's heads must be D apart, their elements contiguous");
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == q.size(2) + kScaleBytes && q.size(2) % 8 == 0 &&
              q.size(1) % kv_cache.size(1) == 0, "paged_decode_int8: shape mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && context_lens.is_contiguous() &&
              block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_decode_int8: block_tables [B, W] and context_lens [B] must be contiguous int64");
  TORCH_CHECK(window >= 0, "paged_decode_int8: window must be >= 0 (0: the whole context)");
  const float* sink = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                sinks->size(0) == q.size(1), "paged_decode_int8: sinks must be contiguous float32 [Hq]");
    sink = sinks->data_ptr<float>();
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  if (q.scalar_type() == at::kFloat) {
    decode_impl<float>(q, kv_cache, tables, lens, block_tables.size(1), scale, window, sink, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_decode_int8: float32 or bfloat16 q only");
    decode_impl<at::BFloat16>(q, kv_cache, tables, lens, block_tables.size(1), scale, window, sink, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("reshape_and_cache_int8(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
        &reshape_and_cache_int8);
  m.def("paged_decode_int8(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, float scale, "
        "int window=0, Tensor? sinks=None) -> Tensor");
  m.impl("paged_decode_int8", c10::DispatchKey::CPU, TORCH_FN(paged_decode_int8));
}
