// Shared by every kernel: element types, 16-byte vector conversions, cp.async, the K/V tile
// copy into shared memory (an fp8 cache's widened to T on the way), and a decode CTA's share
// of the grid.
//
// No CUDA header is included on purpose: NVRTC then compiles these sources the
// same way on any image (a pip-installed cupy without toolkit headers too).
// fp16/bf16 are plain 16-bit payloads converted with PTX or bit shifts.
//
// The launcher prepends this file (after fp8.cuh) to each .cu source, so that CuPy's on-disk
// kernel cache (keyed by source text) sees every change here.

typedef unsigned short u16;
typedef unsigned int u32;

struct half_t { u16 bits; };
struct bf16_t { u16 bits; };

#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ u16 float_to_half(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// Round to nearest even, as torch does; NaN stays NaN.
__device__ __forceinline__ u16 float_to_bf16(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}

// Pack<T>: how T travels in 16-byte vectors (uint4) and 4-element groups.
//   N      elements per 16-byte vector
//   Quad   type holding 4 elements (8 bytes for 16-bit types, 16 for float)
template <typename T> struct Pack;

template <> struct Pack<float> {
  static constexpr int N = 4;
  typedef uint4 Quad;
  __device__ static void unpack(const uint4& v, float* o) {
    o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y);
    o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w);
  }
  __device__ static void unpack_quad(const Quad& v, float* o) { unpack(v, o); }
  __device__ static uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]),
                      __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
  __device__ static float to_float(float x) { return x; }
  __device__ static float from_float(float x) { return x; }
};

template <> struct Pack<half_t> {
  static constexpr int N = 8;
  typedef uint2 Quad;
  __device__ static void unpack_word(u32 w, float* o) {
    o[0] = half_to_float((u16)(w & 0xffffu));
    o[1] = half_to_float((u16)(w >> 16));
  }
  __device__ static void unpack(const uint4& v, float* o) {
    unpack_word(v.x, o); unpack_word(v.y, o + 2); unpack_word(v.z, o + 4); unpack_word(v.w, o + 6);
  }
  __device__ static void unpack_quad(const Quad& v, float* o) { unpack_word(v.x, o); unpack_word(v.y, o + 2); }
  __device__ static u32 pack_word(float a, float b) {
    return (u32)float_to_half(a) | ((u32)float_to_half(b) << 16);
  }
  __device__ static uint4 pack(const float* f) {
    return make_uint4(pack_word(f[0], f[1]), pack_word(f[2], f[3]),
                      pack_word(f[4], f[5]), pack_word(f[6], f[7]));
  }
  __device__ static float to_float(half_t x) { return half_to_float(x.bits); }
  __device__ static half_t from_float(float x) { half_t h; h.bits = float_to_half(x); return h; }
};

template <> struct Pack<bf16_t> {
  static constexpr int N = 8;
  typedef uint2 Quad;
  // bf16 is the top half of a float: widening is a shift or a mask.
  __device__ static void unpack_word(u32 w, float* o) {
    o[0] = __uint_as_float(w << 16);
    o[1] = __uint_as_float(w & 0xffff0000u);
  }
  __device__ static void unpack(const uint4& v, float* o) {
    unpack_word(v.x, o); unpack_word(v.y, o + 2); unpack_word(v.z, o + 4); unpack_word(v.w, o + 6);
  }
  __device__ static void unpack_quad(const Quad& v, float* o) { unpack_word(v.x, o); unpack_word(v.y, o + 2); }
  __device__ static u32 pack_word(float a, float b) {
    return (u32)float_to_bf16(a) | ((u32)float_to_bf16(b) << 16);
  }
  __device__ static uint4 pack(const float* f) {
    return make_uint4(pack_word(f[0], f[1]), pack_word(f[2], f[3]),
                      pack_word(f[4], f[5]), pack_word(f[6], f[7]));
  }
  __device__ static float to_float(bf16_t x) { return __uint_as_float(((u32)x.bits) << 16); }
  __device__ static bf16_t from_float(float x) { bf16_t h; h.bits = float_to_bf16(x); return h; }
};

// Asynchronous 16-byte global -> shared copy (sm_80+). With valid == false the
// destination is zero-filled and nothing is read, so rows past a sequence's end
// hold zeros, never stale data (a stale NaN times a zero probability is NaN).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const u32 dst = (u32)__cvta_generic_to_shared(smem);
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Offset, in elements, of token `offset` of physical block `block` for KV head `head`
// in one half (K or V) of the cache: [Hkv, num_blocks, block_size, D].
// 64-bit: a large cache passes 2^31 elements.
template <int D, int BS>
__device__ __forceinline__ long long cache_offset(int head, int num_blocks, int block, int offset) {
  return (((long long)head * num_blocks + block) * BS + offset) * D;
}

// Issue the cp.async copies of ROWS consecutive positions (from `first`) of one sequence's K
// and V rows for one KV head into a shared stage (kv[0]: K, kv[1]: V), a row every ROW
// elements; positions at or past `end` are zero-filled. THREADS threads share the copies;
// the caller commits the group.
template <typename T, int D, int BS, int THREADS, int ROWS, int ROW, int N>
__device__ __forceinline__ void cp_async_kv_rows(T (&kv)[2][N], int first, int end,
                                                 const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                                 const int* __restrict__ table, int kv_head, int num_blocks) {
  constexpr int VEC = Pack<T>::N, CHUNKS = D / VEC;
  for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
    const int row = i / CHUNKS, c = i % CHUNKS;
    const int pos = first + row;
    const bool valid = pos < end;
    long long off = 0;
    if (valid) off = cache_offset<D, BS>(kv_head, num_blocks, table[pos / BS], pos % BS) + c * VEC;
    cp_async16(&kv[0][row * ROW + c * VEC], k_cache + off, valid);
    cp_async16(&kv[1][row * ROW + c * VEC], v_cache + off, valid);
  }
}

