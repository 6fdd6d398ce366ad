// Paged decode attention: one new query token per sequence against its cached K/V.
//
// One CTA per (sequence, KV head, chunk of up to GMAX query heads of that KV head's
// group): every K/V byte of the group is read from HBM once and used by all its query
// heads. With SPLIT, blockIdx.z picks a partition of `partition_tokens` tokens and
// the CTA writes an unnormalised partial (max, sum, out) that paged_decode_reduce
// combines; partitions past a sequence's end write max = -inf and leave, so a grid
// sized from an upper bound (frozen in a CUDA graph) costs little.
//
// Per CTA, 4 warps walk the context in tiles of TILE tokens, staged in shared memory
// by cp.async two tiles deep (the next tile loads while this one is used):
//
//   kv_s[stage][K|V] : TILE rows x (D + 16 bytes)   padding keeps 16-byte row reads
//                                                    by 8 lanes on distinct banks
//   QK  : lane = token, warp = quarter of D, all GMAX heads -> qk_s[warp][g][token]
//   softmax (fp32, base 2: q is pre-scaled by scale * log2 e): warp w owns heads
//         g = w, w+4, ...; lane = token; updates m_s, l_s, writes p_s and alpha_s
//   PV  : thread = (token group, 16-byte column chunk), all GMAX heads in registers
//
// At the end the token groups' accumulators are summed into shared memory in a fixed
// order (deterministic), divided by l (0 for an empty context: zeros are written).

constexpr int DECODE_THREADS = 128;
constexpr int DECODE_WARPS = DECODE_THREADS / 32;

template <typename T, int D, int BS, int GMAX>
struct DecodeShape {
  static constexpr int VEC = Pack<T>::N;            // elements per 16-byte vector
  static constexpr int TILE = 64 / sizeof(T);       // tokens per stage: 32 (16-bit) or 16 (fp32)
  static constexpr int CHUNKS = D / VEC;            // 16-byte vectors per row
  static constexpr int ROW = D + VEC;               // padded shared-memory row, in elements
  static constexpr int QUARTER = D / DECODE_WARPS;  // QK: D elements summed by each warp
  static constexpr int GROUPS = DECODE_THREADS / CHUNKS;  // PV: token groups
  static_assert(D % (DECODE_WARPS * VEC) == 0, "head size must split into 4 x 16-byte parts");
  static_assert(TILE <= 32, "one lane per token in a tile");
};

template <typename T, int D, int BS, int GMAX>
struct DecodeSmem {
  typedef DecodeShape<T, D, BS, GMAX> S;
  __align__(16) T kv[2][2][S::TILE * S::ROW];
  __align__(16) float q[GMAX][D];  // scaled query; the output accumulator at the end
  float qk[DECODE_WARPS][GMAX][S::TILE];
  float p[GMAX][S::TILE];
  float m[GMAX], l[GMAX], alpha[GMAX];
};

// Stage one tile's K and V rows (one cp.async commit group; an fp8 cache's widened to T).
template <typename T, int D, int BS, int GMAX, typename KV>
__device__ __forceinline__ void decode_load_tile(
    DecodeSmem<T, D, BS, GMAX>& sm, int stage, int tile_start, int end,
    const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
    const int* __restrict__ table, int kv_head, int num_blocks) {
  typedef DecodeShape<T, D, BS, GMAX> S;
  stage_kv_rows<T, D, BS, DECODE_THREADS, S::TILE, S::ROW>(sm.kv[stage], tile_start, end, k_cache, v_cache, table,
                                                           kv_head, num_blocks);
  cp_async_commit();
}

// qk[warp][g][lane] = q[g] . k[lane] over this warp's quarter of D.
template <typename T, int D, int BS, int GMAX>
__device__ __forceinline__ void decode_qk(DecodeSmem<T, D, BS, GMAX>& sm, int stage) {
  typedef DecodeShape<T, D, BS, GMAX> S;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane >= S::TILE) return;
  float s[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) s[g] = 0.f;
  const T* krow = &sm.kv[stage][0][lane * S::ROW + warp * S::QUARTER];
#pragma unroll
  for (int c = 0; c < S::QUARTER / S::VEC; ++c) {
    float k[S::VEC];
    Pack<T>::unpack(*reinterpret_cast<const uint4*>(krow + c * S::VEC), k);
    const int d0 = warp * S::QUARTER + c * S::VEC;
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
#pragma unroll
      for (int e = 0; e < S::VEC; e += 4) {
        const float4 q = *reinterpret_cast<const float4*>(&sm.q[g][d0 + e]);
        s[g] += q.x * k[e] + q.y * k[e + 1] + q.z * k[e + 2] + q.w * k[e + 3];
      }
    }
  }
#pragma unroll
  for (int g = 0; g < GMAX; ++g) sm.qk[warp][g][lane] = s[g];
}

