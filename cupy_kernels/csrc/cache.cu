// reshape_and_cache: scatter this step's new K and V rows into their cache slots.
//
//   key, value : [T, Hkv, D]   token rows `*_stride` elements apart, heads D apart
//   k_cache    : [Hkv, num_blocks, block_size, D]   (v_cache the same)
//   slot       : block * block_size + offset; < 0 marks a padding row (skipped)
//
// It only moves bytes, so one kernel serves every dtype: `vecs` is D in 16-byte
// vectors. One CTA per token; its threads cover Hkv * vecs vectors.

__global__ void reshape_and_cache(
    const uint4* __restrict__ key, const uint4* __restrict__ value,
    uint4* __restrict__ k_cache, uint4* __restrict__ v_cache,
    const int* __restrict__ slot_mapping,
    long long key_stride, long long value_stride,  // in 16-byte vectors
    int num_kv_heads, int vecs, int num_blocks, int block_size) {
  const int t = blockIdx.x;
  const int slot = slot_mapping[t];
  if (slot < 0) return;
  const int block = slot / block_size, offset = slot % block_size;
  for (int i = threadIdx.x; i < num_kv_heads * vecs; i += blockDim.x) {
    const int head = i / vecs, c = i % vecs;
    const long long dst = (((long long)head * num_blocks + block) * block_size + offset) * vecs + c;
    k_cache[dst] = key[t * key_stride + head * vecs + c];
    v_cache[dst] = value[t * value_stride + head * vecs + c];
  }
}

// reshape_and_cache_fp8: the same scatter into an fp8 cache (kv_format.py's convention:
// each value rounded to e4m3, nearest even, saturating at +-448; per-tensor scale 1).
//
//   key, value : [T, Hkv, D] in T   token rows `*_stride` elements apart, heads D apart,
//                                   16-byte aligned rows
//   k_cache    : [Hkv, num_blocks, block_size, D] bytes, as uint2 (8 values each)
//
// One CTA per token; a thread quantizes 8 values at a time (16 or 32 bytes in, 8 out).
template <typename T>
__device__ __forceinline__ uint2 fp8x8(const T* __restrict__ src) {
  constexpr int N = Pack<T>::N;
  float f[8];
#pragma unroll
  for (int j = 0; j < 8; j += N) Pack<T>::unpack(*reinterpret_cast<const uint4*>(src + j), f + j);
  u32 w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i / 4] |= float_to_fp8_e4m3(f[i]) << (8 * (i % 4));
  return make_uint2(w[0], w[1]);
}

template <typename T>
__global__ void reshape_and_cache_fp8(
    const T* __restrict__ key, const T* __restrict__ value,
    uint2* __restrict__ k_cache, uint2* __restrict__ v_cache,
    const int* __restrict__ slot_mapping,
    long long key_stride, long long value_stride,  // in elements
    int num_kv_heads, int head_size, int num_blocks, int block_size) {
  const int t = blockIdx.x;
  const int slot = slot_mapping[t];
  if (slot < 0) return;
  const int block = slot / block_size, offset = slot % block_size, groups = head_size / 8;
  for (int i = threadIdx.x; i < num_kv_heads * groups; i += blockDim.x) {
    const int head = i / groups, c = i % groups;
    const long long dst = (((long long)head * num_blocks + block) * block_size + offset) * groups + c;
    k_cache[dst] = fp8x8(key + t * key_stride + head * head_size + c * 8);
    v_cache[dst] = fp8x8(value + t * value_stride + head * head_size + c * 8);
  }
}
