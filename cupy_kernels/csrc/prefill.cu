// Paged prefill/extend attention: a chunk's new query tokens attend causally to the
// chunk's whole context (cached prefix + the new tokens), all read from the paged
// cache after reshape_and_cache wrote the new rows.
//
// Query token i of a chunk sits at absolute position context_len - num_tokens + i and
// sees keys 0 .. that position (with a sliding window W, the last W of them: keys before
// the tile's first window are never read, their blocks may be released). An attention sink
// per query head (gpt-oss) joins each row's softmax denominator at the end. A CTA takes QROWS query rows of one chunk for one KV
// head; rows are (token, head of the group) pairs, so the K/V tiles it streams serve
// every query head of the group:
//
//   rows of a chunk:  (tok0,g0) (tok0,g1) .. (tok0,gG-1) (tok1,g0) ..   row = tok * G + g
//   grid.x: one entry per QROWS-row tile, over all chunks (tile_chunk, tile_row0)
//   grid.y: KV head
//
// Key tiles of KT = 32 tokens are staged in shared memory (one stage: correctness
// first). QK: warp w owns rows w, w+4, ...; lane = key. It keeps those rows' running
// max and sum in registers (base-2 online softmax). PV: 8 threads per row, each a
// contiguous eighth of D, in 4-element groups.

constexpr int PREFILL_THREADS = 128;
constexpr int PREFILL_WARPS = PREFILL_THREADS / 32;
constexpr int QROWS = 16;
constexpr int KT = 32;
constexpr int ROWS_PER_WARP = QROWS / PREFILL_WARPS;
constexpr int PV_THREADS_PER_ROW = PREFILL_THREADS / QROWS;

template <typename T, int D>
struct PrefillSmem {
  static constexpr int VEC = Pack<T>::N;
  static constexpr int ROW = D + VEC;  // padded: 16-byte row reads by 8 lanes hit distinct banks
  __align__(16) T kv[2][KT * ROW];
  __align__(16) float q[QROWS][D];
  float p[QROWS][KT];
  float alpha[QROWS], l[QROWS], m[QROWS];
};

template <typename T, int D, int BS, typename KV>
__device__ __forceinline__ void prefill_load_tile(PrefillSmem<T, D>& sm, int key0, int key_end,
                                                  const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                                                  const int* __restrict__ table, int kv_head, int num_blocks) {
  stage_kv_rows<T, D, BS, PREFILL_THREADS, KT, PrefillSmem<T, D>::ROW>(sm.kv, key0, key_end, k_cache, v_cache,
                                                                       table, kv_head, num_blocks);
  cp_async_commit();
  cp_async_wait<0>();
}

// Scores of this warp's rows against the tile's keys, masked causally (and to the last
// `window` positions, 0: none); online-softmax update of the rows' running max `m` and sum
// `l`; probabilities to sm.p.
template <typename T, int D>
__device__ __forceinline__ void prefill_scores(PrefillSmem<T, D>& sm, int key0, const int (&qpos)[ROWS_PER_WARP],
                                               int window, float (&m)[ROWS_PER_WARP], float (&l)[ROWS_PER_WARP]) {
  constexpr int VEC = Pack<T>::N, ROW = PrefillSmem<T, D>::ROW;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float s[ROWS_PER_WARP];
#pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) s[r] = 0.f;
#pragma unroll 4
  for (int d0 = 0; d0 < D; d0 += VEC) {
    float k[VEC];
    Pack<T>::unpack(*reinterpret_cast<const uint4*>(&sm.kv[0][lane * ROW + d0]), k);
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
      const float* qrow = sm.q[warp + r * PREFILL_WARPS];
#pragma unroll
      for (int e = 0; e < VEC; e += 4) {
        const float4 q = *reinterpret_cast<const float4*>(qrow + d0 + e);
        s[r] += q.x * k[e] + q.y * k[e + 1] + q.z * k[e + 2] + q.w * k[e + 3];
      }
    }
  }
  const int key = key0 + lane;
#pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
    const int row = warp + r * PREFILL_WARPS;
    // qpos = -1 for rows past the chunk: every key masked
    const bool seen = key <= qpos[r] && (window == 0 || key > qpos[r] - window);
    const float score = seen ? s[r] : NEG_INF;
    const float m_new = fmaxf(m[r], warp_max(score));
    const float base = m_new == NEG_INF ? 0.f : m_new;
    const float p = seen ? exp2f(score - base) : 0.f;
    sm.p[row][lane] = p;
    const float alpha = exp2f(m[r] - base);
    l[r] = l[r] * alpha + warp_sum(p);
    m[r] = m_new;
    if (lane == 0) sm.alpha[row] = alpha;
  }
}