// Online-softmax step for this tile's `valid` tokens; warp w owns heads w, w+4, ...
template <typename T, int D, int BS, int GMAX>
__device__ __forceinline__ void decode_softmax(DecodeSmem<T, D, BS, GMAX>& sm, int valid) {
  typedef DecodeShape<T, D, BS, GMAX> S;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int g = warp; g < GMAX; g += DECODE_WARPS) {
    float s = NEG_INF;
    if (lane < valid) {
      s = 0.f;
#pragma unroll
      for (int w = 0; w < DECODE_WARPS; ++w) s += sm.qk[w][g][lane];
    }
    const float m_old = sm.m[g];
    const float m_new = fmaxf(m_old, warp_max(s));
    const float base = m_new == NEG_INF ? 0.f : m_new;  // no key yet: keep exp2 finite
    const float p = lane < valid ? exp2f(s - base) : 0.f;
    if (lane < S::TILE) sm.p[g][lane] = p;
    const float tile_sum = warp_sum(p);
    __syncwarp();  // every lane has read m[g] before lane 0 replaces it (shuffles don't order memory)
    if (lane == 0) {
      const float alpha = exp2f(m_old - base);
      sm.alpha[g] = alpha;
      sm.l[g] = sm.l[g] * alpha + tile_sum;
      sm.m[g] = m_new;
    }
  }
}

// acc = acc * alpha + p . V over this thread's tokens and column chunk.
template <typename T, int D, int BS, int GMAX>
__device__ __forceinline__ void decode_pv(const DecodeSmem<T, D, BS, GMAX>& sm, int stage, int valid,
                                          float (&acc)[GMAX][Pack<T>::N]) {
  typedef DecodeShape<T, D, BS, GMAX> S;
  const int group = threadIdx.x / S::CHUNKS, c = threadIdx.x % S::CHUNKS;
  if (group >= S::GROUPS) return;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    const float alpha = sm.alpha[g];
#pragma unroll
    for (int e = 0; e < S::VEC; ++e) acc[g][e] *= alpha;
  }
  for (int row = group; row < valid; row += S::GROUPS) {
    float v[S::VEC];
    Pack<T>::unpack(*reinterpret_cast<const uint4*>(&sm.kv[stage][1][row * S::ROW + c * S::VEC]), v);
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const float p = sm.p[g][row];
#pragma unroll
      for (int e = 0; e < S::VEC; ++e) acc[g][e] += p * v[e];
    }
  }
}

// Sum the token groups' accumulators into sm.q, one group at a time (fixed order).
template <typename T, int D, int BS, int GMAX>
__device__ __forceinline__ void decode_combine(DecodeSmem<T, D, BS, GMAX>& sm,
                                               const float (&acc)[GMAX][Pack<T>::N]) {
  typedef DecodeShape<T, D, BS, GMAX> S;
  const int group = threadIdx.x / S::CHUNKS, c = threadIdx.x % S::CHUNKS;
  for (int turn = 0; turn < S::GROUPS; ++turn) {
    if (group == turn) {
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
#pragma unroll
        for (int e = 0; e < S::VEC; ++e) {
          float& dst = sm.q[g][c * S::VEC + e];
          dst = (turn == 0 ? 0.f : dst) + acc[g][e];
        }
      }
    }
    __syncthreads();
  }
}

