// Paged decode attention on tensor cores (fp16/bf16): the query heads of one KV group are the
// M rows of mma.sync, as FlashInfer does for GQA decode.
//
// Same grid and outputs as paged_decode (decode.cu), with 16 query heads per CTA: one CTA per
// (sequence, KV head, chunk of up to 16 heads of its group), blockIdx.z a split-K partition
// whose unnormalised partial paged_decode_reduce combines. Rows past the group's heads hold a
// zero query and are never written.
//
// K/V tiles of TILE = 32 tokens are staged in shared memory by cp.async, two deep, as in
// paged_decode. Each of the 4 warps owns 8 tokens of every tile and runs its own online
// softmax over them (FlashAttention-2's register reuse):
//
//   QK: m16n8k16, A = Q [16 heads x 16 of D] (registers, loaded once), B = K^T [16 of D x 8
//       tokens] (32-bit shared loads, conflict free with the padded rows); D/16 steps give
//       S [16 heads x 8 tokens] in the accumulator layout: lane (g = lane / 4, t = lane % 4)
//       holds heads g and g + 8, tokens 2t and 2t + 1.
//   softmax (fp32, base 2; the scores times scale * log2 e): a head's 8 tokens live in one
//       quad of lanes, so its max takes two shuffles; m per row is quad-uniform, l partial
//       per lane (summed at the end).
//   PV: m16n8k8, A = P [16 heads x 8 tokens] (the accumulator layout is the A layout: S's
//       registers packed to 16-bit pairs), B = V [8 tokens x 8 of D] (ldmatrix.trans, four
//       column blocks per load); O [16 heads x D] accumulates in registers.
//
// At the end the 4 warps' (m, l, O) are merged in shared memory in a fixed order
// (deterministic), reusing the K/V stages.

constexpr int MMA_THREADS = 128;
constexpr int MMA_WARPS = MMA_THREADS / 32;
constexpr int MMA_ROWS = 16;  // query heads per CTA: the M of mma.sync

template <typename T, int D>
struct MmaShape {
  static constexpr int TILE = 32;                // tokens per stage
  static constexpr int WARP_TOKENS = TILE / MMA_WARPS;  // 8: the N of QK, the K of PV
  static constexpr int VEC = 8;                  // 16-bit elements per 16-byte vector
  static constexpr int CHUNKS = D / VEC;         // 16-byte vectors per row
  static constexpr int ROW = D + VEC;            // padded shared row (elements): 16-byte reads by
                                                 // 8 rows land on distinct banks
  static constexpr int KSTEPS = D / 16;          // QK steps over D
  static constexpr int NBLOCKS = D / 8;          // PV column blocks of O
  static_assert(D % 32 == 0, "head size must be a multiple of 32 (four PV blocks per ldmatrix)");
  static_assert(WARP_TOKENS == 8, "one m16n8 block of tokens per warp and tile");
};

template <typename T, int D>
struct MmaSmem {
  typedef MmaShape<T, D> S;
  union {
    __align__(16) T kv[2][2][S::TILE * S::ROW];  // [stage][K|V]
    float o[MMA_WARPS][MMA_ROWS][D];             // the warps' outputs, at the end
  };
  __align__(16) T q[MMA_ROWS][S::ROW];
  float m[MMA_WARPS][MMA_ROWS], l[MMA_WARPS][MMA_ROWS];
};

template <typename T> struct MmaOp;

