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