// KV: the cache's element type, T's own or fp8_e4m3_t (widened to T as tiles are staged).
template <typename T, int D, int BS, typename KV = T>
__global__ void __launch_bounds__(PREFILL_THREADS, 4) paged_prefill(
    T* __restrict__ out, long long out_stride,      // [T, Hq, D], token rows out_stride apart
    const T* __restrict__ q, long long q_stride,    // [T, Hq, D], token rows q_stride apart
    const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
    const int* __restrict__ tile_chunk, const int* __restrict__ tile_row0,  // [num_tiles]
    const int* __restrict__ chunk_token_start, const int* __restrict__ chunk_num_tokens,
    const int* __restrict__ chunk_context_len,                               // [C]
    const int* __restrict__ block_tables, int table_stride,                 // [C, table_stride]
    int num_blocks, int group, float scale_log2,
    int window,                        // sliding window in tokens; 0: none
    const float* __restrict__ sinks) {  // [Hq] attention sinks; null: none
  constexpr int VEC = Pack<T>::N, DPT = D / PV_THREADS_PER_ROW;  // columns per PV thread
  static_assert(DPT % 4 == 0, "PV works in 4-element groups");
  __shared__ PrefillSmem<T, D> sm;
  const int kv_head = blockIdx.y, chunk = tile_chunk[blockIdx.x], row0 = tile_row0[blockIdx.x];
  const int token0 = chunk_token_start[chunk], num_tokens = chunk_num_tokens[chunk];
  const int context_len = chunk_context_len[chunk];
  const int num_rows = min(QROWS, num_tokens * group - row0);
  const int first_pos = context_len - num_tokens;  // absolute position of the chunk's token 0
  const int* table = block_tables + (long long)chunk * table_stride;
  for (int i = threadIdx.x; i < QROWS * (D / VEC); i += PREFILL_THREADS) {
    const int r = i / (D / VEC), c = i % (D / VEC);
    const int tok = (row0 + r) / group, head = kv_head * group + (row0 + r) % group;
    float x[VEC];
    if (r < num_rows) {
      Pack<T>::unpack(*reinterpret_cast<const uint4*>(q + (token0 + tok) * q_stride + head * D + c * VEC), x);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) x[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) sm.q[r][c * VEC + e] = x[e] * scale_log2;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int qpos[ROWS_PER_WARP];
  float m[ROWS_PER_WARP], l[ROWS_PER_WARP];
#pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
    const int row = warp + r * PREFILL_WARPS;
    qpos[r] = row < num_rows ? first_pos + (row0 + row) / group : -1;
    m[r] = NEG_INF;
    l[r] = 0.f;
  }
  const int pv_row = threadIdx.x / PV_THREADS_PER_ROW, col0 = (threadIdx.x % PV_THREADS_PER_ROW) * DPT;
  float acc[DPT];
#pragma unroll
  for (int e = 0; e < DPT; ++e) acc[e] = 0.f;
  // Keys past the tile's last query position are masked for every row: stop there; with a
  // window, keys before its first row's window are masked for every row: start there.
  const int key_end = first_pos + (row0 + num_rows - 1) / group + 1;
  const int key_begin = window > 0 ? max(0, first_pos + row0 / group - window + 1) : 0;
  for (int key0 = key_begin; key0 < key_end; key0 += KT) {
    __syncthreads();  // q written (first pass); previous tile fully used (later passes)
    prefill_load_tile<T, D, BS>(sm, key0, key_end, k_cache, v_cache, table, kv_head, num_blocks);
    __syncthreads();
    prefill_scores(sm, key0, qpos, window, m, l);
    __syncthreads();
    const float alpha = sm.alpha[pv_row];
#pragma unroll
    for (int e = 0; e < DPT; ++e) acc[e] *= alpha;
    const int keys = min(KT, key_end - key0);
    for (int j = 0; j < keys; ++j) {
      const float p = sm.p[pv_row][j];
      const T* vrow = &sm.kv[1][j * PrefillSmem<T, D>::ROW + col0];
#pragma unroll
      for (int e = 0; e < DPT; e += 4) {
        float v[4];
        Pack<T>::unpack_quad(*reinterpret_cast<const typename Pack<T>::Quad*>(vrow + e), v);
        acc[e] += p * v[0]; acc[e + 1] += p * v[1]; acc[e + 2] += p * v[2]; acc[e + 3] += p * v[3];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
    if (lane == 0) { sm.l[warp + r * PREFILL_WARPS] = l[r]; sm.m[warp + r * PREFILL_WARPS] = m[r]; }
  }
  __syncthreads();
  if (pv_row >= num_rows) return;
  const int tok = (row0 + pv_row) / group, head = kv_head * group + (row0 + pv_row) % group;
  const float denominator = with_sink(sm.l[pv_row], sm.m[pv_row] == NEG_INF ? 0.f : sm.m[pv_row], sinks, head);
  const float inv = denominator > 0.f ? 1.f / denominator : 0.f;
  T* dst = out + (token0 + tok) * out_stride + (long long)head * D + col0;
#pragma unroll
  for (int e = 0; e < DPT; ++e) dst[e] = Pack<T>::from_float(acc[e] * inv);
}