template <> struct MmaOp<bf16_t> {
  __device__ static void m16n8k16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static void m16n8k8(float (&c)[4], u32 a0, u32 a1, u32 b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
  }
  // (lo, hi) -> one register: lo in the low 16 bits (the lower column of an mma fragment).
  __device__ static u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

template <> struct MmaOp<half_t> {
  __device__ static void m16n8k16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static void m16n8k8(float (&c)[4], u32 a0, u32 a1, u32 b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
  }
  __device__ static u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

// Four 8x8 16-bit matrices from shared memory, transposed: lane l gives the address of row
// l % 8 of matrix l / 8, and gets, of each matrix, rows 2(l % 4), 2(l % 4) + 1 of column l / 4.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) {
  const u32 addr = (u32)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Stage one tile's K and V rows (one cp.async commit group; an fp8 cache's widened to T).
template <typename T, int D, int BS, typename KV>
__device__ __forceinline__ void mma_load_tile(MmaSmem<T, D>& sm, int stage, int tile_start, int end,
                                              const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                                              const int* __restrict__ table, int kv_head, int num_blocks) {
  typedef MmaShape<T, D> S;
  stage_kv_rows<T, D, BS, MMA_THREADS, S::TILE, S::ROW>(sm.kv[stage], tile_start, end, k_cache, v_cache, table,
                                                        kv_head, num_blocks);
  cp_async_commit();
}

// KV: the cache's element type, T's own or fp8_e4m3_t (widened to T as tiles are staged, so the
// MMAs still see fp16/bf16 operands).
template <typename T, int D, int BS, bool SPLIT, typename KV = T>
__global__ void __launch_bounds__(MMA_THREADS, 3) paged_decode_mma(
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
  typedef MmaShape<T, D> S;
  typedef MmaOp<T> Op;
  __shared__ MmaSmem<T, D> sm;
  const DecodeWork<MMA_ROWS, SPLIT> w(group, num_chunks, partition_tokens, context_lens, window);
  if (w.empty_partition(part_max, part_sum)) return;
  const int seq = w.seq, part = w.part, num_parts = w.num_parts, kv_head = w.kv_head, num_q_heads = w.num_q_heads;
  const int head0 = w.head0, heads_here = w.heads_here, start = w.start, end = w.end;
  const int* table = block_tables + (long long)seq * table_stride;
  const int num_tiles = (end - start + S::TILE - 1) / S::TILE;
  if (num_tiles > 0) mma_load_tile<T, D, BS>(sm, 0, start, end, k_cache, v_cache, table, kv_head, num_blocks);
  // The query rows of this CTA's heads, zeros past them.
  for (int i = threadIdx.x; i < MMA_ROWS * S::CHUNKS; i += MMA_THREADS) {
    const int h = i / S::CHUNKS, c = i % S::CHUNKS;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (h < heads_here) x = *reinterpret_cast<const uint4*>(q + seq * q_stride + (head0 + h) * D + c * S::VEC);
    *reinterpret_cast<uint4*>(&sm.q[h][c * S::VEC]) = x;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  u32 qa[S::KSTEPS][4];  // A fragments of Q, one per 16 columns of D
#pragma unroll
  for (int ks = 0; ks < S::KSTEPS; ++ks) {
    const int col = ks * 16 + 2 * t;
    qa[ks][0] = *reinterpret_cast<const u32*>(&sm.q[g][col]);
    qa[ks][1] = *reinterpret_cast<const u32*>(&sm.q[g + 8][col]);
    qa[ks][2] = *reinterpret_cast<const u32*>(&sm.q[g][col + 8]);
    qa[ks][3] = *reinterpret_cast<const u32*>(&sm.q[g + 8][col + 8]);
  }
  float o[S::NBLOCKS][4];
#pragma unroll
  for (int j = 0; j < S::NBLOCKS; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // heads g and g + 8
  const int tok0 = warp * S::WARP_TOKENS;  // this warp's tokens within a tile
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < num_tiles) {
      mma_load_tile<T, D, BS>(sm, stage ^ 1, start + (tile + 1) * S::TILE, end, k_cache, v_cache, table,
                              kv_head, num_blocks);
    } else {
      cp_async_commit();  // an empty group keeps "wait for all but the newest" uniform
    }
    cp_async_wait<1>();
    __syncthreads();
    const int valid = min(S::TILE, end - start - tile * S::TILE);
    if (tok0 < valid) {  // warp-uniform: a warp past the context's end skips the tile
      const T* k_s = sm.kv[stage][0];
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < S::KSTEPS; ++ks) {
        const T* krow = k_s + (tok0 + g) * S::ROW + ks * 16 + 2 * t;
        Op::m16n8k16(s, qa[ks], *reinterpret_cast<const u32*>(krow), *reinterpret_cast<const u32*>(krow + 8));
      }
      // Lane holds heads (g, g, g + 8, g + 8) x tokens (2t, 2t + 1, 2t, 2t + 1).
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] = tok0 + 2 * t + (i & 1) < valid ? s[i] * scale_log2 : NEG_INF;
      float p[4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = fmaxf(s[2 * r], s[2 * r + 1]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[r], mx);
        const float base = m_new == NEG_INF ? 0.f : m_new;  // no key yet: keep exp2 finite
        const float alpha = exp2f(m[r] - base);
        p[2 * r] = exp2f(s[2 * r] - base);
        p[2 * r + 1] = exp2f(s[2 * r + 1] - base);
        l[r] = l[r] * alpha + p[2 * r] + p[2 * r + 1];
        m[r] = m_new;
#pragma unroll
        for (int j = 0; j < S::NBLOCKS; ++j) { o[j][2 * r] *= alpha; o[j][2 * r + 1] *= alpha; }
      }
      const u32 pa0 = Op::pack(p[0], p[1]), pa1 = Op::pack(p[2], p[3]);
      const T* v_s = sm.kv[stage][1] + (tok0 + lane % 8) * S::ROW + (lane / 8) * 8;
#pragma unroll
      for (int jb = 0; jb < S::NBLOCKS; jb += 4) {
        u32 vb[4];
        ldmatrix_x4_trans(vb, v_s + jb * 8);
#pragma unroll
        for (int j = 0; j < 4; ++j) Op::m16n8k8(o[jb + j], pa0, pa1, vb[j]);
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites the other stage only
  }
  // Merge the warps: l summed over each quad, then (m, l) and O rescaled to the CTA's max.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  if (t == 0) {
    sm.m[warp][g] = m[0]; sm.m[warp][g + 8] = m[1];
    sm.l[warp][g] = l[0]; sm.l[warp][g + 8] = l[1];
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp's m, l visible; the K/V stages free for the outputs
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = g + 8 * r;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < MMA_WARPS; ++w) mx = fmaxf(mx, sm.m[w][h]);
    const float f = exp2f(m[r] - (mx == NEG_INF ? 0.f : mx));  // 0 for a warp that saw no key
#pragma unroll
    for (int j = 0; j < S::NBLOCKS; ++j) {
      *reinterpret_cast<float2*>(&sm.o[warp][h][j * 8 + 2 * t]) = make_float2(o[j][2 * r] * f, o[j][2 * r + 1] * f);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < heads_here * D; i += MMA_THREADS) {
    const int h = i / D, col = i % D;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < MMA_WARPS; ++w) mx = fmaxf(mx, sm.m[w][h]);
    const float base = mx == NEG_INF ? 0.f : mx;
    float sum = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < MMA_WARPS; ++w) {
      sum += sm.l[w][h] * exp2f(sm.m[w][h] - base);
      acc += sm.o[w][h][col];
    }
    const long long row = (long long)seq * num_q_heads + head0 + h;
    if (SPLIT) {
      part_out[(row * num_parts + part) * D + col] = acc;
      if (col == 0) { part_max[row * num_parts + part] = mx; part_sum[row * num_parts + part] = sum; }
    } else {
      const float l = with_sink(sum, base, sinks, head0 + h);
      out[row * D + col] = Pack<T>::from_float(l > 0.f ? acc / l : 0.f);
    }
  }
}