// KV: the cache's element type, T's own or fp8_e4m3_t (widened to T as tiles are staged).
template <typename T, int D, int BS, int GMAX, bool SPLIT, typename KV = T>
__global__ void __launch_bounds__(DECODE_THREADS, 3) paged_decode(
    T* __restrict__ out,              // [B, Hq, D]            (single pass)
    float* __restrict__ part_out,     // [B, Hq, P, D]         (split)
    float* __restrict__ part_max,     // [B, Hq, P], base 2    (split)
    float* __restrict__ part_sum,     // [B, Hq, P]            (split)
    const T* __restrict__ q, long long q_stride,  // [B, Hq, D], rows q_stride elements apart
    const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
    const int* __restrict__ block_tables, int table_stride,  // [B, table_stride]
    const int* __restrict__ context_lens,                    // [B]
    int num_blocks, int group, int num_chunks, int partition_tokens, float scale_log2,
    int window,                        // sliding window in tokens; 0: none
    const float* __restrict__ sinks) {  // [Hq] attention sinks (single pass; the reduce's with SPLIT); null: none
  typedef DecodeShape<T, D, BS, GMAX> S;
  __shared__ DecodeSmem<T, D, BS, GMAX> sm;
  const DecodeWork<GMAX, SPLIT> w(group, num_chunks, partition_tokens, context_lens, window);
  if (w.empty_partition(part_max, part_sum)) return;
  const int seq = w.seq, part = w.part, num_parts = w.num_parts, kv_head = w.kv_head, num_q_heads = w.num_q_heads;
  const int head0 = w.head0, heads_here = w.heads_here, start = w.start, end = w.end;
  for (int i = threadIdx.x; i < GMAX * S::CHUNKS; i += DECODE_THREADS) {
    const int g = i / S::CHUNKS, c = i % S::CHUNKS;
    float x[S::VEC];
    if (g < heads_here) {
      Pack<T>::unpack(*reinterpret_cast<const uint4*>(q + seq * q_stride + (head0 + g) * D + c * S::VEC), x);
    } else {
#pragma unroll
      for (int e = 0; e < S::VEC; ++e) x[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < S::VEC; ++e) sm.q[g][c * S::VEC + e] = x[e] * scale_log2;
  }
  if (threadIdx.x < GMAX) { sm.m[threadIdx.x] = NEG_INF; sm.l[threadIdx.x] = 0.f; }
  float acc[GMAX][S::VEC];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
#pragma unroll
    for (int e = 0; e < S::VEC; ++e) acc[g][e] = 0.f;
  }
  const int* table = block_tables + (long long)seq * table_stride;
  const int num_tiles = (end - start + S::TILE - 1) / S::TILE;
  if (num_tiles > 0) decode_load_tile(sm, 0, start, end, k_cache, v_cache, table, kv_head, num_blocks);
  __syncthreads();  // q, m, l visible to all
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < num_tiles) {
      decode_load_tile(sm, stage ^ 1, start + (tile + 1) * S::TILE, end, k_cache, v_cache, table,
                       kv_head, num_blocks);
    } else {
      cp_async_commit();  // an empty group keeps "wait for all but the newest" uniform
    }
    cp_async_wait<1>();
    __syncthreads();
    const int valid = min(S::TILE, end - start - tile * S::TILE);
    decode_qk(sm, stage);
    __syncthreads();
    decode_softmax(sm, valid);
    __syncthreads();
    decode_pv(sm, stage, valid, acc);
    __syncthreads();  // the next iteration's prefetch overwrites the other stage only
  }
  decode_combine(sm, acc);
  for (int i = threadIdx.x; i < heads_here * S::CHUNKS; i += DECODE_THREADS) {
    const int g = i / S::CHUNKS, c = i % S::CHUNKS;
    const float* acc_row = &sm.q[g][c * S::VEC];
    const long long row = (long long)seq * num_q_heads + head0 + g;
    if (SPLIT) {
      float* dst = part_out + (row * num_parts + part) * D + c * S::VEC;
#pragma unroll
      for (int e = 0; e < S::VEC; e += 4) {
        *reinterpret_cast<float4*>(dst + e) = *reinterpret_cast<const float4*>(acc_row + e);
      }
      if (c == 0) { part_max[row * num_parts + part] = sm.m[g]; part_sum[row * num_parts + part] = sm.l[g]; }
    } else {
      const float l = with_sink(sm.l[g], sm.m[g] == NEG_INF ? 0.f : sm.m[g], sinks, head0 + g);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      float x[S::VEC];
#pragma unroll
      for (int e = 0; e < S::VEC; ++e) x[e] = acc_row[e] * inv;
      *reinterpret_cast<uint4*>(out + row * D + c * S::VEC) = Pack<T>::pack(x);
    }
  }
}

// Combine the partitions of each (sequence, query head): one CTA each, a thread per
// column. Partitions at or past the context's end are never read, nor those a window left
// empty (max -inf), so stale workspace from another step (or NaN poison) cannot leak in.
// An attention sink joins the denominator here.
template <typename T, int D>
__global__ void __launch_bounds__(128) paged_decode_reduce(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max,
    const float* __restrict__ part_sum, const int* __restrict__ context_lens,
    int num_parts, int partition_tokens, const float* __restrict__ sinks) {
  const int seq = blockIdx.x, head = blockIdx.y, num_q_heads = gridDim.y;
  const long long row = (long long)seq * num_q_heads + head;
  const int used = min(num_parts, (context_lens[seq] + partition_tokens - 1) / partition_tokens);
  const float* maxes = part_max + row * num_parts;
  const float* sums = part_sum + row * num_parts;
  float m = NEG_INF;
  for (int p = 0; p < used; ++p) m = fmaxf(m, maxes[p]);
  const float base = m == NEG_INF ? 0.f : m;
  float l = 0.f;
  for (int p = 0; p < used; ++p) {
    if (maxes[p] != NEG_INF) l += sums[p] * exp2f(maxes[p] - base);
  }
  l = with_sink(l, base, sinks, head);
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    for (int p = 0; p < used; ++p) {
      if (maxes[p] != NEG_INF) acc += part_out[(row * num_parts + p) * D + d] * exp2f(maxes[p] - base);
    }
    out[row * D + d] = Pack<T>::from_float(acc * inv);
  }
}