// An fp8 cache's 16 bytes (16 e4m3 values) widened to T at dst (16-byte aligned): exact,
// as every e4m3 value is a float16, a bfloat16 and a float.
template <typename T>
__device__ __forceinline__ void store_fp8x16(T* dst, const uint4& v) {
  const u32 words[4] = {v.x, v.y, v.z, v.w};
  float f[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) f[i] = fp8_e4m3_to_float(words[i / 4] >> (8 * (i % 4)));
#pragma unroll
  for (int j = 0; j < 16; j += Pack<T>::N) *reinterpret_cast<uint4*>(dst + j) = Pack<T>::pack(f + j);
}

// stage_kv_rows: what cp_async_kv_rows does (same arguments, same shared layout of T rows),
// for either cache. A cache in T goes through cp.async. An fp8 cache (kv_format.py) is widened
// to T on the way, so every kernel computes after staging exactly as with a T cache; cp.async
// cannot convert, so its bytes go through registers: each thread issues all its 16-byte loads
// (K and V) first, then converts and stores them. The stores are synchronous; the kernels'
// commit and wait calls around them are then no-ops.
template <typename T, int D, int BS, int THREADS, int ROWS, int ROW, int N>
__device__ __forceinline__ void stage_kv_rows(T (&kv)[2][N], int first, int end,
                                              const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                              const int* __restrict__ table, int kv_head, int num_blocks) {
  cp_async_kv_rows<T, D, BS, THREADS, ROWS, ROW>(kv, first, end, k_cache, v_cache, table, kv_head, num_blocks);
}

template <typename T, int D, int BS, int THREADS, int ROWS, int ROW, int N>
__device__ __forceinline__ void stage_kv_rows(T (&kv)[2][N], int first, int end,
                                              const fp8_e4m3_t* __restrict__ k_cache,
                                              const fp8_e4m3_t* __restrict__ v_cache,
                                              const int* __restrict__ table, int kv_head, int num_blocks) {
  static_assert(D % 16 == 0, "fp8 rows are read as 16-byte vectors");
  constexpr int CHUNKS = D / 16, COPIES = ROWS * CHUNKS, ITERS = (COPIES + THREADS - 1) / THREADS;
  uint4 k[ITERS], v[ITERS];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int i = threadIdx.x + it * THREADS, pos = first + i / CHUNKS;
    k[it] = v[it] = make_uint4(0u, 0u, 0u, 0u);  // rows at or past `end`: zeros, as cp.async fills
    if (i < COPIES && pos < end) {
      const long long off = cache_offset<D, BS>(kv_head, num_blocks, table[pos / BS], pos % BS) + (i % CHUNKS) * 16;
      k[it] = *reinterpret_cast<const uint4*>(k_cache + off);
      v[it] = *reinterpret_cast<const uint4*>(v_cache + off);
    }
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int i = threadIdx.x + it * THREADS, at = (i / CHUNKS) * ROW + (i % CHUNKS) * 16;
    if (i < COPIES) {
      store_fp8x16(&kv[0][at], k[it]);
      store_fp8x16(&kv[1][at], v[it]);
    }
  }
}

// A decode CTA's share of the grid (decode.cu, decode_mma.cu): sequence blockIdx.x, KV head and
// chunk of up to HEADS query heads of its group in blockIdx.y, and with SPLIT the partition
// blockIdx.z of `partition_tokens` tokens, [start, end) of the context. With a sliding
// `window` (0: none) the context is its last `window` tokens: keys before them are never
// read (their blocks may be released), and a partition wholly before them is empty.
template <int HEADS, bool SPLIT>
struct DecodeWork {
  int seq, part, num_parts, kv_head, chunk, num_q_heads, head0, heads_here, context_len, start, end;

  __device__ DecodeWork(int group, int num_chunks, int partition_tokens, const int* __restrict__ context_lens,
                        int window)
      : seq(blockIdx.x), part(blockIdx.z), num_parts(gridDim.z), kv_head(blockIdx.y / num_chunks),
        chunk(blockIdx.y % num_chunks), num_q_heads(gridDim.y / num_chunks * group),
        head0(kv_head * group + chunk * HEADS), heads_here(min(HEADS, group - chunk * HEADS)),
        context_len(context_lens[seq]) {
    const int first = window > 0 ? max(0, context_len - window) : 0;
    start = SPLIT ? max(first, part * partition_tokens) : first;
    end = SPLIT ? min(context_len, part * partition_tokens + partition_tokens) : context_len;
  }

  // A partition with no key (past its sequence's end, or before its window) writes max =
  // -inf and sum 0 (the reduce skips it) and has nothing more to do: true then.
  __device__ bool empty_partition(float* __restrict__ part_max, float* __restrict__ part_sum) const {
    if (!SPLIT || start < end) return false;
    if (threadIdx.x < heads_here) {
      const long long i = ((long long)seq * num_q_heads + head0 + threadIdx.x) * num_parts + part;
      part_max[i] = NEG_INF;
      part_sum[i] = 0.f;
    }
    return true;
  }
};

// A softmax denominator l, summed relative to 2^base (base-2 scores), with an attention sink
// (gpt-oss): one more logit per query head that joins the sum and carries no value. sinks
// (natural-log logits, [Hq]) may be null: l as it is.
__device__ __forceinline__ float with_sink(float l, float base, const float* __restrict__ sinks, int head) {
  return sinks == nullptr ? l : l + exp2f(sinks[head] * 1.4426950408889634f - base);
}
